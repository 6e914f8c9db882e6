"""An embedded worker's mover Dones, published the moment a mover finishes a job.

An embedded :class:`~workers.worker.Worker` runs only when its host calls it (vLLM: a
connector hook, once or twice an engine step). A Disk or Remote job finishes on its
mover's threads (:mod:`workers.disk_mover`, :mod:`workers.remote_mover`) in between; left
to the host, its Done would wait for the next hook, and the scheduler would see it a
step later still. :class:`MoverPublisher` is one thread that waits on the movers'
eventfds (:meth:`~workers.disk_mover.DiskMover.notify_fd`) and, on each wake-up, drains
them and calls ``flush``: the worker's :meth:`~workers.link.WorkerLink._publish_movers`,
which takes the movers' Dones into the worker's book and sends them over the ``done``
ring under the worker's lock.

Invariants:

* The ``done`` ring keeps one producer at a time: every call that publishes on it (the
  host's hooks and ``flush``) holds the worker's lock.
* A Done is published only after its job's bytes are complete: a mover makes a job's
  Done after its last slot's (block's) I/O returned, and ``flush`` publishes only what
  the movers' ``poll`` hands over.
* Dones of copy jobs keep their order: ``flush`` collects only the movers' Dones; copy
  Dones are collected by the host's calls alone, and the book's outbox is one FIFO.
* No lost wake-up: the eventfds are drained *before* ``flush`` polls the movers, so a
  Done finished after the drain makes its eventfd readable again.

Teardown: :meth:`stop` (idempotent) wakes the thread and joins it; call it without the
worker's lock held (the thread may be waiting for it) and before the movers' eventfds
are closed. Every wake-up and every ``flush`` that raised is counted.
"""

from __future__ import annotations

import os
import select
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MoverPublisher"]


class MoverPublisher:
    """One thread waiting on ``fds`` (the movers' eventfds), calling ``flush`` after each
    wake-up (see the module docstring; its result is ignored). Starts at once."""

    def __init__(self, fds: Sequence[int], flush: Callable[[], Any], *, name: str) -> None:
        self._fds = list(fds)
        self._flush = flush
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        #: ``wakeups`` and ``flush_errors``, both present from the start (a reader on
        #: another thread never sees the dict grow)
        self.counts: Counter[str] = Counter(wakeups=0, flush_errors=0)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Wake the thread, join it, close the stop fd (idempotent; see the module
        docstring: never with the worker's lock held)."""
        if self._stop_fd < 0:
            return
        os.eventfd_write(self._stop_fd, 1)
        self._thread.join()
        os.close(self._stop_fd)
        self._stop_fd = -1

    def _loop(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._stop_fd):
            poller.register(fd, select.POLLIN)
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if self._stop_fd in ready:
                return
            self.counts["wakeups"] += 1
            for fd in ready:
                _drain(fd)
            try:
                self._flush()
            except Exception:  # noqa: BLE001 - counted; the host's next call reports too
                self.counts["flush_errors"] += 1


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:  # the host's poll of the mover drained it first
        pass
