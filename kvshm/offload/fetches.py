"""The read path a lower tier shares: fetch blocks into fresh CPU blocks for a request,
then let its next lookup find them as an ordinary CPU hit.

One :class:`Fetches` is held by each lower tier's book (the remote tier's
:class:`~kvshm.offload.remote.RemoteBook`, the disk tier's
:class:`~kvshm.offload.disk.DiskBook`); the book decides what is present (a remote query
answered later, the disk's slot index at once) and makes the job's message, this object
keeps the per-request state machine, the CPU pins and the dedup:

1. The book starts a request's fetch: QUERYING (an answer is still to come) or, with
   the present prefix known, ANSWERED (:meth:`begin`, :meth:`answered`). Lookups answer
   None ("ask again") meanwhile.
2. :meth:`plan` allocates that many CPU blocks (as many as the CPU tier has room for)
   and has the book register the jobs, one command's worth each (``make``: a
   :class:`~kvshm.offload.jobs.RemoteJob` or its disk kind); FETCHING. A CPU pool with
   no room, or a source that no longer holds the blocks (``available``): DONE (counted).
3. A job completed on every rank without failure (:meth:`complete`): its blocks are
   indexed in the CPU tier (keys and depths from the job) and stay pinned for the
   request; once every job of the fetch is done it is FETCHED, until its next lookup,
   which finds an ordinary CPU hit and pins it itself (:meth:`hit`). A failed job frees
   its blocks unindexed: DONE, and the request is not fetched for again (failure = miss
   = recompute; what its other jobs read is indexed, so its next lookup hits up to the
   first block missing). A job whose request has moved on (it timed out, ended, was
   reset, another job of it failed) frees its blocks: they are indexed, so a later
   lookup may still hit them.

A job not done on every rank after ``fetch_timeout_s`` ends the request's wait (DONE,
counted); the job keeps its pins until it ends, and while it is out the tier is
:meth:`overdue` (the manager's lookups then start no new fetch from any lower tier,
and :meth:`plan` turns no answered one into a job).

Dedup: a lookup any of whose keys another request's job is fetching, or another
request's answered fetch is about to fetch (a prefix many requests share, asked in one
step), answers None until that job ends or times out (:meth:`being_fetched`).

Pins: every CPU block this object pins for a request is in :meth:`pinned` (FETCHED
blocks); jobs record their own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvshm.config import Eviction
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import RemoteJob
from kvshm.offload.pool import BlockPool

__all__ = ["Fetch", "FetchCounters", "FetchState", "Fetches", "MakeJob"]


class FetchState(Enum):
    """Where one request's fetch from a lower tier stands (module docstring)."""

    QUERYING = "querying"
    ANSWERED = "answered"
    FETCHING = "fetching"
    FETCHED = "fetched"
    DONE = "done"


#: The states in which the request's lookups answer None.
WAITING = frozenset((FetchState.QUERYING, FetchState.ANSWERED, FetchState.FETCHING))


@dataclass(slots=True, eq=False)
class Fetch:
    """One request's fetch: ``keys`` (CPU index keys, position-major from block
    ``start``), the answer's length in blocks, its jobs still out (a long answer is read
    by several, each one command's worth), the pins of those done (FETCHED once none is
    out); ``token``: the book's handle for an answer still to come (0: none)."""

    state: FetchState
    start: int
    keys: list[bytes]
    token: int
    since: float
    present: int = 0
    end: int = 0  # the block after the last one its jobs read (once planned)
    jobs: set[int] = field(default_factory=set)
    pinned: list[int] = field(default_factory=list)


class FetchCounters(Protocol):
    """The counters a :class:`Fetches` keeps, on its book's counter record (the
    remote tier's names: a disk READ is that tier's GET)."""

    asked_again: int
    fetch_timeouts: int
    get_jobs: int
    get_blocks: int
    get_failed_jobs: int
    get_failed_blocks: int
    get_abandoned_jobs: int
    get_declined_cpu_full: int
    get_declined_overdue: int
    get_capped: int
    hit_blocks: int


#: Registers the job of a planned fetch: (step, CPU ids, keys, depths, request id).
MakeJob = Callable[[int, list[int], list[bytes], list[int], str], RemoteJob]


def _all(keys: Sequence[bytes], n: int) -> int:
    return n


class Fetches:
    """See the module docstring. ``make`` registers a planned fetch's job in the job
    table; ``available(keys, n)``: how many of the first ``n`` keys the source still
    holds when the job is planned (default: all of them); ``allocate(n)``: takes the
    job's fresh CPU blocks (default ``cpu.allocate``; the disk tier's also writes down
    the cached blocks it evicts)."""

    def __init__(self, cpu: BlockPool, gs: GroupSet, counters: FetchCounters, make: MakeJob,
                 *, fetch_timeout_s: float, max_job_blocks: int,
                 clock: Callable[[], float] = time.monotonic,
                 available: Callable[[Sequence[bytes], int], int] = _all,
                 allocate: Callable[[int], list[int]] | None = None) -> None:
        self.cpu, self._gs, self.counters = cpu, gs, counters
        self._make, self._available = make, available
        self._allocate = allocate or cpu.allocate
        self._fetch_timeout = fetch_timeout_s
        self._max_job = max_job_blocks
        self._clock = clock
        self.reqs: dict[str, Fetch] = {}
        self._fetching: dict[bytes, int] = {}  # key -> job id
        self._fetch_since: dict[int, float] = {}  # job id -> when it was planned
        self._claimed: dict[bytes, str] = {}  # key -> the ANSWERED request to fetch it

    # ---- queries ---------------------------------------------------------------------

    def get(self, rid: str) -> Fetch | None:
        return self.reqs.get(rid)

    def pinned(self) -> Iterator[int]:
        """CPU ids pinned for FETCHED requests, with repeats."""
        for st in self.reqs.values():
            yield from st.pinned

    def pending(self) -> bool:
        """A fetch is answered but not planned: the next plan has work."""
        return any(st.state is FetchState.ANSWERED for st in self.reqs.values())

    def waiting(self, rid: str) -> bool:
        """Whether ``rid``'s fetch is under way (QUERYING, ANSWERED or FETCHING)."""
        st = self.reqs.get(rid)
        return st is not None and st.state in WAITING

    def overdue(self) -> bool:
        """A job planned more than the fetch timeout ago is still out: some rank is not
        serving this tier's jobs (stopped, stuck), and any new job, which every rank must
        ack, would wait on it too. O(1): jobs are kept in planning order, so the first is
        the oldest."""
        since = self._fetch_since
        if not since:
            return False
        return self._clock() - next(iter(since.values())) > self._fetch_timeout

    def being_fetched(self, keys: Sequence[bytes]) -> bool:
        """Whether a job not older than the fetch timeout is fetching any of ``keys``, or
        another request's answered fetch will (two requests may reach the same blocks
        from different starting positions, or in the same step)."""
        if self._claimed:
            reqs = self.reqs
            for k in keys:
                rid = self._claimed.get(k)
                if rid is not None:
                    st = reqs.get(rid)
                    if st is not None and st.state is FetchState.ANSWERED:
                        return True
        if not self._fetching:
            return False
        now = self._clock()
        for k in keys:
            job = self._fetching.get(k)
            if job is not None and now - self._fetch_since.get(job, 0.0) <= self._fetch_timeout:
                return True
        return False

    def _unclaim(self, rid: str, st: Fetch) -> None:
        if self._claimed:
            for k in st.keys[:st.present]:
                if self._claimed.get(k) == rid:
                    del self._claimed[k]

    # ---- the state machine -----------------------------------------------------------

    def begin(self, rid: str, start: int, keys: list[bytes], *, token: int = 0,
              present: int = 0) -> Fetch:
        """Start ``rid``'s fetch of ``keys`` (from block ``start``): QUERYING, or
        ANSWERED when ``present`` > 0 (the source answered at once)."""
        st = Fetch(FetchState.QUERYING, start, keys, token, self._clock())
        self.reqs[rid] = st
        if present > 0:
            self.answered(rid, st, present)
        return st

    def answered(self, rid: str, st: Fetch, n: int) -> None:
        """The source holds the first ``n`` blocks of ``rid``'s fetch ``st`` (> 0):
        claimed for it until its job is planned (or it ends)."""
        st.present, st.state = min(n, len(st.keys)), FetchState.ANSWERED
        claimed = self._claimed
        for k in st.keys[:st.present]:
            claimed[k] = rid

    def again(self, rid: str, st: Fetch) -> int | None:
        """A later lookup of ``rid`` (its fetch ``st`` exists): None while it runs, else
        0 after releasing its FETCHED pins (the caller found, or will find, the blocks as
        a CPU hit). A fetch past the fetch timeout ends the wait (counted)."""
        if self.still_waiting(rid):
            return None
        self.release(rid)
        return 0

    def still_waiting(self, rid: str) -> bool:
        """Whether ``rid``'s fetch is under way, nothing released: a fetch whose last
        progress (its planning, or one of its jobs done) is older than the fetch timeout
        ends its wait here (counted; its jobs keep their pins until they end)."""
        st = self.reqs.get(rid)
        if st is None:
            return False
        if (st.state is FetchState.FETCHING
                and self._clock() - st.since > self._fetch_timeout):
            self.counters.fetch_timeouts += 1
            st.state = FetchState.DONE
        return st.state in WAITING

    def reads_past(self, rid: str, end: int) -> bool:
        """Whether ``rid``'s jobs are still out and read past block ``end``: a CPU hit
        that ends there (what its first jobs read) must wait, or pinning it would end
        the fetch and the later jobs would complete for nobody (a review). A hit that
        covers what the jobs read is taken at once, as before."""
        st = self.reqs.get(rid)
        return (st is not None and st.state is FetchState.FETCHING and st.end > end
                and self.still_waiting(rid))

    def hit(self, rid: str) -> Fetch | None:
        """``rid``'s lookup is a CPU hit (pinned): its fetch ends here -- what it fetched
        is released, a job still running goes on unclaimed. Returns the fetch (the book
        drops an answer it still waits for)."""
        st = self.reqs.get(rid)
        if st is not None and st.state in WAITING:
            st.state = FetchState.DONE
        self.release(rid)
        return st

    def release(self, rid: str) -> None:
        """Drop ``rid``'s FETCHED pins (its lookup pinned what it hit meanwhile)."""
        st = self.reqs.get(rid)
        if st is not None and st.pinned:
            self.cpu.free(reversed(st.pinned))
            st.pinned = []

    def end(self, rid: str) -> Fetch | None:
        """The request ended (or a reset): its pins go and its fetch is forgotten; a job
        in flight completes unclaimed. Returns the forgotten fetch."""
        self.release(rid)
        st = self.reqs.pop(rid, None)
        if st is not None:
            self._unclaim(rid, st)
        return st

    def drop(self) -> list[Fetch]:
        """Reset or engine failure: :meth:`end` every fetch; returns them."""
        return [st for rid in list(self.reqs) if (st := self.end(rid)) is not None]

    # ---- plan and completion ---------------------------------------------------------

    def plan(self, step: int, *, overdue: bool = False) -> list[RemoteJob]:
        """This step's jobs: those of each ANSWERED fetch the CPU tier has room for.
        ``overdue``: a tier's read is past the fetch timeout and still out
        (``LowerTiers.overdue``): every ANSWERED fetch ends DONE instead
        (counted), for good, and its request recomputes -- a job would wait on the same
        rank."""
        out: list[RemoteJob] = []
        for rid, st in self.reqs.items():
            if st.state is FetchState.ANSWERED:
                if overdue:
                    self._unclaim(rid, st)
                    st.state = FetchState.DONE
                    self.counters.get_declined_overdue += 1
                    continue
                out += self._jobs(step, rid, st)
        return out

    def _jobs(self, step: int, rid: str, st: Fetch) -> list[RemoteJob]:
        """The jobs of ``rid``'s answered fetch: as much of the answer as the CPU tier
        has room for, in jobs of at most one command's worth (``max_job_blocks``, whole
        positions of every group) -- a long prompt's hit is read whole, not cut to the
        first job (counted ``get_capped`` only where the CPU tier's room cut it)."""
        self._unclaim(rid, st)
        g = self._gs.n
        chunk = self._max_job - self._max_job % g
        n = min(st.present, self.cpu.num_free) if chunk > 0 else 0
        n -= n % g
        if 0 < n < st.present:
            self.counters.get_capped += 1  # no CPU room for the rest: it is recomputed
        if n <= 0:
            self.counters.get_declined_cpu_full += 1
            st.state = FetchState.DONE
            return []
        n = self._available(st.keys, n)
        n -= n % g
        if n <= 0:  # the book counted why
            st.state = FetchState.DONE
            return []
        now = self._clock()
        out = []
        for lo in range(0, n, chunk):
            keys = st.keys[lo:min(n, lo + chunk)]
            depths = [st.start + i // g for i in range(lo, lo + len(keys))]
            job = self._make(step, self._allocate(len(keys)), keys, depths, rid)
            for k in keys:
                self._fetching[k] = job.job_id
            self._fetch_since[job.job_id] = now
            st.jobs.add(job.job_id)
            out.append(job)
            self.counters.get_jobs += 1
        st.state, st.since, st.end = FetchState.FETCHING, now, st.start + n // g
        self.counters.get_blocks += n
        return out

    def complete(self, job: RemoteJob, usable: bool) -> bool:
        """``job`` is done on every rank (it left the job table). ``usable``: it did not
        fail and its result may be used (not abandoned, the engine not failed). True when
        it was its request's last job out and the request is FETCHED.

        A job done is progress of its request's read: the jobs of the request still out
        (queued behind it on the ranks) have their clocks restarted, for the request's
        timeout and for :meth:`overdue` (a healthy read of many jobs is measured job by
        job, not as a whole against a timeout sized for one)."""
        for k in job.keys:
            if self._fetching.get(k) == job.job_id:
                del self._fetching[k]
        self._fetch_since.pop(job.job_id, None)
        st = self.reqs.get(job.req_id)
        ours = st is not None and job.job_id in st.jobs
        mine = ours and st is not None and st.state is FetchState.FETCHING  # not timed out
        if ours:
            assert st is not None
            st.jobs.discard(job.job_id)
            self._progress(st)
        cpu = self.cpu
        if not usable:
            if job.abandoned and not job.nacked:  # a reset's: not a failure
                self.counters.get_abandoned_jobs += 1
            else:
                self.counters.get_failed_jobs += 1
                self.counters.get_failed_blocks += len(job.cpu_ids)
            cpu.free(reversed(job.cpu_ids))
            if mine:  # the request waits no more: what its other jobs read is indexed
                assert st is not None  # (a CPU hit up to the first block missing)
                st.state = FetchState.DONE
            return False
        for c, k, d in zip(job.cpu_ids, job.keys, job.depths):
            cpu.add_hashes(c, (k,))
            if cpu.eviction is not Eviction.LRU:
                cpu.set_depth(c, d)
        self.counters.hit_blocks += len(job.cpu_ids)
        if mine:
            assert st is not None
            st.pinned += job.cpu_ids
            if st.jobs:
                return False
            st.state = FetchState.FETCHED
            return True
        cpu.free(reversed(job.cpu_ids))
        return False

    def _progress(self, st: Fetch) -> None:
        """One of ``st``'s jobs is done: its wait and its other jobs' clocks restart
        (moved to the end of the planning order, which stays oldest first)."""
        if not st.jobs:
            return
        now = self._clock()
        st.since = now
        since = self._fetch_since
        for j in st.jobs:
            if since.pop(j, None) is not None:
                since[j] = now
