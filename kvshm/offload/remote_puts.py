"""The remote tier's write path (scheduler side): which CPU blocks to put, when, and
what a completed PUT publishes. Part of :class:`~kvshm.offload.remote.RemoteBook`.

Rules:

* ``WRITE_THROUGH``: a store job that completed on every rank hands its newly indexed
  CPU blocks to :meth:`PutQueue.stored`; each block whose key is neither published by
  this engine nor queued or in flight is pinned and queued; a plan makes PUT jobs of at
  most :data:`MAX_PUT_BLOCKS` (:data:`MAX_PUT_JOBS` a step), and no more while a
  quarter of the CPU tier is being put (a network slower than the stores must not pin
  the whole tier: the queue waits, counted). ``ON_EVICT`` queues instead
  the unpublished cached blocks among the next ``max(8, num_blocks // 16)`` the CPU tier
  would reuse, scanned by a plan with no such PUT in flight: the PUT's pin takes a block
  out of the eviction order and its release puts it back as recently used, a second
  chance once per block (published blocks are skipped by later scans), like CLOCK.
* A P/D hand-off's blocks (those its :class:`Publisher` wants) are put whatever the
  mode, with the hold TTL (``keep``: a job is all kept or all ordinary).
* A PUT that completed on every rank without failure publishes its blocks' readiness
  keys (a reader never sees half a block), then tells the hand-offs (whose manifest
  goes last); the pins go in every case.
* What was put (or fetched) is not put again while fresh (half the server's TTL) --
  unless the server lost its data: a plan that finds the index's
  :meth:`~kvshm.remote.tier.ReadyIndex.restarts` changed forgets every key it
  remembered (``server_restarts``), so write-through refills the tier within seconds.

Remote hashes: a block's hash in the remote tier is its CPU index key when that is
:data:`REMOTE_HASH_BYTES` long, else a BLAKE2b digest of it of that length
(group-qualified keys are longer): a Remote message carries hashes of one length.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from itertools import islice
from typing import Final, Protocol

from kvshm.config import RemoteMode
from kvshm.ipc.protocol import Remote, RemoteOp, pack_ids
from kvshm.offload.jobs import JobTable, RemoteJob
from kvshm.offload.pool import BlockPool
from kvshm.remote.tier import ReadyIndex

__all__ = ["MAX_PUT_BLOCKS", "MAX_PUT_JOBS", "PUBLISHED_MEMORY", "REMOTE_HASH_BYTES",
           "Publisher", "PutQueue", "RemoteCounters", "max_job_blocks", "message", "remote_hash"]

#: Most blocks one PUT job moves (several jobs go out in one step when more are queued).
MAX_PUT_BLOCKS: Final = 128
#: PUT jobs one plan makes at most (the rest wait for the next step).
MAX_PUT_JOBS: Final = 4
#: Length of every block hash a Remote message carries.
REMOTE_HASH_BYTES: Final = 32
#: Encoded bytes of a Remote command besides its ids and hashes (msgpack headers, a
#: margin); each block adds a 4-byte id and a hash.
REMOTE_OVERHEAD: Final = 64


def max_job_blocks(max_record: int) -> int:
    """The most blocks one Remote command may carry to fit a ring record of
    ``max_record`` bytes."""
    return max(1, (max_record - REMOTE_OVERHEAD) // (4 + REMOTE_HASH_BYTES))


#: Keys this engine remembers as published (oldest forgotten first: re-put, harmless;
#: about 150 bytes each).
PUBLISHED_MEMORY: Final = 1 << 18
#: Readiness keys remembered per publish, to forget a block whose readiness write the
#: server refused (so that it is put and published again).
READY_MEMORY: Final = 1 << 16

_Put = tuple[int, bytes, int, bool]  # (cpu id, key, depth, keep), pinned


@dataclass(slots=True)
class RemoteCounters:
    """Monotonic counters of the remote book (``EngineStats.remote``)."""

    queries: int = 0
    queries_ahead: int = 0
    ahead_used: int = 0
    query_hits: int = 0
    query_misses: int = 0
    query_timeouts: int = 0
    fetch_timeouts: int = 0
    answers_stale: int = 0
    skipped_unhealthy: int = 0
    asked_again: int = 0
    get_jobs: int = 0
    get_blocks: int = 0
    get_failed_jobs: int = 0
    get_failed_blocks: int = 0
    get_abandoned_jobs: int = 0  # GETs a reset abandoned (not failures)
    get_declined_cpu_full: int = 0
    get_declined_overdue: int = 0
    get_capped: int = 0
    hit_blocks: int = 0
    put_jobs: int = 0
    put_blocks: int = 0
    put_failed_blocks: int = 0
    put_abandoned_blocks: int = 0  # blocks of PUTs a reset abandoned (not failures)
    put_skipped_duplicate: int = 0
    put_backpressure: int = 0
    publish_refused: int = 0
    published_blocks: int = 0
    server_restarts: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def remote_hash(key: bytes) -> bytes:
    """The block hash a Remote message and a readiness key carry for CPU index ``key``."""
    if len(key) == REMOTE_HASH_BYTES:
        return key
    return hashlib.blake2b(key, digest_size=REMOTE_HASH_BYTES).digest()


def message(job: RemoteJob, op: RemoteOp) -> Remote:
    """The Remote command of ``job`` (every rank gets the same)."""
    hashes = b"".join(remote_hash(k) for k in job.keys)
    return Remote(job.job_id, op, pack_ids(job.cpu_ids), hashes, REMOTE_HASH_BYTES, job.keep)


class Publisher(Protocol):
    """What the write path tells a P/D hand-off's prefill side (the seam to
    :class:`kvshm.offload.pd.publish.Publications`, which the queue is handed and never
    imports): which blocks a publication waits for, and each PUT's outcome -- reported
    after the PUT's readiness keys, so that a manifest is always written last."""

    def wants(self, key: bytes) -> bool:
        """Whether a publication waits for block ``key`` (put whatever the mode)."""
        ...

    def put_done(self, keys: Sequence[bytes], ok: bool) -> None:
        """A PUT of ``keys`` completed on every rank (``ok``: without failure)."""
        ...


class PutQueue:
    """See the module docstring. Shares the book's counters; ``published`` is also the
    read path's memory of keys fetched from the server (never put back)."""

    def __init__(self, cpu: BlockPool, jobs: JobTable, index: ReadyIndex,
                 ready_key: Callable[[bytes], str], counters: RemoteCounters, *,
                 mode: RemoteMode, evict_window: int | None = None,
                 publisher: Publisher | None = None, max_job_blocks: int = MAX_PUT_BLOCKS,
                 ttl_s: float | None = None, hold_ttl_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu, self._jobs, self.index = cpu, jobs, index
        self._ready_key = ready_key
        self.counters = counters
        self.mode = mode
        self._window = evict_window or max(8, cpu.num_blocks // 16)
        self._batch = max(1, min(MAX_PUT_BLOCKS, max_job_blocks))
        # PUT blocks in flight at most: a slow network must not pin the whole CPU tier
        self._max_inflight = max(self._batch, cpu.num_blocks // 4)
        self._inflight = 0
        self._evict_puts = 0  # ON_EVICT PUT jobs in flight
        self._publisher = publisher
        self._puts: list[_Put] = []
        self._put_keys: set[bytes] = set()  # queued or in flight
        # key -> until when it counts as on the server: half the TTL it was put with
        # (the server may drop it after: put it again). A hand-off's blocks go with the
        # hold TTL, which may be shorter than the server's (or than none at all)
        self.published: OrderedDict[bytes, float] = OrderedDict()
        self._fresh_s = ttl_s / 2 if ttl_s is not None else float("inf")
        self._kept_fresh_s = (self._fresh_s if hold_ttl_s is None
                              else min(self._fresh_s, hold_ttl_s / 2))
        self._clock = clock
        self._ready_of: OrderedDict[str, bytes] = OrderedDict()  # ready key -> CPU key
        self._restarts = index.restarts()  # the index's count this memory is valid for

    def pinned(self) -> list[int]:
        """CPU ids pinned by queued PUTs."""
        return [c for c, _, _, _ in self._puts]

    def pending(self) -> bool:
        """PUTs queued: the next plan has work."""
        return bool(self._puts)

    def stored(self, cpu_ids: Sequence[int], keys: Sequence[bytes],
               depths: Sequence[int]) -> None:
        """A store completed and indexed ``cpu_ids`` under ``keys``: queue write-through
        (and a hand-off's blocks in any mode)."""
        self.forget_lost()
        every = self.mode is RemoteMode.WRITE_THROUGH
        pub = self._publisher
        for i, (c, k) in enumerate(zip(cpu_ids, keys)):
            keep = pub is not None and pub.wants(k)
            if every or keep:
                self._queue(c, k, depths[i] if i < len(depths) else 0, keep)

    def queue_kept(self, keys: Sequence[bytes]) -> None:
        """Queue each of ``keys`` cached here and not queued or in flight for a kept PUT
        (the hold TTL): a P/D hand-off's blocks that a publication waits for."""
        self.forget_lost()
        for k in keys:
            c = self.cpu.get_cached(k)
            if c is not None and k not in self._put_keys:
                self._queue(c, k, 0, True)

    def _queue(self, c: int, k: bytes, depth: int, keep: bool = False) -> None:
        if k in self._put_keys or self.is_published(k):
            self.counters.put_skipped_duplicate += 1
            return
        self.cpu.touch((c,), use=False)  # the PUT reads it: no hit for the order
        self._put_keys.add(k)
        self._puts.append((c, k, depth, keep))

    def _scan_evictable(self) -> None:
        """ON_EVICT: queue the unpublished cached blocks the tier would reuse next."""
        picks: list[tuple[int, bytes]] = []
        for c in islice(self.cpu.iter_free_from_lru(), self._window):
            hs = self.cpu.block_hashes(c)
            if hs and hs[0] not in self._put_keys and not self.is_published(hs[0]):
                picks.append((c, hs[0]))
        for c, k in picks:
            self._queue(c, k, 0)

    def plan(self, step: int) -> list[Remote]:
        """This step's PUT jobs (an ON_EVICT scan first, when none of its PUTs runs)."""
        self.forget_lost()
        self.forget_refused()
        if self.mode is RemoteMode.ON_EVICT and not self._evict_puts:
            self._scan_evictable()
            self._evict_puts = -(-len(self._puts) // self._batch)
        out: list[Remote] = []
        for _ in range(MAX_PUT_JOBS):
            if not self._puts:
                break
            if self._inflight >= self._max_inflight:
                self.counters.put_backpressure += 1  # the queue waits (its pins too)
                break
            keep = self._puts[0][3]  # one job: all kept (hand-off) or all ordinary
            batch: list[_Put] = []
            rest: list[_Put] = []
            for p in self._puts:
                (batch if p[3] is keep and len(batch) < self._batch else rest).append(p)
            self._puts = rest
            job = self._jobs.new_remote(step, [c for c, _, _, _ in batch],
                                        [k for _, k, _, _ in batch],
                                        [d for _, _, d, _ in batch], put=True, keep=keep)
            self.counters.put_jobs += 1
            self.counters.put_blocks += len(batch)
            self._inflight += len(batch)
            out.append(message(job, RemoteOp.PUT))
        return out

    def done(self, job: RemoteJob, usable: bool) -> None:
        """A PUT completed on every rank (``usable``: without failure, not abandoned)."""
        self._put_keys.difference_update(job.keys)
        self._evict_puts = max(0, self._evict_puts - 1)
        self._inflight -= len(job.keys)
        try:
            if usable:
                ready = [self._ready_key(remote_hash(k)) for k in job.keys]
                self.index.publish(ready, keep=job.keep)
                self.remember(job.keys, kept=job.keep)
                self._ready_of.update(zip(ready, job.keys))
                while len(self._ready_of) > READY_MEMORY:
                    self._ready_of.popitem(last=False)
                self.counters.published_blocks += len(job.keys)
            elif job.abandoned and not job.nacked:  # a reset's: not a failure
                self.counters.put_abandoned_blocks += len(job.keys)
            else:
                self.counters.put_failed_blocks += len(job.keys)
            if self._publisher is not None:  # after the readiness keys: manifests go last
                self._publisher.put_done(job.keys, usable)
        finally:
            self.cpu.free(reversed(job.cpu_ids))

    def is_published(self, k: bytes) -> bool:
        """Whether ``k`` was put or fetched by this engine recently enough to be on the
        server still."""
        until = self.published.get(k)
        return until is not None and self._clock() < until

    def forget_lost(self) -> None:
        """The server lost its data since the last plan (the index saw it restart):
        nothing this engine put or fetched counts as there any more (counted once per
        restart seen)."""
        n = self.index.restarts()
        if n != self._restarts:
            self.counters.server_restarts += n - self._restarts
            self._restarts = n
            self.published.clear()
            self._ready_of.clear()

    def forget_refused(self) -> None:
        """The readiness writes the server refused: those blocks count as unpublished
        (a later store puts them again), counted."""
        for ready in self.index.refused():
            k = self._ready_of.pop(ready, None)
            if k is not None and self.published.pop(k, None) is not None:
                self.counters.publish_refused += 1

    def remember(self, keys: Sequence[bytes], *, kept: bool = False) -> None:
        """``keys`` are on the server (put by us, or fetched): not put again while
        fresh -- half the TTL they went with (``kept``: a hand-off's, the hold TTL)."""
        pub = self.published
        until = self._clock() + (self._kept_fresh_s if kept else self._fresh_s)
        for k in keys:
            pub[k] = until
            pub.move_to_end(k)
        while len(pub) > PUBLISHED_MEMORY:
            pub.popitem(last=False)

    def drop(self) -> None:
        """Reset or engine failure: unpin every queued PUT."""
        for c, k, _, _ in reversed(self._puts):
            self._put_keys.discard(k)
            self.cpu.free((c,))
        self._puts = []
        self._evict_puts = 0
