"""``FanOut``: a call's requests over the caller's thread and a pool (no server).

Each test narrates what a store relies on: results in item order, the caller's thread
taking the first share, the probe alone first while a breaker is not closed, a bug in
one item failing only that item (counted), and a closed pool failing the call, not
hanging it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from kvshm.remote.fan_out import FanOut


def test_results_come_back_in_item_order_and_the_callers_thread_takes_share_zero() -> None:
    """Three threads, seven items: thread t runs items t, t + 3, ...; item 0's share
    (0, 3, 6) runs on the caller's own thread, the others on the pool's two -- items
    0, 1 and 2 meet at a barrier, so the three shares run at once."""
    fan = FanOut(3, crashed=lambda: None)
    me = threading.get_ident()
    ran: dict[int, int] = {}
    meet = threading.Barrier(3, timeout=10)

    def one(i: int) -> int:
        ran[i] = threading.get_ident()
        if i < 3:
            meet.wait()  # raises (a crash: the result would be None) if they ran apart
        return i * i

    try:
        assert fan.run(7, one, None) == [0, 1, 4, 9, 16, 25, 36]
    finally:
        fan.close()
    assert {i for i, t in ran.items() if t == me} == {0, 3, 6}
    assert ran[1] == ran[4] and ran[2] == ran[5] and len({ran[1], ran[2], me}) == 3


def test_the_call_returns_only_after_the_pools_shares_finished() -> None:
    """A GET's pool share lands in the caller's buffers: the call must not return
    while it still runs. Item 1 (the pool's) is slow, item 0 (the caller's) instant:
    its result is in the list the call returns, and its write happened before."""
    fan = FanOut(2, crashed=lambda: None)
    buf = bytearray(2)

    def one(i: int) -> int:
        if i == 1:
            time.sleep(0.2)
        buf[i] = 1
        return i

    try:
        assert fan.run(2, one, None) == [0, 1]
        assert buf == b"\x01\x01"
    finally:
        fan.close()


def test_marked_items_run_alone_in_order_on_the_caller_beside_the_others() -> None:
    """Items 0 and 2 are parts of a shard whose breaker is half-open (only one request
    may race nothing: the probe), 1, 3, 4, 5 of healthy shards. The marked ones run one
    at a time, in order, on the caller's thread; the healthy ones do not wait for them:
    item 0 (the probe) only ends once item 3, on the pool, has run."""
    fan = FanOut(2, crashed=lambda: None)
    me = threading.get_ident()
    healthy_ran = threading.Event()
    spans: dict[int, tuple[float, float, int]] = {}

    def one(i: int) -> int:
        start = time.monotonic()
        if i == 0 and not healthy_ran.wait(5):
            raise AssertionError("the healthy parts waited for the probe")
        if i == 3:
            healthy_ran.set()
        spans[i] = (start, time.monotonic(), threading.get_ident())
        return i

    try:
        assert fan.run(6, one, None, probe=lambda i: i in (0, 2)) == list(range(6))
    finally:
        fan.close()
    assert spans[0][2] == spans[2][2] == me
    assert spans[2][0] >= spans[0][1]  # in order, never overlapping
    assert spans[3][2] != me


def test_a_long_call_while_probing_runs_every_item_in_order() -> None:
    """A cluster's GET is one part per block (up to ``16 MiB / block bytes`` a call):
    3,000 parts of a shard whose breaker is not closed run one by one on the caller's
    thread, every one of them (a recursion per item overflowed the stack from about
    1,000)."""
    crashes: list[int] = []
    fan = FanOut(4, crashed=lambda: crashes.append(1))
    order: list[int] = []

    def one(i: int) -> int:
        order.append(i)
        return i

    try:
        assert fan.run(3000, one, None, probe=lambda i: True) == list(range(3000))
    finally:
        fan.close()
    assert order == list(range(3000)) and crashes == []


def test_an_item_that_raises_fails_alone_and_is_counted() -> None:
    """A bug in item 2 (not an outage): its result is ``failed``, ``crashed`` is called
    once, items 0, 1 and 3 keep theirs; nothing raises into the caller."""
    crashes: list[int] = []
    fan = FanOut(2, crashed=lambda: crashes.append(1))

    def one(i: int) -> str:
        if i == 2:
            raise ValueError("a bug")
        return f"ok{i}"

    try:
        assert fan.run(4, one, "failed") == ["ok0", "ok1", "failed", "ok3"]
    finally:
        fan.close()
    assert crashes == [1]


class _ClosingPool:
    """A pool closed between two of a call's hand-offs: the first share goes to a real
    pool, the second is refused (``RuntimeError``, as a shut-down executor does)."""

    def __init__(self) -> None:
        self.real = ThreadPoolExecutor(1)
        self.handed = 0

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        self.handed += 1
        if self.handed > 1:
            raise RuntimeError("cannot schedule new futures after shutdown")
        return self.real.submit(fn, *args)

    def shutdown(self, wait: bool = True) -> None:
        self.real.shutdown(wait=wait)


def test_a_pool_closed_mid_call_is_waited_for_before_the_call_returns() -> None:
    """The store closed while a call hands out its shares: the share already handed
    (items 1, 4) finishes before the call returns -- its writes never land after --
    and the shares not started (the caller's 0, 3; the refused 2) keep ``failed``."""
    fan = FanOut(3, crashed=lambda: None)
    fan._pool.shutdown()
    pool = fan._pool = _ClosingPool()  # type: ignore[assignment]
    done: list[int] = []

    def one(i: int) -> int:
        time.sleep(0.1)
        done.append(i)
        return i

    out = fan.run(5, one, "failed")
    assert done == [1, 4] and out == ["failed", 1, "failed", "failed", 4]
    pool.shutdown()


def test_a_call_after_close_fails_every_item_at_once() -> None:
    """A store closed under a mover's call: the pool refuses work, so the call returns
    ``failed`` for every item without running any (and without hanging)."""
    fan = FanOut(2, crashed=lambda: None)
    fan.close()
    ran: list[int] = []
    assert fan.run(3, lambda i: ran.append(i), "failed") == ["failed"] * 3
    assert ran == []


@pytest.mark.parametrize("threads", [0, 1])
def test_one_thread_runs_everything_on_the_caller(threads: int) -> None:
    """``threads`` 1 (or less) is the caller's thread alone, in order."""
    fan = FanOut(threads, crashed=lambda: None)
    me = threading.get_ident()
    seen: list[tuple[int, int]] = []
    try:
        assert fan.run(3, lambda i: seen.append((i, threading.get_ident())), None) \
            == [None] * 3
    finally:
        fan.close()
    assert seen == [(0, me), (1, me), (2, me)]
