"""workers.done_outbox.DoneOutbox alone: the hand-over of a mover's Dones from its
threads to the rank's servicing thread -- put order kept, each Done taken once, its
eventfd readable exactly while one waits (no lost wake-up), real threads racing."""

from __future__ import annotations

import os
import select
import threading

import pytest

from kvshm.ipc.protocol import Done
from workers.done_outbox import DoneOutbox


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_dones_come_out_in_put_order_once_and_the_fd_says_when_one_waits() -> None:
    box = DoneOutbox()
    try:
        assert box.take() == [] and not readable(box.fd())
        box.put(Done(1, 0, True))
        box.put(Done(2, 0, False, "DiskError: x"))
        assert readable(box.fd())
        assert [d.job_id for d in box.take()] == [1, 2]
        assert not readable(box.fd())
        assert box.take() == []
        box.put(Done(3, 0, True))  # a put after a take rings again
        assert readable(box.fd())
        assert [d.job_id for d in box.take()] == [3]
    finally:
        box.close()


def test_an_empty_take_makes_no_syscall(monkeypatch: pytest.MonkeyPatch) -> None:
    box = DoneOutbox()
    try:
        def no_read(fd: int) -> int:
            raise AssertionError("eventfd_read on an empty outbox")
        monkeypatch.setattr(os, "eventfd_read", no_read)
        assert box.take() == []
    finally:
        box.close()


def test_a_publisher_that_drained_the_fd_first_does_not_lose_the_dones() -> None:
    box = DoneOutbox()
    try:
        box.put(Done(7, 1, True))
        os.eventfd_read(box.fd())  # the mover publisher's drain
        assert [d.job_id for d in box.take()] == [7]
    finally:
        box.close()


def test_racing_producers_lose_nothing_keep_each_ones_order_and_never_miss_a_wakeup(
) -> None:
    """Four threads put 500 Dones each while this thread waits on the fd and takes: every
    Done arrives once, each producer's in its order, and a wait on the fd never sleeps
    past a Done (a lost wake-up would end in the 5 s timeout)."""
    box = DoneOutbox()
    producers, each = 4, 500

    def produce(p: int) -> None:
        for k in range(each):
            box.put(Done(p * each + k, p, True))

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    got: list[int] = []
    try:
        while len(got) < producers * each:
            assert select.select([box.fd()], [], [], 5.0)[0], "woken by nothing"
            got += [d.job_id for d in box.take()]
    finally:
        for t in threads:
            t.join()
        box.close()
    assert sorted(got) == list(range(producers * each))
    for p in range(producers):
        mine = [j for j in got if j // each == p]
        assert mine == sorted(mine)


def test_close_is_idempotent_and_a_late_put_is_kept_not_raised() -> None:
    box = DoneOutbox()
    box.close()
    box.close()
    assert box.fd() == -1
    box.put(Done(9, 0, True))
    assert [d.job_id for d in box.take()] == [9]
