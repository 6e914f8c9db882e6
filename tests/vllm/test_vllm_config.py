"""The vLLM connector's configuration: every refusal is a clear ConfigError, early.

Most checks run on :func:`parse_config` and its parts directly (plain attribute objects
stand in for vLLM's config; this part needs no vLLM): the one-line refusals of an
unknown key (with the closest public key, never an internal one) and of two size keys,
the default size (a quarter of available memory, capped by /dev/shm, per rank) and the
failure policy kvshm sets. The last ones start a real in-process vLLM engine with a bad
setting and check that start-up fails with kvshm's message, first line first.
"""

from __future__ import annotations

import importlib.util
import re
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvshm.config import DEFAULT_EVICTION, EngineConfig, Eviction
from kvshm.errors import ConfigError
from kvshm.integrations.vllm.config import (
    INTERNAL_KEYS,
    PUBLIC_KEYS,
    SIZE_KEYS,
    ConnectorConfig,
    GroupInfo,
    GroupKindName,
    SizeSource,
    adopt_failure_policy,
    check_budget,
    check_extra_config,
    default_cpu_bytes_per_rank,
    engine_name,
    parse_config,
    resolve_size,
    tier_text,
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
    assert cfg.size_source is SizeSource.CPU_BYTES
    assert cfg.groups == (KVGroup.full(),)
    assert cfg.stats_path is None and cfg.test_fail_loads == 0
    assert cfg.hang_timeout_s == 10.0 and cfg.shutdown_timeout_s == 5.0  # as EngineConfig
    EngineConfig(block_size=cfg.block_size, name=cfg.name)  # the name is valid there
    # the default name follows vLLM's engine id, new every start: no later start could
    # serve its slabs, so they go at close; a given name keeps them (warm restart)
    assert cfg.disk_keep is False
    assert _parse(_vllm_config({"name": "n.1"})).disk_keep is True


def test_extra_config_values() -> None:
    cfg = _parse(_vllm_config({"cpu_bytes_per_rank": 3e9, "mode": "lazy", "name": "n.1",
                               "stats_path": "/tmp/s.json",
                               "hang_timeout_s": 2, "test_fail_loads": 1}))
    assert cfg.cpu_bytes_per_rank == 3_000_000_000 and cfg.num_cpu_blocks is None
    assert cfg.size_source is SizeSource.CPU_BYTES_PER_RANK
    blocks = _parse(_vllm_config({"num_cpu_blocks": 7}))
    assert (blocks.num_cpu_blocks, blocks.cpu_bytes_per_rank) == (7, None)
    assert cfg.mode is StoreMode.LAZY and cfg.name == "n.1"
    assert cfg.hang_timeout_s == 2.0 and cfg.test_fail_loads == 1
    assert cfg.eviction is DEFAULT_EVICTION  # not given: kvshm's default order
    lru = _parse(_vllm_config({"cpu_bytes": GIB, "eviction": "lru"}))
    assert lru.eviction is Eviction.LRU


@pytest.mark.parametrize(("extra", "match"), [
    ({"cpu_bytes": 0}, r"'cpu_bytes'\] must be > 0"),
    ({"cpu_bytes": -5}, r"'cpu_bytes'\] must be > 0"),
    ({"cpu_bytes": 1.5}, "must be a positive integer"),
    ({"cpu_bytes": "1GiB"}, "must be a positive integer"),
    ({"cpu_bytes": True}, "must be a positive integer"),
    ({"cpu_bytes": 1e300}, r"'cpu_bytes'\] must be below 2\*\*63, got a number of 997 bits$"),
    ({"cpu_bytes": -1e300}, r"'cpu_bytes'\] must be > 0, got a negative number of 997 bits$"),
    ({"num_cpu_blocks": 1 << 63},
     r"'num_cpu_blocks'\] must be below 2\*\*63, got 9223372036854775808$"),
    # an exact integer from JSON past any float: OverflowError while building the message
    ({"num_cpu_blocks": 10 ** 400}, "must be below 2\\*\\*63, got a number of 1329 bits$"),
    # past str()'s 4,300-digit limit (the Python API): ValueError, not ConfigError
    ({"num_cpu_blocks": -(10 ** 5000)}, "must be > 0, got a negative number of 16610 bits$"),
    ({"cpu_bytes_per_rank": 0}, r"'cpu_bytes_per_rank'\] must be > 0"),
    ({"num_cpu_blocks": -1}, r"'num_cpu_blocks'\] must be > 0"),
    ({"cpu_bytes": GIB, "mode": "sometimes"}, "'mode'.*'eager', 'lazy'"),
    ({"cpu_bytes": GIB, "name": "has space"}, r"'name'\] must be 1-80"),
    ({"cpu_bytes": GIB, "name": "x" * 81}, r"'name'\] must be 1-80"),
    ({"cpu_bytes": GIB, "stats_path": ""}, "'stats_path'"),
    # a NUL byte passed, and the first stats report raised ValueError in vLLM's step
    ({"cpu_bytes": GIB, "stats_path": "/tmp/s\0x.json"}, "'stats_path'"),
    ({"cpu_bytes": GIB, "hang_timeout_s": 0}, "'hang_timeout_s'"),
    ({"cpu_bytes": GIB, "hang_timeout_s": float("inf")}, "'hang_timeout_s'"),
    # 0.01 declared healthy ranks hung on a busy host: offload off for good
    ({"cpu_bytes": GIB, "hang_timeout_s": 0.01}, r"'hang_timeout_s'\] must be at least 0.5 s"),
    ({"cpu_bytes": GIB, "shutdown_timeout_s": float("nan")}, "'shutdown_timeout_s'"),
    ({"cpu_bytes": GIB, "test_fail_loads": -1}, "'test_fail_loads'"),
    ({"cpu_bytes": GIB, "eviction": "mru"}, r"'eviction'\] must be one of \['depth_aged', 'lru', "),
    ({"cpu_bytes": GIB, "cpu_byte": 1}, r"^kvshm: unknown key 'cpu_byte'"),
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
])
def test_bad_vllm_settings(kv: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _parse(_vllm_config(**kv))


# ----------------------------------------------- first-run errors: keys, sizes, policy

PUBLIC_LIST = ("cpu_bytes, cpu_bytes_per_rank, num_cpu_blocks, mode, name, stats_path, "
               "hang_timeout_s, shutdown_timeout_s, eviction, remote_url, remote_mode, "
               "remote_namespace, disk_path, disk_bytes_per_rank, disk_io, disk_mode")


def _first_line(extra: dict[Any, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        _parse(_vllm_config(extra))
    return str(info.value).splitlines()[0]


@pytest.mark.parametrize(("typo", "hint"), [
    ("cpu_byte", "cpu_bytes"),
    ("cpu_bytes_per_ranks", "cpu_bytes_per_rank"),
    ("num_cpu_block", "num_cpu_blocks"),
    ("hang_timeout", "hang_timeout_s"),
    ("evict", "eviction"),
    ("stat_path", "stats_path"),
    ("disk_pth", "disk_path"),
    ("disk_bytes", "disk_bytes_per_rank"),
])
def test_typo_is_one_line_with_the_closest_public_key(typo: str, hint: str) -> None:
    """The whole message is one line: the key, its closest public key, every public key
    (and none of the internal ones)."""
    with pytest.raises(ConfigError) as info:
        _parse(_vllm_config({typo: 1}))
    msg = str(info.value)
    assert msg == (f"kvshm: unknown key {typo!r} in kv_connector_extra_config; did you mean "
                   f"{hint!r}? (keys: {PUBLIC_LIST})")
    for key in INTERNAL_KEYS:
        assert key not in msg


def test_public_keys_table_is_what_the_refusal_lists() -> None:
    """The table has a line (meaning, default) for each key the parser reads; internal
    keys are apart from it and still accepted."""
    assert ", ".join(PUBLIC_KEYS) == PUBLIC_LIST
    assert all(isinstance(v, str) and v for v in PUBLIC_KEYS.values())
    assert not INTERNAL_KEYS & set(PUBLIC_KEYS)
    assert _parse(_vllm_config({"test_fail_loads": 2})).test_fail_loads == 2


def test_unknown_keys_without_a_close_match_and_several() -> None:
    assert _first_line({"zzz": 1}) == (
        f"kvshm: unknown key 'zzz' in kv_connector_extra_config (keys: {PUBLIC_LIST})")
    assert _first_line({"mod": 1, "cpu_byte": 2, "zzz": 3}) == (
        "kvshm: unknown keys 'cpu_byte', 'mod', 'zzz' in kv_connector_extra_config; did you "
        f"mean 'cpu_bytes', 'mode'? (keys: {PUBLIC_LIST})")
    # an internal key is never offered as a correction
    assert "test_fail_loads'?" not in _first_line({"test_fail_load": 1})


def test_unknown_key_is_refused_before_a_bad_value_or_vllm_setting() -> None:
    """The key check runs first: a typo next to a bad value, or with a vLLM setting kvshm
    refuses, is reported as the typo."""
    assert _first_line({"cpu_bytes": -1, "mdoe": "x"}).startswith(
        "kvshm: unknown key 'mdoe' in kv_connector_extra_config; did you mean 'mode'?")
    with pytest.raises(ConfigError, match="^kvshm: unknown key 'nmae'"):
        _parse(_vllm_config({"nmae": "x"}, kv_role="kv_producer"))


@pytest.mark.parametrize(("first", "second"), [
    ("cpu_bytes", "cpu_bytes_per_rank"),
    ("cpu_bytes", "num_cpu_blocks"),
    ("cpu_bytes_per_rank", "num_cpu_blocks"),
])
def test_two_size_keys_are_refused_in_one_line(first: str, second: str) -> None:
    assert SIZE_KEYS.index(first) < SIZE_KEYS.index(second)
    with pytest.raises(ConfigError) as info:
        _parse(_vllm_config({second: 64, first: 64 << 20}))
    assert str(info.value) == (f"kvshm: kv_connector_extra_config sets both {first!r} and "
                               f"{second!r}; keep one (each sizes the CPU tier)")


def test_all_three_size_keys_name_the_first_two() -> None:
    assert _first_line({k: 1 << 20 for k in SIZE_KEYS}) == (
        "kvshm: kv_connector_extra_config sets both 'cpu_bytes' and 'cpu_bytes_per_rank'; "
        "keep one (each sizes the CPU tier)")


def test_extra_config_checks_without_vllm() -> None:
    """``check_extra_config`` (what ``requires_piecewise_for_cudagraph`` runs at vLLM's
    config time) refuses what parse_config refuses about the extra config alone."""
    assert check_extra_config({}).size_source is SizeSource.DEFAULT
    assert check_extra_config({"cpu_bytes": GIB}, 4).cpu_bytes_per_rank == GIB // 4
    with pytest.raises(ConfigError, match="^kvshm: unknown key 'cpu_byte'"):
        check_extra_config({"cpu_byte": 1})
    with pytest.raises(ConfigError, match="'mode'"):
        check_extra_config({"mode": "later"})
    with pytest.raises(ConfigError, match="must be a JSON object"):
        check_extra_config([("cpu_bytes", 1)])  # type: ignore[arg-type]


def test_no_size_key_is_the_default_resolved_on_the_scheduler_side() -> None:
    """No size key: both sizes stay None (the worker side never sizes the tier) until
    resolve_size takes a quarter of available memory, at most what /dev/shm can take,
    split over the ranks; the start-up text says it is the default."""
    cfg = _parse(_vllm_config({}, tp=2))
    assert cfg.size_source is SizeSource.DEFAULT
    assert (cfg.cpu_bytes_per_rank, cfg.num_cpu_blocks) == (None, None)
    roomy = resolve_size(cfg, memory_available=16 * GIB, shm_available=32 * GIB)
    assert roomy.cpu_bytes_per_rank == 2 * GIB  # 16 GiB / 4, over 2 ranks
    assert roomy.size_source is SizeSource.DEFAULT
    tight = resolve_size(cfg, memory_available=16 * GIB, shm_available=GIB)
    assert tight.cpu_bytes_per_rank == GIB // 2  # capped by /dev/shm
    assert tier_text(roomy) == (
        "CPU tier of 2.00 GiB per rank (default: 25% of available memory, at most free "
        "/dev/shm, over 2 rank(s); set kv_connector_extra_config['cpu_bytes'] to choose)")
    with pytest.raises(ConfigError, match=r"no memory for the default CPU tier.*'cpu_bytes'"):
        resolve_size(cfg, memory_available=16 * GIB, shm_available=0)
    explicit = _parse(_vllm_config({"cpu_bytes": GIB}))
    assert resolve_size(explicit, 0, 0) is explicit
    assert tier_text(explicit) == "CPU tier of 1.00 GiB per rank"
    assert default_cpu_bytes_per_rank(4, 8 * GIB, 1 << 50) == GIB // 2
    with pytest.raises(ConfigError, match=r"\(the default: 25% of available memory\) "
                                          r"cannot hold one KV block"):
        check_budget(resolve_size(cfg, 4000, 1 << 40), 1 << 20, 1 << 40)


@pytest.mark.parametrize(("policy", "replaced"), [("fail", "fail"), ("recompute", None)])
def test_failure_policy_is_set_to_recompute(policy: str, replaced: str | None) -> None:
    """vLLM's default 'fail' (indistinguishable from a 'fail' the user wrote) becomes
    'recompute'; parse_config no longer refuses it (the worker side sees vLLM's value)."""
    vc = _vllm_config(kv_load_failure_policy=policy)
    _parse(vc)
    assert adopt_failure_policy(vc.kv_transfer_config) == replaced
    assert vc.kv_transfer_config.kv_load_failure_policy == "recompute"


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


def test_a_disk_slab_that_holds_no_block_is_refused_before_any_engine_starts() -> None:
    """``disk_bytes_per_rank=4096`` with 32 KiB rows (one slot: a 4 KiB header page plus
    the row, after the slab's own 4 KiB header page: 40 KiB) was refused only once the
    ranks said hello: the engine FAILED and served without any offload, the CPU tier
    included (found by a hostile probe). Refused at the budget check now."""
    cfg = _parse(_vllm_config({"cpu_bytes": 4 << 20, "disk_path": "/tmp",
                               "disk_bytes_per_rank": 4096}))
    with pytest.raises(ConfigError, match=r"\['disk_bytes_per_rank'\]=4096 holds no slot: one "
                                          r"block of this model \(32768 bytes per rank\) "
                                          r"takes 40960 bytes"):
        check_budget(cfg, 32 << 10, 1 << 40)
    ok = _parse(_vllm_config({"cpu_bytes": 4 << 20, "disk_path": "/tmp",
                              "disk_bytes_per_rank": 40960}))
    check_budget(ok, 32 << 10, 1 << 40)


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


def test_an_explicit_name_under_data_parallelism_is_one_per_replica() -> None:
    """The hazard: vLLM hands every data-parallel engine the same extra config and keeps
    them apart only by suffixing ``engine_id`` with ``_dp<rank>``. An explicit ``name``
    was taken as it stood, so with ``data_parallel_size=2`` both replicas' schedulers
    asked for rendezvous ``serve1`` and the second was refused (its vLLM engine failed
    to start). Each replica now appends its rank, as vLLM does to the id."""
    def cfg(name: str, size: int, rank: int) -> ConnectorConfig:
        vc = _vllm_config({"name": name, "cpu_bytes": GIB})
        vc.parallel_config.data_parallel_size = size
        vc.parallel_config.data_parallel_rank = rank
        return _parse(vc)

    assert cfg("serve1", 1, 0).name == "serve1"
    assert [cfg("serve1", 2, r).name for r in (0, 1)] == ["serve1_dp0", "serve1_dp1"]
    assert _parse(_vllm_config({"name": "serve1"})).name == "serve1"  # no DP fields
    assert len(cfg("n" * 76, 2, 1).name) == 80
    with pytest.raises(ConfigError, match=r"'n{77}' with data parallelism becomes "
                                          r"'n{77}_dp1', longer than 80"):
        cfg("n" * 77, 2, 1)


def test_stats_path_under_data_parallelism_is_one_file_per_replica(tmp_path: Path) -> None:
    """The hazard: every data-parallel replica gets the same extra config, so with
    ``stats_path`` set both replicas' schedulers rewrote one file (each report, and at
    close): the operator saw whichever replica wrote last, the other engine's
    statistics lost. Each replica now writes ``<stem>_dp<rank><suffix>``."""
    def path(stats: str, size: int, rank: int) -> str | None:
        vc = _vllm_config({"stats_path": stats, "cpu_bytes": GIB})
        vc.parallel_config.data_parallel_size = size
        vc.parallel_config.data_parallel_rank = rank
        return _parse(vc).stats_path

    run = tmp_path / "k.v"  # (the folder must exist: check_paths)
    run.mkdir()
    assert path(f"{run}/stats.json", 1, 0) == f"{run}/stats.json"
    assert [path(f"{run}/stats.json", 2, r) for r in (0, 1)] == [
        f"{run}/stats_dp0.json", f"{run}/stats_dp1.json"]
    assert path(f"{run}/stats", 2, 1) == f"{run}/stats_dp1"
    assert path(".stats", 2, 1) == ".stats_dp1"
    assert _parse(_vllm_config({"cpu_bytes": GIB})).stats_path is None


def test_kvshm_name_of_an_llm() -> None:
    """``engine_stats`` asks the engine the connector named: ``name`` if set, else
    ``kvshm-<engine_id>``; an LLM without a kv_transfer_config is refused."""
    from kvshm.integrations.vllm.query import kvshm_name

    def llm(kvt: Any) -> SimpleNamespace:
        return SimpleNamespace(llm_engine=SimpleNamespace(
            vllm_config=SimpleNamespace(kv_transfer_config=kvt)))

    vc = _vllm_config({})
    assert kvshm_name(llm(vc.kv_transfer_config)) == (
        "kvshm-6a8085bf-9c3d-48d5-a288-ddcede77aaaa")
    assert kvshm_name(llm(_vllm_config({"name": "qs"}).kv_transfer_config)) == "qs"
    with pytest.raises(ConfigError, match="no kv_transfer_config"):
        kvshm_name(llm(None))


# ----------------------------------------------------------------- with a real vLLM engine

LLMFactory = Callable[..., AbstractContextManager[Any]]
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None
    or importlib.util.find_spec("vllm").origin is None,  # type: ignore[union-attr]
    reason="vLLM is not installed (see tools/vllm_install.sh)")


@needs_vllm
@pytest.mark.parametrize(("kv_overrides", "extra", "match"), [
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


@needs_vllm
@pytest.mark.parametrize("multiprocess", [False, True], ids=["in_process", "multi_process"])
def test_vllm_start_with_a_typo_fails_with_the_line_on_top(make_llm: LLMFactory,
                                                           multiprocess: bool) -> None:
    """A typo in kv_connector_extra_config makes ``LLM(...)`` raise kvshm's ConfigError
    whose message's first line names the key and the correction, in both of vLLM's
    modes. Multi-process, vLLM builds the connector only in EngineCore and its workers and
    raises its own "Engine core initialization failed" after their tracebacks; kvshm's
    plugin checks the extra config where vLLM turns its arguments into a config, in the
    caller's process, so the typo is what the caller gets, before any process starts."""
    with pytest.raises(ConfigError) as info:
        with make_llm("KvshmConnector", module="kvshm.integrations.vllm",
                      multiprocess=multiprocess, cpu_byte=1 << 26):
            pass
    assert str(info.value).splitlines()[0] == (
        "kvshm: unknown key 'cpu_byte' in kv_connector_extra_config; did you mean "
        f"'cpu_bytes'? (keys: {PUBLIC_LIST})")


@needs_vllm
def test_the_front_end_check_leaves_other_connectors_alone() -> None:
    """The wrapper around ``EngineArgs.create_engine_config`` checks only configs that
    name kvshm: another connector's extra config (with keys kvshm does not know) passes
    through untouched, and installing it twice wraps once."""
    import vllm.engine.arg_utils as arg_utils

    from kvshm.integrations.vllm import plugin

    assert plugin.check_before_engine_start() is True
    wrapped = arg_utils.EngineArgs.create_engine_config
    assert plugin.check_before_engine_start() is True
    assert arg_utils.EngineArgs.create_engine_config is wrapped
    assert plugin._kvshm_extra_config({"kv_connector": "OffloadingConnector",
                                       "kv_connector_extra_config": {"x": 1}}) is None
    assert plugin._kvshm_extra_config({"kv_connector": "KvshmConnector",
                                       "kv_connector_module_path": "my.fork",
                                       "kv_connector_extra_config": {"x": 1}}) is None
    assert plugin._kvshm_extra_config({"kv_connector": "KvshmConnector"}) == {}


@needs_vllm
def test_requires_piecewise_hook_checks_the_extra_config() -> None:
    """vLLM calls ``requires_piecewise_for_cudagraph(extra_config)`` while it builds its
    config (full CUDA graphs on), before it starts a process: kvshm checks its keys
    there; a good config answers False (no per-layer work to keep out of graphs)."""
    from kvshm.integrations.vllm.connector import KvshmConnector

    assert KvshmConnector.requires_piecewise_for_cudagraph({}) is False
    assert KvshmConnector.requires_piecewise_for_cudagraph({"cpu_bytes": GIB}) is False
    with pytest.raises(ConfigError, match="^kvshm: unknown key 'cpu_byte'.*'cpu_bytes'"):
        KvshmConnector.requires_piecewise_for_cudagraph({"cpu_byte": GIB})
    with pytest.raises(ConfigError, match="sets both 'cpu_bytes' and 'num_cpu_blocks'"):
        KvshmConnector.requires_piecewise_for_cudagraph({"cpu_bytes": GIB,
                                                         "num_cpu_blocks": 8})


@needs_vllm
@pytest.mark.parametrize("multiprocess", [False, True])
def test_paths_that_cannot_serve_are_refused_in_the_callers_process(
        make_llm: LLMFactory, tmp_path: Path, multiprocess: bool) -> None:
    """Found by a hostile probe: a ``disk_path`` that is not a directory was refused only
    by the scheduler side -- in multi-process mode after ~25 s, at the end of the
    EngineCore's 40-line traceback ("Engine core initialization failed") -- and a
    ``stats_path`` in a missing folder was accepted, the closing line then claiming the
    statistics written there. The front end now refuses both, in one line, before any
    engine process starts."""
    bad: list[tuple[dict[str, Any], str]] = [
           ({"disk_path": str(tmp_path / "nope"), "disk_bytes_per_rank": 1 << 24},
            r"^kv_connector_extra_config\['disk_path'\] '.*nope' is not a directory$"),
           ({"stats_path": str(tmp_path / "nope" / "stats.json")},
            r"^kv_connector_extra_config\['stats_path'\] .*: its folder '.*nope' does not "
            r"exist$"),
           ({"stats_path": str(tmp_path)}, r"'stats_path'\] '.*' is a directory, not a file")]
    for extra, match in bad:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            with make_llm("KvshmConnector", module="kvshm.integrations.vllm",
                          multiprocess=multiprocess, cpu_bytes=1 << 26, **extra):
                pass
        assert re.search(match, str(info.value).splitlines()[0]), str(info.value)
        assert time.monotonic() - t0 < 10.0


@needs_vllm
@pytest.mark.parametrize("multiprocess", [False, True])
def test_a_role_or_prefix_caching_kvshm_cannot_serve_is_refused_in_the_callers_process(
        make_llm: LLMFactory, multiprocess: bool) -> None:
    """Found by a hostile probe: ``kv_role='kv_producer'`` and
    ``enable_prefix_caching=False`` were refused only inside EngineCore -- in
    multi-process mode after ~19 s, as vLLM's ``RuntimeError: Engine core initialization
    failed``, kvshm's ConfigError in the engine's log alone. The front end now checks
    the config vLLM resolved, before any engine process starts."""
    bad: list[tuple[dict[str, Any], dict[str, Any], str]] = [
        ({"kv_role": "kv_producer"}, {}, r"kv_role='kv_both'.*got 'kv_producer'"),
        ({}, {"enable_prefix_caching": False}, r"needs prefix caching.*it is off$")]
    for kv, llm, match in bad:
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as info:
            with make_llm("KvshmConnector", module="kvshm.integrations.vllm",
                          multiprocess=multiprocess, cpu_bytes=1 << 26, kv_overrides=kv,
                          llm_overrides=llm):
                pass
        assert re.search(match, str(info.value).splitlines()[0]), str(info.value)
        assert time.monotonic() - t0 < 10.0


def test_prefix_caching_turned_off_for_an_mla_model_says_so() -> None:
    """vLLM's CPU platform turns prefix caching off by itself for an MLA model (without
    AMX): the refusal names that, not only the knob the user never set."""
    vc = _vllm_config()
    vc.cache_config.enable_prefix_caching = False
    vc.model_config = SimpleNamespace(use_mla=True)
    with pytest.raises(ConfigError, match="uses MLA attention: vLLM turns prefix "
                                          "caching off itself for MLA models"):
        _parse(vc)
