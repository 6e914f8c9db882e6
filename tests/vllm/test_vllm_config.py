"""The vLLM connector's configuration: every refusal is a clear ConfigError, early.

Most checks run on :func:`parse_config` directly (plain attribute objects stand in for
vLLM's config; this part needs no vLLM); the last ones start a real in-process vLLM
engine with a bad setting and check that start-up fails with kvshm's message.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import SimpleNamespace
from typing import Any

import pytest

from kvshm.config import DEFAULT_EVICTION, EngineConfig, Eviction
from kvshm.errors import ConfigError
from kvshm.integrations.vllm.config import (
    ConnectorConfig,
    GroupInfo,
    GroupKindName,
    check_budget,
    engine_name,
    parse_config,
)
from kvshm.types import KVGroup, StoreMode

FULL = GroupInfo(GroupKindName.FULL, 32, None, "FullAttentionSpec")
GIB = 1 << 30


def _vllm_config(extra: dict[str, Any] | None = None, *, tp: int = 1, pp: int = 1,
                 **kv: Any) -> SimpleNamespace:
    kvt = SimpleNamespace(kv_role="kv_both", kv_load_failure_policy="recompute",
                          engine_id="6a8085bf-9c3d-48d5-a288-ddcede77aaaa",
                          kv_connector_extra_config={"cpu_bytes": GIB} if extra is None
                          else extra)
    for key, value in kv.items():
        setattr(kvt, key, value)
    return SimpleNamespace(
        kv_transfer_config=kvt,
        cache_config=SimpleNamespace(enable_prefix_caching=kv.pop("prefix", True)),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))


def _parse(vc: Any, infos: tuple[GroupInfo, ...] = (FULL,), hash_bs: int | None = 32
           ) -> ConnectorConfig:
    return parse_config(vc, infos, hash_bs)


def test_defaults() -> None:
    cfg = _parse(_vllm_config(tp=2, pp=2))
    assert cfg.name == "kvshm-6a8085bf-9c3d-48d5-a288-ddcede77aaaa"
    assert (cfg.world_size, cfg.block_size, cfg.mode) == (4, 32, StoreMode.EAGER)
    assert cfg.cpu_bytes_per_rank == GIB // 4  # server-wide budget split over ranks
    assert cfg.groups == (KVGroup.full(),)
    assert cfg.stats_path is None and cfg.test_fail_loads == 0
    assert cfg.hang_timeout_s == 10.0 and cfg.shutdown_timeout_s == 5.0  # as EngineConfig
    EngineConfig(block_size=cfg.block_size, name=cfg.name)  # the name is valid there


def test_extra_config_values() -> None:
    cfg = _parse(_vllm_config({"cpu_bytes_per_rank": 3e9, "mode": "lazy", "name": "n.1",
                               "stats_path": "/tmp/s.json", "num_cpu_blocks": 7,
                               "hang_timeout_s": 2, "test_fail_loads": 1}))
    assert cfg.cpu_bytes_per_rank == 3_000_000_000 and cfg.num_cpu_blocks == 7
    assert cfg.mode is StoreMode.LAZY and cfg.name == "n.1"
    assert cfg.hang_timeout_s == 2.0 and cfg.test_fail_loads == 1
    assert cfg.eviction is DEFAULT_EVICTION  # not given: kvshm's default order
    lru = _parse(_vllm_config({"cpu_bytes": GIB, "eviction": "lru"}))
    assert lru.eviction is Eviction.LRU


@pytest.mark.parametrize(("extra", "match"), [
    ({}, "needs the CPU tier's size"),
    ({"cpu_bytes": 0}, r"'cpu_bytes'\] must be > 0"),
    ({"cpu_bytes": -5}, r"'cpu_bytes'\] must be > 0"),
    ({"cpu_bytes": 1.5}, "must be a positive integer"),
    ({"cpu_bytes": "1GiB"}, "must be a positive integer"),
    ({"cpu_bytes": True}, "must be a positive integer"),
    ({"cpu_bytes_per_rank": 0}, r"'cpu_bytes_per_rank'\] must be > 0"),
    ({"num_cpu_blocks": -1}, r"'num_cpu_blocks'\] must be > 0"),
    ({"cpu_bytes": GIB, "cpu_bytes_per_rank": GIB}, "not both"),
    ({"cpu_bytes": GIB, "mode": "sometimes"}, "'mode'.*'eager', 'lazy'"),
    ({"cpu_bytes": GIB, "name": "has space"}, r"'name'\] must be 1-80"),
    ({"cpu_bytes": GIB, "name": "x" * 81}, r"'name'\] must be 1-80"),
    ({"cpu_bytes": GIB, "stats_path": ""}, "'stats_path'"),
    ({"cpu_bytes": GIB, "hang_timeout_s": 0}, "'hang_timeout_s'"),
    ({"cpu_bytes": GIB, "hang_timeout_s": float("inf")}, "'hang_timeout_s'"),
    ({"cpu_bytes": GIB, "shutdown_timeout_s": float("nan")}, "'shutdown_timeout_s'"),
    ({"cpu_bytes": GIB, "test_fail_loads": -1}, "'test_fail_loads'"),
    ({"cpu_bytes": GIB, "eviction": "mru"}, r"'eviction'\] must be one of \['depth_aged', 'lru', "),
    ({"cpu_bytes": GIB, "cpu_byte": 1}, r"unknown kv_connector_extra_config keys \['cpu_byte'\]"),
])
def test_bad_extra_config(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse(_vllm_config(extra))


def test_budget_smaller_than_ranks() -> None:
    with pytest.raises(ConfigError, match="less than one byte for each of the 4 ranks"):
        _parse(_vllm_config({"cpu_bytes": 3}, tp=4))


@pytest.mark.parametrize(("kv", "match"), [
    ({"kv_role": "kv_producer"}, "kv_role='kv_both'"),
    ({"kv_role": "kv_consumer"}, "kv_role='kv_both'"),
    ({"kv_load_failure_policy": "fail"}, "kv_load_failure_policy='recompute'"),
])
def test_bad_vllm_settings(kv: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse(_vllm_config(**kv))


def test_prefix_caching_off_and_context_parallel() -> None:
    vc = _vllm_config()
    vc.cache_config.enable_prefix_caching = False
    with pytest.raises(ConfigError, match="prefix caching"):
        _parse(vc)
    vc = _vllm_config()
    vc.parallel_config.decode_context_parallel_size = 2
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        _parse(vc)


@pytest.mark.parametrize(("infos", "hash_bs", "match"), [
    ((), 32, "no KV cache groups"),
    ((GroupInfo(GroupKindName.RECURRENT, 32, None, "MambaSpec"),), 32, "recurrent"),
    ((FULL, GroupInfo(GroupKindName.OTHER, 32, None, "CrossAttentionSpec")), 32,
     "CrossAttentionSpec.*not full or sliding-window"),
    ((FULL, GroupInfo(GroupKindName.SLIDING_WINDOW, 64, 128, "SlidingWindowSpec")), 32,
     r"unequal block sizes \[32, 64\]"),
    ((FULL,), 16, "hashes blocks of 16 tokens"),
])
def test_bad_kv_groups(infos: tuple[GroupInfo, ...], hash_bs: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse(_vllm_config(), infos, hash_bs)


def test_hybrid_groups_and_lazy() -> None:
    swa = GroupInfo(GroupKindName.SLIDING_WINDOW, 32, 128, "SlidingWindowSpec")
    cfg = _parse(_vllm_config(), (FULL, swa))
    assert cfg.groups == (KVGroup.full(), KVGroup.sliding_window(128))
    with pytest.raises(ConfigError, match="mode='lazy' supports one KV cache group"):
        _parse(_vllm_config({"cpu_bytes": GIB, "mode": "lazy"}), (FULL, swa))


def test_budget_checks() -> None:
    cfg = _parse(_vllm_config({"cpu_bytes": 4 << 20}, tp=2))  # 2 MiB per rank
    check_budget(cfg, 32 << 10, 8 << 20)
    with pytest.raises(ConfigError, match="does not fit: 1048576 bytes of shared memory"):
        check_budget(cfg, 32 << 10, 1 << 20)
    with pytest.raises(ConfigError, match="cannot hold one KV block of 4194304 bytes"):
        check_budget(cfg, 4 << 20, 1 << 40)
    cfg = _parse(_vllm_config({"num_cpu_blocks": 100}))
    with pytest.raises(ConfigError, match=r"num_cpu_blocks=100 \(3276800 bytes per rank\)"):
        check_budget(cfg, 32 << 10, 1 << 20)


def test_engine_name_is_safe_deterministic_and_short() -> None:
    assert engine_name("abc") == "kvshm-abc"
    assert engine_name("a b/c_dp0") == "kvshm-a-b-c_dp0"
    long1, long2 = "x" * 100 + "1", "x" * 100 + "2"
    n1, n2 = engine_name(long1), engine_name(long2)
    assert len(n1) == 80 and n1 != n2 and n1 == engine_name(long1)
    for name in (n1, engine_name("a b/c")):
        assert re.fullmatch(r"[A-Za-z0-9._-]{1,80}", name)
        EngineConfig(block_size=32, name=name)
    with pytest.raises(ConfigError, match="engine_id"):
        engine_name("")


# ----------------------------------------------------------------- with a real vLLM engine

LLMFactory = Callable[..., AbstractContextManager[Any]]
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None
    or importlib.util.find_spec("vllm").origin is None,  # type: ignore[union-attr]
    reason="vLLM is not installed (see tools/vllm_install.sh)")


@needs_vllm
@pytest.mark.parametrize(("kv_overrides", "extra", "match"), [
    ({"kv_load_failure_policy": "fail"}, {"cpu_bytes": 64 << 20},
     "kv_load_failure_policy='recompute'"),
    ({}, {"cpu_bytes": 1 << 50}, "does not fit"),
    ({}, {"cpu_bytes": 64 << 20, "mode": "later"}, "'mode'"),
])
def test_vllm_start_fails_clearly(make_llm: LLMFactory, kv_overrides: dict[str, Any],
                                  extra: dict[str, Any], match: str) -> None:
    with pytest.raises(Exception) as info:
        with make_llm("KvshmConnector", module="kvshm.integrations.vllm",
                      kv_overrides=kv_overrides, **extra):
            pass
    chain = []
    exc: BaseException | None = info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert any(isinstance(e, ConfigError) and re.search(match, str(e)) for e in chain), chain
