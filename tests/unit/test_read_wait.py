"""``ReadWait``: when a vLLM lookup may sleep for its disk read, and for how long.

A lookup may wait only while every live request has asked again (the step would run
nothing); a request the side forgot must stop counting as waiting, or a later lookup
would wait while another request could run (delaying it by up to 50 ms a step).
"""

from __future__ import annotations

import pytest

from kvshm.integrations.vllm.read_wait import READ_WAIT_MAX_S, READ_WAIT_S, ReadWait
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.types import RequestView

BS = 16


def _view(blocks: int) -> RequestView:
    return RequestView("r", [i.to_bytes(32, "big") for i in range(blocks)], blocks * BS, None, None)


def test_without_a_disk_tier_no_lookup_waits_and_nothing_is_held() -> None:
    live = {"a": object()}
    rw = ReadWait(disk=False, block_size=BS, live=live, counters=SchedulerCounters())
    rw.asked_again("a")
    assert not rw.may_wait("a") and rw._asked == set()


def test_a_lookup_waits_only_while_every_live_request_asked_again() -> None:
    """Live a, b, c. a asked again: b may not wait (c could run). c asks again too:
    b's lookup (the last one not waiting) may wait, a's not (b could run). c is
    answered: b may not wait any more."""
    live = dict.fromkeys("abc")
    rw = ReadWait(disk=True, block_size=BS, live=live, counters=SchedulerCounters())
    rw.asked_again("a")
    assert not rw.may_wait("b")
    rw.asked_again("c")
    assert rw.may_wait("b") and not rw.may_wait("a")  # b could still run beside a
    rw.answered("c")
    assert not rw.may_wait("b")


def test_a_forgotten_request_no_longer_counts_as_waiting() -> None:
    """a and b asked again, then a finished (the side forgot it and a new request d
    arrived): with a still counted, b would wait though d could run."""
    live = dict.fromkeys("ab")
    rw = ReadWait(disk=True, block_size=BS, live=live, counters=SchedulerCounters())
    rw.asked_again("a")
    rw.asked_again("b")
    del live["a"]
    rw.forget("a")
    live["d"] = None
    assert not rw.may_wait("b")


@pytest.mark.parametrize(("blocks", "local", "expected"), [
    (0, 0, READ_WAIT_S), (3, 0, READ_WAIT_S + 0.003), (3, 2 * BS, READ_WAIT_S + 0.001),
    (400, 0, READ_WAIT_MAX_S)])
def test_the_bound_grows_a_millisecond_a_block_past_the_local_hit(
        blocks: int, local: int, expected: float) -> None:
    rw = ReadWait(disk=True, block_size=BS, live={}, counters=SchedulerCounters())
    assert rw.bound(_view(blocks), local) == pytest.approx(expected)
