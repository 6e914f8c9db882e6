"""The remote tier on the scheduler side: what to put, what to fetch, when a block is ready.

Sans-IO but for one injected object, a :class:`~kvshm.remote.tier.ReadyIndex`, which
never blocks (``publish`` and ``query`` enqueue; ``answers`` pops). The manager calls
this book; the bytes move on the workers as :class:`~kvshm.offload.jobs.RemoteJob` s
(``kvshm.ipc.protocol.Remote`` messages), acked like copies.

Write path (:mod:`kvshm.offload.remote_puts`): blocks are put after their store
completed on every rank (write-through) or as they near eviction (``ON_EVICT``); a
completed PUT publishes their readiness keys. P/D hand-offs: :mod:`kvshm.offload.pd`.

Read path (the state machine is :class:`~kvshm.offload.fetches.Fetches`, shared with the
disk tier), for a request whose CPU-tier hit is 0 (an ordinary CPU hit never waits for
the remote), or a P/D hand-off whose CPU hit ends short of its extent (its manifest says
the server holds the rest: the manager asks for the blocks after the hit):

1. :meth:`lookup` queries the readiness keys of the blocks after the local hit and
   answers None ("ask again"); QUERYING. A P/D hand-off sends that query with each read
   of its manifest (:mod:`kvshm.offload.remote_ahead`): once the manifest is trusted,
   an answer that found every block present makes the fetch ANSWERED at once (one
   round of the index's thread instead of two); any shorter answer is thrown away and
   the query asked now.
2. The answer (polled on each lookup and plan) gives the present prefix; 0: DONE.
3. The next :meth:`plan` allocates that many CPU blocks and makes a GET job; FETCHING
   (lookups answer None). A CPU pool with no room, or a read of a lower tier past its
   fetch timeout and still out (``Fetches.plan``'s ``overdue``): DONE (counted).
4. The GET completed on every rank without failure: the blocks are indexed in the CPU
   tier and stay pinned for the request (FETCHED) until its next lookup, which finds an
   ordinary CPU hit and pins it itself. A failed GET frees its blocks unindexed: DONE,
   and the request is never asked for again (failure = miss = recompute).

A query that has no answer after ``answer_timeout_s``, or a GET not done on every rank
after ``fetch_timeout_s`` (a rank stuck on the server), ends DONE (counted): a request
never waits on the remote for longer (the GET keeps its pins until it ends).

Dedup: a key is never put twice by one engine (published, queued or in flight), nor
fetched twice at once (a lookup any of whose keys another request's GET is fetching
answers None until that GET ends, or the fetch timeout).

The book's P/D side is an object it holds when the engine hands off
(:class:`~kvshm.offload.pd.side.HandoffSide`, ``side``; the seam between this book and
:mod:`kvshm.offload.pd`): a hand-off's lookup waits for its manifest there first, and
one whose CPU hit ends short of its extent waits holding that hit (the GET for the rest
must not evict the prefix it extends). The book passes the manager's P/D calls
(``hold``, ``unhold``, ``served``, ``publish_request``, ``transfer_params``,
``store_dropped``) on to it.

Pins: every CPU block this book pins is recorded in :meth:`RemoteBook.pinned` (queued
PUTs, FETCHED requests, held prefixes); jobs record their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvshm.config import RemoteMode
from kvshm.ipc.protocol import Remote, RemoteOp
from kvshm.offload.fetches import WAITING, Fetches, FetchState
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import JobTable, RemoteJob
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import Verdict
from kvshm.offload.pd.side import HandoffSide
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_ahead import AskAhead
from kvshm.offload.remote_puts import (
    MAX_PUT_BLOCKS,
    PutQueue,
    RemoteCounters,
    message,
    remote_hash,
)
from kvshm.remote.tier import ReadyIndex

__all__ = ["RemoteBook"]


class RemoteBook:
    """See the module docstring. ``ready_key(h)``: the readiness key of remote hash
    ``h`` (:func:`kvshm.remote.tier.ready_key` with the engine's fingerprint);
    ``handoffs``: the engine's P/D hand-offs (None: it hands nothing off), held through
    the book's P/D ``side``."""

    def __init__(self, cpu: BlockPool, gs: GroupSet, jobs: JobTable, index: ReadyIndex,
                 ready_key: Callable[[bytes], str], *, mode: RemoteMode,
                 answer_timeout_s: float = 2.0, fetch_timeout_s: float = 15.0,
                 evict_window: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 handoffs: Handoffs | None = None,
                 max_job_blocks: int = MAX_PUT_BLOCKS, ttl_s: float | None = None,
                 hold_ttl_s: float | None = None) -> None:
        self.cpu, self._gs, self._jobs, self.index = cpu, gs, jobs, index
        self._ready_key = ready_key
        self.mode = mode
        self._timeout = answer_timeout_s
        self._clock = clock
        self.counters = RemoteCounters()
        self.puts = PutQueue(cpu, jobs, index, ready_key, self.counters, mode=mode,
                             evict_window=evict_window,
                             publisher=None if handoffs is None else handoffs.publications,
                             max_job_blocks=max_job_blocks, ttl_s=ttl_s,
                             hold_ttl_s=hold_ttl_s, clock=clock)
        self.fetches = Fetches(cpu, gs, self.counters, self._new_get,
                               fetch_timeout_s=fetch_timeout_s, max_job_blocks=max_job_blocks,
                               clock=clock, allocate=self._allocate)
        #: where a lower tier may write them down (the manager sets a list when the
        #: engine has a disk tier): the cached CPU blocks the GETs' allocations evicted,
        #: (CPU id, key) in the order taken, until :meth:`take_victims`
        self.victims: list[tuple[int, bytes]] | None = None
        self._tokens: dict[int, str] = {}
        self._next_token = 1
        self.pd = handoffs
        self.side = None if handoffs is None else HandoffSide(cpu, gs, self.puts, handoffs)
        self.ahead = AskAhead()  # a hand-off's readiness query sent with its manifest read

    # ---- queries ---------------------------------------------------------------------

    def pinned(self) -> list[int]:
        """CPU ids this book pins (queued PUTs, FETCHED requests, held prefixes), with
        repeats."""
        out = self.puts.pinned()
        out.extend(self.fetches.pinned())
        if self.side is not None:
            out.extend(self.side.pinned())
        return out

    def has_pending_work(self) -> bool:
        """PUTs queued or GETs answered but not planned: the next plan has work."""
        return self.puts.pending() or self.fetches.pending()

    # ---- read path ---------------------------------------------------------------------

    def lookup(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int,
               params: Any = None) -> int | None:
        """A request whose CPU hit is 0 (or a hand-off's, short of its extent, from its
        end ``start``): None while its remote lookup runs, else 0 (the blocks, once
        fetched, are an ordinary CPU hit). ``n_max``: blocks after
        ``start`` the hit may cover. A P/D hand-off (``params``) waits for its
        manifest first (:mod:`kvshm.offload.pd.consume`)."""
        self.poll()
        st = self.fetches.get(rid)
        if st is None:
            ahead = False
            if self.side is not None:
                verdict = self.side.consume(rid, hashes, params)
                if verdict is Verdict.WAIT:
                    self._ask_ahead(rid, hashes, start, n_max)
                    return None
                if verdict is Verdict.REFUSED:
                    self.ahead.forget(rid)
                    return 0
                ahead = verdict is Verdict.GO
            return self._begin(rid, hashes, start, n_max, ahead=ahead)
        if st.state is FetchState.QUERYING and self._clock() - st.since > self._timeout:
            self.counters.query_timeouts += 1
            self._tokens.pop(st.token, None)
            st.state = FetchState.DONE
        if self.fetches.again(rid, st) is None:
            return None
        self.unhold(rid)
        return 0

    def _range(self, hashes: Sequence[bytes], start: int, n_max: int) -> list[bytes]:
        """The CPU keys a lookup from block ``start`` would fetch (empty: none)."""
        end = min(start + n_max, len(hashes))
        return self._gs.keys(hashes, start, end) if end > start else []

    def _query(self, keys: Sequence[bytes]) -> int:
        """Send the readiness query of ``keys``; its token."""
        token = self._next_token
        self._next_token += 1
        self.index.query(token, [self._ready_key(remote_hash(k)) for k in keys])
        return token

    def _begin(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int, *,
               ahead: bool = False) -> int | None:
        """Start ``rid``'s fetch: the readiness query, or with ``ahead`` (a trusted
        hand-off) the answer its manifest read brought when that one covers the whole
        range (:mod:`kvshm.offload.remote_ahead`)."""
        keys = self._range(hashes, start, n_max)
        if not keys:
            self.ahead.forget(rid)
            return 0
        if not self.index.healthy():
            self.ahead.forget(rid)
            self.counters.skipped_unhealthy += 1
            return 0
        if self.fetches.being_fetched(keys):  # wait for it, as long as its own request would
            self.counters.asked_again += 1
            return None
        if ahead and self.ahead.take(rid, keys):
            self.counters.ahead_used += 1
            self.counters.query_hits += 1
            self.fetches.begin(rid, start, keys, present=len(keys))
            return None
        self.ahead.forget(rid)
        token = self._query(keys)
        self._tokens[token] = rid
        self.fetches.begin(rid, start, keys, token=token)
        self.counters.queries += 1
        return None

    def _ask_ahead(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int) -> None:
        """``rid``'s manifest is being read: send the readiness query of its fetch
        range with it, unless one is in flight or answered in full
        (:class:`~kvshm.offload.remote_ahead.AskAhead`)."""
        keys = self._range(hashes, start, n_max)
        assert self.side is not None
        read = self.side.manifest_reads(rid)
        if keys and self.ahead.wants(rid, keys, read) and self.index.healthy():
            self.ahead.asked(rid, self._query(keys), keys, read)
            self.counters.queries_ahead += 1

    def poll(self) -> None:
        """Apply the index's answers (a stale one, for a request gone, is counted)."""
        for token, n in self.index.answers():
            if self.ahead.answered(token, n - n % self._gs.n):  # whole positions only
                continue
            rid = self._tokens.pop(token, None)
            st = self.fetches.get(rid) if rid is not None else None
            if rid is None or st is None or st.state is not FetchState.QUERYING:
                self.counters.answers_stale += 1
                continue
            n -= n % self._gs.n  # whole positions only
            if n <= 0:
                self.counters.query_misses += 1
                st.state = FetchState.DONE
                continue
            self.counters.query_hits += 1
            self.fetches.answered(rid, st, n)

    def hit(self, rid: str) -> None:
        """``rid``'s lookup is a CPU hit (pinned): its remote lookup ends here -- what
        it fetched is released, a query or GET still running goes on unclaimed."""
        st = self.fetches.get(rid)
        if st is not None and st.state in WAITING:
            self._tokens.pop(st.token, None)
        self.fetches.hit(rid)
        self.unhold(rid)

    def release(self, rid: str) -> None:
        """Drop ``rid``'s FETCHED pins and its held prefix (its lookup pinned what it
        hit meanwhile)."""
        self.fetches.release(rid)
        self.unhold(rid)

    def forget(self, rid: str) -> None:
        """The request ended: its pins go; a GET in flight completes unclaimed; a
        manifest it trusted is collected (:meth:`HandoffSide.forget
        <kvshm.offload.pd.side.HandoffSide.forget>`)."""
        self.end_lookup(rid)
        if self.side is not None:
            self.side.forget(rid)

    def end_lookup(self, rid: str) -> None:
        """``rid``'s lookups are over (it ended, was admitted, or a reset): its GET's
        record, held prefix and read-ahead go; a GET in flight completes unclaimed. A
        later lookup of ``rid`` (a re-admission after a preemption) asks the server
        afresh."""
        self.ahead.forget(rid)
        self.unhold(rid)
        st = self.fetches.end(rid)
        if st is not None:
            self._tokens.pop(st.token, None)

    # ---- write path (kvshm.offload.remote_puts) ------------------------------------------

    def stored(self, cpu_ids: Sequence[int], keys: Sequence[bytes],
               depths: Sequence[int]) -> None:
        """A store completed and indexed ``cpu_ids`` under ``keys`` (write-through)."""
        self.puts.stored(cpu_ids, keys, depths)

    # ---- plan and completion -------------------------------------------------------------

    def plan(self, step: int, *, overdue: bool = False) -> list[Remote]:
        """This step's remote jobs: GETs for answered lookups, then PUTs. ``overdue``:
        as :meth:`Fetches.plan`'s."""
        self.poll()
        if self.side is not None:
            self.side.tick()
        gets = [message(job, RemoteOp.GET)
                for job in self.fetches.plan(step, overdue=overdue)]
        return gets + self.puts.plan(step)

    def _allocate(self, n: int) -> list[int]:
        """A GET's fresh CPU blocks; the cached ones it evicts go to :attr:`victims`
        where there is one."""
        return self.cpu.allocate(n, self.victims)

    def take_victims(self) -> list[tuple[int, bytes]]:
        """The blocks the GETs planned since the last call evicted (empty without a
        list: :attr:`victims`)."""
        out = self.victims or []
        if self.victims is not None:
            self.victims = []
        return out

    def _new_get(self, step: int, cpu_ids: list[int], keys: list[bytes], depths: list[int],
                 rid: str) -> RemoteJob:
        return self._jobs.new_remote(step, cpu_ids, keys, depths, put=False, req_id=rid)

    def complete(self, job: RemoteJob, usable: bool) -> None:
        """``job`` is done on every rank (it left the job table). ``usable``: it did
        not fail and its result may be used (not abandoned, the engine not failed)."""
        if job.put:
            self.puts.done(job, usable)
        else:
            self._get_done(job, usable)

    def _get_done(self, job: RemoteJob, usable: bool) -> None:
        mine = self.fetches.complete(job, usable)
        if usable:
            self.puts.remember(job.keys)
        if mine and self.side is not None:
            self.side.collected(job.req_id)

    def drop(self) -> None:
        """Reset or engine failure: unpin queued PUTs, FETCHED blocks and held prefixes,
        forget every lookup (GET jobs in flight complete unclaimed; their blocks are
        freed). The requests go on: a manifest one of them trusted is not collected here
        (only a request's end collects it) and its verdict is kept, so its next lookup
        asks the server again without re-reading the manifest."""
        if self.victims:  # (empty between build_steps; kept clean all the same)
            self.victims = []
        self.puts.drop()
        for rid in list(self.fetches.reqs):
            self.end_lookup(rid)
        if self.side is not None:
            self.side.drop()

    # ---- the manager's P/D calls, passed to the side (kvshm.offload.pd.side) ------------

    def hold(self, rid: str, cpu_ids: Sequence[int]) -> None:
        """:meth:`HandoffSide.hold <kvshm.offload.pd.side.HandoffSide.hold>`."""
        assert self.side is not None, "a hold without the hand-offs"
        self.side.hold(rid, cpu_ids)

    def unhold(self, rid: str) -> None:
        """:meth:`HandoffSide.unhold <kvshm.offload.pd.side.HandoffSide.unhold>` (nothing
        without hand-offs)."""
        if self.side is not None:
            self.side.unhold(rid)

    def served(self, rid: str, hashes: Sequence[bytes], params: Any) -> None:
        """:meth:`HandoffSide.served <kvshm.offload.pd.side.HandoffSide.served>`."""
        if self.side is not None:
            self.side.served(rid, hashes, params)

    def store_dropped(self, keys: Sequence[bytes]) -> None:
        """:meth:`HandoffSide.store_dropped <kvshm.offload.pd.side.HandoffSide.store_dropped>`
        (nothing without hand-offs)."""
        if self.side is not None:
            self.side.store_dropped(keys)

    def publish_request(self, rid: str, hashes: Sequence[bytes], confirmed: int,
                        tables: Sequence[Sequence[int]], tail: bytes | None,
                        pin_tail: Callable[[Sequence[Sequence[int]], int, bytes],
                                           list[bytes] | None]) -> None:
        """:meth:`HandoffSide.publish_request
        <kvshm.offload.pd.side.HandoffSide.publish_request>`."""
        assert self.side is not None, "a hand-off without the hand-offs"
        self.side.publish_request(rid, hashes, confirmed, tables, tail, pin_tail)

    def transfer_params(self, rid: str) -> dict[str, Any] | None:
        """:meth:`HandoffSide.transfer_params
        <kvshm.offload.pd.side.HandoffSide.transfer_params>` (None without hand-offs)."""
        return None if self.side is None else self.side.transfer_params(rid)
