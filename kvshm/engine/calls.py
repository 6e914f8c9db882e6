"""The scheduler's calls on the runtime: lookup, allocated, step, finished and the
queries beside them.

:class:`SchedulerCalls` is a base of :class:`~kvshm.engine.runtime.Runtime` (one object:
no extra call per request); it reads the runtime's records declared below and owns
none of them. Every call runs on the runtime's one thread.

Rules kept here:

* Before READY there is no manager: ``lookup`` answers 0, ``allocated`` and
  ``finished`` do nothing, ``step`` plans nothing and records the listed requests, which
  the manager never sees for life (:mod:`~kvshm.engine.admission`).
* ``step`` posts the plan's store before its load, to every live rank, in that order
  (job ids increase on every rank), then its remote and disk jobs; a remote or disk
  message no rank could take fails at once
  (``on_done(.., False)``), which releases its pins.
* A request id that is not a ``str`` is refused with ``InvalidRequest`` before anything
  changes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from kvshm.config import EngineConfig
from kvshm.engine.admission import Admission, check_id
from kvshm.engine.dispatch import Dispatcher
from kvshm.engine.lifecycle import EngineState
from kvshm.engine.snapshot import CoreCounters
from kvshm.engine.startup import log
from kvshm.ipc.protocol import Disk, Remote
from kvshm.offload.manager import OffloadManager
from kvshm.types import LoadResult, RequestView, StepInput, StepPlan

__all__ = ["SchedulerCalls"]

_READY = EngineState.READY
_DEBUG = logging.DEBUG


class SchedulerCalls:
    """See the module docstring; ``Runtime`` sets every attribute below."""

    config: EngineConfig
    manager: OffloadManager | None
    counters: CoreCounters
    _state: EngineState
    _admission: Admission
    _jobs: Dispatcher

    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """Phase A; 0 until READY, once FAILED, and for a request kept out of the manager
        (:mod:`~kvshm.engine.admission`: ``allocated`` ignores it too)."""
        rid = req.req_id
        if type(rid) is not str:
            check_id("lookup", rid)  # InvalidRequest unless a str subclass
        manager = self.manager
        pre = self._admission.pre_ready  # kept_out, inlined (a call per lookup)
        if manager is None or self._state is not _READY or (pre and rid in pre):
            self.counters.lookups_not_ready += 1
            return 0
        hit = manager.lookup(req, num_local_tokens)
        if hit is not None:
            counters = self.counters
            more = req.num_tokens - num_local_tokens
            if more > 0:
                counters.lookup_tokens += more
            if hit > 0:
                counters.lookups_hit += 1
        if log.isEnabledFor(_DEBUG):
            log.debug("kvshm engine %r: lookup %r: %s CPU hit token(s) beyond %d local",
                      self.config.name, rid, hit, num_local_tokens)
        return hit

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """Phase B (ignored before READY: every lookup then returned 0)."""
        if type(req_id) is not str:
            check_id("allocated", req_id)
        manager = self.manager
        pre = self._admission.pre_ready
        if manager is None or (pre and req_id in pre):
            return
        manager.allocated(req_id, gpu_block_ids, num_external_tokens)

    def step(self, inp: StepInput) -> StepPlan:
        """Build this step's plan and post its transfers to every live rank."""
        manager = self.manager
        if manager is None:
            self._admission.before_ready(inp)
            return StepPlan(inp.step)
        plan = manager.build_step(self._admission.admitted(inp))
        self._admission.stepped(inp)
        for t in (plan.store, plan.load):
            if t is not None:
                self._jobs.post(t)
        msgs: Sequence[Remote | Disk] = (*plan.remote, *plan.disk) if plan.disk \
            else plan.remote
        for msg in msgs:
            for rank in self._jobs.post_remote(msg):
                manager.on_done(msg.job_id, rank, False)  # never sent: fails, unpins
        return plan

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]], *,
                 tail_hash: bytes | None = None) -> bool:
        """The request is done; always False (pins, not delayed frees)."""
        if type(req_id) is not str:
            check_id("finished", req_id)
        if (self._admission.pre_ready and self._admission.finish(req_id)
                or self.manager is None):
            return False
        return self.manager.finished(req_id, num_confirmed_tokens, gpu_block_ids,
                                     tail_hash=tail_hash)

    def transfer_params(self, req_id: str) -> dict[str, Any] | None:
        """A finished P/D prefill request's ``kv_transfer_params`` (once), else None."""
        return None if self.manager is None else self.manager.transfer_params(req_id)

    def reset(self) -> bool:
        """Drop the CPU index; True once nothing is in flight."""
        return self.manager is None or self.manager.reset()

    def has_pending_work(self) -> bool:
        """True while any job is queued, in flight or not yet acked by every live rank."""
        return self.manager is not None and self.manager.has_pending_work()

    def jobs_in_flight(self) -> int:
        """Jobs posted and not yet acked by every live rank."""
        return 0 if self.manager is None else self.manager.num_jobs_in_flight

    def take_load_results(self) -> list[LoadResult]:
        """Load outcomes decided since the last call, each exactly once: the manager's
        queue is the only one (nothing is copied on the way)."""
        return [] if self.manager is None else self.manager.take_load_results()
