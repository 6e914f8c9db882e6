"""A circuit breaker: a server that stops answering costs one deadline, not one per call.

States::

    CLOSED --(threshold consecutive failures)--> OPEN
    OPEN   --(backoff elapsed; the next allow() is the probe)--> HALF_OPEN
    HALF_OPEN --(the probe succeeds)--> CLOSED        (backoff back to its start)
    HALF_OPEN --(the probe fails)--> OPEN             (backoff doubled, capped)

While OPEN (and while a HALF_OPEN probe is out) :meth:`allow` says False at once: the
caller answers ERROR / 0 without touching the network. Every transition and every refusal
is counted. Thread-safe (one lock, no I/O under it); the clock is injectable for tests.

Every ``allow() == True`` must be followed by exactly one :meth:`success` or
:meth:`failure` (a probe that is never reported would keep the breaker half-open).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any

from kvshm.errors import ConfigError


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


#: From the worst state to the best: what a set of breakers reports as a whole.
_WORST_FIRST = (BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED)


def worst(states: Iterable[BreakerState]) -> BreakerState:
    """The worst of ``states`` (open, then half-open); CLOSED for none."""
    seen = set(states)
    return next((s for s in _WORST_FIRST if s in seen), BreakerState.CLOSED)


class CircuitBreaker:
    """See the module. ``threshold``: consecutive failures that open it; ``backoff_s``:
    the first wait before a probe, doubled after each failed probe up to
    ``max_backoff_s``."""

    def __init__(self, threshold: int = 3, backoff_s: float = 0.25,
                 max_backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or not 0 < backoff_s <= max_backoff_s:
            raise ConfigError(f"breaker: threshold {threshold} must be >= 1 and "
                              f"0 < backoff_s {backoff_s} <= max_backoff_s {max_backoff_s}")
        self.threshold = threshold
        self.base_backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._backoff_s = backoff_s
        self._probe_at = 0.0
        self.opens = 0
        self.closes = 0
        self.probes = 0
        self.rejected = 0
        self.failures = 0
        self.successes = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    @property
    def backoff_s(self) -> float:
        """The wait before the next probe (the current one while OPEN)."""
        with self._lock:
            return self._backoff_s

    def allow(self) -> bool:
        """Whether a request may go to the server now (True once per backoff while OPEN:
        that request is the probe)."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() >= self._probe_at:
                self._state = BreakerState.HALF_OPEN
                self.probes += 1
                return True
            self.rejected += 1
            return False

    def would_allow(self) -> bool:
        """What :meth:`allow` would say now, without its effects (no probe is taken,
        nothing counted): lets a caller skip work that would only be refused."""
        with self._lock:
            return self._state is BreakerState.CLOSED or (
                self._state is BreakerState.OPEN and self._clock() >= self._probe_at)

    def success(self) -> None:
        """The server answered (a miss is an answer)."""
        with self._lock:
            self.successes += 1
            self._consecutive = 0
            if self._state is not BreakerState.CLOSED:
                self._state = BreakerState.CLOSED
                self._backoff_s = self.base_backoff_s
                self.closes += 1

    def failure(self) -> None:
        """The server failed or timed out."""
        with self._lock:
            self.failures += 1
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN:
                self._backoff_s = min(self._backoff_s * 2, self.max_backoff_s)
                self._open()
            elif (self._state is BreakerState.CLOSED
                  and self._consecutive >= self.threshold):
                self._backoff_s = self.base_backoff_s
                self._open()

    def _open(self) -> None:
        self._state = BreakerState.OPEN
        self._probe_at = self._clock() + self._backoff_s
        self.opens += 1

    def statistics(self) -> dict[str, Any]:
        with self._lock:
            return {"state": self._state.value, "opens": self.opens,
                    "closes": self.closes, "probes": self.probes,
                    "rejected": self.rejected, "failures": self.failures,
                    "backoff_s": self._backoff_s}
