"""The rate-limited logger (:class:`kvshm.ratelog.RateLimitedLog`) with an injected clock:
one line per reason per interval, the suppressed ones counted and reported on the
reason's next line, reasons independent, the memory of reasons bounded."""

from __future__ import annotations

import logging
import threading

import pytest

from kvshm.ratelog import RateLimitedLog

LOGGER = "kvshm.test.ratelog"


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_one_line_per_reason_per_interval_with_the_suppressed_count(
        caplog: pytest.LogCaptureFixture) -> None:
    """Reason "a" 1,000 times within 10 s: one line, 999 suppressed. At t = 60 (the
    interval) the next "a" is written and says 999 were not logged in the last 60 s;
    "b" meanwhile has its own first line. Then "a" again at once: suppressed."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    now = [0.0]
    rl = RateLimitedLog(logging.getLogger(LOGGER), 60.0, clock=lambda: now[0])
    written = []
    for i in range(1000):
        now[0] = i / 100
        written.append(rl.warning("a", "refused %d", i))
    assert written == [True] + [False] * 999
    assert rl.warning("b", "other") is True
    now[0] = 60.0
    assert rl.warning("a", "refused %d", 1000) is True
    assert rl.warning("a", "refused %d", 1001) is False
    assert _lines(caplog) == [
        "refused 0", "other",
        "refused 1000 (999 more like this in the last 60 s were not logged)"]
    assert rl.suppressed == 1000


def test_levels_and_exc_info_go_through(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    rl = RateLimitedLog(logging.getLogger(LOGGER))
    try:
        raise ValueError("boom")
    except ValueError:
        assert rl.error("e", "failed", exc_info=True)
    rec = [r for r in caplog.records if r.name == LOGGER]
    assert rec[0].levelno == logging.ERROR and rec[0].exc_info is not None
    assert rl.log(logging.INFO, "i", "info %s", "x") and rec[0].getMessage() == "failed"


def test_the_memory_of_reasons_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """10,000 distinct reasons remember 8 at most (the oldest forgotten first: a
    forgotten reason seen again is written again)."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rl = RateLimitedLog(logging.getLogger(LOGGER), max_reasons=8, clock=lambda: 0.0)
    for i in range(10_000):
        rl.warning(f"r{i}", "x")
    assert len(rl._last) == 8
    assert rl.warning("r9999", "x") is False and rl.warning("r0", "x") is True


def test_threads_share_one_line_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    """8 threads x 500 lines of one reason: exactly one written, 3,999 suppressed."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    rl = RateLimitedLog(logging.getLogger(LOGGER))

    def spam() -> None:
        for _ in range(500):
            rl.warning("same", "x")
    threads = [threading.Thread(target=spam) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_lines(caplog)) == 1 and rl.suppressed == 3999
