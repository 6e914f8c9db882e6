"""Load bookkeeping for the manager: queued loads, what is being loaded, the outcomes.

The counterpart of :mod:`kvshm.offload.stores` for the other direction. A load goes
through three stages, and :class:`LoadBook` records each:

1. *queued* (``queue``, one :class:`~kvshm.offload.jobs.LoadPart` per request): phase B
   paired the request's accepted hit with GPU destinations; not sent yet. A newer phase
   B of the same request replaces it; the request's end, ``reset`` or a rank's death
   cancel it.
2. *in flight*: :meth:`LoadBook.plan` turns every queued part into one
   :class:`~kvshm.offload.jobs.LoadJob` per step (``job_reqs``: job id -> its request
   ids, listed in every ``StepPlan.load_jobs`` until the job completes).
3. *reported*: the job's requests are told the outcome once (:meth:`LoadBook.report`:
   at the job's first failure, or at its completion), as ``LoadResult``\\ s in
   ``results`` -- the manager's only queue of load outcomes, drained by
   ``take_load_results`` -- but for a part *superseded* first (:meth:`LoadBook.supersede`:
   its request ended, or a newer phase B of it came, while it was in flight; a result
   carries only the request id, so it would reach the request now using the id). A
   load that fails before it is sent (no pin, reset, rank death) is reported at once
   and also listed in the next ``StepPlan.failed_loads`` (``failed``).

Ownership: the CPU and GPU pins of a part are taken by the caller before
:meth:`LoadBook.enqueue` and belong to the book from then on: it releases them when the
part is cancelled or its job completes (every rank acked or is fenced), never earlier.

Invariants (checked by :mod:`kvshm.offload.invariants`):

* ``loading_cpu`` counts each CPU id once per queued part and per *unreported* load job
  that reads it: a lookup whose hit touches one asks again (a block being loaded may
  still be recomputed by its first reader);
* ``dst`` counts each GPU id once per queued part and per *uncompleted* load job that
  writes it: the store planner does not store such a block (it holds no valid KV yet);
* the load jobs in the job table are exactly the keys of ``job_reqs``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

from kvshm.ipc.protocol import Direction, Transfer, pack_ids
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.jobs import JobTable, LoadJob, LoadPart
from kvshm.offload.pool import BlockPool
from kvshm.types import GpuBlocks, LoadFailure, LoadResult

#: What an empty step hands out as ``failed_loads`` (read-only: never the live dict).
_NO_FAILED: Mapping[str, tuple[int, ...]] = MappingProxyType({})

__all__ = ["LoadBook", "Multiset"]


class Multiset:
    """Block ids, each with how many holders mark it; an id no holder marks is absent
    (a count is never 0 or negative: removing an unmarked id is a KeyError)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    @property
    def counts(self) -> Mapping[int, int]:
        """id -> holders, live (the same mapping for the set's life): hot callers test
        membership on it directly."""
        return self._counts

    def add(self, ids: Iterable[int]) -> None:
        """One more holder for each id (repeats count)."""
        counts = self._counts
        for b in ids:
            counts[b] = counts.get(b, 0) + 1

    def remove(self, ids: Iterable[int]) -> None:
        """One holder less for each id (repeats count); an id left with none goes."""
        counts = self._counts
        for b in ids:
            n = counts[b] - 1
            if n:
                counts[b] = n
            else:
                del counts[b]

    def __contains__(self, b: object) -> bool:
        return b in self._counts

    def __iter__(self) -> Iterator[int]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"Multiset({self._counts})"


class LoadBook:
    """Every record of a load from phase B to its outcome; see the module docstring."""

    def __init__(self, cpu: BlockPool, gpu: GpuBlocks, counters: ManagerCounters) -> None:
        self.cpu = cpu
        self.gpu = gpu
        self.counters = counters
        self.queue: dict[str, LoadPart] = {}
        self.loading_cpu = Multiset()
        """CPU ids read by queued loads and unreported load jobs."""
        self.dst = Multiset()
        """GPU ids written by queued loads and uncompleted load jobs."""
        self.job_reqs: dict[int, tuple[str, ...]] = {}
        """Load jobs in flight -> their request ids, in part order."""
        self.failed: dict[str, tuple[int, ...]] = {}
        """Loads failed before they were sent, not yet in a plan -> their destinations."""
        self.results: list[LoadResult] = []
        """Outcomes not yet taken (``take_load_results``)."""

    def pending(self) -> bool:
        """Anything queued or not yet reported (in-flight jobs are the job table's)."""
        return bool(self.queue or self.results or self.failed)

    def is_loading(self, cpu_ids: Iterable[int]) -> bool:
        """True when a queued or unreported load reads any of ``cpu_ids``."""
        loading = self.loading_cpu.counts
        return bool(loading) and not loading.keys().isdisjoint(cpu_ids)

    # ---- queued loads ----------------------------------------------------------------

    def enqueue(self, part: LoadPart) -> None:
        """Queue ``part`` (its CPU and GPU pins already held, now the book's); an older
        queued part of the same request is cancelled."""
        self.cancel(part.req_id)
        self.queue[part.req_id] = part
        self.loading_cpu.add(part.cpu_ids)
        self.dst.add(part.gpu_ids)
        self.counters.loads_planned += 1

    def cancel(self, req_id: str) -> LoadPart | None:
        """Release ``req_id``'s queued (never sent) load, if any: marks and pins."""
        part = self.queue.pop(req_id, None)
        if part is not None:
            self._release(part)
        return part

    def _release(self, part: LoadPart) -> None:
        self.loading_cpu.remove(part.cpu_ids)
        self.dst.remove(part.gpu_ids)
        self.cpu.free(reversed(part.cpu_ids))
        self.gpu.free(reversed(part.gpu_ids))

    def fail_now(self, req_id: str, dests: Sequence[int], cause: LoadFailure) -> None:
        """A load that will not be sent: report it (``dests`` are recomputed)."""
        ids = tuple(dests)
        self.results.append(LoadResult(req_id=req_id, ok=False, failed_block_ids=ids,
                                       cause=cause, num_tokens=0))
        self.failed[req_id] = ids
        self.counters.loads_failed += 1

    def drop_queued(self, cause: LoadFailure) -> None:
        """Cancel and fail every queued load (``reset``, a rank's death)."""
        for rid, part in list(self.queue.items()):
            self._release(part)
            self.fail_now(rid, tuple(part.gpu_ids) + part.failed_ids, cause)
        self.queue.clear()

    # ---- jobs ------------------------------------------------------------------------

    def plan(self, step: int, jobs: JobTable) -> Transfer | None:
        """This step's load: every queued part, in queue order, as one job."""
        if not self.queue:
            return None
        parts = list(self.queue.values())
        self.queue.clear()
        cpu_ids = [b for p in parts for b in p.cpu_ids]
        gpu_ids = [b for p in parts for b in p.gpu_ids]
        job = jobs.new_load(step, parts, gpu_ids, cpu_ids)
        self.job_reqs[job.job_id] = tuple(p.req_id for p in parts)
        return Transfer(step, job.job_id, Direction.LOAD, pack_ids(cpu_ids), pack_ids(gpu_ids))

    def listed_jobs(self, jobs: JobTable) -> dict[int, tuple[str, ...]]:
        """``StepPlan.load_jobs``: load jobs not yet acked by every live rank. A job that
        waits only for revoked ranks (quarantined until they are fenced, possibly for
        the engine's life) is no longer listed: its outcome was reported at the verdict,
        and every rank saw it listed in the step that planned it."""
        if not self.job_reqs:
            return {}
        if not jobs.revoked:
            return dict(self.job_reqs)
        table, revoked = jobs.jobs, jobs.revoked
        return {j: r for j, r in self.job_reqs.items() if not table[j].waiting <= revoked}

    def supersede(self, req_id: str, jobs: JobTable) -> None:
        """``req_id``'s loads in flight, not reported yet, will not be: the request
        ended, or a newer phase B of it came. Their outcome would otherwise reach the
        request using the id now (re-admitted after a preemption, or a new request
        reusing an ended one's id) while its own load may still be writing. Pins and
        marks are released at completion as before; the outcome is counted
        (``load_results_superseded``). O(load jobs in flight)."""
        table = jobs.jobs
        for job_id, rids in self.job_reqs.items():
            if req_id in rids:
                job = table[job_id]
                assert isinstance(job, LoadJob)
                if not job.reported:
                    for part in job.parts:
                        if part.req_id == req_id:
                            part.superseded = True

    def pending_for(self, req_id: str, jobs: JobTable) -> bool:
        """``req_id`` has a load queued, or in flight and not superseded or reported."""
        if req_id in self.queue:
            return True
        table = jobs.jobs
        for job_id, rids in self.job_reqs.items():
            if req_id in rids:
                job = table[job_id]
                assert isinstance(job, LoadJob)
                if not job.reported and any(p.req_id == req_id and not p.superseded
                                            for p in job.parts):
                    return True
        return False

    def report(self, job: LoadJob) -> None:
        """Tell ``job``'s requests its outcome, once (at the first failure, or at
        completion), but for superseded parts; from then on their CPU blocks no longer
        count as being loaded."""
        if job.reported:
            return
        job.reported = True
        for part in job.parts:
            self.loading_cpu.remove(part.cpu_ids)
            result = self._outcome(job, part)
            if part.superseded:
                self.counters.load_results_superseded += 1
            else:
                self.results.append(result)

    def _outcome(self, job: LoadJob, part: LoadPart) -> LoadResult:
        if job.failed:
            assert job.cause is not None
            self.counters.loads_failed += 1
            return LoadResult(req_id=part.req_id, ok=False,
                              failed_block_ids=tuple(part.gpu_ids) + part.failed_ids,
                              cause=job.cause, num_tokens=0)
        self.counters.loaded_blocks += len(part.cpu_ids)
        if part.failed_ids:
            self.counters.loads_failed += 1  # as when phase B fails it (``fail_now``)
            return LoadResult(req_id=part.req_id, ok=False, failed_block_ids=part.failed_ids,
                              cause=LoadFailure.WINDOW_MISSING, num_tokens=0)
        return LoadResult(req_id=part.req_id, ok=True, failed_block_ids=(), cause=None,
                          num_tokens=part.num_tokens)

    def complete(self, job: LoadJob) -> None:
        """Every rank acked or is fenced: report (if not yet), then release the job's
        destination marks and its pins (tail-first)."""
        self.report(job)
        self.dst.remove(job.gpu_ids)
        del self.job_reqs[job.job_id]
        self.cpu.free(reversed(job.cpu_ids))
        self.gpu.free(reversed(job.gpu_ids))

    # ---- outcomes --------------------------------------------------------------------

    def take_results(self) -> list[LoadResult]:
        """The outcomes since the last call, each handed out exactly once."""
        out, self.results = self.results, []
        return out

    def take_failed(self) -> Mapping[str, tuple[int, ...]]:
        """``StepPlan.failed_loads``: the loads failed before they were sent since the
        last plan. The mapping handed out is never written again (an empty step gets a
        shared read-only empty one, not this book's live dict)."""
        failed = self.failed
        if not failed:
            return _NO_FAILED
        self.failed = {}
        return failed
