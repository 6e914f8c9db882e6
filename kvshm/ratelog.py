"""Warnings that cannot flood a log: one line per reason per interval.

A warning that a peer can trigger at will (a refused connection, a hostile manifest
name, a remote error per request) must not write one line each: with stderr on a pipe
that nobody drains, a few hundred KB of them block the writer -- the scheduler's thread
-- in ``write(2)`` for good. :class:`RateLimitedLog` writes the first line of a
*reason* (a short, stable key: a counter's name, not the varying text) at once; more of
that reason within ``interval_s`` are only counted, and the next line of the reason
after the interval says how many were suppressed meanwhile.

Invariants: at most one line per reason per ``interval_s`` (plus one per reason
forgotten and seen again); ``suppressed`` counts every line not written; at most
``max_reasons`` reasons are remembered (the oldest forgotten first, its count with it).
Thread-safe (one lock, released before the line is written).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

__all__ = ["INTERVAL_S", "RateLimitedLog"]

#: The default interval between two lines of one reason (seconds).
INTERVAL_S: Final = 60.0


class RateLimitedLog:
    """See the module docstring. ``logger``: where the lines go."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S, *,
                 max_reasons: int = 256, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.max_reasons = max_reasons
        self._clock = clock
        self._lock = threading.Lock()
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()  # reason -> (when
        # its last line went out, lines suppressed since)
        self.suppressed = 0

    def log(self, level: int, reason: str, msg: str, *args: object,
            exc_info: BaseException | bool | None = None) -> bool:
        """Write ``msg % args`` at ``level`` unless a line of ``reason`` went out less
        than ``interval_s`` ago (then it is only counted). True when written."""
        with self._lock:
            now = self._clock()
            last = self._last.get(reason)
            if last is not None and now - last[0] < self.interval_s:
                self._last[reason] = (last[0], last[1] + 1)
                self.suppressed += 1
                return False
            self._last[reason] = (now, 0)
            self._last.move_to_end(reason)
            while len(self._last) > self.max_reasons:
                self._last.popitem(last=False)
        if last is not None and last[1]:
            msg += " (%d more like this in the last %.0f s were not logged)"
            args = (*args, last[1], now - last[0])
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, reason: str, msg: str, *args: object) -> bool:
        """:meth:`log` at WARNING."""
        return self.log(logging.WARNING, reason, msg, *args)

    def error(self, reason: str, msg: str, *args: object,
              exc_info: BaseException | bool | None = None) -> bool:
        """:meth:`log` at ERROR."""
        return self.log(logging.ERROR, reason, msg, *args, exc_info=exc_info)
