"""What one vLLM worker rank owes vLLM about loads, from a job's listing to its report.

:class:`LoadReports` is held by the worker side (:class:`~kvshm.integrations.vllm.worker.
WorkerSide`, ``side.reports``), which drives the Worker and hands this object the Dones
it collects. Three hooks read it: ``get_finished`` (:meth:`LoadReports.report`: the
request ids whose load this rank finished, ok or not), ``get_block_ids_with_load_errors``
(:meth:`LoadReports.take_errors`) and ``get_transfer_results``
(:meth:`LoadReports.take_failed_requests`).

Invariants, at every return:

* A job's request ids are kept from the first step that lists it (``StepMeta.load_jobs``)
  until its Done is reported, and a reported job is remembered while the scheduler
  still lists it (until every rank acked), so a later listing never registers it again:
  each request is reported finished at most once per load (vLLM asserts on a request
  finished twice). The memory of reported jobs is bounded by the listing.
* A synchronous load's request (``StepMeta.sync_reqs``: vLLM runs it in the same step)
  is never reported finished; its failure goes out as block ids only.
* A failed load's destinations are reported no later than its request id: with one KV
  group as block ids (:meth:`take_errors`), with several as the request id
  (:meth:`take_failed_requests`; block ids are only unique within a group there).
* Once the Worker has left its scheduler for good, every job still unreported is
  reported failed (counted ``loads_orphaned``): no Done will come for it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvshm.integrations.vllm.records import StepMeta, WorkerCounters

if TYPE_CHECKING:
    from kvshm.ipc.protocol import Done

__all__ = ["LoadReports"]

log = logging.getLogger("kvshm.vllm")


class LoadReports:
    """A rank's load jobs between their listing and their report (module docstring)."""

    def __init__(self, counters: WorkerCounters) -> None:
        self.counters = counters
        self.rank = -1  # for the log lines (the worker side's register sets it)
        #: several KV groups: failures go per request, not as block ids
        self.per_request_failures = False
        self._job_reqs: dict[int, tuple[str, ...]] = {}
        self._job_dsts: dict[int, tuple[int, ...]] = {}
        # load jobs this rank already reported while the scheduler may still list them
        # (until every rank acked): never registered, so never reported, twice
        self._reported: set[int] = set()
        self._sched_failed: dict[str, tuple[int, ...]] = {}
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        # requests loaded synchronously whose load this rank has not reported yet
        self._sync: set[str] = set()
        # Dones collected before get_finished (synchronous loads) for its report
        self._early: list[Done] = []

    def listed(self, meta: StepMeta) -> None:
        """A step's metadata: its new load jobs, their destinations, the scheduler's
        failed loads and synchronous requests."""
        done = self._reported
        for job, reqs in meta.load_jobs.items():
            if job not in self._job_reqs and job not in done:
                self._job_reqs[job] = tuple(reqs)
        if done:  # forget reported jobs the scheduler no longer lists (bounded)
            done.intersection_update(meta.load_jobs)
        for job, dsts in meta.load_dsts.items():
            self._job_dsts[job] = tuple(dsts)
        if meta.failed_loads:
            self._sched_failed.update(meta.failed_loads)
        if meta.sync_reqs:
            self._sync.update(meta.sync_reqs)

    def collected(self, dones: Iterable[Done]) -> None:
        """Dones collected ahead of ``get_finished`` (a step's synchronous loads, or
        failures made up for jobs that never ran): reported by the next :meth:`report`."""
        self._early += dones

    @property
    def waiting(self) -> bool:
        """Some listed load job has not been reported yet."""
        return bool(self._job_reqs)

    def unreported(self, have: Iterable[int]) -> list[int]:
        """The listed jobs not yet reported, neither in ``have`` nor collected."""
        seen = set(have)
        seen.update(d.job_id for d in self._early)
        return [j for j in self._job_reqs if j not in seen]

    def report(self, dones: Sequence[Done], *, gone: bool) -> set[str]:
        """``get_finished``'s request ids: those of the jobs the Dones collected earlier
        and ``dones`` finish (ok or not), of every unreported job when the Worker is
        ``gone``, and of the scheduler's failed loads (synchronous ones left out)."""
        done: set[str] = set()
        if self._early:
            dones, self._early = [*self._early, *dones], []
        for d in dones:
            self._on_done(d.job_id, d.ok, done)
        if gone and self._job_reqs:
            for job in list(self._job_reqs):
                self.counters.loads_orphaned += 1
                self._on_done(job, False, done)
        if self._sched_failed:
            self._report_sched_failed(done)
        return done

    def _report_sched_failed(self, done: set[str]) -> None:
        sync = self._sync
        for rid, dsts in self._sched_failed.items():
            if rid in sync:  # vLLM runs it: block ids only
                sync.discard(rid)
            else:
                done.add(rid)
            self._failed_reqs.add(rid)
            self._errors.update(dsts)
            self.counters.scheduler_failed_loads += 1
        self._sched_failed.clear()

    def _on_done(self, job_id: int, ok: bool, done: set[str]) -> None:
        reqs = self._job_reqs.pop(job_id, None)
        dsts = self._job_dsts.pop(job_id, ())
        if reqs is None:
            if not ok and dsts:
                self.counters.dones_unknown += 1
            return  # a store job (the scheduler side handles those)
        self._reported.add(job_id)
        sync = self._sync
        if sync:
            done.update(r for r in reqs if r not in sync)
            sync.difference_update(reqs)
        else:
            done.update(reqs)
        if ok:
            self.counters.loads_done += 1
            return
        self.counters.loads_failed += 1
        self._failed_reqs.update(reqs)
        self._errors.update(dsts)
        first = self.counters.loads_failed == 1
        log.log(logging.WARNING if first else logging.DEBUG,
                "kvshm: rank %d: load job %d failed; %d block(s) of %s recomputed%s",
                self.rank, job_id, len(dsts), sorted(reqs),
                " (further failures: DEBUG lines, counted)" if first else "")

    def take_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: failed destinations since the last call
        (none with several KV groups: those fail per request)."""
        out, self._errors = self._errors, set()
        if self.per_request_failures:
            return set()
        self.counters.error_blocks += len(out)
        return out

    def take_failed_requests(self) -> set[str]:
        """``failed_recving`` of ``get_transfer_results``: requests whose load failed
        since the last call, reported together with (or after) their finished id; empty
        with one KV group (block ids carry the failure there)."""
        out, self._failed_reqs = self._failed_reqs, set()
        if not self.per_request_failures:
            return set()
        self.counters.failed_requests += len(out)
        return out
