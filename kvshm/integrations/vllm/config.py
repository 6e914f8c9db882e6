"""Configuration of kvshm's vLLM connector, validated before anything starts.

Pure Python (no vLLM import): :func:`parse_config` reads the vLLM settings it needs
through plain attributes, so it can be tested without vLLM. Every refusal is a
:class:`~kvshm.errors.ConfigError` that names the setting, the value and what to do.

``kv_connector_extra_config`` keys: every one is optional (:data:`PUBLIC_KEYS` has a line
on each, with its default; it is what the refusal of an unknown key lists):

* ``cpu_bytes`` (server-wide, split evenly over the TP x PP ranks) or
  ``cpu_bytes_per_rank`` or ``num_cpu_blocks`` (exact): the CPU tier's size, reserved
  in shared memory with ``posix_fallocate`` up front. At most one of them (two are
  refused: they would disagree). None: the default, :data:`DEFAULT_MEMORY_SHARE` (a
  quarter) of the memory available to this host's processes (``MemAvailable``, lowered
  to the memory cgroup's headroom), at most what /dev/shm can still take less a margin
  (:func:`kvshm.shm_budget.available_shm_bytes`), split evenly over the ranks; resolved
  once, by the scheduler side (:func:`resolve_size`), and shown in its start-up line.
* ``mode``: ``"eager"`` (default; blocks are stored once computed) or ``"lazy"``
  (stored as they near eviction from vLLM's free queue; one KV group only).
* ``name``: the rendezvous name; default ``kvshm-`` + ``kv_transfer_config.engine_id``
  (vLLM draws the engine id once and ships it to every process of the engine), made
  safe and at most 80 characters by :func:`engine_name`. With data parallelism each
  replica appends ``_dp<rank>``, as vLLM does to the engine id (:func:`replica_name`).
* ``stats_path``: the scheduler side writes its final statistics (JSON) there at
  shutdown; each data-parallel replica to its own file (:func:`replica_stats_path`).
* ``hang_timeout_s``, ``shutdown_timeout_s``: finite positive numbers (defaults 10 --
  ``kvshm.config.DEFAULT_HANG_TIMEOUT_S`` -- and 5); ``hang_timeout_s`` at least
  ``kvshm.config.MIN_HANG_TIMEOUT_S`` (0.5).
* ``eviction``: the CPU tier's eviction order (default ``kvshm.config.DEFAULT_EVICTION``).
* ``remote_url``: a remote tier shared by every engine that names it
  (``valkey://host:port`` or ``valkey+cluster://h1:p1,h2:p2``; ``kvshm valkey`` runs
  one); ``remote_mode``: ``"write_through"`` (default) or ``"on_evict"``. The layout
  fingerprint that keeps deployments apart includes the model, its revision, dtype,
  quantization, a digest of its HF config (rope scaling, overrides), the KV cache dtype
  and ``remote_namespace`` (any string: a salt to keep deployments apart that kvshm
  cannot tell apart, e.g. fine-tunes published under one name), so two engines share
  blocks only when all are equal (and vLLM's block hashes agree: they do with its
  default ``sha256``; with ``prefix_caching_hash_algo`` ``xxhash`` or ``xxhash_cbor``
  start every engine with the same ``PYTHONHASHSEED``, else each process seeds them at
  random: :func:`unshared_hashes`).
* ``disk_path``: a directory for the local disk tier (one slab file per rank; default:
  none), ``disk_bytes_per_rank`` (each rank's slab size in bytes; required with
  ``disk_path``), ``disk_io``: ``"direct"`` (default, ``O_DIRECT``) or ``"buffered"``;
  ``disk_mode``: ``"write_back"`` (default: blocks about to leave the CPU tier) or
  ``"write_through"`` (every stored block). ``disk_io`` or ``disk_mode`` without the
  key ``disk_path``, and ``remote_mode`` without the key ``remote_url``, are
  ConfigErrors: a tier's settings without the tier (the anchor given as None turns
  the tier off explicitly: accepted).
  The slab is named after ``name``: set ``name`` for a restarted server to serve the
  previous one's disk blocks (warm restart). The default name is new every start: its
  slabs are removed when the engine closes.

Internal keys (:data:`INTERNAL_KEYS`: accepted, never listed to a user):
``test_fail_loads``, a test hook: each worker rank fails the copy of the first N load
jobs it is sent (the copy engine raises; nothing is copied). Default 0.

An unknown key is refused with one line naming the closest public key
(:func:`check_extra_keys`); the checks that need no vLLM object
(:func:`check_extra_config`) also run from the connector's
``requires_piecewise_for_cudagraph``, which vLLM calls while it builds its config when
CUDA graphs are on, before any process starts.

vLLM settings: ``kv_role="kv_both"`` (required); ``kv_load_failure_policy``: kvshm sets
``"recompute"`` on the scheduler side before vLLM's scheduler reads it
(:func:`adopt_failure_policy`; vLLM 0.32's default ``"fail"`` would abort a request
whose load failed instead of recomputing it); prefix caching on, no decode or prefill
context parallelism, KV groups that are full or sliding-window attention with one
block size equal to the hash block size.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from kvshm.config import (
    DEFAULT_EVICTION,
    DEFAULT_HANG_TIMEOUT_S,
    MAX_TIMEOUT_S,
    MIN_HANG_TIMEOUT_S,
    DiskIO,
    DiskMode,
    Eviction,
    RemoteMode,
)
from kvshm.errors import ConfigError
from kvshm.remote.tier import RemoteSpec
from kvshm.types import KVGroup, StoreMode

__all__ = [
    "DEFAULT_MEMORY_SHARE",
    "INTERNAL_KEYS",
    "PUBLIC_KEYS",
    "SIZE_KEYS",
    "ConnectorConfig",
    "ExtraSettings",
    "GroupInfo",
    "GroupKindName",
    "SizeSource",
    "adopt_failure_policy",
    "check_budget",
    "check_extra_config",
    "check_paths",
    "check_extra_keys",
    "check_vllm_config",
    "default_cpu_bytes_per_rank",
    "engine_name",
    "lower_tiers_text",
    "parse_config",
    "replica_name",
    "replica_stats_path",
    "resolve_size",
    "tier_text",
    "unshared_hashes",
]

_NAME_MAX: Final = 80
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_EXTRA: Final = "kv_connector_extra_config"

#: Share of the memory available to this host's processes that the CPU tier takes when
#: no size key is set (then capped by what /dev/shm can take; split over the ranks).
DEFAULT_MEMORY_SHARE: Final = 0.25
_SHARE_TEXT: Final = f"{DEFAULT_MEMORY_SHARE:.0%}"

#: The keys a user may set, each with one line: what it does and its default. The
#: refusal of an unknown key lists these, and only these.
PUBLIC_KEYS: Final[Mapping[str, str]] = {
    "cpu_bytes": (f"the CPU tier's size in bytes for the whole server, split evenly over "
                  f"the TP x PP ranks (default: {_SHARE_TEXT} of available memory, at most "
                  f"free /dev/shm less a margin)"),
    "cpu_bytes_per_rank": "the CPU tier's size in bytes for each rank (instead of cpu_bytes)",
    "num_cpu_blocks": "the CPU tier's size in KV blocks, exact (instead of cpu_bytes)",
    "mode": ("'eager' (default: store blocks once computed) or 'lazy' (store them as "
             "they near eviction; one KV group only)"),
    "name": ("the name `kvshm stats --name` takes (default: kvshm-<engine_id>, new every "
             "start; with data parallelism each replica's ends in _dp<rank>)"),
    "stats_path": "a file the final statistics (JSON) are written to at shutdown (default: none)",
    "hang_timeout_s": (f"seconds a rank with work pending may complete nothing before it is "
                       f"declared hung (default {DEFAULT_HANG_TIMEOUT_S:g}, at least "
                       f"{MIN_HANG_TIMEOUT_S:g})"),
    "shutdown_timeout_s": "seconds shutdown waits for the worker ranks (default 5)",
    "eviction": (f"the CPU tier's eviction order, one of {[e.value for e in Eviction]} "
                 f"(default {DEFAULT_EVICTION.value!r})"),
    "remote_url": ("a remote tier shared by the engines that name it, valkey://host:port "
                   "or valkey+cluster://h1:p1,h2:p2 (default: none)"),
    "remote_mode": "'write_through' (default) or 'on_evict': when blocks go to the remote tier",
    "remote_namespace": ("a string that keeps deployments kvshm cannot tell apart from "
                         "sharing remote blocks (default: empty)"),
    "disk_path": ("a directory for the local disk tier, one slab file per rank, kept "
                  "for a restart under the same name (default: none)"),
    "disk_bytes_per_rank": "each rank's disk slab size in bytes (required with disk_path)",
    "disk_io": "'direct' (default: O_DIRECT) or 'buffered' (the disk tier's file I/O)",
    "disk_mode": ("'write_back' (default: blocks about to leave the CPU tier go to disk) "
                  "or 'write_through' (every stored block, for a warm restart)"),
}
#: Keys accepted for tests, never listed to a user.
INTERNAL_KEYS: Final = frozenset({"test_fail_loads"})
#: The keys that size the CPU tier; at most one may be set.
SIZE_KEYS: Final = ("cpu_bytes", "cpu_bytes_per_rank", "num_cpu_blocks")


class GroupKindName(Enum):
    """What a vLLM KV cache group's spec is, as far as kvshm cares."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"  # Mamba and other state-space layers
    OTHER = "other"


class SizeSource(Enum):
    """Which setting sized the CPU tier (the size key's name, or the default)."""

    CPU_BYTES = "cpu_bytes"
    CPU_BYTES_PER_RANK = "cpu_bytes_per_rank"
    NUM_CPU_BLOCKS = "num_cpu_blocks"
    DEFAULT = "default"


@dataclass(frozen=True)
class GroupInfo:
    """One vLLM KV cache group: its kind, block size in tokens, window (sliding only)
    and the spec's class name (for error messages)."""

    kind: GroupKindName
    block_size: int
    window_tokens: int | None = None
    spec_name: str = ""


@dataclass(frozen=True)
class ExtraSettings:
    """``kv_connector_extra_config`` validated on its own (no vLLM object needed).

    Invariant: at most one of ``cpu_bytes_per_rank`` and ``num_cpu_blocks`` is set, and
    ``size_source`` says which key set it (DEFAULT: neither).
    """

    size_source: SizeSource
    cpu_bytes_per_rank: int | None
    num_cpu_blocks: int | None
    mode: StoreMode
    name: str | None
    stats_path: str | None
    hang_timeout_s: float
    shutdown_timeout_s: float
    test_fail_loads: int
    eviction: Eviction
    remote_url: str | None
    remote_mode: RemoteMode
    remote_namespace: str
    disk_path: str | None = None
    disk_bytes_per_rank: int | None = None
    disk_io: DiskIO = DiskIO.DIRECT
    disk_mode: DiskMode = DiskMode.WRITE_BACK


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything both sides of the connector need, validated.

    With ``size_source`` DEFAULT both sizes are None until the scheduler side, the only
    side that sizes the tier, fills ``cpu_bytes_per_rank`` in (:func:`resolve_size`).
    """

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
    size_source: SizeSource = SizeSource.CPU_BYTES
    disk_path: str | None = None
    disk_bytes_per_rank: int | None = None
    disk_io: DiskIO = DiskIO.DIRECT
    disk_mode: DiskMode = DiskMode.WRITE_BACK
    #: The slabs outlive the engine (``EngineConfig.disk_keep``): where ``name`` was
    #: given; the default name is new every start, so its slabs go at close.
    disk_keep: bool = True
    #: ``EngineConfig.disk_stamp``: the model directory's weight files (:func:`weights_stamp`).
    disk_stamp: str = ""
    #: Hits are loaded synchronously, in the step that computes the request: a CPU
    #: device (its worker copies a load inline in ``start_load_kv``, which vLLM calls
    #: before the forward of a step with synchronous loads) with one KV cache group
    #: (a failed synchronous load reaches vLLM as block ids, which it maps back to
    #: requests only with one group). See :func:`sync_loads_for`.
    sync_loads: bool = False

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


def replica_name(name: str, parallel_config: Any) -> str:
    """An explicit ``name`` as one data-parallel replica's rendezvous name.

    vLLM gives every data-parallel engine the same ``kv_connector_extra_config`` but
    appends ``_dp<rank>`` to each one's ``engine_id`` (when ``data_parallel_size > 1``
    or the rank is not 0) so that they do not collide; an explicit name must follow the
    same rule, or the second replica's scheduler finds the name taken and vLLM fails to
    start. ConfigError when the suffixed name exceeds 80 characters.
    """
    rank = _dp_rank(parallel_config)
    if rank is None:
        return name
    named = f"{name}_dp{rank}"
    if len(named) > _NAME_MAX:
        raise ConfigError(f"{_EXTRA}['name']={name!r} with data parallelism becomes "
                          f"{named!r}, longer than {_NAME_MAX} characters; shorten it")
    return named


def _dp_rank(parallel_config: Any) -> int | None:
    """This engine's data-parallel rank when vLLM runs replicas (vLLM's rule for
    suffixing ``engine_id``), else None."""
    size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    rank = int(getattr(parallel_config, "data_parallel_rank", 0) or 0)
    return None if size <= 1 and rank == 0 else rank


def replica_stats_path(path: str | None, parallel_config: Any) -> str | None:
    """``stats_path`` as one data-parallel replica's file: ``_dp<rank>`` before the
    suffix (``/run/kvshm.json`` -> ``/run/kvshm_dp1.json``), as :func:`replica_name`
    does to the name. Every replica gets the same extra config; without it each one
    rewrote the same file and the last writer's engine was all an operator saw."""
    rank = _dp_rank(parallel_config)
    if path is None or rank is None:
        return path
    head, sep, base = path.rpartition("/")
    stem, dot, suffix = base.rpartition(".")
    if not stem:  # no suffix ("stats", ".stats"): append
        return f"{path}_dp{rank}"
    return f"{head}{sep}{stem}_dp{rank}{dot}{suffix}"


# ------------------------------------------------------------------ the extra config


def check_extra_keys(extra: Mapping[Any, Any]) -> None:
    """Refuse unknown keys and more than one size key, each in one line.

    The line names the unknown key(s), the closest public key (``difflib``) and every
    public key; internal keys are accepted but never suggested or listed.
    """
    unknown = sorted((k for k in extra if k not in PUBLIC_KEYS and k not in INTERNAL_KEYS),
                     key=repr)
    if unknown:
        keys = ", ".join(PUBLIC_KEYS)
        hints = [m[0] for k in unknown if isinstance(k, str)
                 for m in [difflib.get_close_matches(k, PUBLIC_KEYS, n=1)] if m]
        hint = f"; did you mean {', '.join(map(repr, hints))}?" if hints else ""
        what = "key" if len(unknown) == 1 else "keys"
        raise ConfigError(f"kvshm: unknown {what} {', '.join(map(repr, unknown))} in "
                          f"{_EXTRA}{hint} (keys: {keys})")
    sizes = [k for k in SIZE_KEYS if extra.get(k) is not None]
    if len(sizes) > 1:
        raise ConfigError(f"kvshm: {_EXTRA} sets both {sizes[0]!r} and {sizes[1]!r}; keep "
                          f"one (each sizes the CPU tier)")


def _int(key: str, value: object) -> int:
    """A positive integer below 2**63 (an integral float such as ``1e9`` from JSON is
    accepted). A refusal names the value as :func:`_shown` does: ``1e300`` was printed
    back as a 301-digit number, and ``10**400`` (exact in JSON, past any float) raised
    OverflowError while its message was built."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{_EXTRA}[{key!r}] must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{_EXTRA}[{key!r}] must be > 0, got {_shown(value)}")
    if value >= 1 << 63:
        raise ConfigError(f"{_EXTRA}[{key!r}] must be below 2**63, got {_shown(value)}")
    return value


def _shown(value: int) -> str:
    """``value`` as a message shows it: its digits up to 100 bits (about 30 digits),
    else its size (no 300-digit line; no str() of a number past Python's 4,300-digit
    conversion limit)."""
    bits = value.bit_length()
    if bits <= 100:
        return str(value)
    return f"{'a negative' if value < 0 else 'a'} number of {bits} bits"


def _seconds(key: str, value: object, default: float, least: float = 0.0) -> float:
    """A number of seconds in (0, a day], at least ``least`` where that is set."""
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not 0 < value <= MAX_TIMEOUT_S):
        raise ConfigError(f"{_EXTRA}[{key!r}] must be a positive number of seconds (> 0, "
                          f"at most a day), got {value!r}")
    if value < least:
        raise ConfigError(f"{_EXTRA}[{key!r}] must be at least {least} s (a busy host "
                          f"stalls healthy ranks for longer than a shorter one), got "
                          f"{value!r}")
    return float(value)


def _eviction(value: object) -> Eviction:
    """``eviction``: the CPU tier's eviction order by name (default: kvshm's default)."""
    if value is None:
        return DEFAULT_EVICTION
    for e in Eviction:
        if value == e.value:
            return e
    raise ConfigError(f"{_EXTRA}['eviction'] must be one of {[e.value for e in Eviction]}, "
                      f"got {value!r}")


def _or_default(extra: Mapping[str, Any], key: str, default: str) -> Any:
    """``extra[key]``, or ``default`` where it is absent or None (a template that sets
    every key, None for "the default", as ``mode`` and ``name`` take it)."""
    value = extra.get(key)
    return default if value is None else value


def _remote(extra: Mapping[str, Any]) -> tuple[str | None, RemoteMode, str]:
    """(remote_url, remote_mode, remote_namespace) from the extra config."""
    url = extra.get("remote_url")
    if url is not None:
        if not isinstance(url, str):
            raise ConfigError(f"{_EXTRA}['remote_url'] must be a URL string, got {url!r}")
        RemoteSpec.parse(url)
    if "remote_url" not in extra and extra.get("remote_mode") is not None:  # the user thinks
        # a tier is on (an explicit ``"remote_url": None`` is a template's "tier off", and
        # a None elsewhere "the default", as for every key: accepted)
        raise ConfigError(f"{_EXTRA}: 'remote_mode' is set but 'remote_url' is not "
                          f"(there is no remote tier without a server)")
    mode = _or_default(extra, "remote_mode", RemoteMode.WRITE_THROUGH.value)
    modes = {m.value: m for m in RemoteMode}
    if not isinstance(mode, str) or mode not in modes:  # a list is no mode (nor hashable)
        raise ConfigError(f"{_EXTRA}['remote_mode'] must be one of {sorted(modes)}, "
                          f"got {mode!r}")
    namespace = _or_default(extra, "remote_namespace", "")
    if not isinstance(namespace, str) or len(namespace) > 100:
        raise ConfigError(f"{_EXTRA}['remote_namespace'] must be a string of at most 100 "
                          f"characters, got {namespace!r}")
    return url, modes[mode], namespace


def _disk(extra: Mapping[str, Any]) -> tuple[str | None, int | None, DiskIO, DiskMode]:
    """(disk_path, disk_bytes_per_rank, disk_io, disk_mode) from the extra config."""
    path = extra.get("disk_path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError(f"{_EXTRA}['disk_path'] must be a directory path, got {path!r}")
    size = extra.get("disk_bytes_per_rank")
    per_rank = None if size is None else _int("disk_bytes_per_rank", size)
    if (path is None) != (per_rank is None):
        raise ConfigError(f"{_EXTRA}: 'disk_path' and 'disk_bytes_per_rank' go together "
                          f"(the disk tier's directory and each rank's slab size)")
    stray = sorted(k for k in ("disk_io", "disk_mode") if extra.get(k) is not None)
    if "disk_path" not in extra and stray:  # the user thinks a tier is on (an explicit
        # ``"disk_path": None`` is a template's "tier off": accepted)
        raise ConfigError(f"{_EXTRA}: {stray} set but 'disk_path' is not (there is no "
                          f"disk tier without a directory)")
    io = _or_default(extra, "disk_io", DiskIO.DIRECT.value)
    ios = {d.value: d for d in DiskIO}
    if not isinstance(io, str) or io not in ios:
        raise ConfigError(f"{_EXTRA}['disk_io'] must be one of {sorted(ios)}, got {io!r}")
    mode = _or_default(extra, "disk_mode", DiskMode.WRITE_BACK.value)
    modes = {m.value: m for m in DiskMode}
    if not isinstance(mode, str) or mode not in modes:
        raise ConfigError(f"{_EXTRA}['disk_mode'] must be one of {sorted(modes)}, "
                          f"got {mode!r}")
    return path, per_rank, ios[io], modes[mode]


def model_identity(vllm_config: Any, namespace: str = "") -> str:
    """What the layout fingerprint covers of the model (at most 400 characters): name,
    revision, dtype, quantization, a digest of the HF config, KV cache dtype, and the
    operator's namespace. Two deployments whose KV bytes may differ must differ here:
    an identity over 400 characters keeps its head and ends with a digest of the whole
    (cutting it cut the revision, dtype and quantization after a long local model
    path, and an fp8 and a bf16 engine of one checkpoint shared KV: a hostile probe)."""
    mc = getattr(vllm_config, "model_config", None)
    parts = [str(getattr(mc, a, "") or "") for a in ("model", "revision", "dtype",
                                                       "quantization")]
    to_dict = getattr(getattr(mc, "hf_config", None), "to_dict", None)
    hf = ""
    if callable(to_dict):
        raw = json.dumps(to_dict(), sort_keys=True, default=str).encode()
        hf = hashlib.sha256(raw).hexdigest()[:16]
    cache = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", ""))
    full = "|".join([*parts, hf, cache, namespace])
    if len(full) <= _IDENTITY_CHARS:
        return full
    digest = hashlib.sha256(full.encode()).hexdigest()[:32]
    return full[:_IDENTITY_CHARS - len(digest) - 1] + "|" + digest


#: The longest model identity (the fingerprint's model field, kept readable in logs).
_IDENTITY_CHARS: Final = 400


#: Files that hold a checkpoint's weights (:func:`weights_stamp`).
_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def weights_stamp(vllm_config: Any) -> str:
    """A digest of the weight files of the model, where it is a local directory: each
    file's name, size and modification time (no file is read). "" for a hub id (its
    revision is in :func:`model_identity`) or an unreadable directory. For the disk
    tier's fingerprint only: a checkpoint replaced in place under the same path and
    config made a warm restart serve the old weights' KV -- wrong output, no warning.
    (Not in the remote tier's: copies of one checkpoint on several machines differ in
    their times and must share one tier.)"""
    model = getattr(getattr(vllm_config, "model_config", None), "model", None)
    if not isinstance(model, str) or not os.path.isdir(model):
        return ""
    try:
        files = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns)
                       for e in os.scandir(model)
                       if e.is_file() and e.name.endswith(_WEIGHT_SUFFIXES))
    except OSError:
        return ""
    return hashlib.sha256(repr(files).encode()).hexdigest()[:16] if files else ""


def _mode(value: object) -> StoreMode:
    if value is None:
        return StoreMode.EAGER
    for m in StoreMode:
        if value == m.value:
            return m
    raise ConfigError(f"{_EXTRA}['mode'] must be one of {[m.value for m in StoreMode]}, "
                      f"got {value!r}")


def _budget(extra: Mapping[str, Any], world_size: int) -> tuple[SizeSource, int | None,
                                                                 int | None]:
    """(size_source, cpu_bytes_per_rank, num_cpu_blocks); at most one size key is set
    (:func:`check_extra_keys` ran first)."""
    blocks = extra.get("num_cpu_blocks")
    if blocks is not None:
        return SizeSource.NUM_CPU_BLOCKS, None, _int("num_cpu_blocks", blocks)
    per_rank = extra.get("cpu_bytes_per_rank")
    if per_rank is not None:
        return SizeSource.CPU_BYTES_PER_RANK, _int("cpu_bytes_per_rank", per_rank), None
    total = extra.get("cpu_bytes")
    if total is None:
        return SizeSource.DEFAULT, None, None
    total_b = _int("cpu_bytes", total)
    if total_b < world_size:
        raise ConfigError(f"{_EXTRA}['cpu_bytes']={total_b} is less than one byte for each "
                          f"of the {world_size} ranks")
    return SizeSource.CPU_BYTES, total_b // world_size, None


def _name(value: object) -> str | None:
    if value is not None and (not isinstance(value, str)
                              or not re.fullmatch(r"[A-Za-z0-9._-]{1,80}", value)):
        raise ConfigError(f"{_EXTRA}['name'] must be 1-80 characters of [A-Za-z0-9._-], "
                          f"got {value!r}")
    return value


def check_extra_config(extra: Mapping[Any, Any], world_size: int = 1) -> ExtraSettings:
    """Validate ``kv_connector_extra_config`` alone: keys first (one line for an unknown
    or a second size key), then every value. Needs no vLLM object."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kvshm: {_EXTRA} must be a JSON object, got {extra!r}")
    check_extra_keys(extra)
    source, per_rank, blocks = _budget(extra, world_size)
    stats_path = extra.get("stats_path")
    if stats_path is not None and (not isinstance(stats_path, str) or not stats_path
                                   or "\0" in stats_path):
        raise ConfigError(f"{_EXTRA}['stats_path'] must be a file path, got {stats_path!r}")
    fail_loads = extra.get("test_fail_loads", 0)
    if fail_loads != 0:
        fail_loads = _int("test_fail_loads", fail_loads)
    url, remote_mode, namespace = _remote(extra)
    disk_path, disk_bytes, disk_io, disk_mode = _disk(extra)
    return ExtraSettings(
        size_source=source, cpu_bytes_per_rank=per_rank, num_cpu_blocks=blocks,
        mode=_mode(extra.get("mode")), name=_name(extra.get("name")), stats_path=stats_path,
        hang_timeout_s=_seconds("hang_timeout_s", extra.get("hang_timeout_s"),
                                DEFAULT_HANG_TIMEOUT_S, MIN_HANG_TIMEOUT_S),
        shutdown_timeout_s=_seconds("shutdown_timeout_s", extra.get("shutdown_timeout_s"),
                                    5.0),
        test_fail_loads=fail_loads, eviction=_eviction(extra.get("eviction")),
        remote_url=url, remote_mode=remote_mode, remote_namespace=namespace,
        disk_path=disk_path, disk_bytes_per_rank=disk_bytes, disk_io=disk_io,
        disk_mode=disk_mode)


# --------------------------------------------------------------- vLLM's own settings


def check_paths(settings: ExtraSettings) -> None:
    """The paths the extra config names, as this process sees them: ``disk_path`` an
    existing directory, ``stats_path`` not a directory and in an existing folder.
    ConfigError (one line) otherwise. The front end runs it before any engine process
    starts (in vLLM's multi-process mode a refusal made later comes at the end of the
    EngineCore's traceback, some 25 s on); the scheduler side runs it again, and checks
    the disk tier's directory in full (writable, free space, O_DIRECT) where it
    starts. A ``stats_path`` that cannot be written was found only at the first report,
    the closing line claiming it written."""
    disk = settings.disk_path
    if disk is not None and not os.path.isdir(disk):
        raise ConfigError(f"{_EXTRA}['disk_path'] {disk!r} is not a directory")
    stats = settings.stats_path
    if stats is not None:
        folder = os.path.dirname(os.path.abspath(stats))
        if os.path.isdir(stats):
            raise ConfigError(f"{_EXTRA}['stats_path'] {stats!r} is a directory, not a file")
        if not os.path.isdir(folder):
            raise ConfigError(f"{_EXTRA}['stats_path'] {stats!r}: its folder {folder!r} "
                              "does not exist")


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


def check_vllm_config(vllm_config: Any) -> None:
    """What kvshm needs of vLLM's resolved config beyond its own keys: ``kv_role``
    ``kv_both``, prefix caching on, no context parallelism. Run where the connector is
    built and, by the plugin, in the front end right after vLLM built the config (so a
    multi-process start is refused before any engine process starts)."""
    kvt = vllm_config.kv_transfer_config
    role = getattr(kvt, "kv_role", None)
    if role != "kv_both":
        raise ConfigError(f"kvshm needs kv_transfer_config.kv_role='kv_both' (it stores "
                          f"and loads), got {role!r}")
    if not getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        mla = getattr(getattr(vllm_config, "model_config", None), "use_mla", False)
        why = (" (this model uses MLA attention: vLLM turns prefix caching off itself "
               "for MLA models on some platforms, its CPU platform without AMX among "
               "them)" if mla is True else "")
        raise ConfigError("kvshm needs prefix caching (enable_prefix_caching=True): it "
                          f"stores and finds blocks by their prefix hashes; it is off{why}")
    par = vllm_config.parallel_config
    for attr in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        size = getattr(par, attr, 1)
        if size != 1:
            raise ConfigError(f"kvshm does not support context parallelism "
                              f"({attr}={size})")


#: vLLM's prefix hash algorithms that seed the block hashes at random in every process
#: unless ``PYTHONHASHSEED`` is set (vLLM 0.32 ``init_none_hash``).
_PROCESS_SEEDED_ALGOS: Final = frozenset({"xxhash", "xxhash_cbor"})


def unshared_hashes(vllm_config: Any, *, disk: bool, remote: bool,
                    env: Mapping[str, str] = os.environ) -> str | None:
    """Why the lower tiers will never find what another process kept, or None: vLLM's
    ``xxhash`` / ``xxhash_cbor`` prefix hashes without ``PYTHONHASHSEED`` are seeded at
    random in each process, so a warm restart from the disk tier and blocks another
    engine put in the remote tier never match (outputs stay right: every such block is
    a miss). Logged once, by the scheduler side's connector (a hostile probe found the
    warm restart serving 0 hits with nothing said)."""
    algo = str(getattr(getattr(vllm_config, "cache_config", None),
                       "prefix_caching_hash_algo", "sha256"))
    if algo not in _PROCESS_SEEDED_ALGOS or "PYTHONHASHSEED" in env:
        return None
    tiers = [what for what, on in (("the disk tier's warm restart", disk),
                                   ("the remote tier", remote)) if on]
    if not tiers:
        return None
    return (f"kvshm: prefix_caching_hash_algo={algo!r} without PYTHONHASHSEED: vLLM seeds "
            f"its block hashes at random in each process, so {' and '.join(tiers)} will "
            "find no block another process or an earlier run kept; start every engine "
            "with the same PYTHONHASHSEED, or use sha256")


def adopt_failure_policy(kv_transfer_config: Any) -> str | None:
    """Set ``kv_load_failure_policy`` to ``"recompute"``; the value it replaced, or None
    if it already was.

    vLLM 0.32 cannot tell a ``"fail"`` the user wrote from its default, and kvshm is a
    cache: a block it fails to load must be recomputed, never abort the request. Called
    by the scheduler-side connector, which vLLM's scheduler builds before it reads the
    policy (vllm/v1/core/sched/scheduler.py: ``create_connector`` at line 176, the
    policy read at 183); the workers never read it.
    """
    old = getattr(kv_transfer_config, "kv_load_failure_policy", None)
    if old == "recompute":
        return None
    kv_transfer_config.kv_load_failure_policy = "recompute"
    return str(old)


def parse_config(vllm_config: Any, infos: Sequence[GroupInfo],
                 hash_block_size: int | None) -> ConnectorConfig:
    """Validate the extra config (keys first), then vLLM's settings; the connector's
    configuration."""
    kvt = vllm_config.kv_transfer_config
    if kvt is None:
        raise ConfigError("kvshm's connector needs a kv_transfer_config")
    par = vllm_config.parallel_config
    tp, pp = int(par.tensor_parallel_size), int(par.pipeline_parallel_size)
    extra = check_extra_config(getattr(kvt, "kv_connector_extra_config", None) or {},
                               tp * pp)
    check_paths(extra)
    check_vllm_config(vllm_config)
    bs, groups = _groups(infos, hash_block_size)
    if extra.mode is StoreMode.LAZY and len(groups) != 1:
        raise ConfigError(f"mode='lazy' supports one KV cache group; the model has "
                          f"{len(groups)}")
    name = (engine_name(str(kvt.engine_id)) if extra.name is None
            else replica_name(extra.name, par))
    return ConnectorConfig(
        name=name, tp=tp, pp=pp, block_size=bs, groups=groups, mode=extra.mode,
        cpu_bytes_per_rank=extra.cpu_bytes_per_rank, num_cpu_blocks=extra.num_cpu_blocks,
        stats_path=replica_stats_path(extra.stats_path, par), hang_timeout_s=extra.hang_timeout_s,
        shutdown_timeout_s=extra.shutdown_timeout_s, test_fail_loads=extra.test_fail_loads,
        eviction=extra.eviction, remote_url=extra.remote_url, remote_mode=extra.remote_mode,
        model_id=model_identity(vllm_config, extra.remote_namespace),
        size_source=extra.size_source, disk_path=extra.disk_path,
        disk_bytes_per_rank=extra.disk_bytes_per_rank, disk_io=extra.disk_io,
        disk_mode=extra.disk_mode, disk_keep=extra.name is not None,
        disk_stamp=weights_stamp(vllm_config) if extra.disk_path is not None else "",
        sync_loads=sync_loads_for(vllm_config, groups))


def sync_loads_for(vllm_config: Any, groups: Sequence[KVGroup]) -> bool:
    """``ConnectorConfig.sync_loads``: a CPU device and one KV cache group.

    vLLM 0.32 runs a synchronous load (``get_num_new_matched_tokens`` answering
    ``(hit, False)``) in the step that schedules the request's prefill and calls
    ``start_load_kv`` before that step's forward; a CPU device's worker copies the load
    there, inline, so the blocks are in place when the forward reads them, and the hit
    costs no engine step of its own (an asynchronous load costs one: the request waits
    in ``WAITING_FOR_REMOTE_KVS`` for a step that reports it). On a GPU the copy runs on
    a stream after the forward's launch: asynchronous. With several KV cache groups a
    failed load must reach vLLM per request (``failed_recving``), which vLLM honours
    only for asynchronous loads."""
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    return str(device) == "cpu" and len(groups) == 1


# ------------------------------------------------------------------- the tier's size


def default_cpu_bytes_per_rank(world_size: int, memory_available: int,
                               shm_available: int) -> int:
    """The default CPU tier per rank: :data:`DEFAULT_MEMORY_SHARE` of
    ``memory_available`` (``kvshm.shm_budget.memory_available_bytes``), at most
    ``shm_available`` (``available_shm_bytes``: free /dev/shm less a margin), split
    evenly over ``world_size`` ranks (they share this host's memory)."""
    total = min(int(memory_available * DEFAULT_MEMORY_SHARE), max(0, shm_available))
    return max(0, total) // world_size


def resolve_size(cfg: ConnectorConfig, memory_available: int,
                 shm_available: int) -> ConnectorConfig:
    """``cfg`` with the default size filled in (size_source DEFAULT), else ``cfg``.

    ConfigError, naming the size keys, if the default leaves no byte for a rank.
    """
    if cfg.size_source is not SizeSource.DEFAULT:
        return cfg
    per_rank = default_cpu_bytes_per_rank(cfg.world_size, memory_available, shm_available)
    if per_rank <= 0:
        raise ConfigError(f"kvshm: no memory for the default CPU tier ({_SHARE_TEXT} of "
                          f"{memory_available} bytes available, at most {shm_available} "
                          f"bytes of /dev/shm); set {_EXTRA}['cpu_bytes']")
    return dataclasses.replace(cfg, cpu_bytes_per_rank=per_rank)


def check_budget(cfg: ConnectorConfig, bytes_per_block: int, available_bytes: int) -> None:
    """Refuse a CPU tier that cannot hold one block per rank, or that all ranks together
    cannot get from this host (``available_bytes``: free shared memory less a margin),
    and a disk slab that cannot hold one block (:func:`_check_disk_slot`).

    Early and approximate (the exact check runs when every rank has said hello); the
    point is a clear error at start-up instead of an engine that serves without offload.
    """
    if bytes_per_block <= 0:
        raise ConfigError(f"vLLM's KV cache has {bytes_per_block} bytes per block")
    _check_disk_slot(cfg, bytes_per_block)
    world = cfg.world_size
    if cfg.num_cpu_blocks is not None:
        need = cfg.num_cpu_blocks * bytes_per_block
        what = f"num_cpu_blocks={cfg.num_cpu_blocks} ({need} bytes per rank)"
    else:
        assert cfg.cpu_bytes_per_rank is not None, "resolve_size runs before check_budget"
        need = cfg.cpu_bytes_per_rank
        what = f"a CPU budget of {need} bytes per rank"
        if cfg.size_source is SizeSource.DEFAULT:
            what += f" (the default: {_SHARE_TEXT} of available memory)"
        if need < bytes_per_block:
            raise ConfigError(f"{what} cannot hold one KV block of {bytes_per_block} bytes; "
                              "raise cpu_bytes")
    if need * world > available_bytes:
        raise ConfigError(f"{what} x {world} rank(s) = {need * world} bytes does not fit: "
                          f"{available_bytes} bytes of shared memory are available here "
                          "(free /dev/shm and MemAvailable, less a margin)")


def _check_disk_slot(cfg: ConnectorConfig, bytes_per_block: int) -> None:
    """A ``disk_bytes_per_rank`` below one slot of this model's rows was refused only
    once the ranks said hello: the start FAILED there, and with it the CPU tier too
    (vLLM served on without any offload, one ERROR line the only sign). vLLM's KV cache
    config gives the row size now: refused here, before any engine starts."""
    if cfg.disk_bytes_per_rank is None:
        return
    from kvshm.disk import PAGE
    from kvshm.engine.disk_link import slot_stride

    need = PAGE + slot_stride(bytes_per_block)
    if cfg.disk_bytes_per_rank < need:
        raise ConfigError(f"{_EXTRA}['disk_bytes_per_rank']={cfg.disk_bytes_per_rank} holds "
                          f"no slot: one block of this model ({bytes_per_block} bytes per "
                          f"rank) takes {need} bytes of slab; raise it")


def lower_tiers_text(c: ConnectorConfig) -> str:
    """The disk and remote tiers for the start-up line ("" without either): where, how
    large, in which mode, and whether the slabs outlive the engine (only under a given
    ``name`` -- a ``write_through`` disk tier without one serves no warm restart)."""
    out = ""
    if c.disk_path is not None and c.disk_bytes_per_rank is not None:
        keep = ("kept for a warm restart under this name" if c.disk_keep else
                f"removed at close: set {_EXTRA}['name'] to restart warm")
        out += (f"; disk tier of {c.disk_bytes_per_rank / (1 << 30):.2f} GiB per rank in "
                f"{c.disk_path} ({c.disk_mode.value}, {keep})")
    if c.remote_url is not None:
        out += f"; remote tier {c.remote_url} ({c.remote_mode.value})"
    return out


def tier_text(c: ConnectorConfig) -> str:
    """The CPU tier's size as configured, for the start-up line (says when it is the
    default, and how it was chosen)."""
    if c.num_cpu_blocks is not None:
        return f"CPU tier of {c.num_cpu_blocks} blocks"
    if c.cpu_bytes_per_rank is None:
        return "CPU tier sized by the engine"
    size = f"CPU tier of {c.cpu_bytes_per_rank / (1 << 30):.2f} GiB per rank"
    if c.size_source is SizeSource.DEFAULT:
        size += (f" (default: {_SHARE_TEXT} of available memory, at most free /dev/shm, "
                 f"over {c.world_size} rank(s); set {_EXTRA}['cpu_bytes'] to choose)")
    return size
