"""The scheduler side's service thread: an idle vLLM engine still answers ``kvshm stats``.

kvshm's :class:`~kvshm.engine.SyncClient` does its I/O (the rendezvous, where ``kvshm
stats --name`` asks, and the done rings) only when it is called; vLLM calls the connector
only while it schedules. An idle engine would never answer. :class:`ServiceThread` pumps
the client when no hook has run for ``interval_s``.

The invariant (one thread at a time touches the client, its manager and its pools): every
hook of :class:`~kvshm.integrations.vllm.scheduler.SchedulerSide` and every pump of this
thread runs inside :class:`HookGuard` (one lock). The thread's pump is the same call a
hook would make first (``SyncClient.poll``: rendezvous, done rings, hang check), so the
client sees nothing a hook could not have done between two hooks. Ordering: a hook that
leaves the guard marks the time; the thread pumps only when the last hook left more than
``interval_s`` ago (a busy scheduler pumps in its own hooks). It reads that time *before*
taking the lock and, while hooks are running, sleeps until ``interval_s`` after the last
one instead of queueing on the lock: a thread waiting on the lock would take it the
moment a hook leaves, and the next hook would then wait for this thread to be scheduled
(on a busy 2-core machine, milliseconds: measured up to 4 ms per stall with
``tools.bench_vs_vllm``). :meth:`ServiceThread.stop`
sets the stop flag and joins the thread *without* holding the guard (the thread may be
waiting for it); after ``stop`` returns no pump runs again.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Concatenate, Final, ParamSpec, Protocol, TypeVar

__all__ = ["DEFAULT_INTERVAL_S", "HookGuard", "ServiceThread", "guarded"]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("kvshm.vllm")
_monotonic = time.monotonic

#: How long the scheduler may be idle before the thread pumps (and its poll period):
#: a ``kvshm stats`` query waits at most about this long plus one pump.
DEFAULT_INTERVAL_S: Final = 0.02


class HookGuard:
    """The one lock around every use of the client; ``with guard:`` in each hook.

    In a forked child the lock is a new one (the service thread, gone there, may have
    held it at the fork: the child's hooks and ``shutdown`` would wait for it for good);
    the client they then reach is its parent's, refused there (:mod:`kvshm.engine.forks`)."""

    def __init__(self) -> None:
        #: taken by the hooks (through ``with guard``) and by the thread's pump directly
        self.lock = threading.RLock()
        #: when a hook last left the guard (the thread's own pumps do not count)
        self.last_exit = time.monotonic()
        _guards.add(self)

    def _renew(self) -> None:
        """In a forked child: a lock nobody holds -- unless the thread that forked holds
        it (it forked inside ``with guard``: its exit releases the lock it took)."""
        is_owned = getattr(self.lock, "_is_owned", None)
        if is_owned is None or not is_owned():
            self.lock = threading.RLock()

    def __enter__(self) -> HookGuard:
        self.lock.acquire()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.last_exit = time.monotonic()
        self.lock.release()


#: every guard of this process (renewed in a forked child)
_guards: weakref.WeakSet[HookGuard] = weakref.WeakSet()


def _renew_guards() -> None:
    for guard in list(_guards):
        guard._renew()


os.register_at_fork(after_in_child=_renew_guards)


class _Guarded(Protocol):
    @property
    def guard(self) -> HookGuard: ...


G = TypeVar("G", bound=_Guarded)


def guarded(fn: Callable[Concatenate[G, P], R]) -> Callable[Concatenate[G, P], R]:
    """Run the method inside its object's ``guard`` (a hook of the scheduler side):
    :class:`HookGuard`'s enter and exit, inlined (vLLM calls dozens of hooks a step)."""
    @functools.wraps(fn)
    def wrapper(self: G, /, *args: P.args, **kwargs: P.kwargs) -> R:
        guard = self.guard
        lock = guard.lock
        lock.acquire()
        try:
            return fn(self, *args, **kwargs)
        finally:
            guard.last_exit = _monotonic()
            lock.release()
    return wrapper


class ServiceThread:
    """A daemon thread that calls ``pump`` under ``guard`` while the hooks are idle.

    ``pump`` must not raise for an ended client (it checks the state itself); anything
    it raises is logged once and counted in :attr:`errors`, and the thread goes on.
    """

    def __init__(self, guard: HookGuard, pump: Callable[[], None], name: str,
                 interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self._guard = guard
        self._pump = pump
        self._interval = interval_s
        self._stop = threading.Event()
        self.pumps = 0
        self.errors = 0
        #: wake-ups that found a hook running or just finished (no pump, no lock wait)
        self.skips = 0
        self._thread = threading.Thread(target=self._run, name=f"kvshm-service-{name}",
                                        daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop and join (idempotent; never call it while holding the guard)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        wait = self._interval
        while not self._stop.wait(wait):
            idle = time.monotonic() - self._guard.last_exit
            if idle < self._interval:  # hooks are running and pump themselves
                self.skips += 1
                wait = self._interval - idle
                continue
            wait = self._interval
            if not self._guard.lock.acquire(blocking=False):
                self.skips += 1  # a hook holds it right now: it pumps itself
                continue
            try:
                if self._stop.is_set():
                    return
                self._pump_once()
            finally:
                self._guard.lock.release()

    def _pump_once(self) -> None:
        try:
            self._pump()
            self.pumps += 1
        except Exception:  # the thread must outlive a bad pump
            self.errors += 1
            if self.errors == 1:
                log.exception("kvshm: the scheduler side's service thread failed to pump "
                              "(further failures are only counted)")
