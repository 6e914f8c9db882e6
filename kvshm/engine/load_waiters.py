"""The load outcomes an asyncio caller awaits (:meth:`kvshm.engine.Engine.wait_loaded`).

One :class:`LoadWaiters` per :class:`~kvshm.engine.Engine`. Per request it keeps whether
a load is *pending* (accepted in phase B and not yet awaited to its end), the result
that came before anyone waited for it (*kept*), and the futures of the tasks waiting.

Invariants:

* A result is never dropped while its request's load is pending: it goes to the live
  waiters, else it is kept for the next :meth:`wait` (a waiter cancelled in the turn its
  result came keeps it too).
* Nothing is kept and nobody waits for a request that ended (:meth:`end`: its waiters
  get ``REQUEST_FINISHED``) or once the engine closed (:meth:`fail_all`).
* A request's new load (re-admitted after a preemption) drops a result kept from its
  earlier one (:meth:`expect`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from kvshm.errors import StateError
from kvshm.types import LoadFailure, LoadResult

__all__ = ["LoadWaiters"]


class LoadWaiters:
    """See the module docstring."""

    def __init__(self) -> None:
        self._waiters: dict[str, list[asyncio.Future[LoadResult]]] = {}
        self._kept: dict[str, LoadResult] = {}
        self._pending: set[str] = set()

    def expect(self, req_id: str) -> None:
        """``req_id``'s phase B accepted a load: a later :meth:`wait` may wait for it."""
        self._kept.pop(req_id, None)
        self._pending.add(req_id)

    def end(self, req_id: str) -> None:
        """``req_id`` ended: nothing is kept for it, its waiters get REQUEST_FINISHED."""
        self._pending.discard(req_id)
        self._kept.pop(req_id, None)
        for fut in self._waiters.pop(req_id, ()):
            if not fut.done():
                fut.set_result(LoadResult(req_id, False, (), LoadFailure.REQUEST_FINISHED, 0))

    def publish(self, results: Iterable[LoadResult]) -> None:
        """Hand each result to its request's live waiters; with none (no waiter, or only
        cancelled ones not yet cleaned up) keep it while the load is pending."""
        for res in results:
            handed = False
            for fut in self._waiters.pop(res.req_id, ()):
                if not fut.done():
                    fut.set_result(res)
                    handed = True
            if not handed and res.req_id in self._pending:
                self._kept[res.req_id] = res

    def fail_all(self, cause: LoadFailure) -> None:
        """Every waiter gets a failed result with ``cause`` (the engine closed)."""
        for req_id, waiters in list(self._waiters.items()):
            for fut in waiters:
                if not fut.done():
                    fut.set_result(LoadResult(req_id, False, (), cause, 0))
        self._waiters.clear()

    def idle(self) -> bool:
        """Nothing pending, kept or awaited (for tests and checks)."""
        return not (self._waiters or self._kept or self._pending)

    async def wait(self, req_id: str) -> LoadResult:
        """``req_id``'s load outcome. StateError when no load of it is pending.
        Cancelling it cancels only this wait: a result that came meanwhile is kept."""
        if req_id in self._kept:
            self._pending.discard(req_id)
            return self._kept.pop(req_id)
        if req_id not in self._pending:
            raise StateError(f"request {req_id!r} has no load pending")
        fut: asyncio.Future[LoadResult] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(req_id, []).append(fut)
        try:
            result = await fut
        except asyncio.CancelledError:
            # cancelled after the result was handed to this waiter but before it ran:
            # kept for a later wait -- unless the request ended meanwhile
            if fut.done() and not fut.cancelled() and req_id in self._pending:
                self._kept[req_id] = fut.result()
            raise
        finally:
            waiters = self._waiters.get(req_id)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[req_id]
        self._kept.pop(req_id, None)
        self._pending.discard(req_id)
        return result
