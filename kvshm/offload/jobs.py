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

Two kinds share that ack state (:class:`Job`): a :class:`StoreJob` (GPU -> CPU, its
in-flight marks kept by :mod:`kvshm.offload.stores`) and a :class:`LoadJob` (CPU -> GPU,
its requests' bookkeeping kept by :mod:`kvshm.offload.loads`); a third, :class:`RemoteJob`
(CPU tier <-> remote tier, kept by :mod:`kvshm.offload.remote`), pins CPU blocks only;
its kind :class:`DiskJob` (CPU tier <-> disk slabs, :mod:`kvshm.offload.disk`) also pins
the slots it reads or writes.
The table only counts
acks; what a failure or completion means for the blocks is the manager's and those
parts' business.

A store is selected first (:mod:`kvshm.offload.stores`): :class:`Cand` per block, into
one step's :class:`Selection`, whose lists become the :class:`StoreJob`'s (both live here,
next to the job they make).

Job ids come from one counter shared by stores and loads, starting at 1, strictly
increasing and never reset (workers and adapters may compare them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

import msgspec

from kvshm.errors import ConfigError
from kvshm.offload.counters import ManagerCounters
from kvshm.types import LoadFailure

__all__ = ["AckOutcome", "AnyJob", "Cand", "DiskJob", "Job", "JobTable", "LoadJob", "LoadPart",
           "RemoteJob", "Selection", "StoreJob"]


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
    #: the request ended, or a newer phase B of it replaced this load, while the load
    #: was in flight: its outcome is not reported (``LoadBook.supersede``)
    superseded: bool = False


@dataclass(slots=True, eq=False)
class Job:
    """What both kinds share: the pairs and the ack state.

    Pairs ``gpu_ids[i] <-> cpu_ids[i]`` in prefix order (per request, position-major);
    every id is pinned until the job completes. ``waiting``: the ranks whose ack is
    still due (live or revoked, never fenced). ``failed`` / ``cause``: set once, at the
    first failed ack or revocation (:meth:`fail`), never cleared. ``abandoned``: failed
    by ``reset``; its completion indexes nothing. ``nacked``: some rank acked it failed
    (its copy or I/O failed), whatever failed the job first -- an abandoned job that a
    rank also failed counts as a failure, not as abandoned.
    """

    job_id: int
    step: int
    gpu_ids: list[int]
    cpu_ids: list[int]
    waiting: set[int]
    failed: bool = False
    cause: LoadFailure | None = None
    abandoned: bool = False
    nacked: bool = False

    def fail(self, cause: LoadFailure) -> bool:
        """Mark the job failed with ``cause`` unless it already is; True if it was
        not (the caller counts it)."""
        if self.failed:
            return False
        self.failed = True
        self.cause = cause
        return True


@dataclass(slots=True, eq=False, kw_only=True)
class StoreJob(Job):
    """GPU -> CPU. ``groups[i]`` / ``keys[i]``: the pair's KV group and group-qualified
    primary hash (its in-flight mark in :class:`~kvshm.offload.stores.StorePlanner`); the
    first ``n_eager`` pairs go back to the GPU pool normally, the rest (lazy offloads)
    with ``evict_first``. ``depths[i]``: the pair's position in its request's block
    sequence (the CPU tier's depth-aware eviction orders read it; empty: all 0)."""

    groups: list[int]
    keys: list[bytes]
    n_eager: int
    depths: list[int] = field(default_factory=list)


class Cand(msgspec.Struct, frozen=True, gc=False):
    """A block selected for storing: its GPU id, KV group and ``key``, the
    group-qualified primary hash (its CPU index key and in-flight mark), and ``pos`` its
    position in the request's block sequence (0 where unknown: lazy offloads), which the
    CPU tier's depth-aware eviction orders read.

    A ``msgspec.Struct`` because a step builds one per selected block: built in C
    (~60 ns here, a plain tuple ~40 ns, a ``NamedTuple`` ~290 ns: +1.5 % of a
    ``tools.bench_manager`` step's instructions at 1k requests). ``gc=False``: it holds
    no reference back to itself."""

    gpu_id: int
    group: int
    key: bytes
    pos: int = 0


class Selection:
    """One step's store pairs in job order: finish-time ones (already touched), then
    running requests' (``to_touch``), then lazy ones (``n_lazy``, also in ``to_touch``)."""

    __slots__ = ("depths", "gpu_ids", "groups", "keys", "n_lazy", "to_touch")

    def __init__(self) -> None:
        self.gpu_ids: list[int] = []
        self.groups: list[int] = []
        self.keys: list[bytes] = []
        self.depths: list[int] = []
        self.to_touch: list[int] = []
        self.n_lazy = 0

    def add(self, c: Cand) -> None:
        self.gpu_ids.append(c.gpu_id)
        self.groups.append(c.group)
        self.keys.append(c.key)
        self.depths.append(c.pos)


@dataclass(slots=True, eq=False, kw_only=True)
class LoadJob(Job):
    """CPU -> GPU, the queued parts of one step in order (their ids concatenated are the
    job's pairs). ``reported``: the parts' requests have been told the outcome
    (:class:`~kvshm.offload.loads.LoadBook`), once."""

    parts: list[LoadPart]
    reported: bool = False


@dataclass(slots=True, eq=False, kw_only=True)
class RemoteJob(Job):
    """CPU tier <-> remote tier (no GPU ids). ``put``: True for a PUT (the CPU blocks
    are indexed and only read), False for a GET (fresh CPU blocks written from the
    remote; unindexed until the job completes without failure). ``keys[i]``: the
    group-qualified hash of ``cpu_ids[i]``; ``depths[i]`` its chain position.
    ``req_id``: the request a GET was fetched for ("" for a PUT)."""

    put: bool
    keys: list[bytes]
    depths: list[int]
    req_id: str = ""
    keep: bool = False  # a PUT without TTL (a P/D hand-off's blocks)


@dataclass(slots=True, eq=False, kw_only=True)
class DiskJob(RemoteJob):
    """CPU tier <-> this engine's disk slabs (kept by :mod:`kvshm.offload.disk`): a
    WRITE (``put``: indexed CPU blocks, only read, into fresh slots) or a READ (fresh
    CPU blocks, unindexed until the job completes without failure, from indexed slots).
    ``slots[i]`` is the slot of ``cpu_ids[i]`` on every rank; each is pinned in the
    disk's slot table until the job completes (a rank declared dead keeps them
    quarantined until it is fenced, like the CPU ids)."""

    slots: list[int]


AnyJob: TypeAlias = StoreJob | LoadJob | RemoteJob
"""A job of either kind, as the table holds it (``isinstance`` tells them apart)."""


@dataclass(frozen=True, slots=True)
class AckOutcome:
    """What one ack changed: the job just failed and/or just completed."""

    job: AnyJob
    newly_failed: bool
    complete: bool


class JobTable:
    """Jobs not yet acked by every live rank, keyed by id (insertion = id order)."""

    def __init__(self, world_size: int, counters: ManagerCounters) -> None:
        if type(world_size) is not int or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        self.world_size = world_size
        self.jobs: dict[int, AnyJob] = {}
        self.revoked: set[int] = set()  # declared dead, not yet fenced
        self.dead: set[int] = set()  # fenced: nothing of it can touch a block any more
        self._next_id = 1
        self._counters = counters

    def __len__(self) -> int:
        return len(self.jobs)

    def _next(self) -> tuple[int, set[int]]:
        """The next job id and the ranks it waits for: every live one (there must be
        one)."""
        waiting = set(range(self.world_size)) - self.dead - self.revoked
        assert waiting, "a job planned with every rank dead"
        job_id = self._next_id
        self._next_id += 1
        return job_id, waiting

    def new_store(self, step: int, gpu_ids: list[int], cpu_ids: list[int], *,
                  groups: list[int], keys: list[bytes], n_eager: int,
                  depths: list[int] | None = None) -> StoreJob:
        """Register a store job waiting for every live rank."""
        job_id, waiting = self._next()
        job = StoreJob(job_id, step, gpu_ids, cpu_ids, waiting, groups=groups, keys=keys,
                       n_eager=n_eager, depths=depths if depths is not None else [])
        self.jobs[job_id] = job
        return job

    def new_load(self, step: int, parts: list[LoadPart], gpu_ids: list[int],
                 cpu_ids: list[int]) -> LoadJob:
        """Register a load job of ``parts`` (``gpu_ids`` / ``cpu_ids``: their ids
        concatenated) waiting for every live rank."""
        job_id, waiting = self._next()
        job = LoadJob(job_id, step, gpu_ids, cpu_ids, waiting, parts=parts)
        self.jobs[job_id] = job
        return job

    def new_remote(self, step: int, cpu_ids: list[int], keys: list[bytes],
                   depths: list[int], *, put: bool, req_id: str = "",
                   keep: bool = False) -> RemoteJob:
        """Register a remote-tier job waiting for every live rank."""
        job_id, waiting = self._next()
        job = RemoteJob(job_id, step, [], cpu_ids, waiting, put=put, keys=keys,
                        depths=depths, req_id=req_id, keep=keep)
        self.jobs[job_id] = job
        return job

    def new_disk(self, step: int, cpu_ids: list[int], keys: list[bytes], depths: list[int],
                 slots: list[int], *, write: bool, req_id: str = "") -> DiskJob:
        """Register a disk-tier job waiting for every live rank."""
        job_id, waiting = self._next()
        job = DiskJob(job_id, step, [], cpu_ids, waiting, put=write, keys=keys,
                      depths=depths, req_id=req_id, slots=slots)
        self.jobs[job_id] = job
        return job

    def ack(self, job_id: int, rank: int, ok: bool, cause: LoadFailure, *,
            nack: bool = True) -> AckOutcome | None:
        """Count one ack. None (counted, ignored) for an unknown job or a rank that is not
        waited for (a duplicate, a dead rank, a rank out of range). ``cause`` labels a
        failure; ``nack`` False: a failed ack that is no failure of the rank's own (a
        fence at the close), ``nacked`` left as it was. A completed job leaves the
        table."""
        job = self.jobs.get(job_id)
        if job is None:
            self._counters.acks_unknown += 1
            return None
        if rank not in job.waiting:
            self._counters.acks_duplicate += 1
            return None
        job.waiting.discard(rank)
        if not ok and nack:
            job.nacked = True
        newly_failed = not ok and job.fail(cause)
        if newly_failed:
            self._counters.jobs_failed += 1
        complete = not job.waiting
        if complete:
            del self.jobs[job_id]
        return AckOutcome(job, newly_failed, complete)

    def revoke_rank(self, rank: int) -> list[AnyJob]:
        """Declare ``rank`` dead: the jobs it has not acked, newly failed (RANK_DIED), are
        returned; they keep waiting for it (quarantined) until :meth:`fence_rank`."""
        self.check_rank(rank)
        if rank in self.dead or rank in self.revoked:
            return []
        self.revoked.add(rank)
        out: list[AnyJob] = []
        for job in self.jobs.values():
            if rank in job.waiting:
                if job.fail(LoadFailure.RANK_DIED):
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

    def check_rank(self, rank: int) -> None:
        """ConfigError unless ``rank`` is an int in ``[0, world_size)``."""
        n = self.world_size
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < n:
            raise ConfigError(f"rank {rank!r} out of range for world_size {n}: a rank is "
                              f"an int in [0, {n})")

    def fence_rank(self, rank: int, *, nack: bool = True) -> list[AckOutcome]:
        """``rank`` can touch no block any more (revoked or not before): every job it
        has not acked gets a failed ack from it (``nack``: as :meth:`ack`'s), so those
        jobs can complete."""
        self.check_rank(rank)
        if rank in self.dead:
            return []
        self.revoked.discard(rank)
        self.dead.add(rank)
        out: list[AckOutcome] = []
        for job in list(self.jobs.values()):
            if rank in job.waiting:
                outcome = self.ack(job.job_id, rank, False, LoadFailure.RANK_DIED, nack=nack)
                assert outcome is not None
                out.append(outcome)
        return out
