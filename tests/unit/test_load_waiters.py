"""``LoadWaiters`` alone: the load outcomes an asyncio caller awaits (no engine)."""

from __future__ import annotations

import asyncio

import pytest

from kvshm.engine.load_waiters import LoadWaiters
from kvshm.errors import StateError
from kvshm.types import LoadFailure, LoadResult


def _ok(rid: str, n: int = 8) -> LoadResult:
    return LoadResult(rid, True, (), None, n)


async def test_a_result_goes_to_its_waiter_or_is_kept_for_the_next_wait() -> None:
    w = LoadWaiters()
    w.expect("a")
    w.expect("b")
    waiting = asyncio.ensure_future(w.wait("a"))
    await asyncio.sleep(0)
    w.publish([_ok("a"), _ok("b", 4), _ok("c")])  # c: no load pending, dropped
    assert (await waiting).num_tokens == 8
    assert (await w.wait("b")).num_tokens == 4      # kept: nobody waited yet
    assert w.idle()
    with pytest.raises(StateError, match="no load pending"):
        await w.wait("c")


async def test_an_ended_request_resolves_its_waiters_and_keeps_nothing() -> None:
    w = LoadWaiters()
    w.expect("a")
    waiting = asyncio.ensure_future(w.wait("a"))
    await asyncio.sleep(0)
    w.end("a")
    res = await waiting
    assert not res.ok and res.cause is LoadFailure.REQUEST_FINISHED
    w.publish([_ok("a")])                           # too late: not kept
    assert w.idle()


async def test_a_new_load_drops_the_result_kept_from_the_earlier_one() -> None:
    w = LoadWaiters()
    w.expect("a")
    w.publish([_ok("a", 8)])
    w.expect("a")                                   # re-admitted: a new load
    waiting = asyncio.ensure_future(w.wait("a"))
    await asyncio.sleep(0)
    assert not waiting.done()
    w.publish([_ok("a", 12)])
    assert (await waiting).num_tokens == 12


async def test_closing_fails_every_waiter() -> None:
    w = LoadWaiters()
    w.expect("a")
    waiting = [asyncio.ensure_future(w.wait("a")) for _ in range(2)]
    await asyncio.sleep(0)
    w.fail_all(LoadFailure.ENGINE_CLOSED)
    for t in waiting:
        assert (await t).cause is LoadFailure.ENGINE_CLOSED
