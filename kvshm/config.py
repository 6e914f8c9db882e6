"""EngineConfig: every knob of a kvshm engine, frozen and validated at construction.

Validation happens here, before anything is started: a bad value is a ConfigError that
names the field and the value, never a failure later inside a worker. Every timeout
(:data:`TIMEOUT_FIELDS`) is a finite number > 0 (not a bool): NaN would compare false
everywhere (a hang never detected), infinity would wait forever (an ``aclose()`` that never
returns), and both break the conversions to milliseconds further down.

Without a size the CPU tier takes :data:`DEFAULT_CPU_BYTES_PER_RANK` (1 GiB) per rank,
reserved up front in /dev/shm: enough to try kvshm, never the whole machine. Set
``num_cpu_blocks`` (exact) or ``cpu_bytes_per_rank`` for real use.

The default name carries :data:`NAME_RANDOM_BITS` random bits beside the pid, so two
engines of one process collide with probability ~2**-64, not 2**-32.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from kvshm.errors import ConfigError
from kvshm.remote.tier import RemoteSpec
from kvshm.types import KVGroup, StoreMode

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,80}$")

#: Random bits in a default engine name (hex digits: a quarter of that).
NAME_RANDOM_BITS: Final = 64
#: Default ``cpu_bytes_per_rank``: 1 GiB of shared memory per worker rank, lowered to
#: what /dev/shm and MemAvailable allow (a 64 MiB Docker /dev/shm still starts).
DEFAULT_CPU_BYTES_PER_RANK: Final = 1 << 30
#: Default ``hang_timeout_s`` (see EngineConfig; chosen from tools.bench_acks).
DEFAULT_HANG_TIMEOUT_S: Final = 10.0
#: Least ``hang_timeout_s``: below it ordinary scheduling stalls of a busy host (up to
#: 0.14 s measured under a saturating soak) declare healthy ranks hung, and offload is
#: off for the engine's life (a probe's 0.01 s did that twice in three vLLM runs).
MIN_HANG_TIMEOUT_S: Final = 0.5
#: The EngineConfig fields that are durations in seconds (each finite and > 0).
TIMEOUT_FIELDS: Final = ("hang_timeout_s", "connect_timeout_s", "shutdown_grace_s")
#: Most worker ranks (tp x pp) one engine has: far past any node's accelerators, and a
#: bound for ``kvshm-workers``, which starts one process per rank.
MAX_WORLD_SIZE: Final = 1024
#: Longest timeout accepted: a day. Larger values behave like infinity (and overflow
#: the millisecond conversions of poll()).
MAX_TIMEOUT_S: Final = 86400.0


class RemoteMode(Enum):
    """When a CPU-tier block is written to the remote tier (``EngineConfig.remote_mode``).

    * ``WRITE_THROUGH`` (default): as soon as its store completed on every rank, so
      another engine can hit it at once.
    * ``ON_EVICT``: only when it nears eviction from the CPU tier (it is among the
      cached blocks the tier would reuse next): less remote traffic, later sharing.
    """

    WRITE_THROUGH = "write_through"
    ON_EVICT = "on_evict"


class Eviction(Enum):
    """Which cached block the CPU tier reuses first when it is full
    (:mod:`kvshm.offload.evict` has each order and its cost: O(1) per operation, but
    ``DEPTH_AGED`` pays a heap push when a block opens a new age slot; none ever takes
    a pinned block). Measured on six workloads at three capacities by
    ``python -m tools.bench_evict``.

    * ``ADAPTIVE`` (default): cost-aware and adaptive
      (:mod:`kvshm.offload.evict_adaptive`): sampled simulations of recency,
      heads-first and probation orders score the prefill compute each would save; the
      tier follows the best.
    * ``DEPTH_AGED``: LRU where a block one level deeper in its prefix chain
      counts as ``num_blocks // 16`` blocks older, so a full tier drops tails before
      heads and still ages out what nobody uses.
    * ``LRU``: least recently stored or hit first (vLLM's CPU offload does this).
    * ``LRU_REFRESH``: LRU, and a block is also refreshed when the engine's own (GPU)
      prefix cache hits it.
    * ``DEEPEST``: the deepest block first, LRU among equals (no aging).
    * ``SLRU``: stored blocks on probation, hit ones protected (80 %).
    * ``S3FIFO``: S3-FIFO (small FIFO, ghost keys, main CLOCK).
    """

    DEPTH_AGED = "depth_aged"
    LRU = "lru"
    LRU_REFRESH = "lru_refresh"
    DEEPEST = "deepest"
    SLRU = "slru"
    S3FIFO = "s3fifo"
    ADAPTIVE = "adaptive"


class DiskIO(Enum):
    """How the workers read and write the local disk tier's slab files
    (``EngineConfig.disk_io``).

    * ``DIRECT`` (default): ``O_DIRECT``, straight between the slot and the rank's host
      row (no page cache: the disk tier does not crowd out the CPU tier). A filesystem
      that refuses ``O_DIRECT`` (tmpfs, some overlays) is refused at start.
    * ``BUFFERED``: ordinary buffered I/O through the page cache, for such filesystems.
    """

    DIRECT = "direct"
    BUFFERED = "buffered"


class DiskMode(Enum):
    """Which CPU-tier blocks the local disk tier writes (``EngineConfig.disk_mode``).

    * ``WRITE_BACK`` (default): those about to be evicted from the CPU tier (the cached
      blocks its eviction order would reuse next): the disk holds what the CPU tier
      lost.
    * ``WRITE_THROUGH``: every block once stored, as well: the disk also holds what the
      CPU tier holds, so an engine restarted on the slab finds it too (twice the disk
      writes of a workload that fits the CPU tier).
    """

    WRITE_BACK = "write_back"
    WRITE_THROUGH = "write_through"


#: The CPU tier's eviction order unless EngineConfig says otherwise.
DEFAULT_EVICTION: Final = Eviction.ADAPTIVE


def default_name() -> str:
    """A name unique to this engine instance (``e<pid>-<64 random bits in hex>``), safe
    for a socket name."""
    return f"e{os.getpid()}-{secrets.token_hex(NAME_RANDOM_BITS // 8)}"


def check_name(name: object) -> None:
    """ConfigError unless ``name`` can name an engine: 1-80 characters of
    ``[A-Za-z0-9._-]`` (a rendezvous name, a file-name part of its slabs)."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        # (fullmatch: ``$`` also matches before a final newline)
        raise ConfigError(f"name must be 1-80 characters of [A-Za-z0-9._-], got {name!r}")


class _GeneratedName(str):
    """The name :class:`EngineConfig` made itself (no ``name`` given): it tells
    ``__post_init__`` that no later start can reuse it, then becomes a plain str."""

    __slots__ = ()


def _generated_name() -> str:
    return _GeneratedName(default_name())


def _positive_int(field_name: str, value: object, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{field_name} must be an integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{field_name} must be > 0, got {value}")


def check_timeout(field_name: str, value: object, *, zero_ok: bool = False) -> float:
    """``value`` as seconds; ConfigError unless it is a finite int or float > 0 (``>= 0``
    with ``zero_ok``) and at most :data:`MAX_TIMEOUT_S` (a bool is no number; NaN,
    infinity and an int too large for a float are refused: a deadline of NaN never
    comes, and one past a float's range raises OverflowError where it is added)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{field_name} must be a number of seconds, got {value!r}")
    try:
        ok = math.isfinite(value) and (0 <= value if zero_ok else 0 < value) \
            and value <= MAX_TIMEOUT_S
    except OverflowError:  # an int too large for a float
        ok = False
    if not ok:
        low = ">= 0" if zero_ok else "> 0"
        raise ConfigError(f"{field_name} must be {low} and at most {MAX_TIMEOUT_S:g} seconds "
                          f"(a day), got {value!r}")
    return float(value)


@dataclass(frozen=True)
class EngineConfig:
    """Configuration of one kvshm engine (scheduler side and the workers it talks to).

    * ``name``: the rendezvous name (``\\0kvshm.<name>``); every process of one engine
      must use the same one; default: unique per engine instance.
    * ``tp`` x ``pp`` = ``world_size`` worker ranks (at most :data:`MAX_WORLD_SIZE`);
      CPU block ``b`` is row ``b`` of every rank's host pool.
    * CPU tier size, reserved in /dev/shm at start (``posix_fallocate``, ~1 s a GiB;
      an INFO line on logger ``kvshm.shm`` for every segment of 4 GiB or more):
      ``num_cpu_blocks`` (exact; wins over the byte budget; ConfigError if it does not
      fit) or ``cpu_bytes_per_rank`` (the largest block count whose host pool fits in
      that many bytes on every rank, lowered to what the machine allows). Default:
      :data:`DEFAULT_CPU_BYTES_PER_RANK` = 1 GiB per rank. ``cpu_bytes_per_rank=None``
      (explicitly, without ``num_cpu_blocks``) takes as much as /dev/shm and
      MemAvailable allow, less a margin.
    * ``hang_timeout_s``: a rank with jobs pending that completes none, and whose CPU
      copy marks no progress, for this long is declared hung and the engine goes to
      FAILED. Default 10 s (was 30): the longest per-rank stall with jobs pending
      measured under a saturating soak was 0.14 s (``python -m tools.bench_acks``,
      README "Faults"); a CPU copy stamps its progress every few thousand ``memmove``
      calls or 256 MiB, so a job of any size is no hang while it copies (a CUDA job
      must finish within it: ~250 GB at 25 GB/s); a hang stalls the loads queued behind
      it for that long.
    * ``hang_timeout_s``, ``connect_timeout_s``, ``shutdown_grace_s``: seconds, each a
      finite number > 0 (ConfigError otherwise, naming the field and the value);
      ``hang_timeout_s`` at least :data:`MIN_HANG_TIMEOUT_S`.
    * ``eviction``: the CPU tier's eviction order (:class:`Eviction`; default
      :data:`DEFAULT_EVICTION`), for the pool the runtime builds.
    * ``remote_url``: a remote tier shared with other engines
      (``valkey://host:port`` or ``valkey+cluster://h1:p1,h2:p2``, knobs such as
      ``?ttl_s=600`` in the query: :class:`kvshm.remote.tier.RemoteSpec`); None: none.
      Checked here (ConfigError naming what is wrong). ``remote_mode``: when blocks are
      written there (:class:`RemoteMode`). ``model_id``: the model and dtype as the
      embedding engine names them; part of the layout fingerprint that keeps two
      deployments from reading each other's blocks (:mod:`kvshm.remote.fingerprint`).
    * ``disk_path``: a directory for the local disk tier (one slab file per rank,
      ``kvshm.disk.slab.slab_path``; None: no disk tier). ``disk_bytes_per_rank``: each
      slab's size (required with ``disk_path``; slots = this // the slot stride, the
      rank's row rounded up to 4 KiB plus a 4 KiB header page). ``disk_io``:
      :class:`DiskIO`; ``disk_mode``: :class:`DiskMode`. A relative ``disk_path`` is
      made absolute here (the ranks may run in another working directory). A directory
      that is not writable, lacks the space or refuses ``O_DIRECT`` is refused at start,
      in one line. ``disk_keep``: whether the slabs outlive the engine; None (default): they
      do where ``name`` was given -- one started again under the same ``name`` and
      layout serves their blocks at once (warm restart) -- and are removed at close
      where the name is the generated default, which no later start can reuse (each
      start would leave a preallocated slab per rank behind until the directory
      refused the next start for space). ``disk_stamp``: what else tells a slab's
      blocks from another's across restarts, beyond ``model_id`` and the layout (vLLM's
      connector: the model directory's weight files, their sizes and modification
      times): a slab written under another stamp is not served (its fingerprint
      differs). Local only: the remote tier's fingerprint leaves it out. ``kvshm
      sweep`` lists slabs of engines that are gone (killed ones included).
    """

    block_size: int
    name: str = field(default_factory=_generated_name)
    tp: int = 1
    pp: int = 1
    groups: tuple[KVGroup, ...] = (KVGroup.full(),)
    mode: StoreMode = StoreMode.EAGER
    num_cpu_blocks: int | None = None
    cpu_bytes_per_rank: int | None = DEFAULT_CPU_BYTES_PER_RANK
    hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S
    connect_timeout_s: float = 60.0
    shutdown_grace_s: float = 2.0
    ring_capacity: int | None = None
    eviction: Eviction = DEFAULT_EVICTION
    remote_url: str | None = None
    remote_mode: RemoteMode = RemoteMode.WRITE_THROUGH
    model_id: str = ""
    disk_path: str | None = None
    disk_bytes_per_rank: int | None = None
    disk_io: DiskIO = DiskIO.DIRECT
    disk_mode: DiskMode = DiskMode.WRITE_BACK
    disk_keep: bool | None = None
    disk_stamp: str = ""

    def __post_init__(self) -> None:
        if self.disk_keep is None:  # resolved here: a copy (dataclasses.replace) keeps it
            object.__setattr__(self, "disk_keep", type(self.name) is not _GeneratedName)
        if type(self.name) is _GeneratedName:
            object.__setattr__(self, "name", str(self.name))
        _positive_int("block_size", self.block_size)
        _positive_int("tp", self.tp)
        _positive_int("pp", self.pp)
        _positive_int("num_cpu_blocks", self.num_cpu_blocks, allow_none=True)
        _positive_int("cpu_bytes_per_rank", self.cpu_bytes_per_rank, allow_none=True)
        _positive_int("ring_capacity", self.ring_capacity, allow_none=True)
        check_name(self.name)
        if self.tp * self.pp > MAX_WORLD_SIZE:
            raise ConfigError(f"tp x pp = {self.tp * self.pp} ranks: at most "
                              f"{MAX_WORLD_SIZE}")
        if (isinstance(self.groups, (str, bytes)) or not isinstance(self.groups, Sequence)
                or not self.groups):
            raise ConfigError(f"groups must be a non-empty sequence of KVGroup, got "
                              f"{self.groups!r}")
        for i, g in enumerate(self.groups):
            if not isinstance(g, KVGroup):
                raise ConfigError(f"groups[{i}] must be a KVGroup (KVGroup.full() or "
                                  f"KVGroup.sliding_window(n)), got {g!r}")
        if not isinstance(self.mode, StoreMode):
            raise ConfigError(f"mode must be a StoreMode, got {self.mode!r}")
        if not isinstance(self.eviction, Eviction):
            raise ConfigError(f"eviction must be an Eviction, got {self.eviction!r}")
        for label in TIMEOUT_FIELDS:
            check_timeout(label, getattr(self, label))
        if self.hang_timeout_s < MIN_HANG_TIMEOUT_S:
            raise ConfigError(f"hang_timeout_s must be at least {MIN_HANG_TIMEOUT_S} s (a "
                              f"busy host stalls healthy ranks for longer than a shorter "
                              f"one), got {self.hang_timeout_s!r}")
        self._check_remote()
        self._check_disk()

    def _check_disk(self) -> None:
        if not isinstance(self.disk_stamp, str):
            raise ConfigError(f"disk_stamp must be a str, got {self.disk_stamp!r}")
        if not isinstance(self.disk_keep, bool):
            raise ConfigError(f"disk_keep must be True, False or None, got {self.disk_keep!r}")
        if not isinstance(self.disk_io, DiskIO):
            raise ConfigError(f"disk_io must be a DiskIO, got {self.disk_io!r}")
        if not isinstance(self.disk_mode, DiskMode):
            raise ConfigError(f"disk_mode must be a DiskMode, got {self.disk_mode!r}")
        _positive_int("disk_bytes_per_rank", self.disk_bytes_per_rank, allow_none=True)
        if self.disk_path is None:
            if self.disk_bytes_per_rank is not None:
                raise ConfigError("disk_bytes_per_rank is set but disk_path is not (the "
                                  "disk tier needs a directory)")
            return
        if not isinstance(self.disk_path, str) or not self.disk_path or "\0" in self.disk_path:
            raise ConfigError(f"disk_path must be a directory path, got {self.disk_path!r}")
        if self.disk_bytes_per_rank is None:
            raise ConfigError("disk_path needs disk_bytes_per_rank (each rank's slab size)")
        # resolved here, in the process that makes the config: the slab paths go to the
        # ranks, whose working directory may be another (kvshm-workers started elsewhere)
        object.__setattr__(self, "disk_path", os.path.abspath(self.disk_path))
        try:  # (the slab paths go to the ranks in Ready, as UTF-8: a name the file
            # system gave as undecodable bytes failed to encode there, in a loop callback;
            # checked on the absolute path: a working directory's name counts too)
            self.disk_path.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"disk_path must be valid UTF-8 (a directory name that "
                              f"is not: {self.disk_path!r}); choose another directory"
                              ) from None
        if any(g.window_tokens is not None for g in self.groups):
            raise ConfigError("disk_path: the disk tier supports full-attention KV groups "
                              "only (sliding-window groups are stored partially)")

    def _check_remote(self) -> None:
        if not isinstance(self.remote_mode, RemoteMode):
            raise ConfigError(f"remote_mode must be a RemoteMode, got {self.remote_mode!r}")
        if not isinstance(self.model_id, str) or len(self.model_id) > 400:
            raise ConfigError(f"model_id must be a str of at most 400 characters, "
                              f"got {self.model_id!r}")
        if self.remote_url is None:
            return
        RemoteSpec.parse(self.remote_url)
        if any(g.window_tokens is not None for g in self.groups):
            raise ConfigError("remote_url: the remote tier supports full-attention KV "
                              "groups only (sliding-window groups are stored partially)")

    @property
    def world_size(self) -> int:
        """Number of worker ranks (tp x pp)."""
        return self.tp * self.pp
