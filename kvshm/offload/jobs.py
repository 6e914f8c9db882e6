"""Transfer jobs and their acknowledgements across ranks (scheduler side, sans-IO).

A job is one ``Transfer`` sent to every rank. It *completes* when every rank has acked
it or been *fenced*; it *fails* at its first failed ack (or when a rank that had not
acked is declared dead). Failing and completing are separate moments: a failed job's
requests learn it at once, but its blocks stay pinned until completion, because
another rank may still be copying into them.

Declared dead is not fenced. A rank declared dead (hang verdict, broken ring) may still
be running a queued copy: :meth:`JobTable.revoke_rank` fails its unacked jobs but keeps
waiting for it, so their blocks stay pinned (*quarantined*). Only
:meth:`JobTable.fence_rank` -- its process is known to have exited, or its lifeline
closed after its last copy -- counts it as acked, and the pins go.

Job ids come from one counter shared by stores and loads, starting at 1, strictly
increasing and never reset (workers and adapters may compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvshm.errors import ConfigError
from kvshm.types import LoadFailure, ManagerCounters

__all__ = ["AckOutcome", "Job", "JobKind", "JobTable", "LoadPart"]


class JobKind(Enum):
    STORE = "store"
    LOAD = "load"


@dataclass(slots=True, eq=False)
class LoadPart:
    """One request's share of a load: ``cpu_ids[i]`` is copied into ``gpu_ids[i]``,
    position-major prefix order. ``failed_ids``: destinations that could not be
    sourced (sliding-window gaps after partial acceptance): recomputed."""

    req_id: str
    cpu_ids: list[int]
    gpu_ids: list[int]
    failed_ids: tuple[int, ...]
    num_tokens: int


@dataclass(slots=True, eq=False)
class Job:
    """Pairs ``gpu_ids[i] <-> cpu_ids[i]`` in prefix order (per request, position-major).

    Stores: ``groups[i]`` / ``keys[i]`` are the pair's KV group and group-qualified
    primary hash (its in-flight mark); the first ``n_eager`` pairs go back to the GPU
    pool normally, the rest (lazy offloads) with ``evict_first``. Loads: ``parts``.
    ``reported``: the job's requests have been told its outcome (loads only).
    """

    job_id: int
    kind: JobKind
    step: int
    gpu_ids: list[int]
    cpu_ids: list[int]
    waiting: set[int]
    groups: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)
    n_eager: int = 0
    parts: list[LoadPart] = field(default_factory=list)
    failed: bool = False
    cause: LoadFailure | None = None
    abandoned: bool = False
    reported: bool = False


@dataclass(frozen=True, slots=True)
class AckOutcome:
    """What one ack changed: the job just failed and/or just completed."""

    job: Job
    newly_failed: bool
    complete: bool


class JobTable:
    """Jobs not yet acked by every live rank, keyed by id (insertion = id order)."""

    def __init__(self, world_size: int, counters: ManagerCounters) -> None:
        if world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.jobs: dict[int, Job] = {}
        self.revoked: set[int] = set()  # declared dead, not yet fenced
        self.dead: set[int] = set()  # fenced: nothing of it can touch a block any more
        self._next_id = 1
        self._counters = counters

    def __len__(self) -> int:
        return len(self.jobs)

    def new_job(self, kind: JobKind, step: int, gpu_ids: list[int], cpu_ids: list[int]) -> Job:
        """Register a job waiting for every live rank (there must be one)."""
        waiting = set(range(self.world_size)) - self.dead - self.revoked
        assert waiting, "a job planned with every rank dead"
        job = Job(self._next_id, kind, step, gpu_ids, cpu_ids, waiting)
        self._next_id += 1
        self.jobs[job.job_id] = job
        return job

    def ack(self, job_id: int, rank: int, ok: bool, cause: LoadFailure) -> AckOutcome | None:
        """Count one ack. None (counted, ignored) for an unknown job or a rank that is not
        waited for (a duplicate, a dead rank, a rank out of range). ``cause`` labels a
        failure. A completed job leaves the table."""
        job = self.jobs.get(job_id)
        if job is None:
            self._counters.acks_unknown += 1
            return None
        if rank not in job.waiting:
            self._counters.acks_duplicate += 1
            return None
        job.waiting.discard(rank)
        newly_failed = False
        if not ok and not job.failed:
            job.failed = True
            job.cause = cause
            newly_failed = True
            self._counters.jobs_failed += 1
        complete = not job.waiting
        if complete:
            del self.jobs[job_id]
        return AckOutcome(job, newly_failed, complete)

    def revoke_rank(self, rank: int) -> list[Job]:
        """Declare ``rank`` dead: the jobs it has not acked, newly failed (RANK_DIED), are
        returned; they keep waiting for it (quarantined) until :meth:`fence_rank`."""
        self._check_rank(rank)
        if rank in self.dead or rank in self.revoked:
            return []
        self.revoked.add(rank)
        out: list[Job] = []
        for job in self.jobs.values():
            if rank in job.waiting:
                if not job.failed:
                    job.failed, job.cause = True, LoadFailure.RANK_DIED
                    self._counters.jobs_failed += 1
                out.append(job)
        return out

    def quarantined(self) -> tuple[set[int], set[int]]:
        """(GPU ids, CPU ids) pinned by jobs that wait for a revoked, unfenced rank."""
        gpu: set[int] = set()
        cpu: set[int] = set()
        if self.revoked:
            for job in self.jobs.values():
                if not self.revoked.isdisjoint(job.waiting):
                    gpu.update(job.gpu_ids)
                    cpu.update(job.cpu_ids)
        return gpu, cpu

    def only_quarantined(self) -> bool:
        """True when every job left waits only for revoked ranks (nothing will move)."""
        revoked = self.revoked
        return all(job.waiting <= revoked for job in self.jobs.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} out of range for world_size {self.world_size}")

    def fence_rank(self, rank: int) -> list[AckOutcome]:
        """``rank`` can touch no block any more (revoked or not before): every job it
        has not acked gets a failed ack from it, so those jobs can complete."""
        self._check_rank(rank)
        if rank in self.dead:
            return []
        self.revoked.discard(rank)
        self.dead.add(rank)
        out: list[AckOutcome] = []
        for job in list(self.jobs.values()):
            if rank in job.waiting:
                outcome = self.ack(job.job_id, rank, False, LoadFailure.RANK_DIED)
                assert outcome is not None
                out.append(outcome)
        return out
