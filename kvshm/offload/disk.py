"""The local disk tier on the scheduler side: which CPU blocks go down to the slabs,
which slots come back, and when a slot may be read or reused. Sans-IO: the bytes move on
the workers (``kvshm.ipc.protocol.Disk`` jobs, one per step and kind to every rank,
acked by an ordinary ``Done`` per rank), each rank between its host rows and its own slab
file (``Ready.disk``).

The slot table is a :class:`~kvshm.offload.pool.BlockPool` of one record per slot (the
same rank-independent slot number on every rank): its hash index says which block a
slot holds (the block's 32-byte disk hash,
:func:`~kvshm.offload.remote_puts.remote_hash`), its ref counts are the pins of the jobs
that use a slot, and its LRU free queue says which slot a write reuses first (an
unindexed slot, else the least recently written or read block).

Write path (:mod:`kvshm.offload.disk_writes`: the book holds one
:class:`~kvshm.offload.disk_writes.WriteBack`): write-back of the blocks the CPU tier
would evict next, write-down of the blocks an allocation evicts before write-back
reached them, write-through, and the pause of a failing disk. A slot is indexed only
when every rank acked its WRITE.

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
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Final

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import Disk
from kvshm.offload.disk_writes import WriteBack, message
from kvshm.offload.fetches import Fetches
from kvshm.offload.groups import GroupSet
from kvshm.offload.hits import Hit
from kvshm.offload.jobs import DiskJob, JobTable, RemoteJob
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import REMOTE_HASH_BYTES, remote_hash
from kvshm.types import LoadFailure

__all__ = ["MAX_DISK_BLOCKS", "DiskBook", "DiskCounters", "WarmTable", "max_disk_blocks",
           "warm_table"]

#: Most blocks one Disk job moves.
MAX_DISK_BLOCKS: Final = 128
#: Encoded bytes of a Disk command besides its ids, slots and hashes.
DISK_OVERHEAD: Final = 64


def max_disk_blocks(max_record: int) -> int:
    """The most blocks one Disk command may carry to fit a ring record of
    ``max_record`` bytes (a 4-byte CPU id, a 4-byte slot and a hash each)."""
    return max(1, min(MAX_DISK_BLOCKS,
                      (max_record - DISK_OVERHEAD) // (8 + REMOTE_HASH_BYTES)))


@dataclass(frozen=True)
class WarmTable:
    """A slot table indexed from the start's scan (:func:`warm_table`) and how many of
    the scan's entries it left out (not a slot in range with a disk hash: no rank
    writes such a header)."""

    slots: BlockPool
    left_out: int


def warm_table(num_slots: int, found: Mapping[int, bytes]) -> WarmTable:
    """A fresh slot table of ``num_slots`` slots with ``found``'s slots (slot -> disk
    hash) indexed as the most recently used. Touches no shared state: the warm scan's
    thread builds it (:mod:`kvshm.engine.warm_scan`) and the scheduler's thread only
    swaps it in (:meth:`DiskBook.end_warming`)."""
    good = {s: h for s, h in found.items() if _warm_entry(s, h) and 0 <= s < num_slots}
    table = BlockPool(num_slots)
    _index(table, good)
    return WarmTable(table, len(found) - len(good))


def _warm_entry(s: object, h: object) -> bool:
    return type(s) is int and type(h) is bytes and len(h) == REMOTE_HASH_BYTES


def _index(slots: BlockPool, found: Mapping[int, bytes]) -> int:
    """Index ``found`` (checked entries, slots in range) in ``slots``, as the most
    recently used; how many."""
    ids = sorted(found)
    if not ids:
        return 0
    slots.touch(ids)
    for s in ids:
        slots.add_hashes(s, (found[s],))
    slots.free(ids)
    return len(ids)


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
    get_abandoned_jobs: int = 0  # READs a reset abandoned (not failures)
    get_declined_cpu_full: int = 0
    get_declined_overdue: int = 0
    get_declined_gone: int = 0  # the slots lost their blocks between lookup and plan
    get_capped: int = 0
    hit_blocks: int = 0  # blocks read back and indexed in the CPU tier
    dropped_slots: int = 0  # slots of failed READs, dropped as suspect
    write_jobs: int = 0
    write_blocks: int = 0
    written_blocks: int = 0  # indexed: every rank acked the WRITE
    write_failed_jobs: int = 0
    write_failed_blocks: int = 0
    write_abandoned_jobs: int = 0  # WRITEs a reset abandoned (not failures; unindexed)
    write_declined_no_slot: int = 0  # blocks not written back: every slot pinned
    write_backpressure: int = 0  # plans that wrote nothing: the in-flight cap was reached
    writes_paused: int = 0  # write-back paused after repeated failed WRITEs
    write_skipped_paused: int = 0  # plans that wrote nothing while paused
    write_through_dropped: int = 0  # stored blocks forgotten before their write (queue full)
    evicted_on_disk: int = 0  # cached CPU blocks evicted that the disk held or was writing
    evicted_written: int = 0  # ... that it did not: written down before their reuse
    evicted_lost: int = 0  # ... and could not be written (paused, warming, no free slot)
    warm_slots: int = 0  # slots indexed at start from the slabs' headers
    warm_disagreed: int = 0  # slots with a header on some rank that not every rank agrees on
    scan_errors: int = 0  # slab files unreadable at start (started cold)
    warm_scan_ms: int = 0  # the start's scan of the slab headers took this long
    warm_voided: int = 0  # scans whose result a reset made void (nothing indexed)
    write_skipped_warming: int = 0  # plans that wrote nothing: the start's scan still ran

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
        max_job = max(1, max_job_blocks)
        first = window or 16
        self.writes = WriteBack(
            cpu, jobs, slots, self.counters, window=first,
            max_window=max_window or max(first, min(cpu.num_blocks // 4, 4096)),
            max_job=max_job, pause_s=pause_s, write_through=write_through, clock=clock)
        self.fetches = Fetches(cpu, gs, self.counters, self._new_read,
                               fetch_timeout_s=fetch_timeout_s, max_job_blocks=max_job,
                               clock=clock, available=self._available,
                               allocate=self._allocate_read)
        self._held: dict[str, list[int]] = {}  # request -> CPU hit held while it reads
        self._victims: list[tuple[int, bytes]] = []  # evicted by READs, not yet written

    @property
    def warming(self) -> bool:
        """The start's scan of the slabs still runs (:meth:`begin_warming`): the index
        is empty and nothing is written."""
        return self.writes.warming

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
            s = get(remote_hash(k))
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
        """The request ended, or was admitted (its lookups are over: a later one, a
        re-admission after a preemption, reads afresh): its hold and fetched pins go; a
        READ in flight completes unclaimed."""
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

    def plan(self, step: int, *, overdue: bool = False) -> list[Disk]:
        """This step's disk jobs: READs for answered lookups, then write-back.
        ``overdue``: as :meth:`Fetches.plan`'s."""
        return self.plan_reads(step, overdue=overdue) + self.writes.plan(step)

    def plan_reads(self, step: int, *, overdue: bool = False) -> list[Disk]:
        """READs for the lookups answered since the last plan (the manager calls it from
        a lookup too, so that a READ is posted at once, not at the next step), each
        preceded by the WRITEs of the cached blocks its allocation evicted (post them in
        this order). ``overdue``: as :meth:`Fetches.plan`'s."""
        reads = [message(job) for job in self.fetches.plan(step, overdue=overdue)
                 if isinstance(job, DiskJob)]
        victims, self._victims = self._victims, []
        return self.writes.write_victims(step, victims) + reads

    def write_victims(self, step: int, victims: Sequence[tuple[int, bytes]]) -> list[Disk]:
        """:meth:`WriteBack.write_victims` (a store's victims, from the manager)."""
        return self.writes.write_victims(step, victims)

    def stored(self, cpu_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """:meth:`WriteBack.stored` (a completed store's blocks, for write-through)."""
        self.writes.stored(cpu_ids, keys)

    # ---- completion ------------------------------------------------------------------

    def complete(self, job: DiskJob, usable: bool) -> None:
        """``job`` is done on every rank (it left the job table). ``usable``: it did not
        fail and its result may be used (not abandoned, the engine not failed)."""
        if job.put:
            self.writes.done(job, usable)
        else:
            self._read_done(job, usable)

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
        self.writes.drop()

    def drop_index(self) -> None:
        """Reset: no slot holds a block any more (slots pinned by jobs stay pinned). While
        the start's scan runs, its result is void (it would index blocks from before the
        reset): writes resume now, and :meth:`end_warming` indexes nothing."""
        self.slots.drop_all_hashes()
        if self.warming:
            self.writes.warming = False
            self.counters.warm_voided += 1

    def begin_warming(self) -> None:
        """The start's scan of the slabs runs on a thread (:mod:`kvshm.engine.warm_scan`):
        until :meth:`end_warming`, nothing is written -- a slot written meanwhile could be
        read by the scan before or after its new header -- so a victim is lost and a
        write-back plan skipped (both counted), and write-through remembers what it will
        write. Lookups find nothing on disk meanwhile (the index is empty)."""
        self.writes.warming = True

    def end_warming(self, table: WarmTable | None, *, disagreed: int = 0,
                    errors: int = 0, seconds: float = 0.0) -> bool:
        """The scan ended: ``table`` (built off this thread by :func:`warm_table`)
        becomes the slot table -- a swap, not O(slots) of indexing inside a step (a
        review: a million slots took 1.1 s) -- and writes resume; ``table`` None (the
        scan failed): writes resume over the empty table. The table in use is untouched
        while warming (no slot is written, none indexed, so none read). After a reset
        meanwhile (:meth:`drop_index`: the result is void) only the scan's counts are
        kept. True when the table was taken. Never raises (it runs in a step)."""
        c = self.counters
        c.warm_disagreed += disagreed + (table.left_out if table is not None else 0)
        c.scan_errors += errors
        c.warm_scan_ms = round(seconds * 1000)
        if not self.warming:
            return False
        self.writes.warming = False
        if table is None:
            return False
        old = self.slots
        assert old.num_hashes == 0 and old.num_pinned == 0, "a slot used while warming"
        assert table.slots.num_blocks == old.num_blocks, "a warm table of another size"
        self.slots = self.writes.slots = table.slots
        c.warm_slots += table.slots.num_hashes
        return True

    def warm(self, found: Mapping[int, bytes]) -> None:
        """Index the slots the slabs' headers agree on at start (slot -> disk hash), as
        the most recently used, in the table in use (:func:`warm_table` builds a new
        one instead). Every entry is checked first (ConfigError, nothing changed: the
        slots are pinned while they are indexed)."""
        for s, h in found.items():
            if not _warm_entry(s, h):
                raise ConfigError(f"warm: slot {s!r} -> {h!r}: a slot id and a "
                                  f"{REMOTE_HASH_BYTES}-byte disk hash expected")
        n = self.slots.num_blocks
        self.counters.warm_slots += _index(self.slots, {s: h for s, h in found.items()
                                                        if 0 <= s < n})

    def statistics(self) -> dict[str, int]:
        """Occupancy (slots total, indexed, pinned) and every counter."""
        out = {"slots": self.slots.num_blocks, "slots_used": self.slots.num_hashes,
               "slots_pinned": self.slots.num_pinned, "slot_evictions": self.slots.evictions,
               "warming": int(self.warming)}
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
        for job in self._jobs.jobs.values():
            if not isinstance(job, DiskJob):
                continue
            if len(job.slots) != len(job.cpu_ids):
                raise AssertionError(f"disk job {job.job_id}: {len(job.slots)} slots for "
                                     f"{len(job.cpu_ids)} CPU ids")
            pins.update(job.slots)
            if job.put:
                writes.update(job.slots)
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
        write_jobs = [j for j in self._jobs.jobs.values() if isinstance(j, DiskJob) and j.put]
        self.writes.check_invariants(write_jobs)
