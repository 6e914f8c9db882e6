"""Configuration of kvshm's vLLM connector, validated before anything starts.

Pure Python (no vLLM import): :func:`parse_config` reads the vLLM settings it needs
through plain attributes, so it can be tested without vLLM. Every refusal is a
:class:`~kvshm.errors.ConfigError` that names the setting, the value and what to do.

``kv_connector_extra_config`` keys (anything else is refused, to catch typos):

* ``cpu_bytes`` (server-wide, split evenly over the TP x PP ranks) or
  ``cpu_bytes_per_rank`` or ``num_cpu_blocks`` (exact; wins over the byte budgets):
  the CPU tier's size. One of them is required: kvshm reserves this much shared memory
  per rank with ``posix_fallocate`` up front, so it never guesses.
* ``mode``: ``"eager"`` (default; blocks are stored once computed) or ``"lazy"``
  (stored as they near eviction from vLLM's free queue; one KV group only).
* ``name``: the rendezvous name; default ``kvshm-`` + ``kv_transfer_config.engine_id``
  (vLLM draws the engine id once and ships it to every process of the engine), made
  safe and at most 80 characters by :func:`engine_name`.
* ``stats_path``: the scheduler side writes its final statistics (JSON) there at
  shutdown.
* ``hang_timeout_s``, ``shutdown_timeout_s``: finite positive numbers (defaults 10 --
  ``kvshm.config.DEFAULT_HANG_TIMEOUT_S`` -- and 5).
* ``remote_url``: a remote tier shared by every engine that names it
  (``valkey://host:port`` or ``valkey+cluster://h1:p1,h2:p2``; ``kvshm valkey`` runs
  one); ``remote_mode``: ``"write_through"`` (default) or ``"on_evict"``. The layout
  fingerprint that keeps deployments apart includes the model, its revision, dtype,
  quantization, a digest of its HF config (rope scaling, overrides), the KV cache dtype
  and ``remote_namespace`` (any string: a salt to keep deployments apart that kvshm
  cannot tell apart, e.g. fine-tunes published under one name), so two engines share
  blocks only when all are equal (and vLLM's block hashes agree: start both with the
  same ``PYTHONHASHSEED``, which seeds vLLM's prefix hashes).
* ``test_fail_loads``: a test hook: each worker rank fails the copy of the first N load
  jobs it is sent (the copy engine raises; nothing is copied). Default 0.

vLLM settings the connector requires: ``kv_role="kv_both"``,
``kv_load_failure_policy="recompute"`` (vLLM 0.32's default ``"fail"`` aborts a request
whose load failed instead of recomputing it), prefix caching on, no decode or prefill
context parallelism, KV groups that are full or sliding-window attention with one
block size equal to the hash block size.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from kvshm.config import (
    DEFAULT_EVICTION,
    DEFAULT_HANG_TIMEOUT_S,
    MAX_TIMEOUT_S,
    Eviction,
    RemoteMode,
)
from kvshm.errors import ConfigError
from kvshm.remote.tier import RemoteSpec
from kvshm.types import KVGroup, StoreMode

__all__ = [
    "ConnectorConfig",
    "GroupInfo",
    "GroupKindName",
    "check_budget",
    "engine_name",
    "parse_config",
    "tier_text",
]

_NAME_MAX: Final = 80
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_KNOWN_KEYS: Final = frozenset({
    "cpu_bytes", "cpu_bytes_per_rank", "num_cpu_blocks", "mode", "name", "stats_path",
    "hang_timeout_s", "shutdown_timeout_s", "test_fail_loads", "eviction",
    "remote_url", "remote_mode", "remote_namespace",
})


class GroupKindName(Enum):
    """What a vLLM KV cache group's spec is, as far as kvshm cares."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"  # Mamba and other state-space layers
    OTHER = "other"


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV cache group: its kind, block size in tokens, window (sliding only)
    and the spec's class name (for error messages)."""

    kind: GroupKindName
    block_size: int
    window_tokens: int | None = None
    spec_name: str = ""


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything both sides of the connector need, validated."""

    name: str
    tp: int
    pp: int
    block_size: int
    groups: tuple[KVGroup, ...]
    mode: StoreMode
    cpu_bytes_per_rank: int | None
    num_cpu_blocks: int | None
    stats_path: str | None
    hang_timeout_s: float
    shutdown_timeout_s: float
    test_fail_loads: int
    eviction: Eviction = DEFAULT_EVICTION
    remote_url: str | None = None
    remote_mode: RemoteMode = RemoteMode.WRITE_THROUGH
    model_id: str = ""

    @property
    def world_size(self) -> int:
        """Worker ranks (TP x PP)."""
        return self.tp * self.pp


def engine_name(engine_id: str) -> str:
    """``kvshm-<engine_id>`` made safe for a rendezvous name, deterministically.

    Characters outside ``[A-Za-z0-9._-]`` become ``-``; a result longer than 80
    characters keeps its head and ends with 16 hex digits of the id's SHA-256, so two
    long ids that share a head still get different names.
    """
    if not isinstance(engine_id, str) or not engine_id:
        raise ConfigError(f"kv_transfer_config.engine_id must be a non-empty string, "
                          f"got {engine_id!r}")
    name = "kvshm-" + _UNSAFE.sub("-", engine_id)
    if len(name) <= _NAME_MAX:
        return name
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:16]
    return f"{name[:_NAME_MAX - 17]}-{digest}"


def _int(key: str, value: object) -> int:
    """A positive integer (an integral float such as ``1e9`` from JSON is accepted)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive integer, "
                          f"got {value!r}")
    if value <= 0:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be > 0, got {value}")
    return value


def _seconds(key: str, value: object, default: float) -> float:
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value <= MAX_TIMEOUT_S):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive number "
                          f"of seconds (> 0, at most a day), got {value!r}")
    return float(value)


def _eviction(value: object) -> Eviction:
    """``eviction``: the CPU tier's eviction order by name (default: kvshm's default)."""
    if value is None:
        return DEFAULT_EVICTION
    for e in Eviction:
        if value == e.value:
            return e
    raise ConfigError(f"kv_connector_extra_config['eviction'] must be one of "
                      f"{[e.value for e in Eviction]}, got {value!r}")


def _remote(extra: Mapping[str, Any], vllm_config: Any) -> tuple[str | None, RemoteMode,
                                                                   str]:
    """(remote_url, remote_mode, model_id) from the extra config and the model config."""
    url = extra.get("remote_url")
    if url is not None:
        if not isinstance(url, str):
            raise ConfigError(f"kv_connector_extra_config['remote_url'] must be a URL "
                              f"string, got {url!r}")
        RemoteSpec.parse(url)
    mode = extra.get("remote_mode", RemoteMode.WRITE_THROUGH.value)
    modes = {m.value: m for m in RemoteMode}
    if mode not in modes:
        raise ConfigError(f"kv_connector_extra_config['remote_mode'] must be one of "
                          f"{sorted(modes)}, got {mode!r}")
    namespace = extra.get("remote_namespace", "")
    if not isinstance(namespace, str) or len(namespace) > 100:
        raise ConfigError(f"kv_connector_extra_config['remote_namespace'] must be a string "
                          f"of at most 100 characters, got {namespace!r}")
    return url, modes[mode], model_identity(vllm_config, namespace)


def model_identity(vllm_config: Any, namespace: str = "") -> str:
    """What the layout fingerprint covers of the model (at most 400 characters): name,
    revision, dtype, quantization, a digest of the HF config, KV cache dtype, and the
    operator's namespace. Two deployments whose KV bytes may differ must differ here."""
    mc = getattr(vllm_config, "model_config", None)
    parts = [str(getattr(mc, a, "") or "") for a in ("model", "revision", "dtype",
                                                       "quantization")]
    to_dict = getattr(getattr(mc, "hf_config", None), "to_dict", None)
    hf = ""
    if callable(to_dict):
        raw = json.dumps(to_dict(), sort_keys=True, default=str).encode()
        hf = hashlib.sha256(raw).hexdigest()[:16]
    cache = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", ""))
    tail = "|".join([hf, cache, namespace])
    return ("|".join(parts)[:400 - len(tail) - 1] + "|" + tail)[:400]


def _mode(value: object) -> StoreMode:
    if value is None:
        return StoreMode.EAGER
    for m in StoreMode:
        if value == m.value:
            return m
    raise ConfigError(f"kv_connector_extra_config['mode'] must be one of "
                      f"{[m.value for m in StoreMode]}, got {value!r}")


def _budget(extra: Mapping[str, Any], world_size: int) -> tuple[int | None, int | None]:
    """(cpu_bytes_per_rank, num_cpu_blocks) from the extra config."""
    blocks = extra.get("num_cpu_blocks")
    per_rank = extra.get("cpu_bytes_per_rank")
    total = extra.get("cpu_bytes")
    if blocks is None and per_rank is None and total is None:
        raise ConfigError("kvshm needs the CPU tier's size: set kv_connector_extra_config"
                          "['cpu_bytes'] (server-wide bytes, split over the TP x PP ranks), "
                          "['cpu_bytes_per_rank'] or ['num_cpu_blocks']")
    if per_rank is not None and total is not None:
        raise ConfigError("set either kv_connector_extra_config['cpu_bytes'] or "
                          "['cpu_bytes_per_rank'], not both")
    n = _int("num_cpu_blocks", blocks) if blocks is not None else None
    if per_rank is not None:
        return _int("cpu_bytes_per_rank", per_rank), n
    if total is not None:
        total_b = _int("cpu_bytes", total)
        if total_b < world_size:
            raise ConfigError(f"kv_connector_extra_config['cpu_bytes']={total_b} is less "
                              f"than one byte for each of the {world_size} ranks")
        return total_b // world_size, n
    return None, n


def _groups(infos: Sequence[GroupInfo], hash_block_size: int | None) -> tuple[int,
                                                                            tuple[KVGroup,
                                                                                  ...]]:
    if not infos:
        raise ConfigError("the model has no KV cache groups; nothing to offload")
    groups = []
    for i, g in enumerate(infos):
        if g.kind is GroupKindName.RECURRENT:
            raise ConfigError(f"KV cache group {i} ({g.spec_name}) is recurrent (Mamba-like) "
                              "state; kvshm offloads attention KV blocks only")
        if g.kind is GroupKindName.OTHER:
            raise ConfigError(f"KV cache group {i} ({g.spec_name}) is not full or "
                              "sliding-window attention; kvshm does not support it")
        if g.kind is GroupKindName.SLIDING_WINDOW:
            if g.window_tokens is None:
                raise ConfigError(f"KV cache group {i} ({g.spec_name}) has no window size")
            groups.append(KVGroup.sliding_window(g.window_tokens))
        else:
            groups.append(KVGroup.full())
    sizes = sorted({g.block_size for g in infos})
    if len(sizes) != 1:
        raise ConfigError(f"KV cache groups have unequal block sizes {sizes} (tokens); "
                          "kvshm needs one block size for every group")
    bs = sizes[0]
    if hash_block_size is not None and hash_block_size != bs:
        raise ConfigError(f"vLLM hashes blocks of {hash_block_size} tokens but allocates "
                          f"blocks of {bs}; kvshm needs them equal")
    return bs, tuple(groups)


def _check_vllm(vllm_config: Any) -> None:
    kvt = vllm_config.kv_transfer_config
    role = getattr(kvt, "kv_role", None)
    if role != "kv_both":
        raise ConfigError(f"kvshm needs kv_transfer_config.kv_role='kv_both' (it stores "
                          f"and loads), got {role!r}")
    policy = getattr(kvt, "kv_load_failure_policy", None)
    if policy != "recompute":
        raise ConfigError(f"kvshm needs kv_transfer_config.kv_load_failure_policy="
                          f"'recompute' (a failed CPU load must be recomputed; 'fail' aborts "
                          f"the request), got {policy!r}")
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ConfigError("kvshm needs prefix caching (enable_prefix_caching=True): it "
                          "stores and finds blocks by their prefix hashes")
    par = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(par, attr, 1)
        if size != 1:
            raise ConfigError(f"kvshm does not support context parallelism "
                              f"({attr}={size})")


def parse_config(vllm_config: Any, infos: Sequence[GroupInfo],
                 hash_block_size: int | None) -> ConnectorConfig:
    """Validate vLLM's settings and the extra config; the connector's configuration."""
    kvt = vllm_config.kv_transfer_config
    if kvt is None:
        raise ConfigError("kvshm's connector needs a kv_transfer_config")
    _check_vllm(vllm_config)
    extra = dict(getattr(kvt, "kv_connector_extra_config", None) or {})
    unknown = sorted(set(extra) - _KNOWN_KEYS)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config keys {unknown}; kvshm knows "
                          f"{sorted(_KNOWN_KEYS)}")
    par = vllm_config.parallel_config
    tp, pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    per_rank, blocks = _budget(extra, tp * pp)
    bs, groups = _groups(infos, hash_block_size)
    mode = _mode(extra.get("mode"))
    if mode is StoreMode.LAZY and len(groups) != 1:
        raise ConfigError(f"mode='lazy' supports one KV cache group; the model has "
                          f"{len(groups)}")
    name = extra.get("name")
    if name is None:
        name = engine_name(str(kvt.engine_id))
    elif not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,80}", name):
        raise ConfigError(f"kv_connector_extra_config['name'] must be 1-80 characters of "
                          f"[A-Za-z0-9._-], got {name!r}")
    stats_path = extra.get("stats_path")
    if stats_path is not None and (not isinstance(stats_path, str) or not stats_path):
        raise ConfigError(f"kv_connector_extra_config['stats_path'] must be a file path, "
                          f"got {stats_path!r}")
    fail_loads = extra.get("test_fail_loads", 0)
    if fail_loads != 0:
        fail_loads = _int("test_fail_loads", fail_loads)
    url, remote_mode, model_id = _remote(extra, vllm_config)
    return ConnectorConfig(
        name=name, tp=tp, pp=pp, block_size=bs, groups=groups, mode=mode,
        cpu_bytes_per_rank=per_rank, num_cpu_blocks=blocks, stats_path=stats_path,
        hang_timeout_s=_seconds("hang_timeout_s", extra.get("hang_timeout_s"),
                                DEFAULT_HANG_TIMEOUT_S),
        shutdown_timeout_s=_seconds("shutdown_timeout_s", extra.get("shutdown_timeout_s"),
                                    5.0),
        test_fail_loads=fail_loads, eviction=_eviction(extra.get("eviction")),
        remote_url=url, remote_mode=remote_mode, model_id=model_id)


def check_budget(cfg: ConnectorConfig, bytes_per_block: int, available_bytes: int) -> None:
    """Refuse a CPU tier that cannot hold one block per rank, or that all ranks together
    cannot get from this host (``available_bytes``: free shared memory less a margin).

    Early and approximate (the exact check runs when every rank has said hello); the
    point is a clear error at start-up instead of an engine that serves without offload.
    """
    if bytes_per_block <= 0:
        raise ConfigError(f"vLLM's KV cache has {bytes_per_block} bytes per block")
    world = cfg.world_size
    if cfg.num_cpu_blocks is not None:
        need = cfg.num_cpu_blocks * bytes_per_block
        what = f"num_cpu_blocks={cfg.num_cpu_blocks} ({need} bytes per rank)"
    else:
        assert cfg.cpu_bytes_per_rank is not None
        need = cfg.cpu_bytes_per_rank
        what = f"a CPU budget of {need} bytes per rank"
        if need < bytes_per_block:
            raise ConfigError(f"{what} cannot hold one KV block of {bytes_per_block} bytes; "
                              "raise cpu_bytes")
    if need * world > available_bytes:
        raise ConfigError(f"{what} x {world} rank(s) = {need * world} bytes does not fit: "
                          f"{available_bytes} bytes of shared memory are available here "
                          "(free /dev/shm and MemAvailable, less a margin)")


def tier_text(c: ConnectorConfig) -> str:
    """The CPU tier's size as configured, for the start-up line."""
    if c.num_cpu_blocks is not None:
        return f"CPU tier of {c.num_cpu_blocks} blocks"
    if c.cpu_bytes_per_rank is not None:
        return f"CPU tier of {c.cpu_bytes_per_rank / (1 << 30):.2f} GiB per rank"
    return "CPU tier sized by the engine"
