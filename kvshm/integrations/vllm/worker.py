"""Worker side of kvshm's vLLM connector (each vLLM worker process, one per TP x PP rank).

An embedded kvshm ``Worker`` copies blocks between this rank's KV cache and its host
pool; the connector only tells it when. Hook by hook:

* ``register_kv_caches`` -> :meth:`WorkerSide.register`: records the KV regions and
  attaches the Worker, which never blocks (vLLM calls this before the scheduler side
  exists; the first :meth:`bind` connects and says hello).
* ``bind_connector_metadata`` -> :meth:`bind`: ``begin_step(step, flush)``; remembers
  new load jobs' request ids and destinations from the metadata.
* ``start_load_kv`` -> ``submit_loads`` (after the forward is launched: on a GPU
  ordered after it with a CUDA event; on the CPU the forward has already run -- or,
  in a step with synchronous loads, is about to run --, and the Worker's CPU copy
  engine copies the loads right there, in this thread: ``inline``,
  :mod:`workers.cpu_copy`).
* Synchronous loads (``StepMeta.sync_reqs``, a CPU device: vLLM calls
  ``start_load_kv`` before the forward of a step that has them): after submitting,
  :meth:`start_loads` waits for this step's load jobs that carry them (at most
  ``cfg.hang_timeout_s``; an inline copy is already done), so the forward reads loaded
  blocks; their requests are never reported in ``finished_recving`` (vLLM runs them:
  it asserts a running request is not there), a failure goes out as block ids only
  (one KV cache group). A job that has not started by then (its Transfer queued behind
  a full command ring) is cancelled -- never copied -- and reported as failed blocks at
  once (counted ``sync_loads_late``): vLLM recomputes them. One still copying is waited
  for, with a warning every ``hang_timeout_s`` (``sync_loads_slow``): its copy writes
  blocks vLLM would recompute into and hand out again.
* ``wait_for_save`` -> ``submit_stores`` (after the step's compute, same ordering; on
  the CPU copied right there too, ``inline``: on a copy thread a store waited for the
  GIL after each piece while vLLM's loop stepped, and the finished request's blocks
  stayed held 40-60 ms instead of 2.5).
* ``get_finished`` -> :meth:`finished_loads`: ``poll`` the Worker (on a CPU device
  first waiting, at most ``CPU_LOAD_WAIT_S``, for the loads this rank submitted: vLLM
  calls it right after ``start_load_kv``, and a load reported now costs the request one
  engine step, not one per step until the copy thread finishes); the request ids of
  every load job this rank finished (ok or not), plus every request of the metadata's
  scheduler-side failures -- a synchronous load's request left out (vLLM runs it; its
  failure goes out as block ids). vLLM counts a request as loaded once every rank
  reported it.
* ``get_block_ids_with_load_errors`` -> ``reports.take_errors``: destinations of failed
  jobs and scheduler-side failures, reported no later than the request's id.
* ``get_transfer_results`` -> ``reports.take_failed_requests`` as ``failed_recving``
  with several KV groups (full + sliding window): block ids are only unique within a
  group there, and vLLM 0.32 raises on ``invalid_block_ids`` for such models
  (``Scheduler._handle_invalid_blocks``), so failures go per request and vLLM
  recomputes the whole request; ``take_errors`` then reports nothing. With one group,
  block ids keep the valid prefix of a failed load.

What is reported, and the rules that keep a request from being reported twice, are
:class:`~kvshm.integrations.vllm.load_reports.LoadReports`' (``side.reports``): this
side drives the Worker and hands it the Dones it collects.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvshm.errors import StateError
from kvshm.integrations.vllm.blocks import kv_layout
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.load_reports import LoadReports
from kvshm.integrations.vllm.records import StepMeta, WorkerCounters

if TYPE_CHECKING:
    from kvshm.ipc.protocol import Done
    from workers.worker import Worker

__all__ = ["FailLoadIds", "WorkerSide"]

log = logging.getLogger("kvshm.vllm")

CPU_LOAD_WAIT_S = 0.05
"""How long ``get_finished`` waits for a CPU device's submitted loads
(:meth:`WorkerSide._wait_loads`): a load of a few hundred 32-token blocks copies in
about a millisecond; the bound only keeps a stuck copy from stalling the engine."""


def _gone(worker: Worker) -> bool:
    """The Worker has left its scheduler for good (detached or closed)."""
    from workers.worker import Phase

    return worker.phase in (Phase.DETACHED, Phase.CLOSED)


class FailLoadIds(frozenset[int]):
    """Test hook (``test_fail_loads``): the job ids the copy engine must fail.

    A ``frozenset`` to the copy engine's ``FaultInjection``, which asks ``job_id in
    fail_job_ids`` when a job is submitted; the worker side adds the first N load jobs
    it is told about (at ``bind``, before their submission).
    """

    ids: set[int]
    budget: int

    def __new__(cls, budget: int) -> FailLoadIds:
        self = super().__new__(cls)
        self.ids = set()
        self.budget = budget
        return self

    def offer(self, job_id: int) -> None:
        """Mark ``job_id`` to fail while the budget lasts."""
        if self.budget > 0:
            self.budget -= 1
            self.ids.add(job_id)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self.ids


class WorkerSide:
    """See the module docstring."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self._worker: Worker | None = None
        self._regions: list[torch.Tensor] = []
        self._meta: StepMeta | None = None
        self._fail = FailLoadIds(cfg.test_fail_loads) if cfg.test_fail_loads else None
        self._cuda = False
        self.rank = -1
        self.counters = WorkerCounters()
        self.reports = LoadReports(self.counters)

    # -- lifecycle -------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any,
                 rank: int) -> None:
        """Build this rank's regions and attach the Worker (never blocks)."""
        if self._worker is not None:
            raise StateError("register_kv_caches called twice")
        kv = kv_layout(kv_caches, kv_cache_config.kv_cache_tensors,
                       int(kv_cache_config.num_blocks))
        self._regions = kv.rows
        self.reports.per_request_failures = len(kv_cache_config.kv_cache_groups) > 1
        self._cuda = self._regions[0].device.type == "cuda"
        from workers.worker import Worker as _Worker

        fault = None
        if self._fail is not None:
            from workers.cpu_copy import FaultInjection

            fault = FaultInjection(fail_job_ids=self._fail)
        self.rank = self.reports.rank = rank
        # on the CPU the request waits for its load: copy it in the caller (no hand-off)
        self._worker = _Worker.attach(self.cfg.name, rank, self.cfg.world_size, self._regions,
                                     kv_outer=False, fault=fault, inline=not self._cuda,
                                     meaning=(kv.dtypes, kv.shapes))
        nbytes = sum(int(r.shape[1]) for r in self._regions)
        log.info("kvshm: worker rank %d/%d attached to %r: %d region(s), %d bytes per block",
                 rank, self.cfg.world_size, self.cfg.name, len(self._regions), nbytes)

    def shutdown(self) -> None:
        """Close the Worker (idempotent)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            # DEBUG: the engine's final-statistics line is the one an operator reads
            log.debug("kvshm: worker rank %d closing: %s", self.rank,
                      self.statistics_of(worker))
            worker.close()

    def statistics(self) -> dict[str, Any]:
        """This rank's counters and the Worker's statistics."""
        return self.statistics_of(self._worker)

    def statistics_of(self, worker: Worker | None) -> dict[str, Any]:
        out: dict[str, Any] = {"rank": self.rank, "connector": dict(vars(self.counters))}
        if worker is not None:
            out["worker"] = worker.statistics()
        return out

    # -- per step --------------------------------------------------------------------------
    def bind(self, meta: StepMeta) -> None:
        """``bind_connector_metadata``: begin the step (connects on the first call)."""
        self._meta = meta
        self.counters.steps += 1
        self.reports.listed(meta)
        if self._fail is not None:
            for job in meta.load_dsts:
                self._fail.offer(job)
        if self._worker is not None:
            self._worker.begin_step(meta.step, tuple(meta.flush))

    def start_loads(self) -> None:
        """``start_load_kv``: submit this step's loads."""
        if self._worker is not None and self._meta is not None:
            self._worker.submit_loads(self._meta.step, after=self._fence())
            if self._meta.sync_reqs:
                self._wait_sync(self._worker, self._meta)

    def _wait_sync(self, worker: Worker, meta: StepMeta) -> None:
        """Synchronous loads (module docstring): this step's jobs that carry one are
        finished before the forward; their Dones are reported by this step's
        ``get_finished``. A job still unfinished at the deadline is failed here: its
        blocks go out as load errors (vLLM recomputes them) and its late Done reports
        nothing more."""
        from kvshm.ipc import protocol

        sync = set(meta.sync_reqs)
        jobs = [j for j in meta.load_dsts if sync.intersection(meta.load_jobs.get(j, ()))]
        if not jobs:
            return
        self.counters.sync_load_waits += 1
        got = worker.wait(jobs, self.cfg.hang_timeout_s)
        self.reports.collected(got)
        missing = set(jobs) - {d.job_id for d in got}
        if not missing:
            return
        if _gone(worker):  # no Done will ever come (finished_loads' orphans)
            self.counters.loads_orphaned += len(missing)
            self.reports.collected(protocol.Done(j, self.rank, False, "CopyError: late")
                                   for j in sorted(missing))
            return
        # Not started yet (its Transfer queued behind a full command ring): cancelled,
        # never copied, so vLLM may recompute its blocks. Running: waited for, however
        # long -- a copy under way still writes blocks vLLM would recompute into, and
        # hand out again once the request ends (the rule: a block a rank may still touch
        # is never handed out again).
        cancelled = worker.cancel_unstarted(missing)
        for job in sorted(cancelled):
            self.counters.sync_loads_late += 1
            log.warning("kvshm: rank %d: synchronous load job %d had not reached the rank "
                        "before the forward; its blocks are recomputed", self.rank, job)
            self.reports.collected([protocol.Done(job, self.rank, False, "CopyError: late")])
        self._wait_running(worker, missing - cancelled)

    def _wait_running(self, worker: Worker, running: set[int]) -> None:
        """Wait for ``running`` (synchronous loads under way) to finish, warning every
        ``hang_timeout_s`` (counted ``sync_loads_slow``); stops early only when the
        worker is gone."""
        from kvshm.ipc import protocol

        while running:
            self.counters.sync_loads_slow += len(running)
            log.warning("kvshm: rank %d: synchronous load job(s) %s still copying after "
                        "%g s; the forward waits for them", self.rank, sorted(running),
                        self.cfg.hang_timeout_s)
            got = worker.wait(running, self.cfg.hang_timeout_s)
            self.reports.collected(got)
            running -= {d.job_id for d in got}
            if running and _gone(worker):
                self.counters.loads_orphaned += len(running)
                self.reports.collected(protocol.Done(j, self.rank, False, "CopyError: late")
                                       for j in sorted(running))
                return

    def submit_stores(self) -> None:
        """``wait_for_save``: submit this step's stores, after its compute."""
        if self._worker is not None and self._meta is not None:
            self._worker.submit_stores(self._meta.step, after=self._fence())

    def _fence(self) -> Any:
        """A CUDA event on the current stream (GPU); None on the CPU, whose forward runs
        in this thread (finished before these hooks, or, for a step's synchronous loads,
        not begun)."""
        if not self._cuda:
            return None
        from workers.cuda_copy import CudaFence

        return CudaFence.record()

    def finished_loads(self) -> set[str] | None:
        """``get_finished``'s receiving half: the request ids whose load this rank
        finished (:meth:`LoadReports.report
        <kvshm.integrations.vllm.load_reports.LoadReports.report>`).

        Once the Worker has left its scheduler for good (detached or closed), no Done
        will come for the load jobs it never received: they are reported failed here,
        so vLLM never waits for them.
        """
        worker = self._worker
        if worker is None:
            return self.reports.report((), gone=False) or None
        dones = worker.poll()
        if self.reports.waiting and not self._cuda:
            dones += self._wait_loads(worker, {d.job_id for d in dones})
        return self.reports.report(dones, gone=_gone(worker)) or None

    def _wait_loads(self, worker: Worker, have: set[int]) -> list[Done]:
        """CPU device: wait (at most :data:`CPU_LOAD_WAIT_S`) for the load jobs this
        rank has submitted and not yet reported, so this step reports them.

        vLLM calls ``get_finished`` right after ``start_load_kv``; on the CPU the copy
        thread has rarely finished by then, and each engine step that follows (the
        request waits in ``WAITING_FOR_REMOTE_KVS``, a busy loop holding the GIL the
        copy thread needs between its memmoves) adds to the request's time to first
        token: measured 2-40 idle steps a load on a loaded 2-core machine, where a
        synchronous copy takes exactly one. Waiting releases the GIL to the copy
        thread; a load still running at the deadline is reported by a later step (as
        before; counted ``load_waits_timed_out``). Jobs queued for a later step are
        not waited for (``Worker.wait`` ignores them)."""
        pending = self.reports.unreported(have)
        if not pending:
            return []
        self.counters.load_waits += 1
        got = worker.wait(pending, CPU_LOAD_WAIT_S)
        if len(got) < len(pending):
            self.counters.load_waits_timed_out += 1
        return got

    def clear(self) -> None:
        """``clear_connector_metadata``."""
        self._meta = None
