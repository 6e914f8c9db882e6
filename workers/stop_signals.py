"""Stop signals in ``kvshm-workers``' own processes, from their first line to their exit.

Standard library only, so the console script installs it before any other import. A
rank's process and the parent each record SIGTERM/SIGINT from their start on
(:meth:`EarlyStop.install`), outside the spans where :mod:`workers.loop` handles them
itself (a rank's ``_Stopper``, the parent's forwarding), and ignore them from their exit
on (:meth:`EarlyStop.ignore`). Before those spans (a rank's ``import torch`` takes 1-2
s) a stop signal killed a rank (exit 143) or raised KeyboardInterrupt out of its imports
(a traceback, exit 130); after them (the handlers put back were the defaults, and
Python's finalization puts the default back for any Python handler) the second copy of
one signal -- the parent forwards it and a supervisor signals the whole process group,
so each process often gets two within milliseconds -- killed a process that had
already stopped cleanly. A signal recorded before a rank's stopper stops the rank at its
first look (exit 0, ``detached (signal ...)``); one recorded before the parent's
forwarding is sent to every rank it starts.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Final

__all__ = ["STOP_SIGNALS", "EarlyStop"]

#: What stops a rank (and the parent, which forwards them).
STOP_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)


class EarlyStop:
    """See the module docstring. ``signum``: the last stop signal recorded (0: none)."""

    signum = 0

    @classmethod
    def install(cls) -> None:
        """Record the stop signals from now on (idempotent), then unblock them: a rank
        starts with them blocked (:meth:`blocked`), so one sent before this line --
        during the interpreter's own start, before any handler could exist -- waits,
        pending, and is recorded here."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, cls._record)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    @staticmethod
    @contextmanager
    def blocked() -> Iterator[None]:
        """The stop signals blocked in this thread while the block runs (the parent,
        around each rank's start: the rank inherits the mask across ``exec`` and
        unblocks it in :meth:`install`); the mask restored after, so the parent's own
        pending signal then reaches its handler."""
        old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    @classmethod
    def _record(cls, signum: int, frame: FrameType | None) -> None:
        cls.signum = signum

    @classmethod
    def ignore(cls) -> None:
        """From the exit on: ignored (Python's finalization leaves SIG_IGN alone)."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
