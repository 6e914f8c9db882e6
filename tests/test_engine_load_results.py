"""``Engine.wait_loaded`` answers the request's current load, and only while it lives:
re-admission after a preemption, an end listed in ``StepInput.finished``, and a wait
cancelled after its request ended (an ATTACH engine, two embedded ranks)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import pytest
from engine_rig import BS, Client, embedded_engine, tokens

from kvshm.engine import Engine
from kvshm.errors import ConfigError, InvalidRequest, StateError
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.types import LoadFailure, RequestView, ScheduledRequest, StepInput


async def test_a_readmitted_request_waits_for_its_new_load_not_the_old_result() -> None:
    """B's load #1 finishes and its result is kept (nobody waited yet). The server then
    preempts B and re-admits it: load #2, the ranks paused so it stays in flight.
    ``wait_loaded("b")`` used to return load #1's kept result at once -- the forward
    would have read blocks load #2 was still writing -- and load #2's result was lost.
    Now it waits for load #2 and returns its result."""
    async with embedded_engine() as (eng, gpu, _, ranks):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=1)
        h = chain_hashes(toks, BS)
        await c.store_only("a", toks)
        hit, t1, _ = c.load("b", toks)
        assert hit == 4 * BS
        await c.settle()                                   # load #1 done, kept
        c.step(ScheduledRequest("b", h, len(toks), ((),), preempted=True))
        gpu.free(reversed(t1))
        ranks.paused = True
        t2 = _readmit(c, eng, gpu, "b", toks)
        waiter = asyncio.ensure_future(eng.wait_loaded("b"))
        await asyncio.sleep(0.2)
        assert not waiter.done()                            # load #2 is in flight
        ranks.paused = False
        res = await asyncio.wait_for(waiter, 20)
        assert res.ok and res.num_tokens == 4 * BS
        c.finish("b", t2, len(toks))
        await c.settle()


def _allocated(eng: Engine, gpu: BlockPool, rid: str, toks: list[int]) -> list[int]:
    """``rid`` looked up and allocated: its load queued (not stepped yet)."""
    hit = eng.lookup(RequestView(rid, chain_hashes(toks, BS), len(toks)), 0)
    assert hit == 4 * BS
    table = gpu.allocate(4)
    eng.allocated(rid, [table], hit)
    return table


def _readmit(c: Client, eng: Engine, gpu: BlockPool, rid: str, toks: list[int]) -> list[int]:
    """``rid`` re-admitted after its preemption: looked up, allocated, its load planned."""
    h = chain_hashes(toks, BS)
    table = _allocated(eng, gpu, rid, toks)
    plan = c.step(ScheduledRequest(rid, h, len(toks), (tuple(table),), new_or_resumed=True))
    assert plan.load is not None
    return table


@pytest.mark.parametrize("listed", [lambda: ["b"], lambda: (r for r in ["b"])],
                         ids=["list", "generator"])
async def test_a_request_ended_in_the_step_input_ends_its_wait(
        listed: Callable[[], Iterable[str]]) -> None:
    """``StepInput.finished`` is the step's way to end a request, as ``finished()``
    is. B's load is queued and a ``wait_loaded("b")`` waits; the step that lists B as
    finished drops the load. The waiter used to wait forever (only ``finished()``
    resolved it); now it gets REQUEST_FINISHED, and a later wait is refused at once.
    The ids may come as any iterable: given a generator, the step's input check
    consumed it and the engine's own pass over it (ending the waits) found nothing --
    the manager dropped the load, the waiter waited for good."""
    async with embedded_engine() as (eng, gpu, _, _):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=2)
        await c.store_only("a", toks)
        table = _allocated(eng, gpu, "b", toks)
        waiter = asyncio.ensure_future(eng.wait_loaded("b"))
        await asyncio.sleep(0)
        c.step_no += 1
        # (typed a Sequence; the input check accepts any iterable, as a caller may pass)
        eng.step(StepInput(c.step_no, [], finished=listed()))  # type: ignore[arg-type]
        res = await asyncio.wait_for(waiter, 5)
        assert not res.ok and res.cause is LoadFailure.REQUEST_FINISHED
        with pytest.raises(StateError):
            await eng.wait_loaded("b")
        gpu.free(reversed(table))
        await c.settle()


async def test_a_wait_cancelled_after_its_request_ended_keeps_nothing() -> None:
    """A ``wait_loaded("b")`` is resolved with REQUEST_FINISHED by ``finished("b")``,
    then cancelled before it runs (the client went away). It used to keep that result
    for the ended request: a leak, and a request reusing the id got the stale failure
    instead of its own load's result. Now the new request's wait returns its load."""
    async with embedded_engine() as (eng, gpu, _, _):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=3)
        await c.store_only("a", toks)
        table = _allocated(eng, gpu, "b", toks)
        waiter = asyncio.ensure_future(eng.wait_loaded("b"))
        await asyncio.sleep(0)
        eng.finished("b", 0, [table])
        gpu.free(reversed(table))
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        await c.settle()
        hit, table, plan = c.load("b", toks)
        assert hit == 4 * BS and plan.load is not None
        res = await c.loaded("b")
        assert res.ok and res.num_tokens == 4 * BS
        c.finish("b", table, len(toks))
        await c.settle()


async def test_a_reset_hands_the_loads_it_failed_to_their_waiters_at_once() -> None:
    """B's load is queued and ``wait_loaded("b")`` waits; ``reset()`` drops the queued
    load (failed, RESET). The waiter has its result as soon as ``reset`` returns -- it
    used to wait for the engine's next tick (up to 0.25 s) to be handed it."""
    async with embedded_engine() as (eng, gpu, _, _):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=5)
        await c.store_only("a", toks)
        table = _allocated(eng, gpu, "b", toks)
        waiter = asyncio.ensure_future(eng.wait_loaded("b"))
        await asyncio.sleep(0)
        assert await eng.reset()
        await asyncio.sleep(0)
        assert waiter.done()
        res = waiter.result()
        assert not res.ok and res.cause is LoadFailure.RESET
        c.finish("b", table, len(toks))
        await c.settle()


async def test_a_refused_phase_b_leaves_the_load_in_flight_and_its_result() -> None:
    """B's load is in flight (the ranks paused). A careless server looks B up again,
    under another prefix, and accepts more tokens than offered: InvalidRequest, as
    documented -- but the call had already marked B's in-flight load superseded, so its
    result was dropped and ``wait_loaded("b")`` waited for good. Now the refusal comes
    before any change: the load's result arrives as if the call had not been made."""
    async with embedded_engine() as (eng, gpu, _, ranks):
        c = Client(eng, gpu)
        toks, other = tokens(4 * BS + 1, seed=3), tokens(4 * BS + 1, seed=4)
        await c.store_only("a", toks)
        await c.store_only("o", other)
        ranks.paused = True
        _readmit(c, eng, gpu, "b", toks)          # load planned, in flight
        hit2 = eng.lookup(RequestView("b", chain_hashes(other, BS), len(other)), 0)
        assert hit2 == 4 * BS
        before = eng.statistics().counters["load_results_superseded"]
        with pytest.raises(InvalidRequest, match=f"accepted, {4 * BS} offered"):
            eng.allocated("b", [gpu.allocate(5)], hit2 + BS)
        assert eng.statistics().counters["load_results_superseded"] == before
        ranks.paused = False
        res = await asyncio.wait_for(eng.wait_loaded("b"), 20)
        assert res.ok and res.num_tokens == 4 * BS


async def test_a_wait_or_reset_given_the_wrong_type_is_a_typed_refusal() -> None:
    """``wait_loaded(["r"])`` raised a bare TypeError (unhashable list) and
    ``reset(timeout="1")`` another (str + float): every call of the API refuses bad
    input with a kvshm error instead, before anything changes."""
    async with embedded_engine() as (eng, _, _, _):
        with pytest.raises(InvalidRequest, match="req_id: must be a str"):
            await eng.wait_loaded(["r"])  # type: ignore[arg-type]
        # 10**400: an int past a float's range passed the check, then the deadline's
        # addition raised a bare OverflowError
        for bad in ("1", float("nan"), -1.0, float("inf"), True, 10**400):
            with pytest.raises(ConfigError, match="reset: timeout must be"):
                await eng.reset(bad)  # type: ignore[arg-type]
        assert await eng.reset(5.0)
