"""The local disk tier on the scheduler side: which CPU blocks go down to the slabs,
which slots come back, and when a slot may be read or reused. Sans-IO: the bytes move on
the workers (``kvshm.ipc.protocol.Disk`` jobs, one per step and kind to every rank,
acked by an ordinary ``Done`` per rank), each rank between its host rows and its own slab
file (``Ready.disk``).

The slot table is a :class:`~kvshm.offload.pool.BlockPool` of one record per slot (the
same rank-independent slot number on every rank): its hash index says which block a
slot holds (the block's 32-byte disk hash, :func:`disk_hash`), its ref counts are the
pins of the jobs that use a slot, and its LRU free queue says which slot a write reuses
first (an unindexed slot, else the least recently written or read block).

Write-back (``plan``): the cached CPU blocks among the next ``window`` blocks the CPU
tier's own eviction order would reuse (:meth:`BlockPool.iter_free_from_lru`: the order
-- depth_aged by default -- is the value; an uncached block is worth nothing, a block
the disk holds or is writing is skipped) are pinned in the CPU pool and written to
fresh slots (WRITE jobs to every rank of at most ``max_job_blocks`` blocks; at most
``max_window`` blocks in flight). The window follows the pressure: twice the cached
blocks the CPU tier evicted since the last plan (halving each plan without evictions),
at least ``window`` and at most ``max_window``; a scan costs about 2 us a block, so an
idle tier scans 16, and a step whose stores evict many scans ahead as many as they
take. Only when every rank acked ok is each slot indexed under
its block's hash; the CPU pin goes in every case, and a written block returns to the CPU
tier's free set as the next to reuse (``evict_first``: it was about to be evicted and
the disk holds it now). A failed write leaves its slots unindexed (reused first); three
failed writes in a row (a full or failing disk: ENOSPC, EIO) pause write-back for
``pause_s`` (counted), while reads and serving go on.

Write-down of victims (every mode): a CPU block the tier evicts to make room -- for a
store (the manager's plan) or for a READ (:meth:`_allocate_read`) -- whose block the
disk neither holds nor is writing is written down by a WRITE job of its own
(:meth:`write_victims`) in the same call, before the block is reused: the WRITE pins
the CPU block beside its new owner (ref 2) and is posted *before* the store or READ
that overwrites its rows (``StepPlan.disk`` goes out before ``StepPlan.store``; a
lookup's READs after their victims' WRITEs), and each rank runs a copy or READ into a
row only after every WRITE it received earlier that reads the row
(:mod:`workers.disk_mover`'s row fence). So no cached block leaves the CPU tier
unwritten while write-back has not reached it: the scan is the early, spread-out
write; this is the last chance. Counted: ``evicted_on_disk`` (the disk had it),
``evicted_written`` (written down now), ``evicted_lost`` (not: write-back paused, or
no free slot). A remote GET's allocation is not covered (no disk victims there).

Write-through (``write_through``, ``EngineConfig.disk_mode``): every block a store
indexes in the CPU tier is also remembered (not pinned: at most ``4 x max_window``, the
oldest forgotten) and written by the next plans, before the eviction scan, if its CPU
block still holds it then; such a block returns to the CPU tier's free set as any freed
block does (it was not about to be evicted). The disk then holds what the CPU tier
holds, so a restart finds it too; the eviction scan still covers the rest.

Read path: the state machine of :class:`~kvshm.offload.fetches.Fetches`, shared with the
remote tier. The manager asks the disk after the CPU tier (order CPU -> disk ->
remote):

* a CPU miss at block ``s`` (:meth:`lookup`): the disk's longest present prefix from
  ``s``; > 0: ANSWERED, and the lookup answers None ("ask again");
* a CPU hit that ends at ``e`` short of what the request could use (:meth:`extend`):
  the disk's prefix from ``e``; > 0: the CPU hit is held (pinned here: the READ's CPU
  allocation must not evict the prefix it extends) and the lookup answers None. Any
  answer of a later lookup releases the hold (:meth:`unhold`).

The next plan allocates fresh CPU blocks and sends a READ (slots pinned); done on every
rank without failure: the blocks are indexed in the CPU tier and held for the request
until its next lookup, an ordinary CPU hit. A READ that failed on a rank
(``WORKER_FAILED``: a header or CRC mismatch, an I/O error) drops its slots from the
index (suspect) -- a miss, recomputed. Never both: a slot being written carries no hash
(never read), a slot being read is pinned (never reused by a write).

Rank death and reset: disk jobs are jobs (:class:`~kvshm.offload.jobs.DiskJob`, a
:class:`~kvshm.offload.jobs.RemoteJob`): they fail at once and keep their CPU and slot
pins until every rank acked or was fenced (quarantine). ``reset`` forgets every slot's
hash (:meth:`drop_index`): the engine's KV may have changed meaning.

Pins: every CPU block this book pins outside a job is in :meth:`pinned` (held prefixes
and FETCHED blocks); every slot pin is a job's (:meth:`check_invariants`).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from itertools import islice
from typing import Final

from kvshm.ipc.protocol import Disk, DiskOp, pack_ids
from kvshm.offload.fetches import Fetches
from kvshm.offload.groups import GroupSet
from kvshm.offload.hits import Hit
from kvshm.offload.jobs import DiskJob, JobTable, RemoteJob
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import REMOTE_HASH_BYTES, remote_hash
from kvshm.types import LoadFailure

__all__ = ["DISK_HASH_BYTES", "MAX_DISK_BLOCKS", "DiskBook", "DiskCounters", "disk_hash",
           "max_disk_blocks", "message"]

#: Most blocks one Disk job moves.
MAX_DISK_BLOCKS: Final = 128
#: Length of every block hash a Disk message and a slot header carry.
DISK_HASH_BYTES: Final = REMOTE_HASH_BYTES
#: Encoded bytes of a Disk command besides its ids, slots and hashes.
DISK_OVERHEAD: Final = 64
#: Failed WRITE jobs in a row that pause write-back.
WRITE_FAILURES_TO_PAUSE: Final = 3

disk_hash = remote_hash
"""The hash a slot header and a Disk message carry for CPU index key ``key`` (the key
itself when it is 32 bytes, else its BLAKE2b digest: one length for every slot)."""


def max_disk_blocks(max_record: int) -> int:
    """The most blocks one Disk command may carry to fit a ring record of
    ``max_record`` bytes (a 4-byte CPU id, a 4-byte slot and a hash each)."""
    return max(1, min(MAX_DISK_BLOCKS,
                      (max_record - DISK_OVERHEAD) // (8 + DISK_HASH_BYTES)))


def message(job: DiskJob) -> Disk:
    """The Disk command of ``job`` (every rank gets the same)."""
    hashes = b"".join(disk_hash(k) for k in job.keys)
    return Disk(job.job_id, DiskOp.WRITE if job.put else DiskOp.READ, pack_ids(job.cpu_ids),
                pack_ids(job.slots), hashes, DISK_HASH_BYTES)


@dataclass(slots=True)
class DiskCounters:
    """Monotonic counters of the disk book (``EngineStats.disk``). The read path's
    names are the remote tier's (:class:`~kvshm.offload.fetches.FetchCounters`): a
    ``get`` is a READ job."""

    lookups: int = 0  # the disk was asked (after the CPU tier)
    lookup_hits: int = 0  # ... and held a prefix: a READ follows
    lookup_misses: int = 0  # ... and held nothing
    asked_again: int = 0  # another request's READ was fetching the same blocks
    fetch_timeouts: int = 0
    get_jobs: int = 0
    get_blocks: int = 0
    get_failed_jobs: int = 0
    get_failed_blocks: int = 0
    get_declined_cpu_full: int = 0
    get_declined_gone: int = 0  # the slots lost their blocks between lookup and plan
    get_capped: int = 0
    hit_blocks: int = 0  # blocks read back and indexed in the CPU tier
    dropped_slots: int = 0  # slots of failed READs, dropped as suspect
    write_jobs: int = 0
    write_blocks: int = 0
    written_blocks: int = 0  # indexed: every rank acked the WRITE
    write_failed_jobs: int = 0
    write_failed_blocks: int = 0
    write_declined_no_slot: int = 0  # blocks not written back: every slot pinned
    write_backpressure: int = 0  # plans that wrote nothing: the in-flight cap was reached
    writes_paused: int = 0  # write-back paused after repeated failed WRITEs
    write_skipped_paused: int = 0  # plans that wrote nothing while paused
    write_through_dropped: int = 0  # stored blocks forgotten before their write (queue full)
    evicted_on_disk: int = 0  # cached CPU blocks evicted that the disk held or was writing
    evicted_written: int = 0  # ... that it did not: written down before their reuse
    evicted_lost: int = 0  # ... and could not be written (paused, no free slot)
    warm_slots: int = 0  # slots indexed at start from the slabs' headers
    warm_disagreed: int = 0  # slots with a header on some rank that not every rank agrees on
    scan_errors: int = 0  # slab files unreadable at start (started cold)

    def as_dict(self) -> dict[str, int]:
        """Every counter by name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


class DiskBook:
    """See the module docstring. ``slots``: the slot table (one record per slot, LRU);
    ``window``: the fewest CPU free-set blocks a write-back scan looks at (default 16);
    ``max_window``: the most, also the most blocks being written at once (default
    ``clamp(num_blocks // 4, window, 4096)``)."""

    def __init__(self, cpu: BlockPool, gs: GroupSet, jobs: JobTable, slots: BlockPool, *,
                 window: int | None = None, max_window: int | None = None,
                 max_job_blocks: int = MAX_DISK_BLOCKS,
                 fetch_timeout_s: float = 15.0, pause_s: float = 30.0,
                 write_through: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu, self._gs, self._jobs, self.slots = cpu, gs, jobs, slots
        self.counters = DiskCounters()
        self._window = window or 16
        self._max_window = max_window or max(self._window, min(cpu.num_blocks // 4, 4096))
        self._pressure = 0  # cached CPU blocks evicted lately (halved each plan)
        self._evictions = cpu.evictions
        self._max_job = max(1, max_job_blocks)
        self._pause_s = pause_s
        self._clock = clock
        self.fetches = Fetches(cpu, gs, self.counters, self._new_read,
                               fetch_timeout_s=fetch_timeout_s, max_job_blocks=self._max_job,
                               clock=clock, available=self._available,
                               allocate=self._allocate_read)
        self._held: dict[str, list[int]] = {}  # request -> CPU hit held while it reads
        self._writing: set[bytes] = set()  # disk hashes being written
        self._inflight = 0  # blocks being written
        self._failures = 0  # failed WRITE jobs in a row
        self._paused_until = 0.0
        self.write_through = write_through
        self._fresh: deque[tuple[int, bytes]] = deque()  # stored, to write through
        self._scan_jobs: set[int] = set()  # WRITE jobs of blocks about to be evicted
        self._victims: list[tuple[int, bytes]] = []  # evicted by READs, not yet written

    # ---- queries ---------------------------------------------------------------------

    def pinned(self) -> list[int]:
        """CPU ids this book pins outside its jobs (held prefixes, FETCHED blocks)."""
        out = list(self.fetches.pinned())
        for ids in self._held.values():
            out.extend(ids)
        return out

    def has_pending_work(self) -> bool:
        """READs answered but not planned: the next plan has work."""
        return self.fetches.pending()

    def quarantined_slots(self) -> int:
        """Slots pinned only by jobs that wait for a revoked, unfenced rank."""
        revoked = self._jobs.revoked
        if not revoked:
            return 0
        return len({s for job in self._jobs.jobs.values()
                    if isinstance(job, DiskJob) and not revoked.isdisjoint(job.waiting)
                    for s in job.slots})

    def _present(self, keys: Sequence[bytes]) -> list[int]:
        """The slots of the longest prefix of ``keys`` the disk holds."""
        get = self.slots.get_cached
        out: list[int] = []
        for k in keys:
            s = get(disk_hash(k))
            if s is None:
                break
            out.append(s)
        return out

    # ---- read path -------------------------------------------------------------------

    def lookup(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int) -> int | None:
        """A CPU miss at block ``start``: None while the disk reads this request's
        blocks (or another request's READ fetches them), else 0 (what it read is then an
        ordinary CPU hit). ``n_max``: blocks after ``start`` the hit may cover."""
        st = self.fetches.get(rid)
        if st is not None:
            return self.fetches.again(rid, st)
        return self._begin(rid, hashes, start, min(start + n_max, len(hashes)))

    def extend(self, rid: str, hashes: Sequence[bytes], hit: Hit, end: int) -> bool:
        """A CPU hit ``hit`` that ends before block ``end`` (the most the request may
        use): True while the disk reads what follows it, the hit held meanwhile; False:
        the hit stands as it is (nothing on disk, or the read is over)."""
        st = self.fetches.get(rid)
        if st is not None:
            return self.fetches.again(rid, st) is None
        end = min(end, len(hashes))
        if hit.end >= end or self._begin(rid, hashes, hit.end, end) is not None:
            return False
        self._hold(rid, hit.pinned)
        return True

    def _begin(self, rid: str, hashes: Sequence[bytes], start: int, end: int) -> int | None:
        if end <= start or not self.slots.num_hashes:
            return 0
        self.counters.lookups += 1
        keys = self._gs.keys(hashes, start, end)
        n = len(self._present(keys))
        n -= n % self._gs.n
        if n <= 0:
            self.counters.lookup_misses += 1
            return 0
        if self.fetches.being_fetched(keys[:n]):  # wait, as long as its own request would
            self.counters.asked_again += 1
            return None
        self.counters.lookup_hits += 1
        self.fetches.begin(rid, start, keys, present=n)
        return None

    def _hold(self, rid: str, cpu_ids: Sequence[int]) -> None:
        """Pin ``rid``'s CPU hit while its READ runs (a hold already there is replaced)."""
        self.cpu.touch(cpu_ids)
        old = self._held.pop(rid, None)
        if old:
            self.cpu.free(reversed(old))
        self._held[rid] = list(cpu_ids)

    def unhold(self, rid: str) -> None:
        """``rid``'s lookup answered: the hit it held is released (it pinned what it hit)."""
        ids = self._held.pop(rid, None)
        if ids:
            self.cpu.free(reversed(ids))

    def hit(self, rid: str) -> None:
        """``rid``'s lookup is a CPU hit (pinned): its disk read ends here; what it read
        is released (the hit pins it now), a READ still running goes on unclaimed."""
        self.fetches.hit(rid)

    def forget(self, rid: str) -> None:
        """The request ended: its hold and fetched pins go; a READ in flight completes
        unclaimed."""
        self.unhold(rid)
        self.fetches.end(rid)

    def _available(self, keys: Sequence[bytes], n: int) -> int:
        got = len(self._present(keys[:n]))
        if got < n:
            self.counters.get_declined_gone += 1
        return got

    def _allocate_read(self, n: int) -> list[int]:
        """A READ's fresh CPU blocks; the cached ones it evicts wait in ``_victims`` for
        :meth:`plan_reads` to write them down (before the READ is posted)."""
        return self.cpu.allocate(n, self._victims)

    def _new_read(self, step: int, cpu_ids: list[int], keys: list[bytes], depths: list[int],
                  rid: str) -> RemoteJob:
        slots = self._present(keys)
        assert len(slots) == len(keys), "a READ planned for slots that are gone"
        self.slots.touch(slots)
        return self._jobs.new_disk(step, cpu_ids, keys, depths, slots, write=False,
                                   req_id=rid)

    # ---- plan ------------------------------------------------------------------------

    def plan(self, step: int) -> list[Disk]:
        """This step's disk jobs: READs for answered lookups, then write-back."""
        return self.plan_reads(step) + self._write_back(step)

    def plan_reads(self, step: int) -> list[Disk]:
        """READs for the lookups answered since the last plan (the manager calls it from
        a lookup too, so that a READ is posted at once, not at the next step), each
        preceded by the WRITEs of the cached blocks its allocation evicted (post them in
        this order)."""
        reads = [message(job) for job in self.fetches.plan(step) if isinstance(job, DiskJob)]
        victims, self._victims = self._victims, []
        return self.write_victims(step, victims) + reads

    def write_victims(self, step: int, victims: Sequence[tuple[int, bytes]]) -> list[Disk]:
        """WRITE jobs of ``victims`` (CPU id, key: the cached blocks an allocation just
        evicted; the ids now belong to a store or READ planned in the same call) that
        the disk neither holds nor is writing, pinned here until written. Post them
        before the job that reuses their rows: each rank runs it after them (module
        docstring). Never raises: a block without a free slot, or while write-back is
        paused, is lost (counted)."""
        if not victims:
            return []
        c = self.counters
        writing, on_disk = self._writing, self.slots.cached_keys
        picks = [(cid, k) for cid, k in victims
                 if disk_hash(k) not in writing and disk_hash(k) not in on_disk]
        c.evicted_on_disk += len(victims) - len(picks)
        if not picks:
            return []
        if self._paused_until and self._clock() < self._paused_until:
            c.evicted_lost += len(picks)
            return []
        n = min(len(picks), self.slots.num_free)  # what _write_jobs takes
        c.evicted_written += n
        c.evicted_lost += len(picks) - n
        return self._write_jobs(step, picks, scan=False)

    def stored(self, cpu_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """A store completed and indexed ``cpu_ids`` under ``keys``: remembered for
        write-through (nothing without it)."""
        if not self.write_through:
            return
        fresh = self._fresh
        fresh.extend(zip(cpu_ids, keys))
        over = len(fresh) - 4 * self._max_window
        if over > 0:
            self.counters.write_through_dropped += over
            for _ in range(over):
                fresh.popleft()

    def _write_back(self, step: int) -> list[Disk]:
        if self._paused_until:
            if self._clock() < self._paused_until:
                self.counters.write_skipped_paused += 1
                return []
            self._paused_until = 0.0
        evicted = self.cpu.evictions - self._evictions
        self._evictions = self.cpu.evictions
        self._pressure = max(evicted, self._pressure // 2)
        budget = self._max_window - self._inflight
        if budget <= 0:
            self.counters.write_backpressure += 1
            return []
        window = min(self._max_window, max(self._window, 2 * self._pressure))
        chosen: set[bytes] = set()
        fresh = self._through(budget, chosen)
        scanned = self._candidates(window, budget - len(fresh), chosen)
        out = self._write_jobs(step, fresh, scan=False)
        return out + self._write_jobs(step, scanned, scan=True)

    def _write_jobs(self, step: int, picks: list[tuple[int, bytes]], *, scan: bool
                    ) -> list[Disk]:
        """WRITE jobs of ``picks`` into fresh slots (as many as there are free slots)."""
        n = min(len(picks), self.slots.num_free)
        if n < len(picks):
            self.counters.write_declined_no_slot += len(picks) - n
            picks = picks[:n]
        if not n:
            return []
        self.cpu.touch([c for c, _ in picks])
        slots = self.slots.allocate(n)  # the least recently used disk blocks go
        out: list[Disk] = []
        for i in range(0, n, self._max_job):
            batch = picks[i:i + self._max_job]
            keys = [k for _, k in batch]
            job = self._jobs.new_disk(step, [c for c, _ in batch], keys, [0] * len(batch),
                                      slots[i:i + self._max_job], write=True)
            if scan:
                self._scan_jobs.add(job.job_id)
            self._writing.update(disk_hash(k) for k in keys)
            self._inflight += len(batch)
            self.counters.write_jobs += 1
            self.counters.write_blocks += len(batch)
            out.append(message(job))
        return out

    def _through(self, budget: int, chosen: set[bytes]) -> list[tuple[int, bytes]]:
        """(CPU id, key) of the remembered stored blocks whose CPU block still holds
        them and that the disk neither holds nor is writing, at most ``budget``."""
        picks: list[tuple[int, bytes]] = []
        fresh, cpu = self._fresh, self.cpu
        writing, on_disk = self._writing, self.slots.cached_keys
        while fresh and len(picks) < budget:
            c, k = fresh.popleft()
            hs = cpu.block_hashes(c)
            if not hs or hs[0] != k:
                continue  # evicted (and reused) meanwhile
            d = disk_hash(k)
            if d in writing or d in on_disk or d in chosen:
                continue
            chosen.add(d)
            picks.append((c, k))
        return picks

    def _candidates(self, window: int, budget: int, chosen: set[bytes]
                    ) -> list[tuple[int, bytes]]:
        """(CPU id, key) of the cached blocks among the next ``window`` the CPU tier would
        reuse that the disk neither holds nor is writing (nor ``chosen``), at most
        ``budget``, in the order they would go."""
        picks: list[tuple[int, bytes]] = []
        if budget <= 0:
            return picks
        cpu, writing, on_disk = self.cpu, self._writing, self.slots.cached_keys
        for c in islice(cpu.iter_free_from_lru(), window):
            hs = cpu.block_hashes(c)
            if not hs:
                continue
            d = disk_hash(hs[0])
            if d in writing or d in on_disk or d in chosen:
                continue
            chosen.add(d)
            picks.append((c, hs[0]))
            if len(picks) >= budget:
                break
        return picks

    # ---- completion ------------------------------------------------------------------

    def complete(self, job: DiskJob, usable: bool) -> None:
        """``job`` is done on every rank (it left the job table). ``usable``: it did not
        fail and its result may be used (not abandoned, the engine not failed)."""
        if job.put:
            self._write_done(job, usable)
        else:
            self._read_done(job, usable)

    def _write_done(self, job: DiskJob, usable: bool) -> None:
        self._writing.difference_update(disk_hash(k) for k in job.keys)
        self._inflight -= len(job.keys)
        slots = self.slots
        if usable:
            for s, k in zip(job.slots, job.keys):
                slots.add_hashes(s, (disk_hash(k),))
            self.counters.written_blocks += len(job.keys)
            self._failures = 0
        else:
            self.counters.write_failed_jobs += 1
            self.counters.write_failed_blocks += len(job.keys)
            if job.cause is LoadFailure.WORKER_FAILED:
                self._failures += 1
                if self._failures >= WRITE_FAILURES_TO_PAUSE:
                    self._failures = 0
                    self.counters.writes_paused += 1
                    self._paused_until = self._clock() + self._pause_s
        slots.free(job.slots)  # indexed: most recently used; unindexed: reused first
        scan = job.job_id in self._scan_jobs
        self._scan_jobs.discard(job.job_id)
        self.cpu.free(reversed(job.cpu_ids), evict_first=usable and scan)

    def _read_done(self, job: DiskJob, usable: bool) -> None:
        if not usable and job.cause is LoadFailure.WORKER_FAILED:
            for s in job.slots:  # a header, CRC or I/O failure on some rank: suspect
                if self.slots.block_hashes(s):
                    self.slots.remove_hashes(s)
                    self.counters.dropped_slots += 1
        self.slots.free(job.slots)
        self.fetches.complete(job, usable)

    # ---- reset, failure, start -------------------------------------------------------

    def drop(self) -> None:
        """Reset or engine failure: unpin every hold and FETCHED block, forget every read
        (READs in flight complete unclaimed)."""
        for rid in list(self._held):
            self.unhold(rid)
        self.fetches.drop()
        self._fresh.clear()

    def drop_index(self) -> None:
        """Reset: no slot holds a block any more (slots pinned by jobs stay pinned)."""
        self.slots.drop_all_hashes()

    def warm(self, found: Mapping[int, bytes]) -> None:
        """Index the slots the slabs' headers agree on at start (slot -> disk hash), as
        the most recently used; the CPU tier is empty."""
        slots = self.slots
        ids = sorted(s for s in found if 0 <= s < slots.num_blocks)
        if not ids:
            return
        slots.touch(ids)
        for s in ids:
            slots.add_hashes(s, (found[s],))
        slots.free(ids)
        self.counters.warm_slots += len(ids)

    def statistics(self) -> dict[str, int]:
        """Occupancy (slots total, indexed, pinned) and every counter."""
        out = {"slots": self.slots.num_blocks, "slots_used": self.slots.num_hashes,
               "slots_pinned": self.slots.num_pinned, "slot_evictions": self.slots.evictions}
        out.update(self.counters.as_dict())
        return out

    # ---- checks ----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """O(slots) consistency check for tests; AssertionError names the fault: the slot
        table's own invariants; every slot pin is a disk job's; no slot is written by two
        jobs, or written and read at once; a slot being written carries no hash; the
        keys being written and the in-flight count match the WRITE jobs."""
        self.slots.check_invariants()
        pins: Counter[int] = Counter()
        writes: Counter[int] = Counter()
        reads: set[int] = set()
        writing: set[bytes] = set()
        inflight = 0
        for job in self._jobs.jobs.values():
            if not isinstance(job, DiskJob):
                continue
            if len(job.slots) != len(job.cpu_ids):
                raise AssertionError(f"disk job {job.job_id}: {len(job.slots)} slots for "
                                     f"{len(job.cpu_ids)} CPU ids")
            pins.update(job.slots)
            if job.put:
                writes.update(job.slots)
                writing.update(disk_hash(k) for k in job.keys)
                inflight += len(job.keys)
            else:
                reads.update(job.slots)
        for s in range(self.slots.num_blocks):
            if self.slots.ref_cnt(s) != pins.get(s, 0):
                raise AssertionError(f"slot {s}: ref {self.slots.ref_cnt(s)}, jobs pin it "
                                     f"{pins.get(s, 0)} time(s)")
        for s, n in writes.items():
            if n > 1 or s in reads:
                raise AssertionError(f"slot {s} written by {n} job(s) and read: "
                                     f"{s in reads}")
            if self.slots.block_hashes(s):
                raise AssertionError(f"slot {s} is being written but carries a hash")
        ids = {j for j, job in self._jobs.jobs.items() if isinstance(job, DiskJob) and job.put}
        if not self._scan_jobs <= ids:
            raise AssertionError(f"scan WRITE jobs {sorted(self._scan_jobs - ids)} are gone")
        if writing != self._writing or inflight != self._inflight:
            raise AssertionError(f"keys being written {len(self._writing)} / in flight "
                                 f"{self._inflight}, WRITE jobs say {len(writing)} / "
                                 f"{inflight}")
