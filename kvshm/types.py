"""Plain data exchanged between a serving engine and kvshm's scheduler side.

A leaf module: it imports only :mod:`kvshm.ipc.protocol` (``Transfer``, ``Remote``, ``Disk``),
:mod:`kvshm.hashing` (for ``BlockHash``) and :mod:`kvshm.errors`, all leaves.
Nothing here has behaviour beyond small constructors and validation of its own fields.

Block hashes are the *plain* chained hashes of :mod:`kvshm.hashing` (``bytes``), the same
for every KV group; the manager qualifies them per group for its CPU index. A
``GpuBlocks.block_hashes`` implementation must therefore return plain hashes too (the
vLLM adapter strips vLLM's group id suffix).

The manager's own counters and decline reasons are not exchanged data: they live with it,
in :mod:`kvshm.offload.counters`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

import msgspec

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.ipc.protocol import Disk, Remote, Transfer

__all__ = ["DeviceKind", "GpuBlocks", "GroupKind", "KVGroup", "LoadFailure", "LoadResult",
           "RequestView", "ScheduledRequest", "StepInput", "StepPlan", "StoreMode",
           "no_new_blocks"]


class DeviceKind(Enum):
    """Where a rank's device caches live (a standalone worker's ``--device``)."""

    CPU = "cpu"
    CUDA = "cuda"


class StoreMode(Enum):
    """When blocks are stored. EAGER: once their tokens are confirmed (per-request
    cursors). LAZY: when they near the LRU end of the GPU free queue (only one KV group;
    ``do_remote_decode`` requests are still stored eagerly)."""

    EAGER = "eager"
    LAZY = "lazy"


class GroupKind(Enum):
    """Attention kind of a KV cache group."""

    FULL = "full"
    SLIDING_WINDOW = "sliding_window"


@dataclass(frozen=True, slots=True)
class KVGroup:
    """One KV cache group; every group shares the manager's block size in tokens."""

    kind: GroupKind
    window_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.kind is GroupKind.SLIDING_WINDOW:
            w = self.window_tokens  # (2.5 passed here and broke the first lookup)
            if type(w) is not int or w < 1:
                raise ConfigError("sliding window needs window_tokens, an int >= 1, "
                                  f"got {self.window_tokens!r}")
        elif self.window_tokens is not None:
            raise ConfigError("a full-attention group has no window_tokens")

    @classmethod
    def full(cls) -> KVGroup:
        return cls(GroupKind.FULL)

    @classmethod
    def sliding_window(cls, window_tokens: int) -> KVGroup:
        return cls(GroupKind.SLIDING_WINDOW, window_tokens)


class GpuBlocks(Protocol):
    """The engine's GPU block pool as kvshm sees it (``kvshm.offload.pool.BlockPool`` fits).

    ``num_blocks``: the pool's size; every valid block id is in ``[0, num_blocks)`` (the
    manager refuses any other before it changes anything). ``touch`` pins (ref +1: the
    block is neither reused nor evicted, its hashes do not change); ``free`` unpins
    (``evict_first``: evicted soonest; earlier ids are evicted before later ones);
    ``block_hashes`` are the block's current plain hashes; ``iter_free_from_lru`` yields
    ref-0 ids, next-evicted first (the caller touches only after iterating).

    Two optional attributes, read once by the manager: ``hash_bytes`` (int), the exact
    length of the engine's block hashes (without it any length in
    ``kvshm.offload.validate.HASH_LEN_RANGE`` is accepted), and ``null_block_id`` (int), a
    placeholder id the engine may repeat within one table where a sliding-window group
    holds no block (vLLM's null block); no other id may appear twice in one table.
    """

    @property
    def num_blocks(self) -> int: ...

    def touch(self, ids: Iterable[int]) -> None: ...

    def free(self, ids: Iterable[int], *, evict_first: bool = False) -> None: ...

    def block_hashes(self, block_id: int) -> tuple[BlockHash, ...]: ...

    def iter_free_from_lru(self) -> Iterator[int]: ...


class RequestView(msgspec.Struct, frozen=True, gc=False):
    """A waiting request as phase A (``lookup``) sees it. A frozen ``msgspec.Struct``:
    an adapter builds one per lookup, and C builds it in ~0.1 us where the frozen
    dataclass took 0.8 - 2.5 us. ``gc=False``: it holds no reference back to itself."""

    req_id: str
    block_hashes: Sequence[BlockHash]
    """Chained hashes of the request's full blocks (prompt, and output so far)."""
    num_tokens: int
    kv_transfer_params: Mapping[str, Any] | None = None
    tail_hash: BlockHash | None = None
    """A P/D decode request's partial last block's hash (:func:`kvshm.hashing.tail_hash`
    of the last full block's hash and the remaining tokens), when ``num_tokens`` does not
    end on a block boundary: a hand-off that carries that block loads it too, so only
    the last token is computed. Ignored by every other lookup."""


_NO_NEW_BLOCKS: dict[int, tuple[tuple[int, ...], ...]] = {}


def no_new_blocks(num_groups: int) -> tuple[tuple[int, ...], ...]:
    """The shared ``new_block_ids`` value for "nothing appended this step" with
    ``num_groups`` groups. Any equal tuple works; this very object lets the manager's
    per-request check skip a tuple compare (an identity test instead)."""
    value = _NO_NEW_BLOCKS.get(num_groups)
    if value is None:
        value = _NO_NEW_BLOCKS[num_groups] = ((),) * num_groups
    return value


class ScheduledRequest(msgspec.Struct, gc=False):
    """One request of a step. An engine lists the requests that changed (new or resumed,
    preempted, new block ids, a block boundary reached); listing an unchanged one is
    allowed and costs the manager a dict lookup and a few compares; a store the CPU pool
    deferred is retried by the manager without a listing.

    Read-only by contract; the manager never mutates it and keeps no reference past the
    step. An engine adapter builds one per running request per step, so construction
    cost is paid 16k times a step at 16k running requests: a ``msgspec.Struct`` is built
    by C code (~0.08 us here) where a slotted dataclass's ``__init__`` took ~0.2-0.33 us
    and a frozen one ~1.8 us. ``gc=False``: never tracked by the cyclic collector (it
    holds no reference back to itself).

    ``new_block_ids[g]``: GPU ids appended to group ``g``'s table this step, or the whole
    table when ``new_or_resumed``. ``num_confirmed_tokens``: tokens whose KV earlier
    steps have written (vLLM: ``num_computed_tokens - num_output_placeholders``).
    ``preempted``: its blocks were taken back since it was last listed; the manager
    forgets its table and restarts its store cursors (it comes back ``new_or_resumed``).
    ``block_hashes`` may be the engine's live, growing sequence.
    """

    req_id: str
    block_hashes: Sequence[BlockHash]
    num_tokens: int
    new_block_ids: tuple[tuple[int, ...], ...]
    new_or_resumed: bool = False
    num_confirmed_tokens: int = 0
    preempted: bool = False
    kv_transfer_params: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class StepInput:
    """What an engine hands the manager once per step (see ``OffloadManager.build_step``)."""

    step: int
    requests: Sequence[ScheduledRequest]
    finished: Sequence[str] = ()
    """Requests finished since the last step whose ``finished()`` was not called."""
    allocated_block_ids: Collection[int] = ()
    """Every GPU block id allocated since the last accepted step (a reused
    sliding-window id is stale: :mod:`kvshm.offload.window_reuse`); a refused step's go
    again with the next."""


class LoadFailure(Enum):
    """Why a load did not deliver its blocks; the engine recomputes them."""

    WORKER_FAILED = "worker_failed"
    RANK_DIED = "rank_died"
    NO_PIN = "no_pin"
    RESET = "reset"
    ENGINE_FAILED = "engine_failed"
    ENGINE_CLOSED = "engine_closed"
    WINDOW_MISSING = "window_missing"
    """Partial acceptance needed sliding-window blocks the CPU tier no longer holds."""
    REQUEST_FINISHED = "request_finished"
    """The request finished while its load was queued or running (Engine waiters)."""


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Outcome of one request's load. ``failed_block_ids``: GPU destinations whose KV
    must be recomputed (empty when ``ok``); ``num_tokens``: tokens loaded (0 when not
    ok). A result may arrive for a request that has already finished: ignore it."""

    req_id: str
    ok: bool
    failed_block_ids: tuple[int, ...] = ()
    cause: LoadFailure | None = None
    num_tokens: int = 0


_NO_JOBS: Mapping[int, tuple[str, ...]] = {}
_NO_FAILED: Mapping[str, tuple[int, ...]] = {}


@dataclass(frozen=True, slots=True)
class StepPlan:
    """The manager's answer to one ``StepInput``.

    ``store``/``load``: at most one transfer each (store src = GPU ids, dst = CPU ids;
    load the reverse). ``flush``: job ids a worker must finish before this step's compute
    (always empty: every block under transfer is pinned with ``touch``).
    Load outcomes are not in the plan: ``take_load_results`` drains the manager's one
    queue. ``load_jobs``: every load job not yet acked by
    every rank -> its request ids. ``failed_loads``: loads that failed on the scheduler
    side and never reached a worker -> destination GPU ids (their ``LoadResult`` is queued
    too). ``remote``: remote-tier jobs (PUT / GET) to post to every rank; ``disk``:
    disk-tier jobs (WRITE / READ, :mod:`kvshm.offload.disk`), likewise, posted in order
    and *before* ``store``: they may write down CPU blocks the store reuses, and a rank
    copies into a row only after the WRITEs it received earlier that read it.
    """

    step: int
    store: Transfer | None = None
    load: Transfer | None = None
    flush: tuple[int, ...] = ()
    load_jobs: Mapping[int, tuple[str, ...]] = field(default_factory=lambda: _NO_JOBS)
    failed_loads: Mapping[str, tuple[int, ...]] = field(default_factory=lambda: _NO_FAILED)
    remote: tuple[Remote, ...] = ()
    disk: tuple[Disk, ...] = ()
