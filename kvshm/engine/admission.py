"""Which requests reach the manager: every one but those first listed before READY.

Before READY there is no manager, so it never sees those requests arrive and cannot
track their tables. :class:`Admission` remembers them (from the step that lists them
before READY until they finish) and keeps them away from the manager for their whole
life: no CPU hit (it would be a pin nobody releases and a load nobody reports), phase
B ignored, left out of every step, finished without offload.

Ordering: every request id a call names is checked to be a ``str``
(:func:`check_id`, InvalidRequest otherwise) before any id meets a set, so a refused
call records nothing; a kept-out request that finishes in a step is forgotten only
once the manager accepted that step.
"""

from __future__ import annotations

from dataclasses import replace

from kvshm.errors import InvalidRequest
from kvshm.types import StepInput

__all__ = ["Admission", "check_id", "not_a_step_input"]


def check_id(call: str, req_id: object) -> None:
    """A request id must be a str (InvalidRequest otherwise) before it meets a set."""
    if not isinstance(req_id, str):
        raise InvalidRequest(call, None, "req_id", f"must be a str, got {req_id!r}")


def _check_ids(inp: StepInput) -> None:
    try:
        ids = (*(r.req_id for r in inp.requests), *inp.finished)
    except (AttributeError, TypeError) as e:  # not a StepInput of ScheduledRequests
        raise not_a_step_input(inp, e) from None
    for rid in ids:
        check_id("build_step", rid)


def not_a_step_input(inp: object, error: Exception) -> InvalidRequest:
    """What a step given something other than a StepInput (of ScheduledRequests) raises,
    before anything read it changes state."""
    return InvalidRequest("build_step", None, "inp", f"a StepInput of ScheduledRequests "
                          f"expected, got {type(inp).__name__} ({error})")


class Admission:
    """The requests kept away from the manager (see the module docstring)."""

    def __init__(self) -> None:
        self.pre_ready: set[str] = set()  # listed before READY and not finished yet

    def kept_out(self, req_id: str) -> bool:
        """True for a request first listed before READY."""
        return req_id in self.pre_ready

    def before_ready(self, inp: StepInput) -> None:
        """A step while there is no manager: remember its requests, forget its finished."""
        _check_ids(inp)
        self.pre_ready.update(r.req_id for r in inp.requests)
        self.pre_ready.difference_update(inp.finished)

    def admitted(self, inp: StepInput) -> StepInput:
        """``inp`` without the kept-out requests (``inp`` itself when there are none)."""
        pre = self.pre_ready
        if not pre:
            return inp
        _check_ids(inp)
        return replace(inp, requests=[r for r in inp.requests if r.req_id not in pre],
                       finished=[f for f in inp.finished if f not in pre])

    def stepped(self, inp: StepInput) -> None:
        """The manager accepted ``admitted(inp)``: forget the kept-out requests that
        finished in it."""
        if self.pre_ready:
            self.pre_ready.difference_update(inp.finished)

    def finish(self, req_id: str) -> bool:
        """``req_id`` finished: True (and forgotten) if it was kept out."""
        if req_id in self.pre_ready:
            self.pre_ready.discard(req_id)
            return True
        return False
