"""The remote tier on the scheduler side: what to put, what to fetch, when a block is ready.

Sans-IO but for one injected object, a :class:`~kvshm.remote.tier.ReadyIndex`, which
never blocks (``publish`` and ``query`` enqueue; ``answers`` pops). The manager calls
this book; the bytes move on the workers as :class:`~kvshm.offload.jobs.RemoteJob` s
(``kvshm.ipc.protocol.Remote`` messages), acked like copies.

Write path (``RemoteMode.WRITE_THROUGH``): a store job that completed on every rank
hands its newly indexed CPU blocks to :meth:`RemoteBook.stored`; each block whose key is
neither published by this engine nor queued or in flight is pinned and queued; the next
:meth:`RemoteBook.plan` makes one PUT job of at most :data:`MAX_PUT_BLOCKS`. When the PUT
completed on every rank without failure, the blocks' readiness keys are published (so a
reader never sees half a block: the all-ranks rule of local stores) and the pins go.
``ON_EVICT`` queues instead the unpublished cached blocks among the next ones the CPU
tier would reuse (a window of ``max(8, num_blocks // 16)`` at the eviction end, scanned
by a plan with no such PUT in flight). The PUT's pin takes a block out of the eviction
order and its release puts it back as recently used: a second chance, once per block
(published blocks are skipped by later scans), like CLOCK.

Read path, for a request whose CPU-tier hit is 0 (a CPU hit never waits for the remote):

1. :meth:`lookup` queries the readiness keys of the blocks after the local hit and
   answers None ("ask again"); QUERYING.
2. The answer (polled on each lookup and plan) gives the present prefix; 0: DONE.
3. The next :meth:`plan` allocates that many CPU blocks and makes a GET job; FETCHING
   (lookups answer None). A CPU pool with no room: DONE (counted).
4. The GET completed on every rank without failure: the blocks are indexed in the CPU
   tier and stay pinned for the request (FETCHED) until its next lookup, which finds an
   ordinary CPU hit and pins it itself. A failed GET frees its blocks unindexed: DONE,
   and the request is never asked for again (failure = miss = recompute).

A query that has no answer after ``answer_timeout_s`` ends DONE (counted): a request
never waits on the remote for longer. Dedup: a key is never put twice by one engine
(published, queued or in flight), nor fetched twice at once (a lookup whose first key is
being fetched by another request answers None until that GET ends).

Pins: every CPU block this book pins is recorded in :meth:`pinned` (queued PUTs, FETCHED
requests); jobs record their own. Remote hashes: each block's key in the remote tier is
its CPU index key when that is :data:`REMOTE_HASH_BYTES` long, else a BLAKE2b digest of
it of that length (group-qualified keys are longer), so a Remote message carries hashes
of one length.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from itertools import islice
from typing import Any, Final

from kvshm.config import Eviction, RemoteMode
from kvshm.ipc.protocol import Remote, RemoteOp, pack_ids
from kvshm.offload.groups import GroupSet
from kvshm.offload.handoff import Handoffs, Verdict
from kvshm.offload.jobs import JobTable, RemoteJob
from kvshm.offload.pool import BlockPool
from kvshm.remote.tier import ReadyIndex

__all__ = ["MAX_PUT_BLOCKS", "REMOTE_HASH_BYTES", "RemoteBook", "RemoteCounters",
           "RemoteState"]

#: Most blocks one PUT job moves (several jobs go out in one step when more are queued).
MAX_PUT_BLOCKS: Final = 128
#: PUT jobs one plan makes at most (the rest wait for the next step).
MAX_PUT_JOBS: Final = 4
#: Length of every block hash a Remote message carries.
REMOTE_HASH_BYTES: Final = 32
#: Keys this engine remembers as published (oldest forgotten first: re-put, harmless).
PUBLISHED_MEMORY: Final = 1 << 20


class RemoteState(Enum):
    """Where one request's remote lookup stands (module docstring, read path)."""

    QUERYING = "querying"
    ANSWERED = "answered"
    FETCHING = "fetching"
    FETCHED = "fetched"
    DONE = "done"


@dataclass(slots=True)
class RemoteCounters:
    """Monotonic counters of the remote book (``EngineStats.remote``)."""

    queries: int = 0
    query_hits: int = 0
    query_misses: int = 0
    query_timeouts: int = 0
    answers_stale: int = 0
    skipped_unhealthy: int = 0
    asked_again: int = 0
    get_jobs: int = 0
    get_blocks: int = 0
    get_failed_jobs: int = 0
    get_failed_blocks: int = 0
    get_declined_cpu_full: int = 0
    hit_blocks: int = 0
    put_jobs: int = 0
    put_blocks: int = 0
    put_failed_blocks: int = 0
    put_skipped_duplicate: int = 0
    published_blocks: int = 0

    def as_dict(self) -> dict[str, int]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(slots=True, eq=False)
class _Lookup:
    """One request's remote lookup: ``keys`` (CPU index keys, position-major from
    block ``start``), the answer's length in blocks, the GET job, the FETCHED pins."""

    state: RemoteState
    start: int
    keys: list[bytes]
    token: int
    since: float
    present: int = 0
    job_id: int = 0
    pinned: list[int] = field(default_factory=list)


def remote_hash(key: bytes) -> bytes:
    """The block hash a Remote message and a readiness key carry for CPU index ``key``."""
    if len(key) == REMOTE_HASH_BYTES:
        return key
    return hashlib.blake2b(key, digest_size=REMOTE_HASH_BYTES).digest()


class RemoteBook:
    """See the module docstring. ``ready_key(h)``: the readiness key of remote hash
    ``h`` (:func:`kvshm.remote.tier.ready_key` with the engine's fingerprint)."""

    def __init__(self, cpu: BlockPool, gs: GroupSet, jobs: JobTable, index: ReadyIndex,
                 ready_key: Callable[[bytes], str], *, mode: RemoteMode,
                 answer_timeout_s: float = 2.0, evict_window: int | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 handoffs: Handoffs | None = None) -> None:
        self.cpu, self._gs, self._jobs, self.index = cpu, gs, jobs, index
        self._ready_key = ready_key
        self.mode = mode
        self._timeout = answer_timeout_s
        self._window = evict_window or max(8, cpu.num_blocks // 16)
        self._evict_puts = 0  # ON_EVICT PUT jobs in flight
        self._clock = clock
        self.counters = RemoteCounters()
        self._reqs: dict[str, _Lookup] = {}
        self._tokens: dict[int, str] = {}
        self._next_token = 1
        self._puts: list[tuple[int, bytes, int, bool]] = []  # (cpu id, key, depth, keep)
        self._put_keys: set[bytes] = set()  # queued or in flight
        self._published: OrderedDict[bytes, None] = OrderedDict()
        self._fetching: dict[bytes, int] = {}  # key -> GET job id
        self.pd = handoffs

    # ---- queries ---------------------------------------------------------------------

    def pinned(self) -> list[int]:
        """CPU ids this book pins (queued PUTs, FETCHED requests), with repeats."""
        out = [c for c, _, _, _ in self._puts]
        for st in self._reqs.values():
            out.extend(st.pinned)
        return out

    def has_pending_work(self) -> bool:
        """PUTs queued or GETs answered but not planned: the next plan has work."""
        return bool(self._puts) or any(st.state is RemoteState.ANSWERED
                                       for st in self._reqs.values())

    # ---- read path ---------------------------------------------------------------------

    def lookup(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int,
               params: Any = None) -> int | None:
        """A request whose CPU hit is 0: None while its remote lookup runs, else 0 (the
        blocks, once fetched, are an ordinary CPU hit). ``n_max``: blocks after
        ``start`` the hit may cover. A P/D hand-off (``params``) waits for its
        manifest first (:mod:`kvshm.offload.handoff`)."""
        self.poll()
        st = self._reqs.get(rid)
        if st is None:
            if self.pd is not None:
                verdict = self.pd.consume(rid, params, lambda: self._keys(hashes, 0,
                                                                          len(hashes)))
                if verdict is Verdict.WAIT:
                    return None
                if verdict is Verdict.REFUSED:
                    return 0
            return self._begin(rid, hashes, start, n_max)
        if st.state is RemoteState.QUERYING and self._clock() - st.since > self._timeout:
            self.counters.query_timeouts += 1
            self._tokens.pop(st.token, None)
            st.state = RemoteState.DONE
        if st.state in (RemoteState.QUERYING, RemoteState.ANSWERED, RemoteState.FETCHING):
            return None
        self.release(rid)
        return 0

    def _begin(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int) -> int | None:
        end = min(start + n_max, len(hashes))
        if end <= start:
            return 0
        if not self.index.healthy():
            self.counters.skipped_unhealthy += 1
            return 0
        keys = self._keys(hashes, start, end)
        if keys[0] in self._fetching:
            self.counters.asked_again += 1
            return None
        token = self._next_token
        self._next_token += 1
        self._tokens[token] = rid
        self._reqs[rid] = _Lookup(RemoteState.QUERYING, start, keys, token, self._clock())
        self.counters.queries += 1
        self.index.query(token, [self._ready_key(remote_hash(k)) for k in keys])
        return None

    def _keys(self, hashes: Sequence[bytes], start: int, end: int) -> list[bytes]:
        key = self._gs.key
        return [key(hashes[p], g) for p in range(start, end) for g in range(self._gs.n)]

    def poll(self) -> None:
        """Apply the index's answers (a stale one, for a request gone, is counted)."""
        for token, n in self.index.answers():
            rid = self._tokens.pop(token, None)
            st = self._reqs.get(rid) if rid is not None else None
            if st is None or st.state is not RemoteState.QUERYING:
                self.counters.answers_stale += 1
                continue
            n -= n % self._gs.n  # whole positions only
            if n <= 0:
                self.counters.query_misses += 1
                st.state = RemoteState.DONE
                continue
            self.counters.query_hits += 1
            st.present, st.state = min(n, len(st.keys)), RemoteState.ANSWERED

    def release(self, rid: str) -> None:
        """Drop ``rid``'s FETCHED pins (its lookup pinned what it hit meanwhile)."""
        st = self._reqs.get(rid)
        if st is not None and st.pinned:
            self.cpu.free(reversed(st.pinned))
            st.pinned = []

    def forget(self, rid: str) -> None:
        """The request is gone: its pins go; a GET in flight completes unclaimed."""
        self.release(rid)
        st = self._reqs.pop(rid, None)
        if st is not None:
            self._tokens.pop(st.token, None)
        if self.pd is not None:
            self.pd.forget(rid)

    # ---- write path --------------------------------------------------------------------

    def stored(self, cpu_ids: Sequence[int], keys: Sequence[bytes],
               depths: Sequence[int]) -> None:
        """A store completed and indexed ``cpu_ids`` under ``keys``: queue write-through."""
        every = self.mode is RemoteMode.WRITE_THROUGH
        pd = self.pd
        for i, (c, k) in enumerate(zip(cpu_ids, keys)):
            keep = pd is not None and pd.wants(k)
            if every or keep:
                self._queue_put(c, k, depths[i] if i < len(depths) else 0, keep)

    def publish(self, rid: str, keys: Sequence[bytes], num_tokens: int) -> dict[str, Any]:
        """A P/D prefill request finished: its hand-off's ``kv_transfer_params``. Its
        blocks cached here but not on the server are queued for a PUT now; the others
        come from its finish-time store (:meth:`stored`) or are there already."""
        assert self.pd is not None, "publish without hand-offs"
        params = self.pd.publish(rid, keys, num_tokens, self._published.__contains__)
        for k in keys:
            c = self.cpu.get_cached(k)
            if c is not None and self.pd.wants(k) and k not in self._put_keys:
                self._queue_put(c, k, 0, True)
        return params

    def _queue_put(self, c: int, k: bytes, depth: int, keep: bool = False) -> None:
        if k in self._put_keys or k in self._published:
            self.counters.put_skipped_duplicate += 1
            return
        self.cpu.touch((c,))
        self._put_keys.add(k)
        self._puts.append((c, k, depth, keep))

    def _scan_evictable(self) -> None:
        """ON_EVICT: queue the unpublished cached blocks the tier would reuse next."""
        picks: list[tuple[int, bytes]] = []
        for c in islice(self.cpu.iter_free_from_lru(), self._window):
            hs = self.cpu.block_hashes(c)
            if hs and hs[0] not in self._put_keys and hs[0] not in self._published:
                picks.append((c, hs[0]))
        for c, k in picks:
            self._queue_put(c, k, 0)

    # ---- plan and completion -------------------------------------------------------------

    def plan(self, step: int) -> list[Remote]:
        """This step's remote jobs: GETs for answered lookups, then PUTs."""
        self.poll()
        if self.pd is not None:
            self.pd.poll()
            self.pd.expire()
        out: list[Remote] = []
        for rid, st in self._reqs.items():
            if st.state is RemoteState.ANSWERED:
                msg = self._get_job(step, rid, st)
                if msg is not None:
                    out.append(msg)
        if self.mode is RemoteMode.ON_EVICT and not self._evict_puts:
            self._scan_evictable()
            self._evict_puts = -(-len(self._puts) // MAX_PUT_BLOCKS)
        for _ in range(MAX_PUT_JOBS):
            if not self._puts:
                break
            keep = self._puts[0][3]  # one job: all kept (hand-off) or all ordinary
            batch: list[tuple[int, bytes, int, bool]] = []
            rest: list[tuple[int, bytes, int, bool]] = []
            for p in self._puts:
                (batch if p[3] is keep and len(batch) < MAX_PUT_BLOCKS else rest).append(p)
            self._puts = rest
            job = self._jobs.new_remote(step, [c for c, _, _, _ in batch],
                                        [k for _, k, _, _ in batch],
                                        [d for _, _, d, _ in batch], put=True, keep=keep)
            self.counters.put_jobs += 1
            self.counters.put_blocks += len(batch)
            out.append(self._message(job, RemoteOp.PUT))
        return out

    def _get_job(self, step: int, rid: str, st: _Lookup) -> Remote | None:
        n = min(st.present, self.cpu.num_free)
        n -= n % self._gs.n
        if n <= 0:
            self.counters.get_declined_cpu_full += 1
            st.state = RemoteState.DONE
            return None
        keys = st.keys[:n]
        depths = [st.start + i // self._gs.n for i in range(n)]
        job = self._jobs.new_remote(step, self.cpu.allocate(n), keys, depths, put=False,
                                    req_id=rid)
        for k in keys:
            self._fetching[k] = job.job_id
        st.state, st.job_id = RemoteState.FETCHING, job.job_id
        self.counters.get_jobs += 1
        self.counters.get_blocks += n
        return self._message(job, RemoteOp.GET)

    @staticmethod
    def _message(job: RemoteJob, op: RemoteOp) -> Remote:
        hashes = b"".join(remote_hash(k) for k in job.keys)
        return Remote(job.job_id, op, pack_ids(job.cpu_ids), hashes, REMOTE_HASH_BYTES,
                      job.keep)

    def complete(self, job: RemoteJob, usable: bool) -> None:
        """``job`` is done on every rank (it left the job table). ``usable``: it did
        not fail and its result may be used (not abandoned, the engine not failed)."""
        if job.put:
            self._put_done(job, usable)
        else:
            self._get_done(job, usable)

    def _put_done(self, job: RemoteJob, usable: bool) -> None:
        self._put_keys.difference_update(job.keys)
        self._evict_puts = max(0, self._evict_puts - 1)
        try:
            if usable:
                self.index.publish([self._ready_key(remote_hash(k)) for k in job.keys],
                                   keep=job.keep)
                self._remember(job.keys)
                self.counters.published_blocks += len(job.keys)
            else:
                self.counters.put_failed_blocks += len(job.keys)
            if self.pd is not None:  # after the readiness keys: the manifest goes last
                self.pd.put_done(job.keys, usable)
        finally:
            self.cpu.free(reversed(job.cpu_ids))

    def _get_done(self, job: RemoteJob, usable: bool) -> None:
        for k in job.keys:
            if self._fetching.get(k) == job.job_id:
                del self._fetching[k]
        st = self._reqs.get(job.req_id)
        mine = st is not None and st.job_id == job.job_id
        if not usable:
            self.counters.get_failed_jobs += 1
            self.counters.get_failed_blocks += len(job.cpu_ids)
            self.cpu.free(reversed(job.cpu_ids))
            if mine:
                assert st is not None
                st.state = RemoteState.DONE
            return
        cpu = self.cpu
        for c, k, d in zip(job.cpu_ids, job.keys, job.depths):
            cpu.add_hashes(c, (k,))
            if cpu.eviction is not Eviction.LRU:
                cpu.set_depth(c, d)
        self._remember(job.keys)
        self.counters.hit_blocks += len(job.cpu_ids)
        if mine:
            assert st is not None
            st.state, st.pinned = RemoteState.FETCHED, list(job.cpu_ids)
            if self.pd is not None:
                self.pd.collected(job.req_id)
        else:
            cpu.free(reversed(job.cpu_ids))

    def _remember(self, keys: Sequence[bytes]) -> None:
        pub = self._published
        for k in keys:
            pub[k] = None
            pub.move_to_end(k)
        while len(pub) > PUBLISHED_MEMORY:
            pub.popitem(last=False)

    def drop(self) -> None:
        """Reset or engine failure: unpin queued PUTs and FETCHED blocks, forget every
        lookup (GET jobs in flight complete unclaimed; their blocks are freed)."""
        for c, k, _, _ in reversed(self._puts):
            self._put_keys.discard(k)
            self.cpu.free((c,))
        self._puts = []
        self._evict_puts = 0
        if self.pd is not None:
            self.pd.drop_all()
        for rid in list(self._reqs):
            self.forget(rid)
