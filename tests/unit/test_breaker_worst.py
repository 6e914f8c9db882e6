"""The state a set of circuit breakers reports as a whole (``breaker_state``)."""

from __future__ import annotations

from kvshm.remote.breaker import BreakerState, worst


def test_the_worst_state_wins_and_no_breaker_is_closed() -> None:
    o, h, c = BreakerState.OPEN, BreakerState.HALF_OPEN, BreakerState.CLOSED
    assert worst([c, h, o, c]) is o
    assert worst([c, h, c]) is h
    assert worst([c, c]) is c
    assert worst([]) is c
