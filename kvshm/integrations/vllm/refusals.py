"""The vLLM requests kvshm refused a call for, on the scheduler side.

kvshm refuses a call with ``InvalidRequest`` (nothing changed); raising it into vLLM's
scheduler would kill the engine core, so the connector leaves that request out of
offload instead: from the refusal on, its lookups answer 0 and the step listings skip
it, until it ends. A phase B that accepted tokens from a lookup and was refused leaves
vLLM waiting for blocks nobody loads: those destinations travel in the next step's
metadata as a failed load (vLLM recomputes them). Each refusal is counted
(``requests_refused``) and logged once per kind (call and field): a bug in an engine
refuses the same way every step.
"""

from __future__ import annotations

import logging

from kvshm.errors import InvalidRequest
from kvshm.integrations.vllm.records import SchedulerCounters

__all__ = ["Refusals"]

log = logging.getLogger("kvshm.vllm")


class Refusals:
    """See the module docstring. ``ids``: the refused requests still alive (a plain set:
    the hot paths test membership on it directly)."""

    __slots__ = ("_counters", "_loads", "_logged", "ids")

    def __init__(self, counters: SchedulerCounters) -> None:
        self._counters = counters
        self.ids: set[str] = set()
        self._logged: set[tuple[str, str]] = set()
        self._loads: dict[str, tuple[int, ...]] = {}

    def refuse(self, rid: str, exc: InvalidRequest) -> None:
        """kvshm refused a call for ``rid``: count it, log it once per kind, and leave
        the request out of offload from now on."""
        self._counters.requests_refused += 1
        self.ids.add(rid)
        kind = (exc.call, exc.field.split("[", 1)[0])
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("kvshm refused %s for request %s (%s); that request goes without "
                      "offload (further refusals of this kind are only counted)",
                      exc.call, rid, exc)

    def refuse_load(self, rid: str, dsts: tuple[int, ...]) -> None:
        """``rid``'s phase B was refused with tokens accepted: vLLM expects ``dsts``
        filled; they fail in the next metadata (:meth:`take_loads`)."""
        self._loads[rid] = dsts

    def take_loads(self) -> dict[str, tuple[int, ...]]:
        """The refused loads since the last call (request -> destinations), once."""
        out = self._loads
        if out:
            self._loads = {}
        return out

    def forget(self, rid: str) -> None:
        """``rid`` ended: a new request may reuse its id."""
        self.ids.discard(rid)
