"""What :class:`~kvshm.engine.Engine` and :class:`~kvshm.engine.SyncClient` share.

:class:`Facade` holds one :class:`~kvshm.engine.runtime.Runtime` and gives both public
faces the same scheduler calls (``lookup``, ``allocated``, ``step``, ``finished``,
``statistics``) behind one state guard, :meth:`Facade._enter`. Lifecycle states and
what each promises: :mod:`kvshm.engine.lifecycle`.

Ordering of every guarded call:

1. the guard: :class:`~kvshm.errors.StateError` once CLOSING or CLOSED (nothing else
   happens), then, for ``step`` (and ``SyncClient``'s own ``poll``, ``reset``,
   ``has_pending_work``), :meth:`Facade._service` -- ``SyncClient`` pumps the runtime
   there (rendezvous, done rings, hang check), ``Engine`` has nothing to do (its loop
   callbacks already did it). The per-request calls (``lookup``, ``allocated``,
   ``finished``) do not pump: a synchronous scheduler makes dozens of them a step, and
   they act on the state the step's own pump left (a pump costs ~10 µs: measured with
   ``tools.bench_vs_vllm``), and they inline the guard's state test;
2. the runtime call;
3. the after-hook, only when the runtime call returned: ``Engine`` publishes the load
   results that are now due to its waiters; ``SyncClient`` leaves them for ``poll`` (a
   face that does not override a hook does not call it).

Every call runs on the one thread that owns the runtime.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from typing import Any

from kvshm.engine.admission import not_a_step_input
from kvshm.engine.lifecycle import ENDED, EngineState
from kvshm.engine.runtime import Runtime
from kvshm.errors import StateError
from kvshm.stats import EngineStats
from kvshm.types import RequestView, StepInput, StepPlan

__all__ = ["Facade"]

# ENDED's members, tested by identity on the per-request path (``state in ENDED``
# hashes the Enum: a Python-level ``Enum.__hash__`` call per test)
_CLOSING, _CLOSED = EngineState.CLOSING, EngineState.CLOSED
assert ENDED == {_CLOSING, _CLOSED}


class Facade:
    """The shared half of ``Engine`` and ``SyncClient`` (see the module docstring)."""

    #: What a StateError calls this face ("engine 'x' is CLOSED").
    _kind = "engine"

    def __init__(self, core: Runtime) -> None:
        self._core = core
        cls = type(self)
        # the after-hooks a face overrides (the base ones do nothing and are not called)
        self._hooks_allocated = cls._after_allocated is not Facade._after_allocated
        self._hooks_step = cls._after_step is not Facade._after_step
        self._hooks_finished = cls._after_finished is not Facade._after_finished

    @property
    def state(self) -> EngineState:
        """The lifecycle state (:class:`~kvshm.engine.lifecycle.EngineState`)."""
        return self._core.state

    @property
    def disk_warming(self) -> bool:
        """The disk tier's start scan of its slabs has not ended and been applied yet:
        it serves nothing meanwhile (``EngineStats.disk["warming"]``)."""
        return self._core.disk_warming

    @property
    def owner_pid(self) -> int | None:
        """The process this engine belongs to where that is not this one (a forked
        child: :mod:`kvshm.engine.forks`); None in the process that opened it."""
        return self._core.owner_pid

    @property
    def name(self) -> str:
        """The rendezvous name (``kvshm stats --name`` takes it)."""
        return self._core.config.name

    @property
    def _ended(self) -> bool:
        """CLOSING or CLOSED: scheduler calls raise, closing again does nothing."""
        state = self._core.state
        return state is _CLOSING or state is _CLOSED

    # -- scheduler calls ---------------------------------------------------------------
    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """Phase A: the CPU hit in tokens beyond ``num_local_tokens`` (pinned until phase
        B); 0 unless READY; None: ask again later (see ``OffloadManager.lookup``)."""
        core = self._core
        state = core.state
        if state is _CLOSING or state is _CLOSED:  # _enter(service=False), inlined
            raise self._ended_error()
        return core.lookup(req, num_local_tokens)

    def lookup_skipped(self, req: RequestView) -> None:
        """Phase A for a request the host recomputes whatever kvshm holds (vLLM's
        ``skip_reading_prefix_cache``, set for prompt logprobs): no hit is pinned or read,
        and no ``allocated`` need follow; a P/D hand-off's manifest is read, so that the
        request's ``finished`` collects it (see ``OffloadManager.lookup_skipped``)."""
        core = self._core
        state = core.state
        if state is _CLOSING or state is _CLOSED:  # _enter(service=False), inlined
            raise self._ended_error()
        core.lookup_skipped(req)

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """Phase B: where the hit goes (see ``OffloadManager.allocated``). The load's
        outcome: ``await Engine.wait_loaded(req_id)`` after ``step``, or
        ``SyncClient.poll``."""
        core = self._core
        state = core.state
        if state is _CLOSING or state is _CLOSED:  # _enter(service=False), inlined
            raise self._ended_error()
        core.allocated(req_id, gpu_block_ids, num_external_tokens)
        if self._hooks_allocated:
            self._after_allocated(req_id, num_external_tokens)

    def step(self, step_input: StepInput, *, service: bool = True) -> StepPlan:
        """Plan and post this step's transfers; never blocks, never raises on a full ring.
        ``service`` False skips the face's service (``SyncClient``: the pump) for a
        caller that serviced it just before, in the same critical section
        (``SyncClient.poll``): a Done that arrives in between is applied by the next
        pump, as if it had arrived after the step.

        Contract (SPAWN / standalone workers): call it only after the compute of every
        earlier step has finished writing the device caches.
        """
        self._enter(service=service)
        if self._hooks_step:  # (a face that reads the input again after the core)
            step_input = _materialized(step_input)
        plan = self._core.step(step_input)
        if self._hooks_step:
            self._after_step(step_input)
        return plan

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]], *,
                 tail_hash: bytes | None = None) -> bool:
        """The request is done; its unsaved full blocks go out in the next step. Always
        False (pins, not delayed frees; see ``OffloadManager.finished``). ``tail_hash``:
        a P/D prefill request's partial last block's hash
        (:func:`kvshm.hashing.tail_hash`), handed off with its full blocks."""
        core = self._core
        state = core.state
        if state is _CLOSING or state is _CLOSED:  # _enter(service=False), inlined
            raise self._ended_error()
        out = core.finished(req_id, num_confirmed_tokens, gpu_block_ids, tail_hash=tail_hash)
        if self._hooks_finished:
            self._after_finished(req_id)
        return out

    def transfer_params(self, req_id: str) -> dict[str, Any] | None:
        """After ``finished`` of a P/D prefill request (``do_remote_decode`` in its
        params) on an engine with a remote tier: the ``kv_transfer_params`` a decode
        engine needs (the hand-off's manifest; pass them with ``do_remote_prefill``);
        handed out once. None for any other request."""
        return self._core.transfer_params(req_id)

    def statistics(self) -> EngineStats:
        """A statistics snapshot (in every state, closed included)."""
        return self._core.statistics()

    # -- the guard and the hooks -------------------------------------------------------
    def _enter(self, *, service: bool = True) -> None:
        """The state guard every scheduler call passes first (the only copy); then the
        face's service unless ``service`` is False (the per-request calls)."""
        if self._ended:
            raise self._ended_error()
        if service:
            self._service()

    def _ended_error(self) -> StateError:
        """What a call on an ended face raises (the only copy of its text)."""
        owner = self._core.owner_pid
        if owner is not None:
            return StateError(f"{self._kind} {self.name!r} belongs to process {owner}; "
                              f"this process ({os.getpid()}) is a fork of it and cannot "
                              "use it: create an engine of its own here")
        return StateError(f"{self._kind} {self.name!r} is {self._core.state.name}")

    def _service(self) -> None:
        """After the guard, before the runtime call (SyncClient: pump)."""

    def _after_allocated(self, req_id: str, num_external_tokens: int) -> None:
        """After a phase B the runtime accepted."""

    def _after_step(self, step_input: StepInput) -> None:
        """After a step the runtime planned."""

    def _after_finished(self, req_id: str) -> None:
        """After a finish the runtime accepted."""


def _materialized(inp: StepInput) -> StepInput:
    """``inp`` with any one-shot iterator among its collections made a tuple: the input
    check consumed a generator, and the face's own pass over ``finished`` (ending the
    waits of the requests listed) then found nothing -- their ``wait_loaded`` waited
    for good. Lists and tuples pass as they are (the per-step cost: three isinstance)."""
    try:
        lazy = (isinstance(inp.requests, Iterator) or isinstance(inp.finished, Iterator)
                or isinstance(inp.allocated_block_ids, Iterator))
    except AttributeError as e:
        raise not_a_step_input(inp, e) from None
    if lazy:
        return dataclasses.replace(
            inp, requests=_once(inp.requests), finished=_once(inp.finished),
            allocated_block_ids=_once(inp.allocated_block_ids))
    return inp


def _once(items: Any) -> Any:
    return tuple(items) if isinstance(items, Iterator) else items
