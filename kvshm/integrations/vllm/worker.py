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
* ``get_block_ids_with_load_errors`` -> :meth:`load_errors`: destinations of failed
  jobs and scheduler-side failures, reported no later than the request's id.
* ``get_transfer_results`` -> :meth:`take_failed_requests` as ``failed_recving`` with
  several KV groups (full + sliding window): block ids are only unique within a group
  there, and vLLM 0.32 raises on ``invalid_block_ids`` for such models
  (``Scheduler._handle_invalid_blocks``), so failures go per request and vLLM
  recomputes the whole request; :meth:`load_errors` then reports nothing. With one
  group, block ids keep the valid prefix of a failed load.

A job's request ids come from the metadata's ``load_jobs`` map, which lists a job until
every rank has acked it (or its outcome was reported); this side keeps its own copy from
the first step that lists a job until it sees the job's ``Done`` (its ack goes to the
scheduler in the same ``poll``), so a ``Done`` always finds its requests. A job it has
reported is remembered while still listed, so a later listing never registers it again
(it would be reported twice -- vLLM asserts on a request finished twice).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvshm.errors import StateError
from kvshm.integrations.vllm.blocks import kv_regions
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.records import StepMeta

if TYPE_CHECKING:
    from kvshm.ipc.protocol import Done
    from workers.worker import Worker

__all__ = ["FailLoadIds", "WorkerCounters", "WorkerSide"]

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


@dataclass
class WorkerCounters:
    """This rank's connector counters; monotonic."""

    steps: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    scheduler_failed_loads: int = 0
    error_blocks: int = 0
    dones_unknown: int = 0
    loads_orphaned: int = 0  # the Worker detached before their Done: reported failed
    failed_requests: int = 0  # reported as failed_recving (several KV groups)
    load_waits: int = 0  # get_finished waited for this rank's loads (CPU device)
    load_waits_timed_out: int = 0  # ... and some were still running at the deadline
    sync_load_waits: int = 0  # start_load_kv waited for a step's synchronous loads
    sync_loads_late: int = 0  # ... a job not started by the deadline: cancelled, failed
    sync_loads_slow: int = 0  # ... a job still copying at a deadline: waited for


class WorkerSide:
    """See the module docstring."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self._worker: Worker | None = None
        self._regions: list[torch.Tensor] = []
        self._meta: StepMeta | None = None
        self._job_reqs: dict[int, tuple[str, ...]] = {}
        self._job_dsts: dict[int, tuple[int, ...]] = {}
        # load jobs this rank already reported while the scheduler may still list them
        # (until every rank acked): never registered, so never reported, twice
        self._reported: set[int] = set()
        self._sched_failed: dict[str, tuple[int, ...]] = {}
        self._errors: set[int] = set()
        self._failed_reqs: set[str] = set()
        self.per_request_failures = False  # several KV groups: see the module docstring
        self._fail = FailLoadIds(cfg.test_fail_loads) if cfg.test_fail_loads else None
        # requests loaded synchronously whose load this rank has not reported yet
        self._sync: set[str] = set()
        # Dones that start_loads collected (synchronous loads) for this step's report
        self._early: list[Done] = []
        self._cuda = False
        self.rank = -1
        self.counters = WorkerCounters()

    # -- lifecycle -------------------------------------------------------------------------
    def register(self, kv_caches: Mapping[str, torch.Tensor], kv_cache_config: Any,
                 rank: int) -> None:
        """Build this rank's regions and attach the Worker (never blocks)."""
        if self._worker is not None:
            raise StateError("register_kv_caches called twice")
        self._regions = kv_regions(kv_caches, kv_cache_config.kv_cache_tensors,
                                   int(kv_cache_config.num_blocks))
        self.per_request_failures = len(kv_cache_config.kv_cache_groups) > 1
        self._cuda = self._regions[0].device.type == "cuda"
        from workers.worker import Worker as _Worker

        fault = None
        if self._fail is not None:
            from workers.cpu_copy import FaultInjection

            fault = FaultInjection(fail_job_ids=self._fail)
        self.rank = rank
        # on the CPU the request waits for its load: copy it in the caller (no hand-off)
        self._worker = _Worker.attach(self.cfg.name, rank, self.cfg.world_size, self._regions,
                                     kv_outer=False, fault=fault, inline=not self._cuda)
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
        done = self._reported
        for job, reqs in meta.load_jobs.items():
            if job not in self._job_reqs and job not in done:
                self._job_reqs[job] = tuple(reqs)
        if done:  # forget reported jobs the scheduler no longer lists (bounded)
            done.intersection_update(meta.load_jobs)
        for job, dsts in meta.load_dsts.items():
            self._job_dsts[job] = tuple(dsts)
            if self._fail is not None:
                self._fail.offer(job)
        if meta.failed_loads:
            self._sched_failed.update(meta.failed_loads)
        if meta.sync_reqs:
            self._sync.update(meta.sync_reqs)
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
        self._early += got
        missing = set(jobs) - {d.job_id for d in got}
        if not missing:
            return
        if _gone(worker):  # no Done will ever come (finished_loads' orphans)
            self.counters.loads_orphaned += len(missing)
            self._early += [protocol.Done(j, self.rank, False, "CopyError: late")
                            for j in sorted(missing)]
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
            self._early.append(protocol.Done(job, self.rank, False, "CopyError: late"))
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
            self._early += got
            running -= {d.job_id for d in got}
            if running and _gone(worker):
                self.counters.loads_orphaned += len(running)
                self._early += [protocol.Done(j, self.rank, False, "CopyError: late")
                                for j in sorted(running)]
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
        """``get_finished``'s receiving half: requests whose load this rank finished.

        Once the Worker has left its scheduler for good (detached or closed), no Done
        will come for the load jobs it never received: they are reported failed here,
        so vLLM never waits for them.
        """
        done: set[str] = set()
        worker = self._worker
        if worker is not None:
            dones = worker.poll()
            if self._early:
                dones, self._early = self._early + dones, []
            if self._job_reqs and not self._cuda:
                dones += self._wait_loads(worker, {d.job_id for d in dones})
            for d in dones:
                self._on_done(d.job_id, d.ok, done)
            if self._job_reqs and _gone(worker):
                for job in list(self._job_reqs):
                    self.counters.loads_orphaned += 1
                    self._on_done(job, False, done)
        if self._sched_failed:
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
        return done or None

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
        pending = [j for j in self._job_reqs if j not in have]
        if not pending:
            return []
        self.counters.load_waits += 1
        got = worker.wait(pending, CPU_LOAD_WAIT_S)
        if len(got) < len(pending):
            self.counters.load_waits_timed_out += 1
        return got

    def _on_done(self, job_id: int, ok: bool, done: set[str]) -> None:
        reqs = self._job_reqs.pop(job_id, None)
        dsts = self._job_dsts.pop(job_id, ())
        if reqs is not None:
            self._reported.add(job_id)
        if reqs is None:
            if not ok and dsts:
                self.counters.dones_unknown += 1
            return  # a store job (the scheduler side handles those)
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

    def load_errors(self) -> set[int]:
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

    def clear(self) -> None:
        """``clear_connector_metadata``."""
        self._meta = None
