"""The disk tier's write path (scheduler side): which CPU blocks go down to the slabs,
when, and what a completed WRITE indexes. Part of :class:`~kvshm.offload.disk.DiskBook`,
which holds one :class:`WriteBack` (its read path is the book's own).

Write-back (:meth:`WriteBack.plan`): the cached CPU blocks among the next ``window``
blocks the CPU tier's own eviction order would reuse (:meth:`BlockPool.iter_free_from_lru`:
the order -- depth_aged by default -- is the value; an uncached block is worth nothing, a
block the disk holds or is writing is skipped) are pinned in the CPU pool and written to
fresh slots (WRITE jobs to every rank of at most ``max_job_blocks`` blocks; at most
``max_window`` blocks in flight). The window follows the pressure: twice the cached
blocks the CPU tier evicted since the last plan (halving each plan without evictions),
at least ``window`` and at most ``max_window``; a scan costs about 2 us a block, so an
idle tier scans 16, and a step whose stores evict many scans ahead as many as they
take. Only when every rank acked ok is each slot indexed under its block's hash; the
CPU pin goes in every case, and a written block returns to the CPU tier's free set as
the next to reuse (``evict_first``: it was about to be evicted and the disk holds it
now). A failed write leaves its slots unindexed (reused first).

Pause (:class:`WritePause`): :data:`WRITE_FAILURES_TO_PAUSE` failed WRITEs in a row (a
full or failing disk: ENOSPC, EIO) pause every write for ``pause_s`` (counted), while
reads and serving go on; a WRITE that succeeds clears the count.

Write-down of victims (every mode, :meth:`WriteBack.write_victims`): a CPU block the
tier evicts to make room -- for a store (the manager's plan), a READ (the book's
allocation) or a remote GET (:attr:`RemoteBook.victims
<kvshm.offload.remote.RemoteBook.victims>`, handed over in the same plan) -- whose block
the disk neither holds nor is writing is written down by a WRITE job of its own in the
same call, before the block is reused: the WRITE pins the CPU block beside its new owner
(ref 2) and is posted *before* the store or READ that overwrites its rows
(``StepPlan.disk`` goes out before ``StepPlan.store`` and ``StepPlan.remote``; a
lookup's READs after their victims' WRITEs), and each rank runs a copy, READ or GET into
a row only after every WRITE it received earlier that reads the row
(:mod:`workers.disk_mover`'s row fence). So no cached block leaves the CPU tier
unwritten while write-back has not reached it: the scan is the early, spread-out write;
this is the last chance. Counted: ``evicted_on_disk`` (the disk had it),
``evicted_written`` (written down now), ``evicted_lost`` (not: write-back paused, the
start's scan still running, or no free slot).

Write-through (``write_through``, ``EngineConfig.disk_mode``): every block a store
indexes in the CPU tier is also remembered (not pinned: at most ``4 x max_window``, the
oldest forgotten) and written by the next plans, before the eviction scan, if its CPU
block still holds it then; such a block returns to the CPU tier's free set as any freed
block does (it was not about to be evicted). The disk then holds what the CPU tier
holds, so a restart finds it too; the eviction scan still covers the rest.

Invariants (:meth:`WriteBack.check_invariants`): the keys being written and the blocks
in flight are exactly those of the WRITE jobs in the job table; every scan job is one
of them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Final

from kvshm.ipc.protocol import Disk, DiskOp, pack_ids
from kvshm.offload.jobs import DiskJob, JobTable
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote_puts import REMOTE_HASH_BYTES, remote_hash
from kvshm.types import LoadFailure

if TYPE_CHECKING:
    from kvshm.offload.disk import DiskCounters

__all__ = ["WRITE_FAILURES_TO_PAUSE", "WritePause", "WriteBack", "message"]

#: Failed WRITE jobs in a row that pause write-back.
WRITE_FAILURES_TO_PAUSE: Final = 3

# A slot header and a Disk message carry, for CPU index key ``key``, the remote tier's
# fixed-length hash of it (:func:`~kvshm.offload.remote_puts.remote_hash`: the key
# itself when it is 32 bytes, else its BLAKE2b digest; ``REMOTE_HASH_BYTES`` long).


def message(job: DiskJob) -> Disk:
    """The Disk command of ``job`` (every rank gets the same)."""
    hashes = b"".join(remote_hash(k) for k in job.keys)
    return Disk(job.job_id, DiskOp.WRITE if job.put else DiskOp.READ, pack_ids(job.cpu_ids),
                pack_ids(job.slots), hashes, REMOTE_HASH_BYTES)


class WritePause:
    """Back-off of a failing disk: after :data:`WRITE_FAILURES_TO_PAUSE` WRITE jobs
    failed by a worker in a row, no write is planned for ``pause_s``; any WRITE that
    succeeds clears the count. Failures that are not the disk's (a rank lost, a reset)
    do not count."""

    def __init__(self, counters: DiskCounters, pause_s: float,
                 clock: Callable[[], float]) -> None:
        self.counters = counters
        self._pause_s = pause_s
        self._clock = clock
        self._failures = 0  # WORKER_FAILED WRITE jobs in a row
        self._until = 0.0  # 0: not paused

    def active(self) -> bool:
        """True while paused; the first call after the pause ran out ends it."""
        if not self._until:
            return False
        if self._clock() < self._until:
            return True
        self._until = 0.0
        return False

    def succeeded(self) -> None:
        """A WRITE succeeded: the count of failures in a row starts again."""
        self._failures = 0

    def failed(self, cause: LoadFailure | None) -> None:
        """A WRITE job failed for ``cause``; the third worker failure in a row pauses."""
        if cause is not LoadFailure.WORKER_FAILED:
            return
        self._failures += 1
        if self._failures >= WRITE_FAILURES_TO_PAUSE:
            self._failures = 0
            self.counters.writes_paused += 1
            self._until = self._clock() + self._pause_s


class WriteBack:
    """See the module docstring. Shares the book's counters and slot table; ``window``,
    ``max_window``: the fewest and most CPU free-set blocks a scan looks at (the most is
    also the cap on blocks being written at once)."""

    def __init__(self, cpu: BlockPool, jobs: JobTable, slots: BlockPool,
                 counters: DiskCounters, *, window: int, max_window: int, max_job: int,
                 pause_s: float, write_through: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cpu, self._jobs, self.slots = cpu, jobs, slots
        self.counters = counters
        self._window = window
        self._max_window = max_window
        self._max_job = max_job
        self.pause = WritePause(counters, pause_s, clock)
        self.write_through = write_through
        self._pressure = 0  # cached CPU blocks evicted lately (halved each plan)
        self._evictions = cpu.evictions
        self._writing: set[bytes] = set()  # disk hashes being written
        self._inflight = 0  # blocks being written
        self._fresh: deque[tuple[int, bytes]] = deque()  # stored, to write through
        self._scan_jobs: set[int] = set()  # WRITE jobs of blocks about to be evicted
        #: the start's scan of the slabs still runs: nothing is written (``DiskBook.warming``)
        self.warming = False

    def _wanted(self, d: bytes) -> bool:
        """The disk neither holds nor is writing the block of disk hash ``d``."""
        return d not in self._writing and d not in self.slots.cached_keys

    # ---- what to write ---------------------------------------------------------------

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

    def write_victims(self, step: int, victims: Sequence[tuple[int, bytes]]) -> list[Disk]:
        """WRITE jobs of ``victims`` (CPU id, key: the cached blocks an allocation just
        evicted; the ids now belong to a store or READ planned in the same call) that
        the disk neither holds nor is writing, pinned here until written. Post them
        before the job that reuses their rows: each rank runs it after them (module
        docstring). Never raises: a block without a free slot, or while write-back is
        paused or the start's scan runs, is lost (counted). Two victims may carry one
        key (a disk READ of it completed after another request had stored it): only the
        first is written --
        two slots for one block would waste one, and two WRITE jobs of one key would
        leave ``_writing`` without it while the second is still out."""
        if not victims:
            return []
        c = self.counters
        chosen: set[bytes] = set()
        picks = []
        for cid, k in victims:
            d = remote_hash(k)
            if d not in chosen and self._wanted(d):
                chosen.add(d)
                picks.append((cid, k))
        c.evicted_on_disk += len(victims) - len(picks)
        if not picks:
            return []
        if self.warming or self.pause.active():
            c.evicted_lost += len(picks)
            return []
        n = min(len(picks), self.slots.num_free)
        c.evicted_written += n
        c.evicted_lost += len(picks) - n  # counted here only, not as declined writes too
        return self._write_jobs(step, picks[:n], scan=False)

    def plan(self, step: int) -> list[Disk]:
        """This step's write-back: the remembered stored blocks (write-through) first,
        then the scan of the blocks the CPU tier would reuse next; nothing while paused
        or while ``max_window`` blocks are in flight, or while the start's scan runs (each
        counted)."""
        if self.warming:
            self.counters.write_skipped_warming += 1
            return []
        if self.pause.active():
            self.counters.write_skipped_paused += 1
            return []
        evicted = self.cpu.evictions - self._evictions
        self._evictions = self.cpu.evictions
        self._pressure = max(evicted, self._pressure // 2)
        budget = self._max_window - self._inflight
        if budget <= 0:
            self.counters.write_backpressure += 1
            return []
        window = min(self._max_window, max(self._window, 2 * self._pressure))
        chosen: set[bytes] = set()
        # write-through takes its blocks off the remembered queue: no more than there are
        # free slots, or one taken and not written would be lost, not left for the next plan
        fresh = self._through(min(budget, self.slots.num_free), chosen)
        scanned = self._candidates(window, budget - len(fresh), chosen)
        out = self._write_jobs(step, fresh, scan=False)
        return out + self._write_jobs(step, scanned, scan=True)

    def _through(self, budget: int, chosen: set[bytes]) -> list[tuple[int, bytes]]:
        """(CPU id, key) of the remembered stored blocks whose CPU block still holds
        them and that the disk neither holds nor is writing, at most ``budget``."""
        picks: list[tuple[int, bytes]] = []
        fresh, cpu = self._fresh, self.cpu
        while fresh and len(picks) < budget:
            c, k = fresh.popleft()
            hs = cpu.block_hashes(c)
            if not hs or hs[0] != k:
                continue  # evicted (and reused) meanwhile
            d = remote_hash(k)
            if d in chosen or not self._wanted(d):
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
        cpu = self.cpu
        for c in islice(cpu.iter_free_from_lru(), window):
            hs = cpu.block_hashes(c)
            if not hs:
                continue
            d = remote_hash(hs[0])
            if d in chosen or not self._wanted(d):
                continue
            chosen.add(d)
            picks.append((c, hs[0]))
            if len(picks) >= budget:
                break
        return picks

    def _write_jobs(self, step: int, picks: list[tuple[int, bytes]], *, scan: bool
                    ) -> list[Disk]:
        """WRITE jobs of ``picks`` into fresh slots (as many as there are free slots)."""
        n = min(len(picks), self.slots.num_free)
        if n < len(picks):
            self.counters.write_declined_no_slot += len(picks) - n
            picks = picks[:n]
        if not n:
            return []
        self.cpu.touch([c for c, _ in picks], use=False)  # read, not used: no hit
        slots = self.slots.allocate(n)  # the least recently used disk blocks go
        out: list[Disk] = []
        for i in range(0, n, self._max_job):
            batch = picks[i:i + self._max_job]
            keys = [k for _, k in batch]
            job = self._jobs.new_disk(step, [c for c, _ in batch], keys, [0] * len(batch),
                                      slots[i:i + self._max_job], write=True)
            if scan:
                self._scan_jobs.add(job.job_id)
            self._writing.update(remote_hash(k) for k in keys)
            self._inflight += len(batch)
            self.counters.write_jobs += 1
            self.counters.write_blocks += len(batch)
            out.append(message(job))
        return out

    # ---- completion, reset -----------------------------------------------------------

    def done(self, job: DiskJob, usable: bool) -> None:
        """``job`` (a WRITE) is done on every rank: its slots are indexed if ``usable``
        (unindexed ones are reused first), its CPU pins go -- a scanned block as the
        next to reuse once the disk holds it."""
        self._writing.difference_update(remote_hash(k) for k in job.keys)
        self._inflight -= len(job.keys)
        slots = self.slots
        if usable:
            for s, k in zip(job.slots, job.keys):
                slots.add_hashes(s, (remote_hash(k),))
            self.counters.written_blocks += len(job.keys)
            self.pause.succeeded()
        elif job.abandoned and not job.nacked:  # a reset's: not a failure
            self.counters.write_abandoned_jobs += 1
        else:  # a rank's own failure feeds the pause even inside a reset's window
            self.counters.write_failed_jobs += 1
            self.counters.write_failed_blocks += len(job.keys)
            self.pause.failed(LoadFailure.WORKER_FAILED if job.nacked else job.cause)
        slots.free(job.slots)  # indexed: most recently used; unindexed: reused first
        scan = job.job_id in self._scan_jobs
        self._scan_jobs.discard(job.job_id)
        self.cpu.free(reversed(job.cpu_ids), evict_first=usable and scan)

    def drop(self) -> None:
        """Reset or engine failure: forget the blocks remembered for write-through
        (WRITEs in flight complete as usual)."""
        self._fresh.clear()

    # ---- checks ----------------------------------------------------------------------

    def check_invariants(self, writes: Iterable[DiskJob]) -> None:
        """``writes``: every WRITE job in the job table (module docstring)."""
        writing: set[bytes] = set()
        inflight = 0
        ids: set[int] = set()
        for job in writes:
            ids.add(job.job_id)
            writing.update(remote_hash(k) for k in job.keys)
            inflight += len(job.keys)
        if not self._scan_jobs <= ids:
            raise AssertionError(f"scan WRITE jobs {sorted(self._scan_jobs - ids)} are gone")
        if writing != self._writing or inflight != self._inflight:
            raise AssertionError(f"keys being written {len(self._writing)} / in flight "
                                 f"{self._inflight}, WRITE jobs say {len(writing)} / "
                                 f"{inflight}")
