"""`OffloadManager`: the scheduler side of kvshm, sans-IO and single-threaded.

It decides which blocks are stored and loaded, owns the CPU tier's index and pins, and
hands out job ids; it never touches KV bytes, sockets or threads. Calls, in the order an
engine step makes them (docs/design.md, "The scheduler-side contract"):

1. ``lookup`` (phase A): longest CPU hit beyond the engine's block-aligned GPU hit,
   capped at ``num_tokens - 1``; pins the hit; a repeated lookup drops the older pin;
   None (no pin) while another request is loading part of the hit.
2. ``allocated`` (phase B): pairs the accepted hit blocks with GPU destinations, queues
   the load, releases unused pins; with no pin but tokens expected: a failed result.
3. ``build_step``: at most one store and one load ``Transfer`` per step.
4. ``on_done``: acks; a job completes when every rank acked or is dead.
5. ``finished``: pins the request's unstored full blocks for the next store.
6. ``reset`` / ``rank_failed`` / ``has_pending_work`` / ``check_invariants`` (acks,
   completions, reset and rank death are decided by the manager's
   :class:`~kvshm.offload.outcomes.JobOutcomes`, ``self.outcomes``; the manager's
   methods hand them over in one line).

Every call above checks its whole input before it changes anything (the rules:
:mod:`kvshm.offload.validate`; one check per call: :mod:`kvshm.offload.inputs`): bad
input -- a wrong type, an id out of range or repeated, a table per group missing, a
count that disagrees -- raises ``InvalidRequest`` (a ConfigError) with the manager
exactly as before but for ``counters.invalid_calls``.

Pins (ref counts) are the only protection: every CPU block a lookup, queued load or job
uses and every GPU block a job or queued transfer uses is pinned, and each pin is
recorded by exactly one hit, queued load, finish-time store or job
(:meth:`check_invariants` compares, :mod:`kvshm.offload.invariants`). A block is never
reused while any rank may still copy into it, so ``StepPlan.flush`` is always empty.

Parts: the manager keeps the phase-A hits (:mod:`kvshm.offload.hits`) and orders the
calls; the records live in its parts, each owning its pins once handed over: the job
table and ack state (:mod:`kvshm.offload.jobs`), held by the job outcomes with the
failed and abandoned states (:mod:`kvshm.offload.outcomes`), load bookkeeping from
phase B to outcome (:mod:`kvshm.offload.loads`), store selection and in-flight marks
(:mod:`kvshm.offload.stores`), per-request tables and cursors
(:mod:`kvshm.offload.requests`), KV groups and index keys (:mod:`kvshm.offload.groups`),
and the lower tiers a miss reads from, with their overdue gate
(:mod:`kvshm.offload.tiers`; P/D hand-offs stay here).

Cost per step: O(listed requests) with a dict lookup and a few compares each, plus
O(blocks that changed); no scan over every request's blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import Direction, Disk, Remote, Transfer, pack_ids
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.disk import DiskBook
from kvshm.offload.groups import GroupSet, cdiv
from kvshm.offload.hits import Hit, assign, find_hit, guess_dests, refresh_prefix
from kvshm.offload.inputs import View, for_pool
from kvshm.offload.invariants import Parts, check_parts, recorded_pins
from kvshm.offload.jobs import JobTable, LoadPart, Selection
from kvshm.offload.loads import LoadBook
from kvshm.offload.outcomes import JobOutcomes
from kvshm.offload.pd.manifest import handoff_extent, is_handoff, remote_decode
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote import RemoteBook
from kvshm.offload.requests import ReqState, RequestTracker
from kvshm.offload.side_stores import lazy_scan, pin_tail
from kvshm.offload.stores import StorePlanner
from kvshm.offload.tiers import LowerTiers
from kvshm.offload.validate import Tables
from kvshm.types import (
    GpuBlocks,
    KVGroup,
    LoadFailure,
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
    StepPlan,
    StoreMode,
)

__all__ = ["OffloadManager"]

_EMPTY: frozenset[int] = frozenset()


class OffloadManager:
    """See the module docstring. ``lazy_window``: GPU free-queue blocks a lazy step
    looks at from the LRU end (LAZY mode needs a single KV group). ``hash_bytes``: the
    exact length of the engine's block hashes (default: ``gpu.hash_bytes`` where the pool
    has one, else any length in ``kvshm.offload.validate.HASH_LEN_RANGE``). ``remote``:
    builds the remote tier's book from the manager's pool, groups and job table
    (:mod:`kvshm.offload.remote`); None: no remote tier. ``disk``: likewise the local
    disk tier's book (:mod:`kvshm.offload.disk`), asked after the CPU tier and before
    the remote one."""

    def __init__(self, cpu: BlockPool, gpu: GpuBlocks, *, block_size: int,
                 groups: Sequence[KVGroup] = (KVGroup.full(),), world_size: int = 1,
                 mode: StoreMode = StoreMode.EAGER, lazy_window: int = 256,
                 hash_bytes: int | None = None,
                 remote: Callable[[BlockPool, GroupSet, JobTable], RemoteBook] | None = None,
                 disk: Callable[[BlockPool, GroupSet, JobTable], DiskBook] | None = None
                 ) -> None:
        self._gs = GroupSet(groups, block_size)
        if not isinstance(mode, StoreMode):  # ("lazy", a str, stored nothing, silently)
            raise ConfigError(f"mode must be a StoreMode, got {mode!r}")
        if mode is StoreMode.LAZY and self._gs.n != 1:
            raise ConfigError("lazy store mode supports a single KV group only")
        if type(lazy_window) is not int or lazy_window < 1:
            raise ConfigError(f"lazy_window must be an int >= 1, got {lazy_window!r}")
        self.counters = ManagerCounters()
        self._check = for_pool(gpu, n_groups=self._gs.n, block_size=block_size,
                               hash_bytes=hash_bytes, counters=self.counters,
                               full_groups=self._gs.full)
        self.cpu = cpu
        self.gpu = gpu
        self.block_size = block_size
        self.mode = mode
        self._eager = mode is StoreMode.EAGER
        jobs = JobTable(world_size, self.counters)
        self._loads = LoadBook(cpu, gpu, self.counters)
        self._stores = StorePlanner(cpu, gpu, self._gs, block_size, self.counters, lazy_window,
                                  self._loads.dst.counts)
        self._track = RequestTracker(self._gs, block_size, self._eager, self._stores)
        self._hits: dict[str, Hit] = {}
        remote_book = None if remote is None else remote(cpu, self._gs, jobs)
        if remote_book is not None:  # a P/D publication learns of a dropped tail store
            self._stores.finished.on_dropped = remote_book.store_dropped
        disk_book = None if disk is None else disk(cpu, self._gs, jobs)
        self._tiers = LowerTiers(disk_book, remote_book, self.counters)
        self.outcomes = JobOutcomes(jobs, cpu, self._loads, self._stores, remote_book,
                                    self.counters, self._tombstone_hits, disk=disk_book)
        self._jobs = jobs
        self._last_step = 0  # the step of the latest build_step (reads planned between)

    # ---- small queries -------------------------------------------------------------

    @property
    def remote(self) -> RemoteBook | None:
        """The remote tier's book (None: no remote tier)."""
        return self._tiers.remote

    @property
    def disk(self) -> DiskBook | None:
        """The local disk tier's book (None: no disk tier)."""
        return self._tiers.disk

    @property
    def world_size(self) -> int:
        return self._jobs.world_size

    @property
    def failed(self) -> bool:
        """True once a rank was declared dead: no lookups hit, nothing is planned."""
        return self.outcomes.failed

    @property
    def num_jobs_in_flight(self) -> int:
        """Jobs not yet acked by every live rank (abandoned ones included)."""
        return len(self._jobs)

    def settle(self, limit: int = 0) -> bool:
        """The CPU tier's deferred eviction bookkeeping, now, at most ``limit`` items
        (``BlockPool.settle``; True while some is left): for a host's idle time, never
        needed for correctness."""
        return self.cpu.settle(limit)

    def fetch_to_plan(self) -> bool:
        """A lower tier's fetch is answered and waits for the next plan
        (``LowerTiers.fetch_to_plan``): no wait in a lookup can move it."""
        return self._tiers.active and self._tiers.fetch_to_plan()

    def has_pending_work(self) -> bool:
        """Anything queued, in flight or not yet reported: keep stepping. Jobs that wait
        only for a revoked, unfenced rank do not count: nothing will move them."""
        jobs = self.outcomes.has_pending_work()
        tiers = self._tiers.active and self._tiers.has_pending_work()
        return bool(jobs or tiers or self._loads.pending() or self._stores.finished.items)

    def take_load_results(self) -> list[LoadResult]:
        """Load outcomes decided since the last call, each handed out exactly once. This
        queue is the only one: the runtime and the engines drain it, never copy it."""
        return self._loads.take_results()

    def pins_held(self) -> int:
        """CPU plus GPU pins the manager holds (from its own records)."""
        cpu, gpu = recorded_pins(self._parts())
        return sum(cpu.values()) + sum(gpu.values())

    # ---- outcomes (decided by self.outcomes) ---------------------------------------

    def on_done(self, job_id: int, rank: int, ok: bool) -> None:
        """One rank's ack (:meth:`JobOutcomes.on_done`)."""
        self.outcomes.on_done(job_id, rank, ok)

    def reset(self) -> bool:
        """Drop the CPU index, abandon every job in flight; True once nothing is in
        flight (:meth:`JobOutcomes.reset`)."""
        return self.outcomes.reset()

    def reset_done(self) -> bool:
        """True once the jobs the last :meth:`reset` abandoned are done
        (:meth:`JobOutcomes.reset_done`); poll this, not ``reset``."""
        return self.outcomes.reset_done()

    def close(self, stopped: Iterable[int] = ()) -> None:
        """The engine closes (:meth:`JobOutcomes.close`): every pin no rank may still
        touch goes -- all of them once every rank is in ``stopped`` (proven stopped)."""
        self.outcomes.close(stopped)

    def rank_failed(self, rank: int) -> None:
        """``rank`` was declared dead: every job fails, nothing more is planned; its
        unacked blocks are quarantined (:meth:`JobOutcomes.rank_failed`)."""
        self.outcomes.rank_failed(rank)

    def rank_fenced(self, rank: int) -> None:
        """``rank`` can touch no block any more (:meth:`JobOutcomes.rank_fenced`)."""
        self.outcomes.rank_fenced(rank)

    def quarantined_blocks(self) -> tuple[int, int]:
        """(GPU, CPU) blocks pinned only because a revoked rank is not fenced yet."""
        return self.outcomes.quarantined_blocks()

    def _tombstone_hits(self, cause: LoadFailure) -> None:
        """Release every pending phase-A hit's pins; its phase B fails with ``cause``
        (handed to the outcomes, which call it on reset and rank death)."""
        for rid, hit in list(self._hits.items()):
            if hit.cause is None:
                self.cpu.free(reversed(hit.pinned))
                self._hits[rid] = Hit(hit.start, hit.end, [], [], (), cause, hit.offered)

    # ---- phase A / B ---------------------------------------------------------------

    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """Tokens the CPU tier can supply after ``num_local_tokens`` (block-aligned; an
        unaligned value gets 0), in whole blocks. At least one prompt token is always
        left to compute (the model needs it for the first output token), so the hit
        covers at most ``num_tokens - 1`` tokens: the last full block of a prompt that
        ends on a block boundary is never a hit. Pins the hit; None: ask again next
        step (no pin of its own; a P/D hand-off waiting for the rest of its extent
        holds its local prefix until it answers, ``RemoteBook.hold``)."""
        view = self._check.view(req, num_local_tokens)
        if self.cpu.refresh_gpu_hits and num_local_tokens >= self.block_size:
            # refresh_prefix reads the engine's own hit's hashes, which view() does not
            # check: all of them whenever it will run (the hit grew) -- this view's
            # hashes are not those an earlier lookup checked
            st = self._track.reqs.get(view.req_id)
            s = num_local_tokens // self.block_size
            if st is None or s > st.refreshed:
                self._check.hashes("lookup", view.req_id, "block_hashes", view.hashes, 0,
                                   min(s, len(view.hashes)))
        # the request's earlier hit (one the engine cannot admit yet is looked up every
        # step) is released only after the new one is pinned: a block in both never
        # returns to the free set, so waiting is not a new use of it each step (it would
        # score as a hit, advance the order's clock and raise its frequency)
        old = self._hits.pop(view.req_id, None)
        try:
            tokens = self._lookup(view, num_local_tokens)
        finally:
            if old is not None and old.cause is None:
                self.cpu.free(reversed(old.pinned))
        if tokens is not None and self._tiers.active:
            self._tiers.answered(view.req_id)  # an answer ends a hand-off's or a read's wait
        return tokens

    def lookup_skipped(self, req: RequestView) -> None:
        """The engine recomputes ``req``'s whole prompt whatever the tiers hold (vLLM's
        ``skip_reading_prefix_cache``: prompt logprobs need every prompt token): nothing
        is pinned, counted as a lookup or read -- except a P/D hand-off's manifest,
        read so that the request's end collects it once it is checked, as for a
        hand-off the engine held whole (``RemoteBook.served``). Without this such a
        decode request never read its manifest: the manifest and its blocks' hold
        stayed on the server until the hold TTL. InvalidRequest (nothing changed) for
        bad input, as :meth:`lookup`."""
        view = self._check.view(req, 0)
        remote = self.remote
        if (view.params is not None and remote is not None and remote.pd is not None
                and not self.outcomes.failed and is_handoff(view.params)):
            remote.served(view.req_id, view.hashes, view.params)

    def _lookup(self, view: View, num_local_tokens: int) -> int | None:
        """:meth:`lookup` after its checks, the request's earlier hit already taken out
        (released by the caller after this pins the new one). A hand-off that answers
        None may hold its local prefix (``RemoteBook.hold``); any answer releases that
        hold (the caller)."""
        self.counters.lookups += 1
        rid = view.req_id
        st = self._track.state(rid)
        st.remote = st.remote or remote_decode(view.params)
        bs = self.block_size
        if num_local_tokens % bs:
            self.counters.lookups_unaligned += 1
            st.start = 0
            return 0
        s = num_local_tokens // bs
        st.start = s
        out = self.outcomes
        if out.failed or out.abandoned:
            if out.abandoned and not out.failed:
                self.counters.lookups_during_reset += 1
            return 0
        if s > st.refreshed and self.cpu.refresh_gpu_hits:
            # once a wait: a request the engine cannot admit yet is looked up every step.
            # A hit that grew is refreshed whole, tail first, so its head stays the
            # last to go (refreshing only the new tail would age the head below it)
            refresh_prefix(self.cpu, self._gs, view.hashes, s)
            st.refreshed = s
        hashes, n_max = view.hashes, (view.num_tokens - 1 - num_local_tokens) // bs
        cap = 0  # a P/D hand-off's hit may end inside a block: num_tokens - 1 at most
        tiers = self._tiers
        remote = tiers.remote
        handoff = (view.params is not None and remote is not None
                   and remote.pd is not None and is_handoff(view.params))
        if handoff:
            hashes, n_max = handoff_extent(hashes, view.tail, view.num_tokens, bs, s)
            cap = view.num_tokens - 1 - num_local_tokens
        hit = find_hit(self.cpu, self._gs, hashes, s, n_max)
        if hit is None:  # the lower tiers read the blocks (None), or a recompute (0)
            return tiers.miss(rid, hashes, s, n_max, view.params, handoff=handoff) \
                if tiers.active else 0
        if self._loads.is_loading(hit.pinned):  # before the remote: its DONE unpins
            self.counters.lookups_asked_again += 1
            return None
        if handoff and self._handoff_waits(rid, hit, hashes, s + n_max, view.params):
            return None
        if tiers.active and not handoff and tiers.extends(rid, hashes, hit, s + n_max):
            return None  # the disk reads what follows the hit, held meanwhile
        return self._pin_hit(rid, hit, s, cap, handoff)

    def _pin_hit(self, rid: str, hit: Hit, start: int, cap: int, handoff: bool) -> int:
        """Pin ``rid``'s CPU hit (from block ``start``) for its phase B; the tokens
        offered, at most ``cap`` where a hand-off's hit may end inside a block (0: no
        cap). The pin comes before the lower tiers release what they fetched for ``rid``
        (those blocks never reach the free set in between)."""
        self.cpu.touch(hit.pinned)
        if self._tiers.active:
            self._tiers.hit(rid, disk=not handoff)  # what they fetched is the hit's pin now
        self._hits[rid] = hit
        tokens = (hit.end - start) * self.block_size
        if cap and tokens > cap:
            tokens = cap
        hit.offered = tokens
        self.counters.lookup_hit_tokens += tokens
        return tokens

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """Phase B: ``gpu_block_ids`` are the request's full per-group tables; the first
        ``cdiv(num_external_tokens, block_size)`` hit blocks are loaded (the rest of the
        pin is released). InvalidRequest (nothing changed) for a bad table, a table too
        short for the accepted hit, or more tokens than offered."""
        req_id, tables, num_external_tokens = self._check.allocated(
            req_id, gpu_block_ids, num_external_tokens)
        hit = self._hits.get(req_id)
        if num_external_tokens:  # (with 0 tokens there is nothing to refuse: no call)
            self._check_phase_b(req_id, tables, num_external_tokens, hit)
        st = self._track.reqs.get(req_id)
        if st is not None and st.tracked:  # (its tables may be new: a preemption the
            st.phase_b_tables = [list(t) for t in tables]  # steps have not listed yet)
        if num_external_tokens == 0:
            self._drop_hit(req_id)
            self._admit(req_id, st, 0)
            return
        # an older load's outcome is not this one's: dropped -- only once the call is
        # accepted (a refused call that did this lost the in-flight load's result, and
        # its wait_loaded waited for good)
        self._loads.supersede(req_id, self._jobs)
        if hit is None or hit.cause is not None:
            self._hits.pop(req_id, None)
            cause = hit.cause if hit is not None and hit.cause is not None else (
                LoadFailure.ENGINE_FAILED if self.outcomes.failed else LoadFailure.NO_PIN)
            self._loads.fail_now(req_id, guess_dests(hit, tables, num_external_tokens,
                                                     self.block_size), cause)
            if hit is None:  # tokens nobody offered: not a hit (hit_tokens is what was)
                self.counters.phase_b_unoffered += 1
                self._admit(req_id, st, 0)
            else:
                self._admit(req_id, st, num_external_tokens)
            return
        k = cdiv(num_external_tokens, self.block_size)
        self._admit(req_id, st, num_external_tokens)
        a = assign(self.cpu, self._gs, hit, tables, k)
        del self._hits[req_id]
        self._hand_over(hit.pinned, a.cpu_ids)
        if st is not None:  # a hand-off's partial last block is stored once it fills
            st.start = hit.start + num_external_tokens // self.block_size
        if not a.cpu_ids:
            self._loads.fail_now(req_id, a.failed, LoadFailure.WINDOW_MISSING)
            return
        self.gpu.touch(a.gpu_ids)
        self._track.reallocated(a.gpu_ids)  # a load overwrites them: no window store reads them
        self._loads.enqueue(
            LoadPart(req_id, a.cpu_ids, a.gpu_ids, tuple(a.failed), num_external_tokens))

    def _check_phase_b(self, req_id: str, tables: Tables, tokens: int, hit: Hit | None
                       ) -> None:
        """Every refusal of a phase B with ``tokens`` > 0 whose fields passed their checks
        (InvalidRequest, nothing changed): a second one with no lookup since the first;
        more tokens than the hit offered; tables that do not reach the accepted hit; a
        destination a store in flight still reads."""
        if hit is None and self._loads.pending_for(req_id, self._jobs):
            # a second phase B for one lookup: its failure would name blocks the first
            # one's load is writing. (One with 0 tokens is vLLM's own: a request whose
            # asynchronous load finished is allocated again, external tokens 0, while
            # the load's acks may still be on their way -- its outcome stays reported.)
            raise self._check.refuse("allocated", req_id, "req_id",
                                     "a second phase B with no lookup since the first: "
                                     "its load is queued or in flight")
        if hit is None:
            return
        # a dropped hit (reset, a rank's death) too: its failure names the blocks of the
        # accepted range, which must be the offered one (2**62 tokens walked that range
        # for ever)
        if tokens > hit.offered:
            raise self._check.refuse("allocated", req_id, "num_external_tokens",
                                     f"{tokens} accepted, {hit.offered} offered")
        if hit.cause is None:
            end = hit.start + cdiv(tokens, self.block_size)
            self._check.reach("allocated", req_id, tables, end)
            self._refuse_stored_dests(req_id, tables, hit.start, end)

    def _refuse_stored_dests(self, req_id: str, tables: Tables, start: int, end: int) -> None:
        """InvalidRequest where a load destination (positions ``[start, end)``) is a
        GPU block a store in flight (or queued) still reads: the engine handed out a
        block kvshm pins, and the load would race that read -- the store would cache the
        loaded bytes under the other request's hash. O(the destinations), only while a
        store is in flight."""
        busy = self._stores.marks.gpu
        if not busy or all(busy.isdisjoint(t[start:end]) for t in tables):
            return
        for g, t in enumerate(tables):  # (only to name the first one)
            for p in range(start, min(end, len(t))):
                if t[p] in busy:
                    raise self._check.refuse(
                        "allocated", req_id, f"gpu_block_ids[{g}][{p}]",
                        f"GPU block {t[p]} is read by a store in flight (pinned by kvshm: "
                        "the engine must not hand it out)")

    def _admit(self, req_id: str, st: ReqState | None, tokens: int) -> None:
        """An accepted phase B (after its checks passed) ends the request's lookups: a
        lower tier's read record for it goes, so that a later lookup -- a re-admission
        after a preemption -- reads afresh (it used to answer 0 without asking: the
        record of the first read, FETCHED or DONE, stayed until the request ended).
        Counts the hit tokens: a request's first phase B in ``hit_tokens`` -- once per
        request, whatever its lookups were asked again -- a later one in
        ``hit_tokens_readmitted``. A request the manager does not track counts as
        first."""
        if self._tiers.active:
            self._tiers.admitted(req_id)
        if st is not None:
            st.refreshed = 0  # a later lookup (a re-admission) is a new use of the prefix
            if st.admitted:
                self.counters.hit_tokens_readmitted += tokens
                return
            st.admitted = True
        self.counters.hit_tokens += tokens

    def _handoff_waits(self, rid: str, hit: Hit, hashes: Sequence[bytes], end: int,
                       params: Any) -> bool:
        """A P/D hand-off's CPU hit ends before its extent's end (``end``, or the
        hashes', whichever is first: a decoder without the tail key can hit no further)
        -- the decoder holds a prefix, e.g. a shared system prompt: the rest is asked of
        the remote tier, as for a CPU miss, because the manifest says the server holds
        it. True: ask again, the hit held meanwhile (``RemoteBook.hold``: the GET's
        allocation must not evict it). False: the remote part is over (fetched, refused
        or missing) and the hit stands. A hit covering the extent never waits; its
        manifest is read so that the request's end collects it. An ordinary request's
        shorter CPU hit never waits for the remote (nothing says the rest is there)."""
        remote = self.remote
        assert remote is not None
        end = min(end, len(hashes))
        if hit.end >= end:
            remote.served(rid, hashes, params)
            return False
        if remote.lookup(rid, hashes, hit.end, end - hit.end, params) is None:
            remote.hold(rid, hit.pinned)
            return True
        return False

    def _hand_over(self, pinned: list[int], taken: list[int]) -> None:
        """Phase B: the hit's pins on ``taken`` (the load's CPU ids) become the load's;
        the rest of ``pinned`` is released tail-first. One full-attention group takes a
        prefix of ``pinned`` in order: those pins move without a pool call (a touch then
        a free of a pinned block changes neither its ref count nor its queue place)."""
        k = len(taken)
        if pinned[:k] == taken:
            if k < len(pinned):
                self.cpu.free(reversed(pinned[k:]))
            return
        self.cpu.touch(taken)
        self.cpu.free(reversed(pinned))

    def _drop_hit(self, req_id: str) -> None:
        hit = self._hits.pop(req_id, None)
        if hit is not None and hit.cause is None:
            self.cpu.free(reversed(hit.pinned))

    # ---- the step ------------------------------------------------------------------

    def build_step(self, inp: StepInput) -> StepPlan:
        """Track the listed requests and plan this step's store and load. The whole
        input is checked first (InvalidRequest: nothing changed)."""
        step, requests, gone, alloc = self._check.step_input(inp)
        changes = self._track.prepare(requests, set(gone) if gone else (), self._check,
                                      tracking=not self.outcomes.failed)
        self._last_step = step  # after every check: a refused step changes nothing
        for rid in gone:
            self._forget(rid)
        store = load = None
        remote: tuple[Remote, ...] = ()
        disk: tuple[Disk, ...] = ()
        out = self.outcomes
        if not out.failed:
            self._track.reallocated(alloc)
            dirty = self._track.apply(changes)
            if not out.abandoned:
                victims: list[tuple[int, bytes]] = []
                store = self._plan_stores(step, alloc, dirty, victims)
                load = self._loads.plan(step, self._jobs)
                if self._tiers.active:  # the victims' WRITEs go out before the store
                    remote, disk = self._tiers.plan(step, victims)
        failed_loads = self._loads.take_failed()
        jobs = self._loads.listed_jobs(self._jobs)
        return StepPlan(step=step, store=store, load=load, load_jobs=jobs,
                        failed_loads=failed_loads, remote=remote, disk=disk)

    def plan_reads(self) -> list[Disk]:
        """The disk READs of the lookups answered since the last ``build_step``, planned
        now (:meth:`DiskBook.plan_reads`: fresh CPU blocks allocated, slots pinned, jobs
        in the job table under the latest step's number) so that the caller posts them
        from the lookup itself; ``[]`` without a disk tier, once failed or abandoned.
        What this leaves unplanned (no CPU room yet) the next ``build_step`` plans."""
        out = self.outcomes
        if out.failed or out.abandoned:
            return []
        return self._tiers.plan_reads(self._last_step)

    def _plan_stores(self, step: int, alloc: frozenset[int], dirty: list[ScheduledRequest],
                     victims: list[tuple[int, bytes]]) -> Transfer | None:
        """The step's store job; the cached CPU blocks its allocation evicts are appended
        to ``victims`` when a disk tier may write them down (``DiskBook.write_victims``)."""
        sel = Selection()
        plan = self._stores
        avail = plan.finished.take(self.cpu.num_free, bool(self._jobs.jobs), sel)
        if dirty:
            avail = self._track.select(dirty, alloc if self._gs.sw else _EMPTY, avail, sel)
        if not self._eager:
            lazy_scan(plan, avail, sel)
        n = len(sel.gpu_ids)
        if not n:
            return None
        cpu_ids = self.cpu.allocate(n, victims if self._tiers.disk is not None else None)
        if sel.to_touch:
            self.gpu.touch(sel.to_touch)
        job = self._jobs.new_store(step, sel.gpu_ids, cpu_ids, groups=sel.groups,
                                   keys=sel.keys, n_eager=n - sel.n_lazy, depths=sel.depths)
        self.counters.stores_planned_blocks += n
        return Transfer(step, job.job_id, Direction.STORE, pack_ids(sel.gpu_ids),
                        pack_ids(cpu_ids))

    # ---- request end -----------------------------------------------------------------

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]], *,
                 block_hashes: Sequence[bytes] | None = None,
                 tail_hash: bytes | None = None) -> bool:
        """The request is done (its final confirmed count and tables). Its unstored full
        blocks are pinned here and stored by the next ``build_step``; its other pins are
        released. ``block_hashes``: its final hashes, when the engine's sequence seen
        so far may lack the last block. ``tail_hash``: a P/D prefill request's partial
        last block's (handed off with the rest; ignored for other requests, but refused
        for any whose confirmed tokens end on a block boundary: no partial block). Always
        False (pins make delayed frees unnecessary). InvalidRequest (nothing changed)
        for bad input."""
        req_id, confirmed, tables, hashes, tail = self._check.finished(
            req_id, num_confirmed_tokens, gpu_block_ids, block_hashes, tail_hash)
        st = self._track.reqs.get(req_id)
        failed = self.outcomes.failed
        if st is not None and not failed:
            self._track.check_finish(st, confirmed, tables, hashes, self._check)
        st = self._forget(req_id)
        if st is not None and not failed:
            self._track.finish(st, confirmed, tables, hashes)
            if st.remote and self.remote is not None and self.remote.pd is not None:
                self.remote.publish_request(req_id, st.hashes, confirmed, tables, tail,
                                            partial(pin_tail, self._stores))
        return False

    def transfer_params(self, req_id: str) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of a P/D prefill request that just finished (its
        hand-off's manifest: :mod:`kvshm.offload.pd`), once; None otherwise.
        InvalidRequest (nothing changed) for an id that is no str."""
        req_id = self._check.fields.req_id("transfer_params", req_id)
        return None if self.remote is None else self.remote.transfer_params(req_id)

    def _forget(self, req_id: str) -> ReqState | None:
        """Drop a request's pin, queued load and tracking (in-flight jobs keep theirs,
        but their outcome is no longer reported: a new request may reuse the id)."""
        self._drop_hit(req_id)
        self._loads.cancel(req_id)
        self._loads.supersede(req_id, self._jobs)
        if self._tiers.active:
            self._tiers.forget(req_id)
        return self._track.forget(req_id)

    # ---- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """O(everything) consistency check for tests; AssertionError names the fault."""
        check_parts(self._parts())
        if self.disk is not None:
            self.disk.check_invariants()

    def _parts(self) -> Parts:
        return Parts(cpu=self.cpu, gpu=self.gpu, world_size=self.world_size, hits=self._hits,
                     jobs=self._jobs, loads=self._loads, stores=self._stores,
                     failed=self.outcomes.failed, abandoned=self.outcomes.abandoned,
                     remote_pins=self._tiers.pinned())
