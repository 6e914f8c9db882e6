"""Store selection for the manager: per-request cursors, in-flight dedup (the lazy scan
and a P/D tail block's store: :mod:`kvshm.offload.side_stores`, through this planner).

Rules (each is a hazard of docs/design.md):

* A GPU block is a candidate once its tokens are confirmed. One cursor per request
  walks positions in prefix order; all groups of a position are taken together, and
  when the CPU pool cannot supply them the cursor stops there (deferred, retried next
  step, nothing half-recorded).
* In-flight dedup across steps: a GPU id being stored, or any block whose
  group-qualified hash is being stored, is skipped (``IN_FLIGHT``); marks are set when a
  block is selected and cleared only when its job completes (or a not-yet-sent
  finish-time store is dropped).
* Validity for the position: the GPU block must carry the position's hash (a block the
  engine re-hashed for other content is ``HASH_MISMATCH``; for a sliding-window group
  ``STALE_WINDOW``). A full-attention block with no GPU hash is the request's own and
  is stored under the position's hash; a sliding-window one is not (``STALE_WINDOW``),
  nor is a sliding-window id the engine allocated this step.
* A GPU block that is the destination of a pending load holds no valid KV yet: the
  cursor waits there.

Ownership: the planner holds the in-flight marks (``marks``) and the finish-time queue
(``finished``, which owns the GPU pins of queued finish-time stores): two records of
their own, :mod:`kvshm.offload.store_marks`; the planner decides what goes into them. A
store job lives in the job table
(:class:`~kvshm.offload.jobs.StoreJob`) until every rank acked it or is fenced; then
:meth:`StorePlanner.complete` clears its marks, indexes its blocks and releases its pins.
The load destinations a cursor waits at belong to :mod:`kvshm.offload.loads` (read only
here). Invariants (checked by :mod:`kvshm.offload.invariants`): the marks are exactly
the GPU ids and keys of the store jobs in flight plus the queued finish-time stores, each
at most once.

Cost: a step touches only requests whose confirmed tokens crossed their cursor's block
(see :mod:`kvshm.offload.requests`), plus the lazy scan window.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Container, Sequence
from functools import partial
from itertools import repeat
from operator import eq
from typing import Protocol

from kvshm.config import Eviction
from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.offload.counters import DeclineReason, ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import Cand, Selection, StoreJob
from kvshm.offload.pool import BlockPool
from kvshm.offload.store_marks import FinishQueue, InFlightMarks
from kvshm.types import GpuBlocks

__all__ = ["Cursor", "StorePlanner"]


class Cursor(Protocol):
    """What the planner reads and moves of a request's store tracking
    (:class:`kvshm.offload.requests.ReqState` is one): ``tables[g][p]`` the GPU id of
    position ``p`` in group ``g``, ``hashes[p]`` its hash where known, ``cursor`` the next
    position to consider."""

    tables: list[list[int]]
    hashes: Sequence[BlockHash]
    cursor: int
    stale: set[tuple[int, int]] | None


_NO_IDS: frozenset[int] = frozenset()


def _each(block_hashes: Callable[[int], tuple[BlockHash, ...]],
          ids: list[int]) -> list[tuple[BlockHash, ...]]:
    """``block_hashes`` of each id (a pool without a bulk read)."""
    return list(map(block_hashes, ids))


class StorePlanner:
    """Selects stores under the module docstring's rules, into the in-flight marks
    (``marks``) and the finish-time queue (``finished``) it holds.
    ``load_dst``: the GPU ids pending loads write (owned by
    :class:`~kvshm.offload.loads.LoadBook`, read here: a cursor waits at one)."""

    def __init__(self, cpu: BlockPool, gpu: GpuBlocks, gs: GroupSet, block_size: int,
                 counters: ManagerCounters, lazy_window: int, load_dst: Container[int]) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.gs = gs
        self.bs = block_size
        self.counters = counters
        self.lazy_window = lazy_window
        self.marks = InFlightMarks()
        self.finished = FinishQueue(gpu, self.marks, counters)
        self.load_dst = load_dst
        # what walk reads, in one tuple: none of these objects is ever replaced
        # (the sets and dicts change in place; the index view is live)
        self._hot = (load_dst, self.marks.gpu, self.marks.keys, cpu.cached_keys,
                     gpu.block_hashes, counters.declined)
        #: ``gpu.block_hashes`` of many ids in one call (a pool's own bulk read, e.g.
        #: ``VllmGpuBlocks.block_hashes_of``, where it has one)
        self._hashes_of: Callable[[list[int]], list[tuple[BlockHash, ...]]] = getattr(
            gpu, "block_hashes_of", None) or partial(_each, gpu.block_hashes)

    # ---- classification ----------------------------------------------------------

    def classify(self, b: int, h: BlockHash | None, g: int,
                 alloc: Collection[int]) -> tuple[DeclineReason | None, bytes]:
        """Why GPU block ``b`` at a position with hash ``h`` (None: unknown) must not be
        stored now, or (None, its CPU key)."""
        if b in self.marks.gpu:
            return DeclineReason.IN_FLIGHT, b""
        sw = self.gs.is_sw[g]
        if sw and b in alloc:
            return DeclineReason.STALE_WINDOW, b""
        gh = self.gpu.block_hashes(b)
        if h is None:
            if not gh:
                return DeclineReason.UNHASHED, b""
            h = gh[0]
        elif gh:
            if h not in gh:
                return (DeclineReason.STALE_WINDOW if sw else DeclineReason.HASH_MISMATCH), b""
        elif sw:
            return DeclineReason.STALE_WINDOW, b""
        key = self.gs.key(h, g)
        if key in self.marks.keys:
            return DeclineReason.IN_FLIGHT, b""
        if self.cpu.is_cached(key):
            return DeclineReason.ALREADY_CACHED, b""
        return None, key

    # ---- eager -------------------------------------------------------------------

    def walk(self, st: Cursor, ready: int, avail: int, alloc: Collection[int],
             sel: Selection) -> int:
        """Select ``st``'s candidates ``[cursor, ready)`` into ``sel`` within ``avail``
        CPU blocks; returns what is left of ``avail``. Moves the cursor past every
        position decided (stored or declined), never past a deferred one.

        One full-attention group (``gs.single``, the hot case) is walked here, with
        :meth:`classify`, ``Cand``, :meth:`_mark` and :meth:`Selection.add` inlined (a
        key is the plain hash; no sliding window): the same decisions in the same order
        as :meth:`_walk_groups`, which walks any other group set."""
        p = st.cursor
        if p >= ready:
            return avail
        if not self.gs.single:
            return self._walk_groups(st, ready, avail, alloc, sel)
        table = st.tables[0]
        hashes = st.hashes
        nh = len(hashes)
        load_dst, inflight_gpu, inflight_keys, cached, gh_of, declined = self._hot
        while p < ready:
            b = table[p]
            if b in load_dst:
                break
            reason: DeclineReason | None = None
            if b in inflight_gpu:
                reason = DeclineReason.IN_FLIGHT
            else:
                gh = gh_of(b)
                h = hashes[p] if p < nh else None
                if h is None:
                    if gh:
                        h = gh[0]
                    else:
                        reason = DeclineReason.UNHASHED
                elif gh and h not in gh:
                    reason = DeclineReason.HASH_MISMATCH
                if h is not None and reason is None:
                    if h in inflight_keys:
                        reason = DeclineReason.IN_FLIGHT
                    elif h in cached:
                        reason = DeclineReason.ALREADY_CACHED
            if reason is not None:
                if 0 > avail:  # walk's "more picks than avail" with no pick
                    declined[DeclineReason.CPU_FULL] += 1
                    break
                declined[reason] += 1
                p += 1
                continue
            if avail < 1:
                declined[DeclineReason.CPU_FULL] += 1
                break
            assert h is not None
            inflight_gpu.add(b)
            inflight_keys.add(h)
            sel.gpu_ids.append(b)
            sel.groups.append(0)
            sel.keys.append(h)
            sel.depths.append(p)
            sel.to_touch.append(b)
            avail -= 1
            p += 1
        st.cursor = p
        return avail

    def pick_run(self, blocks: list[int], keys: list[bytes], depths: list[int],
                 sel: Selection) -> bool:
        """Select ``(blocks[i], keys[i])`` at position ``depths[i]`` for every ``i`` at
        once, in order, and return True -- exactly when :meth:`walk` (one full-attention
        group), given each as its request's only position to walk with its hash known
        and CPU blocks for all, would pick every one: the blocks and keys are distinct,
        none is in flight, cached or a pending load's destination, and each GPU block
        carries its key or no hash. Else False with nothing changed (the caller walks
        them one by one). The tests of a pick are set operations in C; only the GPU
        hashes are read block by block."""
        n = len(blocks)
        load_dst, inflight_gpu, inflight_keys, cached, _, _ = self._hot
        if (len(set(blocks)) != n or len(set(keys)) != n
                or not inflight_gpu.isdisjoint(blocks) or not inflight_keys.isdisjoint(keys)
                or not cached.isdisjoint(keys)
                or load_dst and any(map(load_dst.__contains__, blocks))):
            return False
        for gh, h in zip(self._hashes_of(blocks), keys):
            if gh and h not in gh:
                return False
        inflight_gpu.update(blocks)
        inflight_keys.update(keys)
        sel.gpu_ids += blocks
        sel.groups += repeat(0, n)
        sel.keys += keys
        sel.depths += depths
        sel.to_touch += blocks
        return True

    def _walk_groups(self, st: Cursor, ready: int, avail: int, alloc: Collection[int],
                     sel: Selection) -> int:
        """:meth:`walk` for any groups: every group of a position, then the position."""
        p = st.cursor
        tables = st.tables
        hashes = st.hashes
        stale = st.stale
        nh = len(hashes)
        declined = self.counters.declined
        while p < ready:
            h = hashes[p] if p < nh else None
            picks: list[Cand] = []
            reasons: list[DeclineReason] = []
            wait = False
            for g in range(self.gs.n):
                b = tables[g][p]
                if b in self.load_dst:
                    wait = True
                    break
                if stale is not None and (g, p) in stale:  # (kvshm.offload.window_reuse)
                    reasons.append(DeclineReason.STALE_WINDOW)
                    continue
                reason, key = self.classify(b, h, g, alloc)
                if reason is None and any(c.gpu_id == b for c in picks):
                    # two groups' tables name one block here (bad input): store it once,
                    # or the job would list it twice and its completion fail its check
                    reason = DeclineReason.IN_FLIGHT
                if reason is None:
                    picks.append(Cand(b, g, key, p))
                else:
                    reasons.append(reason)
            if wait:
                break
            if len(picks) > avail:
                declined[DeclineReason.CPU_FULL] += 1
                break
            for r in reasons:
                declined[r] += 1
            for c in picks:
                self.marks.mark(c)
                sel.add(c)
                sel.to_touch.append(c.gpu_id)
            avail -= len(picks)
            p += 1
        st.cursor = p
        return avail

    def pin_finished(self, st: Cursor, ready: int) -> int:
        """Finish-time: touch and queue ``st``'s unstored candidates ``[cursor, ready)``
        (no CPU limit; the next steps send them). Returns how many were queued. One
        full-attention group is classified inline (:meth:`_pin_one_group`)."""
        if self.gs.single:
            picks = self._pin_one_group(st, ready)
        else:
            picks = self._pin_groups(st, ready)
        st.cursor = max(st.cursor, ready)
        self.finished.queue(picks)
        return len(picks)

    def _pin_one_group(self, st: Cursor, ready: int) -> list[Cand]:
        """:meth:`_pin_groups` for ``gs.single``, :meth:`classify` inlined (the key is
        the plain hash; no window): the same decisions and counts, marked as taken."""
        picks: list[Cand] = []
        table, hashes = st.tables[0], st.hashes
        nh = len(hashes)
        load_dst, inflight_gpu, inflight_keys, cached, gh_of, declined = self._hot
        for p in range(st.cursor, ready):
            b = table[p]
            if b in load_dst or b in inflight_gpu:
                declined[DeclineReason.IN_FLIGHT] += 1
                continue
            gh = gh_of(b)
            h = hashes[p] if p < nh else None
            if h is None:
                if not gh:
                    declined[DeclineReason.UNHASHED] += 1
                    continue
                h = gh[0]
            elif gh and h not in gh:
                declined[DeclineReason.HASH_MISMATCH] += 1
                continue
            if h in inflight_keys:
                declined[DeclineReason.IN_FLIGHT] += 1
            elif h in cached:
                declined[DeclineReason.ALREADY_CACHED] += 1
            else:
                inflight_gpu.add(b)
                inflight_keys.add(h)
                picks.append(Cand(b, 0, h, p))
        return picks

    def _pin_groups(self, st: Cursor, ready: int) -> list[Cand]:
        """Classify and mark ``st``'s candidates ``[cursor, ready)`` of every group."""
        picks: list[Cand] = []
        declined = self.counters.declined
        hashes = st.hashes
        for p in range(st.cursor, ready):
            h = hashes[p] if p < len(hashes) else None
            for g in range(self.gs.n):
                b = st.tables[g][p]
                if b in self.load_dst:
                    declined[DeclineReason.IN_FLIGHT] += 1
                    continue
                if st.stale is not None and (g, p) in st.stale:
                    declined[DeclineReason.STALE_WINDOW] += 1
                    continue
                reason, key = self.classify(b, h, g, _NO_IDS)
                if reason is not None:
                    declined[reason] += 1
                    continue
                c = Cand(b, g, key, p)
                self.marks.mark(c)
                picks.append(c)
        return picks

    # ---- completion --------------------------------------------------------------

    def complete(self, job: StoreJob, register: bool) -> None:
        """``job`` is done on every rank: clear its marks; when ``register``, index each
        CPU block under its primary key and the GPU block's current hashes; free CPU
        blocks tail-first (a prefix's tail is evicted before its head); unpin GPU blocks
        (tail-first; lazy ones ``evict_first``). The job has left the job table already,
        so its pins go even when indexing fails (a GPU pool that answers a hash kvshm
        cannot index): no pin outlives its record."""
        gpu_ids, cpu_ids, n_eager = job.gpu_ids, job.cpu_ids, job.n_eager
        try:
            self.marks.unmark_all(gpu_ids, job.keys)
            if register:
                self._register(gpu_ids, cpu_ids, job.groups, job.keys, job.depths)
        finally:
            self.cpu.free(reversed(cpu_ids))
            if n_eager:
                self.gpu.free(reversed(gpu_ids[:n_eager]))
            if n_eager < len(gpu_ids):
                self.gpu.free(gpu_ids[n_eager:], evict_first=True)

    def _register(self, gpu_ids: list[int], cpu_ids: list[int], groups: list[int],
                  keys: list[bytes], depths: list[int]) -> None:
        """Index each CPU block under its key, then the GPU block's other hashes (as
        qualified keys); set the depths (not for plain LRU). Where no GPU block carries
        a hash besides its key (the usual case: one group, the block hashed as stored)
        this is one :meth:`BlockPool.add_keys` call; else the pairs one by one."""
        cpu = self.cpu
        depth_list = depths if cpu.eviction is not Eviction.LRU else None
        gh_of = self.gpu.block_hashes
        if self.gs.single:
            ghs = self._hashes_of(gpu_ids)
            # each GPU block carries no hash or exactly its key: (k,) per key from zip
            if ghs.count(()) + sum(map(eq, ghs, zip(keys))) == len(ghs):
                cpu.index.add_keys(cpu_ids, keys, depth_list)
                self.counters.stored_blocks += len(cpu_ids)
                return
        key_of = self.gs.key
        pairs: list[tuple[int, list[bytes]]] = []
        for c, b, g, k in zip(cpu_ids, gpu_ids, groups, keys):
            hs = [k]
            for h in gh_of(b):
                q = key_of(h, g)
                if q != k:
                    hs.append(q)
            pairs.append((c, hs))
        for _, hs in pairs:  # every key checked before any is indexed, as add_keys does
            for h in hs:
                if not isinstance(h, bytes):
                    raise ConfigError(f"block hash must be bytes, got {type(h).__name__}")
        for c, hs in pairs:
            cpu.add_hashes(c, hs)
        if depth_list:
            for c, d in zip(cpu_ids, depth_list):
                cpu.set_depth(c, d)
        self.counters.stored_blocks += len(cpu_ids)
