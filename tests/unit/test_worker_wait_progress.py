"""workers.loop.WaitProgress: the cadence of a waiting rank's "still waiting" lines (one
every interval from the start of the wait, one line for a late check, never a burst)."""

from __future__ import annotations

import pytest

from workers.loop import PROGRESS_S, WaitProgress


def test_the_default_interval_is_ten_seconds() -> None:
    assert PROGRESS_S == 10.0


def test_one_line_per_interval_counted_from_the_start() -> None:
    p = WaitProgress(100.0, 10.0)
    assert [p.due(t) for t in (100.0, 105.0, 109.99)] == [False] * 3
    assert p.due(110.0)
    assert not p.due(110.0) and not p.due(119.5)
    assert p.due(120.3)
    assert not p.due(129.9)  # the next stays on the 10 s grid, not 10 s after 120.3
    assert p.due(130.0)


def test_a_late_check_prints_one_line_and_keeps_the_grid() -> None:
    p = WaitProgress(0.0, 10.0)
    assert p.due(47.0)  # 4 intervals missed (a stopped process): one line
    assert not p.due(49.9)
    assert p.due(50.0)


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan")])
def test_an_interval_that_is_not_positive_is_refused(interval: float) -> None:
    with pytest.raises(ValueError, match="interval must be > 0"):
        WaitProgress(0.0, interval)
