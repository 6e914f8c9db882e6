"""The mover publisher's command watch (workers/mover_publisher.py): a ``take`` that raises
ends the watch instead of spinning on a ring that still holds what failed."""

from __future__ import annotations

import os
import threading
import time

from workers.mover_publisher import Armed, CommandWatch, MoverPublisher


def test_a_take_that_raises_ends_the_watch_and_flush_goes_on() -> None:
    """``arm`` always finds commands waiting (PENDING: the ring keeps what ``take``
    failed on); ``take`` raises. The thread counts one take error and stops watching
    the ring -- one command wake-up, not thousands -- and a mover's eventfd still wakes
    it to flush."""
    cmd_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    mover_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    took = threading.Event()
    flushed: list[int] = []

    def take() -> None:
        took.set()
        raise RuntimeError("a bug in take")

    pub = MoverPublisher([mover_fd], lambda: flushed.append(1), name="test-publisher",
                         commands=CommandWatch(cmd_fd, lambda: Armed.PENDING, take))
    try:
        assert took.wait(5)
        deadline = time.monotonic() + 5
        while pub.counts["take_errors"] == 0:  # counted just after take raised
            assert time.monotonic() < deadline, "the take error was not counted"
            time.sleep(0.005)
        time.sleep(0.1)  # a spinning thread would take thousands of times by now
        assert pub.counts["take_errors"] == 1
        assert pub.counts["command_wakeups"] == 1
        before = len(flushed)
        os.eventfd_write(mover_fd, 1)
        deadline = time.monotonic() + 5
        while len(flushed) == before:
            assert time.monotonic() < deadline, "the mover's eventfd did not wake it"
            time.sleep(0.005)
    finally:
        pub.stop()
        os.close(mover_fd)
