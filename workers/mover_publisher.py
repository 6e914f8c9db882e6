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

With a disk tier the thread also takes the commands off the ``cmd`` ring as they arrive
(``commands``, a :class:`CommandWatch`): before each wait it arms the ring's doorbell
(:meth:`~kvshm.ipc.worker_channel.WorkerChannel.arm`: the scheduler rings the next post),
and after each wake-up ``take`` queues what came and starts its Disk and Remote jobs on
their movers at once -- a READ posted while the host runs no connector hook (vLLM's
scheduler waiting in a lookup for that very read) starts then, not at the next hook.
Copies still run at the host's hooks (``take`` only queues them, in ring order). ``arm``
and ``take`` hold the worker's lock (the ``cmd`` ring keeps one consumer at a time);
``arm`` answering :attr:`Armed.OFF` (the worker left the link), or raising, and a
``take`` that raises (counted in ``take_errors``) end the watch: the host's hooks pump the
ring from then on, and the thread never spins on commands it cannot take.

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
from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["Armed", "CommandWatch", "MoverPublisher"]


class Armed(Enum):
    """What arming the ``cmd`` ring's doorbell found."""

    ARMED = "armed"  # the ring is empty; the next post rings ``fd``
    PENDING = "pending"  # commands wait already: take them without sleeping
    OFF = "off"  # the worker left the link: stop watching


@dataclass(frozen=True, slots=True)
class CommandWatch:
    """The ``cmd`` ring, watched by the publisher thread: ``fd`` (the publisher's own
    duplicate of the ring's doorbell eventfd, closed by :meth:`MoverPublisher.stop`),
    ``arm`` and ``take`` (both under the worker's lock; see the module docstring)."""

    fd: int
    arm: Callable[[], Armed]
    take: Callable[[], None]


class MoverPublisher:
    """One thread waiting on ``fds`` (the movers' eventfds), calling ``flush`` after each
    wake-up (see the module docstring; its result is ignored). Starts at once; owns
    ``commands.fd`` once constructed (a construction that raises leaves it the
    caller's)."""

    def __init__(self, fds: Sequence[int], flush: Callable[[], Any], *, name: str,
                 commands: CommandWatch | None = None) -> None:
        self._fds = list(fds)
        self._flush = flush
        self._commands = commands
        self._stop_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        #: ``wakeups``, ``flush_errors``, ``command_wakeups`` (the ``cmd`` ring rang or
        #: held commands) and ``take_errors``, all present from the start (a reader on
        #: another thread never sees the dict grow)
        self.counts: Counter[str] = Counter(wakeups=0, flush_errors=0, command_wakeups=0,
                                            take_errors=0)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        try:
            self._thread.start()
        except BaseException:  # its stop fd closed; ``commands.fd`` stays the caller's
            os.close(self._stop_fd)
            self._stop_fd = -1
            raise

    def stop(self) -> None:
        """Wake the thread, join it, close the stop fd (idempotent; see the module
        docstring: never with the worker's lock held)."""
        if self._stop_fd < 0:
            return
        os.eventfd_write(self._stop_fd, 1)
        self._thread.join()
        os.close(self._stop_fd)
        self._stop_fd = -1
        if self._commands is not None:
            os.close(self._commands.fd)

    def _loop(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._stop_fd):
            poller.register(fd, select.POLLIN)
        cmd = self._commands
        if cmd is not None:
            poller.register(cmd.fd, select.POLLIN)
        while True:
            armed = Armed.OFF if cmd is None else self._arm(cmd)
            if armed is Armed.OFF and cmd is not None:
                poller.unregister(cmd.fd)  # the link is gone: movers only from here on
                cmd = None
            ready = {fd for fd, _ in poller.poll(0 if armed is Armed.PENDING else None)}
            if self._stop_fd in ready:
                return
            self.counts["wakeups"] += 1
            for fd in ready:
                if cmd is None or fd != cmd.fd:  # arm drains the doorbell itself
                    _drain(fd)
            if cmd is not None and (armed is Armed.PENDING or cmd.fd in ready):
                self.counts["command_wakeups"] += 1
                try:
                    cmd.take()
                except Exception:  # noqa: BLE001 - counted; the host's hooks pump from here
                    self.counts["take_errors"] += 1
                    # the ring may still hold what failed: arm() would answer PENDING
                    # again and this thread would spin on the worker's lock; stop
                    # watching it (the host's next hook takes the commands)
                    poller.unregister(cmd.fd)
                    cmd = None
            try:
                self._flush()
            except Exception:  # noqa: BLE001 - counted; the host's next call reports too
                self.counts["flush_errors"] += 1

    def _arm(self, cmd: CommandWatch) -> Armed:
        try:
            return cmd.arm()
        except Exception:  # noqa: BLE001 - counted; the host's hooks still pump the ring
            self.counts["take_errors"] += 1
            return Armed.OFF


def _drain(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:  # the host's poll of the mover drained it first
        pass
