"""The fork guard's hook alone (``kvshm.engine.forks``): every runtime tracked is
disowned in the child even where one raises, and a loop it cannot renew is left as it
is, never an exception out of the hook."""

from __future__ import annotations

import asyncio
import os

from kvshm.engine import forks


class _Runtime:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.owner: int | None = None

    def disown(self, owner_pid: int) -> None:
        self.owner = owner_pid
        if self.fail:
            raise AttributeError("'NoneType' object has no attribute 'close'")


def test_one_runtime_that_raises_does_not_keep_the_others_owned() -> None:
    """A review: the hook walked the runtimes with no guard, so the first whose disown
    raised (an engine left open after its ``asyncio.run`` ended: a closed loop, whose
    selector is None) stopped the walk, and every runtime after it stayed live in the
    child -- a child's ``close()`` then detached the parent's ranks, the very fault the
    guard is for. Each is disowned now, whatever another raised."""
    a, bad, c = _Runtime(), _Runtime(fail=True), _Runtime()
    for rt in (a, bad, c):
        forks.track(rt)
    forks._after_fork_in_child()  # as the hook runs it, here in-process
    assert (a.owner, bad.owner, c.owner) == (os.getpid(),) * 3


def test_a_closed_loop_is_left_as_it_is_and_an_open_one_gets_its_own_selector() -> None:
    """``own_selector`` on a closed selector loop (its selector None) returned an
    AttributeError; now it does nothing. On an open one: a new selector and a new
    self-pipe, the loop still runs callbacks handed over from another thread."""
    closed = asyncio.new_event_loop()
    closed.close()
    forks.own_selector(closed)
    loop = asyncio.new_event_loop()
    try:
        raw = loop
        old_selector, old_ssock = raw._selector, raw._ssock  # type: ignore[attr-defined]
        forks.own_selector(loop)
        assert raw._selector is not old_selector  # type: ignore[attr-defined]
        assert raw._ssock is not old_ssock and old_ssock.fileno() == -1  # type: ignore[attr-defined]

        async def handed_over() -> str:
            fut: asyncio.Future[str] = loop.create_future()
            loop.run_in_executor(None, lambda: loop.call_soon_threadsafe(
                fut.set_result, "woken"))
            return await asyncio.wait_for(fut, 5)

        assert loop.run_until_complete(handed_over()) == "woken"
    finally:
        loop.run_until_complete(loop.shutdown_default_executor())
        loop.close()
