"""Job outcomes: a rank's acks, a job's completion, reset and rank death.

:class:`JobOutcomes` is the part of :class:`~kvshm.offload.manager.OffloadManager` that
ends jobs; the manager inherits it (one object, no extra call per ack). It reads and
writes the manager's own records, declared below; it owns none of them.

Ordering and invariants:

* A job completes once every rank acked or is dead (:class:`~kvshm.offload.jobs.JobTable`
  decides); only then are its pins released, and a store is indexed only if the job
  did not fail, was not abandoned and no rank died (``usable``).
* A failed load is reported once, at its first failed ack; its pins stay until it
  completes (pins outlive failure).
* ``reset`` abandons every job in flight: no new job is planned until the last one
  completed (``_abandoned`` counts them down in ``_complete``).
* ``rank_failed`` fails every job and drops the index; the jobs the dead rank had not
  acked keep their pins -- quarantined -- until ``rank_fenced``: a block a rank may
  still touch is never handed out again.
"""

from __future__ import annotations

from kvshm.offload.counters import DeclineReason, ManagerCounters
from kvshm.offload.disk import DiskBook
from kvshm.offload.hits import Hit
from kvshm.offload.jobs import AckOutcome, AnyJob, DiskJob, JobTable, LoadJob, RemoteJob, StoreJob
from kvshm.offload.loads import LoadBook
from kvshm.offload.pool import BlockPool
from kvshm.offload.remote import RemoteBook
from kvshm.offload.stores import StorePlanner
from kvshm.types import LoadFailure

__all__ = ["JobOutcomes"]


class JobOutcomes:
    """Acks, completions, reset and rank death of the manager's jobs (see the module
    docstring); a base of ``OffloadManager``, which sets every attribute below."""

    cpu: BlockPool
    counters: ManagerCounters
    remote: RemoteBook | None
    disk: DiskBook | None
    _jobs: JobTable
    _loads: LoadBook
    _stores: StorePlanner
    _hits: dict[str, Hit]
    _failed: bool
    _abandoned: int

    def on_done(self, job_id: int, rank: int, ok: bool) -> None:
        """One rank's ack. Unknown jobs and repeated or unexpected ranks are counted
        (``acks_unknown`` / ``acks_duplicate``) and ignored."""
        out = self._jobs.ack(job_id, rank, ok, LoadFailure.WORKER_FAILED)
        if out is not None:
            self._apply(out)

    def _apply(self, out: AckOutcome) -> None:
        job = out.job
        if job.failed and isinstance(job, LoadJob):
            self._loads.report(job)
        if out.complete:
            self._complete(job)

    def _complete(self, job: AnyJob) -> None:
        """Every rank acked or is dead: release the job's pins (and index a store)."""
        if job.abandoned:
            self._abandoned -= 1
        usable = not job.failed and not self._failed
        if isinstance(job, StoreJob):
            self._stores.complete(job, register=usable)
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
            self._loads.complete(job)

    def reset(self) -> bool:
        """Drop the CPU index; abandon every job in flight (its completion releases refs
        without indexing; no new job is planned until they are all done). True once
        nothing is in flight (jobs that wait only for a revoked, unfenced rank do not
        count: nothing will move them, and the engine is FAILED anyway)."""
        if not self._failed:
            self._drop_pending(LoadFailure.RESET, DeclineReason.RESET)
            for job in self._jobs.jobs.values():
                if not job.abandoned:
                    job.abandoned = True
                    self._abandoned += 1
                    self.counters.jobs_abandoned += 1
                    self._fail_job(job, LoadFailure.RESET, count=False)
            self.cpu.drop_all_hashes()
            if self.disk is not None:
                self.disk.drop_index()
        return not self._jobs.jobs or self._jobs.only_quarantined()

    def rank_failed(self, rank: int) -> None:
        """``rank`` was declared dead (it may still be running a copy): every job fails
        (failed load results now); the index is dropped; from now on lookups get 0 and
        nothing is planned. The jobs ``rank`` has not acked keep their pins -- those
        blocks are *quarantined* -- until :meth:`rank_fenced`: a block a rank may still
        touch is never handed out again."""
        first = not self._failed
        self._failed = True
        for job in self._jobs.revoke_rank(rank):
            self._fail_job(job, LoadFailure.RANK_DIED, count=False)
        if first:
            for job in self._jobs.jobs.values():
                self._fail_job(job, LoadFailure.RANK_DIED, count=True)
            self._drop_pending(LoadFailure.RANK_DIED, DeclineReason.ENGINE_FAILED)
            self.cpu.drop_all_hashes()

    def rank_fenced(self, rank: int) -> None:
        """``rank`` can touch no block any more (its process exited, or its lifeline
        closed after its last copy): the jobs it had not acked count as acked by it, so
        their pins go once the other ranks are done. Implies :meth:`rank_failed`."""
        self.rank_failed(rank)
        for out in self._jobs.fence_rank(rank):
            self._apply(out)

    def quarantined_blocks(self) -> tuple[int, int]:
        """(GPU, CPU) blocks pinned only because a revoked rank is not fenced yet."""
        gpu, cpu = self._jobs.quarantined()
        return len(gpu), len(cpu)

    def _fail_job(self, job: AnyJob, cause: LoadFailure, *, count: bool) -> None:
        """Mark ``job`` failed (``count``: as a failed job; an abandoned one is not)."""
        if job.fail(cause) and count:
            self.counters.jobs_failed += 1
        if isinstance(job, LoadJob):
            self._loads.report(job)

    def _drop_pending(self, cause: LoadFailure, decline: DeclineReason) -> None:
        """Release every phase-A pin (tombstones), fail every queued load, drop queued
        finish-time stores."""
        for rid, hit in list(self._hits.items()):
            if hit.cause is None:
                self.cpu.free(reversed(hit.pinned))
                self._hits[rid] = Hit(hit.start, hit.end, [], [], (), cause)
        self._loads.drop_queued(cause)
        self._stores.drop_finished(decline)
        if self.remote is not None:
            self.remote.drop()
        if self.disk is not None:
            self.disk.drop()
