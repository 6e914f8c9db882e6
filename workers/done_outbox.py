"""A mover's finished jobs' Dones, waiting to be taken, with an eventfd that says so.

A mover (:mod:`workers.disk_mover`, :mod:`workers.remote_mover`) runs its jobs on its own
threads; the rank's worker thread (or an embedded worker's mover publisher,
:mod:`workers.mover_publisher`) takes their Dones and sends them on the ``done`` ring.
:class:`DoneOutbox` is the hand-over between the two.

Who does what:

* **Producers**: the mover's threads (any number) and the worker thread itself (a job
  refused at submit is a failed Done at once) call :meth:`DoneOutbox.put`.
* **Consumer**: whoever services the rank calls :meth:`DoneOutbox.take`; the worker's
  lock (held by every caller that publishes on the ring) keeps that to one at a time,
  but :meth:`take` is safe from any thread.
* :meth:`DoneOutbox.fd` is watched by the worker's channel (a parked standalone loop
  wakes) and by the mover publisher.

Invariants and ordering:

* Dones come out in the order :meth:`put` appended them (one list under one lock), each
  exactly once.
* No lost wake-up: :meth:`put` appends before it writes the eventfd, and :meth:`take`
  drains the eventfd before it swaps the list out; a Done put after that drain makes
  the eventfd readable again, so a wait on :meth:`fd` wakes for it.
* :meth:`take` with nothing waiting returns at once, without a syscall (it is called on
  every pump); a racing :meth:`put` is then seen by the next call, its eventfd still set.
* After :meth:`close` the fd is -1 and :meth:`put` still queues (a late Done is kept, not
  raised), it just rings nothing.
"""

from __future__ import annotations

import os
import threading

from kvshm.ipc.protocol import Done

__all__ = ["DoneOutbox"]


class DoneOutbox:
    """A FIFO of Dones plus a non-blocking eventfd that is readable while one waits (see
    the module docstring). Owns the eventfd; :meth:`close` closes it (idempotent)."""

    def __init__(self) -> None:
        self._done: list[Done] = []
        self._lock = threading.Lock()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def put(self, done: Done) -> None:
        """Append ``done`` (any thread), then ring the eventfd."""
        with self._lock:
            self._done.append(done)
        if self._efd >= 0:
            os.eventfd_write(self._efd, 1)

    def take(self) -> list[Done]:
        """Every Done put since the last call, in put order; ``[]`` without a syscall
        when none waits."""
        if not self._done:
            return []
        if self._efd >= 0:
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:  # a publisher drained it first
                pass
        with self._lock:
            out, self._done = self._done, []
        return out

    def fd(self) -> int:
        """The eventfd: readable while a Done waits in :meth:`take` (-1 once closed)."""
        return self._efd

    def close(self) -> None:
        """Close the eventfd (after the producers stopped and a last :meth:`take`)."""
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1
