"""Job outcomes: a rank's acks, a job's completion, reset and rank death.

:class:`JobOutcomes` is the component of :class:`~kvshm.offload.manager.OffloadManager`
that ends jobs. It holds the job table (the manager and its books add jobs to it; only
the outcomes end them), and owns the two states that stop the manager planning:
``failed`` (a rank was declared dead) and ``abandoned`` (jobs a ``reset`` abandoned that
have not completed yet). It is handed the CPU pool, the load and store books and the
remote book it releases pins through, and a callback that turns the manager's phase-A
hits into tombstones (the hits stay the manager's).

Ordering and invariants:

* A job completes once every rank acked or is dead (:class:`~kvshm.offload.jobs.JobTable`
  decides); only then are its pins released, and a store is indexed only if the job
  did not fail, was not abandoned and no rank died (``usable``).
* A failed load is reported once, at its first failed ack; its pins stay until it
  completes (pins outlive failure).
* ``reset`` abandons every job in flight: ``abandoned`` counts the abandoned jobs not
  yet completed, so it is 0 exactly when none is left; the manager plans no new job
  while it is not 0.
* ``rank_failed`` sets ``failed`` for good, fails every job, tombstones every pending
  hit and drops the index; the jobs the dead rank had not acked keep their pins --
  quarantined -- until ``rank_fenced``: a block a rank may still touch is never handed
  out again.
* ``failed`` and ``abandoned`` are written only here; the manager reads them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvshm.errors import ConfigError
from kvshm.offload.counters import DeclineReason, ManagerCounters
from kvshm.offload.disk import DiskBook
from kvshm.offload.jobs import AckOutcome, AnyJob, DiskJob, JobTable, LoadJob, RemoteJob, StoreJob
from kvshm.offload.loads import LoadBook
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote import RemoteBook
from kvshm.offload.stores import StorePlanner
from kvshm.types import LoadFailure

__all__ = ["JobOutcomes"]


class JobOutcomes:
    """Acks, completions, reset and rank death of the jobs in ``jobs`` (see the module
    docstring). ``drop_hits(cause)``: release every pending phase-A hit's pins and leave
    a tombstone failing with ``cause`` (the manager's hits)."""

    def __init__(self, jobs: JobTable, cpu: BlockPool, loads: LoadBook,
                 stores: StorePlanner, remote: RemoteBook | None,
                 counters: ManagerCounters,
                 drop_hits: Callable[[LoadFailure], None],
                 disk: DiskBook | None = None) -> None:
        self.jobs = jobs
        self.cpu = cpu
        self.loads = loads
        self.stores = stores
        self.remote = remote
        self.disk = disk
        self.counters = counters
        self._drop_hits = drop_hits
        self.failed = False
        self.abandoned = 0

    def on_done(self, job_id: int, rank: int, ok: bool) -> None:
        """One rank's ack. Unknown jobs and repeated or unexpected ranks are counted
        (``acks_unknown`` / ``acks_duplicate``) and ignored. ConfigError, nothing changed,
        unless ``job_id`` and ``rank`` are ints and ``ok`` a bool (``ok="failed"`` was
        truthy: a failed store was indexed as done)."""
        if type(job_id) is not int or type(rank) is not int or type(ok) is not bool:
            raise ConfigError(f"on_done: job_id and rank must be ints and ok a bool, got "
                              f"{job_id!r}, {rank!r}, {ok!r}")
        out = self.jobs.ack(job_id, rank, ok, LoadFailure.WORKER_FAILED)
        if out is not None:
            self._apply(out)

    def _apply(self, out: AckOutcome) -> None:
        job = out.job
        self._report_if_due(job)
        if out.complete:
            self._complete(job)

    def _complete(self, job: AnyJob) -> None:
        """Every rank acked or is dead: release the job's pins (and index a store)."""
        if job.abandoned:
            self.abandoned -= 1
        usable = not job.failed and not self.failed
        if isinstance(job, StoreJob):
            self.stores.complete(job, register=usable)
            if usable and self.remote is not None:
                self.remote.stored(job.cpu_ids, job.keys, job.depths)
            if usable and self.disk is not None:
                self.disk.stored(job.cpu_ids, job.keys)
        elif isinstance(job, DiskJob):
            assert self.disk is not None, "a disk job without a disk tier"
            self.disk.complete(job, usable and not job.abandoned)
        elif isinstance(job, RemoteJob):
            assert self.remote is not None, "a remote job without a remote tier"
            self.remote.complete(job, usable and not job.abandoned)
        else:
            self.loads.complete(job)

    def reset(self) -> bool:
        """Drop the CPU index; abandon every job in flight (its completion releases refs
        without indexing; no new job is planned until they are all done). Returns
        :meth:`reset_done`. Every call is a new reset: poll :meth:`reset_done`, not
        this (under traffic a step plans new stores once the abandoned jobs are done,
        and a poll that abandoned those again never saw the end).

        A load in flight fails (RESET) but is reported only once no rank may copy it any
        more (:meth:`_report_if_due`), never at the reset: reported at once, the host
        recomputed into the request's blocks while a live rank still copied the bytes
        from before the reset (new weights, say) over them (a hostile probe). A queued
        load, which no rank has, fails at once."""
        if not self.failed:
            self._drop_pending(LoadFailure.RESET, DeclineReason.RESET)
            for job in self.jobs.jobs.values():
                if not job.abandoned:
                    job.abandoned = True
                    self.abandoned += 1
                    self.counters.jobs_abandoned += 1
                    self._fail_job(job, LoadFailure.RESET, count=False)
            self.cpu.drop_all_hashes()
            if self.disk is not None:
                self.disk.drop_index()
        return self.reset_done()

    def reset_done(self) -> bool:
        """True once no job a reset abandoned is in flight (once failed: no job at all).
        Jobs that wait only for a revoked, unfenced rank do not count: nothing will move
        them, and the engine is FAILED anyway."""
        if self.failed:
            return not self.jobs.jobs or self.jobs.only_quarantined()
        return self.abandoned == 0 or self.jobs.only_quarantined()

    def rank_failed(self, rank: int) -> None:
        """``rank`` was declared dead (it may still be running a copy): every job fails
        (failed load results now); the index is dropped; from now on lookups get 0 and
        nothing is planned. The jobs ``rank`` has not acked keep their pins -- those
        blocks are *quarantined* -- until :meth:`rank_fenced`: a block a rank may still
        touch is never handed out again. A rank out of range is a ConfigError that
        changes nothing (checked before ``failed`` is set: a manager marked failed
        without its first failure's cleanup would leak every pinned hit)."""
        self.jobs.check_rank(rank)
        first = not self.failed
        self.failed = True
        for job in self.jobs.revoke_rank(rank):
            self._fail_job(job, LoadFailure.RANK_DIED, count=False)
        if first:
            for job in self.jobs.jobs.values():
                self._fail_job(job, LoadFailure.RANK_DIED, count=True)
            self._drop_pending(LoadFailure.RANK_DIED, DeclineReason.ENGINE_FAILED)
            self.cpu.drop_all_hashes()

    def close(self, stopped: Iterable[int]) -> None:
        """The engine closes; every rank in ``stopped`` is proven to copy nothing any
        more (its process reaped). Once (first call): nothing is planned from now on
        (``failed``), every job fails and is abandoned (ENGINE_CLOSED, not counted as a
        failure; a load reported once no rank may copy it: :meth:`_report_if_due`), and
        what no rank holds goes -- queued loads, finish-time stores, phase-A hits, the
        tiers' pins. Each call: the jobs of every ``stopped`` rank end as if it had
        acked (no failure of that rank: a disk or remote job counts as abandoned, a
        review), so a job no other rank waits for releases its pins. A job that waits for
        a rank that gave no proof (an attached or embedded one) keeps its pins: the
        host's GPU blocks stay pinned rather than be handed out while it may copy.
        Before, a close left every pin in the host's GPU pool for good, and a server
        that launched another engine on the same pool lost those blocks at each close
        (a hostile probe: 6 of 64 after one request's finish-time store)."""
        if not self.failed:
            self.failed = True
            self._drop_pending(LoadFailure.ENGINE_CLOSED, DeclineReason.ENGINE_CLOSED)
            for job in self.jobs.jobs.values():
                if not job.abandoned:  # (as a reset's: its end is no failure of a rank)
                    job.abandoned = True
                    self.abandoned += 1
                self._fail_job(job, LoadFailure.ENGINE_CLOSED, count=False)
        for rank in stopped:
            for out in self.jobs.fence_rank(rank, nack=False):
                self._apply(out)

    def rank_fenced(self, rank: int) -> None:
        """``rank`` can touch no block any more (its process exited, or its lifeline
        closed after its last copy): the jobs it had not acked count as acked by it, so
        their pins go once the other ranks are done. Implies :meth:`rank_failed`."""
        self.rank_failed(rank)
        for out in self.jobs.fence_rank(rank):
            self._apply(out)

    def quarantined_blocks(self) -> tuple[int, int]:
        """(GPU, CPU) blocks pinned only because a revoked rank is not fenced yet."""
        gpu, cpu = self.jobs.quarantined()
        return len(gpu), len(cpu)

    def has_pending_work(self) -> bool:
        """A job in flight that something will still move (jobs that wait only for a
        revoked, unfenced rank do not count)."""
        return bool(self.jobs.jobs) and not self.jobs.only_quarantined()

    def _fail_job(self, job: AnyJob, cause: LoadFailure, *, count: bool) -> None:
        """Mark ``job`` failed (``count``: as a failed job; an abandoned one is not); a
        load's outcome is reported when due (:meth:`_report_if_due`)."""
        if job.fail(cause) and count:
            self.counters.jobs_failed += 1
        self._report_if_due(job)

    def _report_if_due(self, job: AnyJob) -> None:
        """A failed load is reported at its first failure (its other ranks' copies only
        rewrite the same blocks with the same KV) -- but one a reset or the close
        abandoned only once no rank it waits for may still copy: every one acked or is
        fenced, or is declared dead (the quarantine's accepted risk, docs/operations.md).
        Its bytes are from before the reset: reported at the reset, the host recomputed
        into the request's blocks while a live rank still copied them over the
        recompute (a hostile probe; with two ranks, the first one's ack reported it, a
        review)."""
        if isinstance(job, LoadJob) and job.failed and (
                not job.abandoned or job.waiting <= self.jobs.revoked):
            self.loads.report(job)

    def _drop_pending(self, cause: LoadFailure, decline: DeclineReason) -> None:
        """Release every phase-A pin (tombstones), fail every queued load, drop queued
        finish-time stores."""
        self._drop_hits(cause)
        self.loads.drop_queued(cause)
        self.stores.finished.drop(decline)
        if self.remote is not None:
            self.remote.drop()
        if self.disk is not None:
            self.disk.drop()
