"""The disk write path's pause (:class:`kvshm.offload.disk_writes.WritePause`), alone:
which failures count toward it, what clears the count, and when it ends. (Write-back
itself is narrated through the book in ``test_disk_book.py``.)"""

from __future__ import annotations

from kvshm.offload.disk import DiskCounters
from kvshm.offload.disk_writes import WRITE_FAILURES_TO_PAUSE, WritePause
from kvshm.types import LoadFailure


def _pause(now: list[float]) -> tuple[WritePause, DiskCounters]:
    c = DiskCounters()
    return WritePause(c, 30.0, lambda: now[0]), c


def test_only_failures_in_a_row_pause_and_a_success_starts_the_count_again() -> None:
    """Two disk failures, a WRITE that succeeds, two more: no pause (the disk recovered
    in between); a third in a row pauses for 30 s, counted once."""
    now = [0.0]
    p, c = _pause(now)
    assert WRITE_FAILURES_TO_PAUSE == 3
    p.failed(LoadFailure.WORKER_FAILED)
    p.failed(LoadFailure.WORKER_FAILED)
    p.succeeded()
    p.failed(LoadFailure.WORKER_FAILED)
    p.failed(LoadFailure.WORKER_FAILED)
    assert not p.active() and c.writes_paused == 0
    p.failed(LoadFailure.WORKER_FAILED)
    assert p.active() and c.writes_paused == 1
    now[0] = 29.9
    assert p.active()
    now[0] = 30.0
    assert not p.active()
    assert not p.active(), "an ended pause stays ended"


def test_failures_that_are_not_the_disks_do_not_pause() -> None:
    """A WRITE failed because a rank died or the engine reset (not a disk error): the
    disk may be fine, so any number of them pause nothing."""
    now = [0.0]
    p, c = _pause(now)
    for cause in (LoadFailure.RANK_DIED, LoadFailure.RESET, None) * 3:
        p.failed(cause)
    assert not p.active() and c.writes_paused == 0
