"""Engine lifecycle edges found in review, each a regression test with real workers:
a failed start, a cancelled aclose, finishing a request whose load is queued, a
wait_loaded cancelled as its result arrives, a request first listed before READY, and
``SyncClient`` closing as it leaves its ``with`` block."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from engine_rig import BS, GPU_BLOCKS, Client, config, shards, spawned_engine, tokens
from worker_rig import live_children

import kvshm.engine.launcher as launcher_mod
from kvshm.engine import SPAWN, Engine, EngineState, SyncClient
from kvshm.engine.launcher import Launcher
from kvshm.engine.runtime import Runtime
from kvshm.engine.startup import StartTimeout
from kvshm.errors import ConfigError, InvalidRequest, StateError, WorkerDied
from kvshm.hashing import chain_hashes
from kvshm.ipc.rendezvous_client import query_stats
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from kvshm.stats import EngineStats
from kvshm.types import (
    DeviceKind,
    LoadFailure,
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
)


async def _reaped(before: set[int], timeout_s: float = 10.0) -> None:
    """Until this process has no child beyond ``before`` (AssertionError after
    ``timeout_s``): a rank's exit is reaped a little after the engine returned."""
    deadline = time.monotonic() + timeout_s
    while live_children() - before and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert live_children() <= before


@pytest.fixture
def rank0_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = launcher_mod.worker_command

    def command(name: str, rank: int, world: int, device: DeviceKind) -> list[str]:
        if rank == 0:
            return [sys.executable, "-c", "raise SystemExit(3)"]
        return real(name, rank, world, device)

    monkeypatch.setattr(launcher_mod, "worker_command", command)
    yield


async def test_rank_dying_during_start_closes_everything(rank0_exits_at_once: None) -> None:
    """SPAWN TP=2, rank 0 exits with 3 before it connects: launch raises WorkerDied(0, 3),
    rank 1 is stopped and reaped, and the name is free again for the next engine."""
    ks = shards()
    cfg = config(shutdown_grace_s=0.5)
    before = live_children()  # a server another test of this process started stays
    with pytest.raises(WorkerDied) as err:
        await Engine.launch(cfg, workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[k] for k in ks])
    assert err.value.rank == 0 and err.value.exitcode == 3
    assert live_children() <= before
    core = Runtime(cfg, gpu_blocks=BlockPool(GPU_BLOCKS), device_caches=None, spawned=False)
    core.open()  # NameInUse if the failed engine had left its listener bound
    core.close()


async def _stored_then_looked_up(eng: Engine, gpu: BlockPool) -> tuple[Client, list[int], int]:
    """a's 6 blocks stored; b (same tokens) looked up and allocated: its load is queued."""
    c = Client(eng, gpu)
    toks = tokens(6 * BS + 1, seed=11)
    await c.store_only("a", toks)
    hit = eng.lookup(RequestView("b", chain_hashes(toks, BS), len(toks)), 0)
    assert hit == 6 * BS
    table_b = gpu.allocate(len(toks) // BS)
    eng.allocated("b", [table_b], hit)
    return c, table_b, hit


async def test_finishing_a_request_with_a_queued_load_resolves_its_waiter() -> None:
    """b finishes after allocated() but before any step planned its load: the manager
    drops the queued load (no LoadResult); the waiter gets REQUEST_FINISHED, a new
    wait_loaded is a StateError, and b's CPU pins are gone."""
    async with spawned_engine() as (eng, gpu, _):
        c, table_b, _ = await _stored_then_looked_up(eng, gpu)
        waiter = asyncio.ensure_future(eng.wait_loaded("b"))
        await asyncio.sleep(0)
        c.finish("b", table_b, 0)
        res = await asyncio.wait_for(waiter, 5)
        assert not res.ok and res.cause is LoadFailure.REQUEST_FINISHED
        with pytest.raises(StateError):
            await eng.wait_loaded("b")
        await c.settle()
        assert eng.statistics().pins_held == 0


async def test_cancelled_aclose_still_closes_and_resolves_waiters() -> None:
    """aclose() cancelled while it stops the workers: the ranks are still reaped, a
    pending wait_loaded resolves (ENGINE_CLOSED) and a second aclose() returns."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()  # a server another test of this process started stays
    eng = await Engine.launch(config(shutdown_grace_s=0.5), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    c, table_b, _ = await _stored_then_looked_up(eng, gpu)
    waiter = asyncio.ensure_future(eng.wait_loaded("b"))
    closing = asyncio.ensure_future(eng.aclose())
    # Cancelled at aclose()'s first suspension (one loop turn), not after a fixed sleep:
    # an idle rank now exits in about 50 ms, so aclose() can end within a 50 ms sleep.
    await asyncio.sleep(0)
    assert not closing.done()  # suspended in the (shielded) stop of the ranks
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    res = await asyncio.wait_for(waiter, 5)
    assert not res.ok and res.cause in (LoadFailure.ENGINE_CLOSED, LoadFailure.WORKER_FAILED,
                                        LoadFailure.RANK_DIED, LoadFailure.ENGINE_FAILED)
    await asyncio.wait_for(eng.aclose(), 5)
    assert eng.state is EngineState.CLOSED
    await _reaped(before)


async def test_an_aclose_cancelled_while_jobs_drain_still_closes_and_a_second_returns(
        ) -> None:
    """Three requests of 8 blocks stored, their jobs in flight, then aclose() cancelled
    at its first suspension -- the graceful drain of those jobs. The drain sat before
    aclose()'s try: the cancel left the engine READY with both ranks up and the
    "closing" flag set, so a second aclose() waited for a close that never came (15 s
    and counting, the workers never stopped). Now the cancel ends the drain, the
    closing goes on (CLOSED, ranks reaped), CancelledError follows, and a second
    aclose() returns at once."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    eng = await Engine.launch(config(shutdown_grace_s=5.0), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    c = Client(eng, gpu)
    for i in range(3):
        toks = tokens(8 * BS + 1, seed=70 + i)
        table, _ = c.compute(f"r{i}", toks)
        c.finish(f"r{i}", table, len(toks))
    c.step()
    assert eng._core.jobs_in_flight() > 0
    closing = asyncio.ensure_future(eng.aclose())
    await asyncio.sleep(0)
    assert not closing.done()  # suspended in the drain
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert eng.state is EngineState.CLOSED
    await asyncio.wait_for(eng.aclose(), 5)
    await _reaped(before)


async def test_a_second_aclose_returns_only_once_the_ranks_are_reaped_when_the_first_is_cancelled(
        ) -> None:
    """Rank 0 is stopped (SIGSTOP: it cannot exit on Shutdown), aclose() A stops the
    ranks, aclose() B waits for it, and A is cancelled while the (shielded) stop runs.
    A's finally set the "closed" event at once: B -- and any later aclose() -- returned
    while the stopped rank was still alive, against "every caller returns only once the
    spawned ranks are reaped". Now the event is set when the stop ends."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    eng = await Engine.launch(config(shutdown_grace_s=0.5), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    ranks = sorted(live_children() - before)
    assert len(ranks) == 2
    os.kill(ranks[0], signal.SIGSTOP)
    a = asyncio.ensure_future(eng.aclose())
    await asyncio.sleep(0.3)  # A is in the shielded stop (the grace runs)
    b = asyncio.ensure_future(eng.aclose())
    await asyncio.sleep(0.05)
    a.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a
    await asyncio.wait_for(b, 20)
    assert not (live_children() & set(ranks)), "B returned before the ranks were reaped"
    await asyncio.wait_for(eng.aclose(), 5)


async def test_a_cancelled_aclose_resolves_a_waiter_only_once_no_rank_can_copy_into_its_blocks(
        ) -> None:
    """b's load is posted while rank 1 is stopped (SIGSTOP: a rank slowed by a busy host,
    its copy into b's blocks not finished), then aclose() is cancelled in its (shielded)
    stop of the ranks (a caller's timeout). Its ``finally`` failed every waiter
    at the cancel: ``wait_loaded("b")`` said ENGINE_CLOSED ("recompute") while rank 1 was
    alive -- the serving engine recomputed b into its blocks, then the resumed rank
    finished its copy over them (the probe saw 5 of 6 blocks overwritten). Now the waiter
    resolves when the stop ends: rank 1 is reaped (killed past the grace) by then."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    eng = await Engine.launch(config(shutdown_grace_s=0.5), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    assert eng._launcher is not None
    rank1 = eng._launcher.workers[1].proc.pid
    c, _, _ = await _stored_then_looked_up(eng, gpu)
    os.kill(rank1, signal.SIGSTOP)
    plan = c.step()
    assert plan.load is not None and plan.load_jobs[plan.load.job_id] == ("b",)
    waiter = asyncio.ensure_future(eng.wait_loaded("b"))
    closing = asyncio.ensure_future(eng.aclose())
    while not eng._launcher._stopped:  # past the drain (0.5 s): the ranks' stop began
        await asyncio.sleep(0.01)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.wait({waiter}, timeout=0.2)  # the stop's grace (0.5 s) still runs
    if waiter.done():
        assert rank1 not in live_children(), \
            "b was told to recompute while rank 1 could still copy into its blocks"
    res = await asyncio.wait_for(waiter, 20)
    assert rank1 not in live_children()
    assert not res.ok and res.cause is LoadFailure.ENGINE_CLOSED
    await asyncio.wait_for(eng.aclose(), 5)
    await _reaped(before)


async def test_a_tick_that_raises_does_not_end_the_ticks() -> None:
    """The engine's 0.25 s tick (hang checks, fencing, results) re-armed itself as its
    last line: one exception out of it -- a bug, or a KeyboardInterrupt the loop
    delivers inside the callback -- ended the ticks for the engine's life, and a rank
    that hung afterwards was never judged (the probe's wait_loaded still waited after
    8 s with hang_timeout_s=1). Now the next tick is armed first, and an Exception is
    counted (``tick_errors``) and logged at most once a minute (a review: a tick that
    kept failing printed a traceback four times a second): the ticks after it run."""
    async with spawned_engine() as (eng, _, _):
        real = eng._core.tick
        calls: list[float] = []

        def tick(now: float) -> None:
            calls.append(now)
            if len(calls) <= 2:
                raise RuntimeError("a tick that fails twice")
            real(now)

        eng._core.tick = tick  # type: ignore[method-assign]
        try:
            deadline = time.monotonic() + 5
            while len(calls) < 4 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        finally:
            eng._core.tick = real  # type: ignore[method-assign]
        assert len(calls) >= 4, f"the ticks ended after the one that raised: {calls}"
        assert eng.statistics().counters["tick_errors"] == 2


async def test_an_aclose_whose_closing_raises_still_stops_the_ranks_and_a_second_finishes(
        ) -> None:
    """The runtime's close raises inside aclose() (a bug, or a second Ctrl-C under a
    custom loop runner). aclose()'s ``finally`` set the "closed" event without ever
    stopping the ranks: every later aclose() returned at once, the state stayed CLOSING,
    the spawned ranks ran on unreaped and the rendezvous name stayed bound (a restart
    under it got NameInUse). Now the ranks stop whatever the closing raised, and the
    close that was cut off is finished once they are reaped: CLOSED, ranks reaped, the
    name free."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    cfg = config(shutdown_grace_s=0.5)
    eng = await Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    real = eng._core.close

    def interrupted() -> None:
        eng._core.close = real  # type: ignore[method-assign]
        raise RuntimeError("the closing was interrupted")

    eng._core.close = interrupted  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="interrupted"):
        await eng.aclose()
    await asyncio.wait_for(eng.aclose(), 20)
    assert eng.state is EngineState.CLOSED
    await _reaped(before)
    core = Runtime(cfg, gpu_blocks=BlockPool(GPU_BLOCKS), device_caches=None, spawned=False)
    core.open()  # NameInUse while the cut-off close had left the listener bound
    core.close()


async def test_statistics_from_another_thread_are_taken_on_the_launch_loop() -> None:
    """A metrics thread polled ``statistics()`` while the loop served traffic and got
    ``RuntimeError: dictionary changed size during iteration`` (2 in about 19k calls:
    the snapshot walked the manager's pin table while the loop changed it). The
    manager's state belongs to the launch loop: from another thread the snapshot is now
    taken on the loop, and the thread waits for it."""
    async with spawned_engine() as (eng, _, _):
        real = eng._core.statistics
        where: list[int] = []

        def stats() -> EngineStats:
            where.append(threading.get_ident())
            return real()

        eng._core.statistics = stats  # type: ignore[method-assign]
        try:
            got = await asyncio.to_thread(eng.statistics)
            assert got.state == "ready"
            assert where == [threading.get_ident()], "the snapshot was taken off the loop"
            eng.statistics()  # on the loop: taken here, at once
            assert where[-1] == threading.get_ident() and len(where) == 2
        finally:
            eng._core.statistics = real  # type: ignore[method-assign]


class _Core:
    """Just enough of a Runtime for Engine's waiter bookkeeping (a seam for timing)."""

    state = EngineState.READY

    def __init__(self) -> None:
        self.results: list[LoadResult] = []

    def take_load_results(self) -> list[LoadResult]:
        out, self.results = self.results, []
        return out


async def test_wait_loaded_cancelled_as_its_result_arrives_keeps_the_result() -> None:
    """The result is handed to the waiter and the waiting task is cancelled in the same
    loop turn: only the wait is cancelled; the next wait_loaded gets the result."""
    core = _Core()
    eng = Engine(core, None)  # type: ignore[arg-type]
    eng._loop = asyncio.get_running_loop()  # what _start binds: calls only from this loop
    eng._waits.expect("r")
    first = asyncio.ensure_future(eng.wait_loaded("r"))
    await asyncio.sleep(0)
    core.results.append(LoadResult("r", True, (), None, 8))
    eng._publish()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    res = await asyncio.wait_for(eng.wait_loaded("r"), 1)
    assert res.ok and res.num_tokens == 8


async def test_wait_loaded_cancelled_before_its_result_arrives_keeps_the_result() -> None:
    """The other order: the waiting task is cancelled first (its future is cancelled, its
    clean-up has not run yet) and the result arrives in that same loop turn. The result
    went to the cancelled future only and was lost: the next wait_loaded hung."""
    core = _Core()
    eng = Engine(core, None)  # type: ignore[arg-type]
    eng._loop = asyncio.get_running_loop()  # what _start binds: calls only from this loop
    eng._waits.expect("r")
    first = asyncio.ensure_future(eng.wait_loaded("r"))
    await asyncio.sleep(0)
    first.cancel()
    core.results.append(LoadResult("r", True, (), None, 8))
    eng._publish()
    with pytest.raises(asyncio.CancelledError):
        await first
    res = await asyncio.wait_for(eng.wait_loaded("r"), 1)
    assert res.ok and res.num_tokens == 8
    assert eng._waits.idle()


def test_a_sync_wait_or_stats_query_given_a_bad_timeout_is_refused_at_once() -> None:
    """The hazards: ``SyncClient.wait_ready(timeout_s=nan)`` with no rank coming never
    returned (``monotonic() >= nan`` is always False), ``"1"`` raised a bare
    TypeError, and ``query_stats`` took any timeout (NaN: a deadline that never comes).
    Each now refuses with a ConfigError before it waits, and the client is unchanged:
    a valid wait still times out as it should."""
    cfg = config(connect_timeout_s=0.2)
    with SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
        for bad in (float("nan"), "1", 0, -1.0, float("inf"), 10**400, True):
            t0 = time.monotonic()
            with pytest.raises(ConfigError, match="wait_ready: timeout_s must be"):
                client.wait_ready(bad)  # type: ignore[arg-type]
            assert time.monotonic() - t0 < 0.1
        assert client.state is EngineState.STARTING
        with pytest.raises(StartTimeout):
            client.wait_ready(0.05)
        for bad in (float("nan"), "1", 0):
            with pytest.raises(ConfigError, match="query_stats: timeout must be"):
                query_stats(cfg.name, timeout=bad)  # type: ignore[arg-type]


async def test_a_stall_of_the_schedulers_own_loop_does_not_make_healthy_ranks_hung() -> None:
    """The hazard: a callback on the engine's loop posts a store to both ranks, then
    blocks the loop for 2.5 s (anything can: a host's slow callback, a flood of
    connections before the accepts were bounded), in the same loop iteration as the
    engine's 0.25 s tick. The ranks ack within milliseconds, but the tick ran first and
    judged them by the time since the job went out: with ``hang_timeout_s=2`` both were
    declared hung and killed, and the engine went FAILED, their Dones unread in the
    rings. Now the tick drains the done rings before its hang check: the engine stays
    READY, no hang counted, the store acked by both."""
    async with spawned_engine(hang_timeout_s=2.0) as sp:
        c = Client(sp.eng, sp.gpu)
        await c.store_only("warm", tokens(4 * BS, 0))
        loop = asyncio.get_running_loop()
        before = sp.eng.statistics().counters["stored_blocks"]

        def stall() -> None:
            c.compute("r1", tokens(4 * BS, 1))  # posts a store to both ranks
            time.sleep(2.5)                     # the loop is stalled; the ranks ack at once

        ticker = sp.eng._ticker
        assert ticker is not None
        loop.call_at(ticker.when() - 1e-4, stall)  # the tick's own loop iteration
        await asyncio.sleep(1.0)
        st = sp.eng.statistics()
        assert st.state == "ready" and st.counters["hangs"] == 0, st.as_dict()["ranks"]
        assert st.counters["stored_blocks"] >= before + 4


def _poll_until_ready(client: SyncClient, timeout_s: float = 30.0) -> None:
    """Poll ``client`` until every rank connected (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while client.state is not EngineState.READY:
        assert time.monotonic() < deadline
        client.poll()
        time.sleep(0.01)


def test_request_listed_before_ready_gets_no_hit_and_no_pin() -> None:
    """SyncClient: b is listed in step 1, before any worker connected. Once READY and
    once a's blocks (the same tokens) are cached, lookup(b) answers 0 - the manager
    never tracked b, so a pin would never be released - and no pin is left."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    cfg = config()
    client = SyncClient(cfg, gpu_blocks=gpu, device_caches=[[k] for k in ks])
    workers = Launcher(cfg.name, 2)
    try:
        toks = tokens(6 * BS + 1, seed=12)
        hashes = chain_hashes(toks, BS)
        client.step(StepInput(1, [ScheduledRequest("b", hashes, len(toks), ((),),
                                                   new_or_resumed=True)]))
        workers.start()
        _poll_until_ready(client)
        table = gpu.allocate(6)
        client.allocated("a", [table], 0)
        client.step(StepInput(2, [ScheduledRequest("a", hashes, len(toks), (tuple(table),),
                                                   new_or_resumed=True,
                                                   num_confirmed_tokens=len(toks))]))
        client.finished("a", len(toks), [table])
        gpu.free(reversed(table))
        step, deadline = 3, time.monotonic() + 30
        while client.has_pending_work():
            assert time.monotonic() < deadline
            client.step(StepInput(step, []))
            step += 1
            time.sleep(0.005)
        assert client.statistics().counters["stored_blocks"] == 6
        assert client.lookup(RequestView("b", hashes, len(toks)), 0) == 0
        assert client.statistics().pins_held == 0
    finally:
        client.close()
        workers.stop(2.0)


def test_sync_client_closes_when_its_with_block_ends() -> None:
    """``with SyncClient(...) as client`` closes the client on exit -- a raise out of the
    block included: scheduler calls then raise StateError and the name is free again."""
    cfg = config()
    with SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
        assert client.state is EngineState.STARTING
        assert client.lookup(RequestView("r", [], 1), 0) == 0  # no rank yet: a miss
    assert client.state is EngineState.CLOSED
    with pytest.raises(StateError, match="is CLOSED"):
        client.poll()
    client.close()  # idempotent after the with block
    with (pytest.raises(RuntimeError, match="inside the block"),
          SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS)) as again):  # same name: free
        raise RuntimeError("inside the block")
    assert again.state is EngineState.CLOSED


def test_statistics_before_ready_carry_every_counter_as_zero() -> None:
    """Before READY there is no manager, and the snapshot used to leave the manager's
    counters out: ``statistics()["counters"]["loaded_blocks"]`` raised KeyError until
    the first rank connected, and so did a vLLM test that read a counter first thing
    (it passed only after an earlier test had made the engine READY), and a final
    statistics file of an engine that never got READY lacked them too. The keys are the
    same in every state; the manager's read 0 before it exists."""
    cfg = config()
    client = SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS),
                        device_caches=[[k] for k in shards()])
    workers = Launcher(cfg.name, 2)
    try:
        st = client.statistics()
        assert st.state == EngineState.STARTING.value, st.state
        counters = st.as_dict()["counters"]
        assert counters["loaded_blocks"] == 0 and counters["jobs_failed"] == 0
        assert counters["declined_cpu_full"] == 0
        workers.start()
        _poll_until_ready(client)
        assert set(client.statistics().as_dict()["counters"]) == set(counters)
    finally:
        client.close()
        workers.stop(2.0)


def test_an_engine_called_off_its_launch_loop_refuses_and_still_closes() -> None:
    """The hazard: an engine launched in one ``asyncio.run`` and used in a second. Its
    rings, its ranks' pidfds and its ticker are watched by the first loop, now closed:
    ``step`` posted a store (one job in flight, its blocks pinned) and then raised a bare
    RuntimeError from ``call_later``; the first ``aclose`` raised the same before it set
    its closed event, so every later ``aclose`` waited for it for good, the ranks up.
    Now a scheduler call off the launch loop -- a thread with no loop, another loop --
    is a StateError that changes nothing, and ``aclose`` from the second loop (twice)
    stops and reaps the ranks."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()

    async def launch() -> Engine:
        return await Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                                   device_caches=[[k] for k in ks])

    eng = asyncio.run(launch())
    hashes = chain_hashes(tokens(21, 1), BS)
    table = tuple(gpu.allocate(6))
    refused: list[BaseException] = []

    def from_a_thread() -> None:
        try:
            eng.lookup(RequestView("t", hashes, 21), 0)
        except StateError as e:
            refused.append(e)

    thread = threading.Thread(target=from_a_thread)
    thread.start()
    thread.join()
    assert len(refused) == 1 and "that loop is closed" in str(refused[0])

    async def use() -> None:
        counters = dict(eng.statistics().counters)
        with pytest.raises(StateError, match="that loop is closed"):
            eng.allocated("A", [table], 0)
        with pytest.raises(StateError, match="that loop is closed"):
            eng.step(StepInput(1, [ScheduledRequest("A", hashes, 21, (table,),
                                                    new_or_resumed=True,
                                                    num_confirmed_tokens=21)]))
        with pytest.raises(StateError, match="that loop is closed"):
            eng.finished("A", 21, [table])
        with pytest.raises(StateError, match="that loop is closed"):
            await eng.reset(1)
        stats = eng.statistics()
        assert dict(stats.counters) == counters
        assert (stats.jobs_in_flight, stats.pins_held, eng.has_pending_work()) == (0, 0, False)
        await asyncio.wait_for(eng.aclose(), 20)
        await asyncio.wait_for(eng.aclose(), 5)  # a second one returns too
        assert eng.state is EngineState.CLOSED
        with pytest.raises(StateError, match="CLOSED"):
            eng.allocated("A", [table], 0)
        await _reaped(before)

    asyncio.run(use())


async def test_a_step_given_no_step_input_is_refused_on_both_faces() -> None:
    """Found by a hostile probe: ``step(None)`` (or a dict) raised a bare AttributeError
    from the face's own pass over the input -- ``Engine``'s iterator check, and
    ``SyncClient``'s id check before READY -- before the manager's check, which refuses
    it typed, ever ran. Both now refuse it with InvalidRequest."""
    with SyncClient(config(tp=1), gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
        for bad in (None, {"step": 1}, 5):
            with pytest.raises(InvalidRequest, match="a StepInput of ScheduledRequests"):
                client.step(bad)  # type: ignore[arg-type]
    eng = Engine(_Core(), None)  # type: ignore[arg-type]
    eng._loop = asyncio.get_running_loop()
    for bad in (None, {"step": 1}):
        with pytest.raises(InvalidRequest, match="a StepInput of ScheduledRequests"):
            eng.step(bad)  # type: ignore[arg-type]


def test_settle_refuses_a_limit_that_is_no_count() -> None:
    """Found by a hostile probe: ``SyncClient.settle("x")`` and ``settle(-1)`` were
    accepted (the pool read "no limit" from them). A ConfigError names the argument;
    ``settle(0)`` still settles everything."""
    with SyncClient(config(tp=1), gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
        for bad in ("x", -1, 1.5, True, None):
            with pytest.raises(ConfigError, match="settle: limit must be an int >= 0"):
                client.settle(bad)  # type: ignore[arg-type]
        assert client.settle(0) is False


def test_aclose_after_the_launch_loop_closed_under_a_waiter_still_ends() -> None:
    """Found by a review: the launch loop closed (``loop.close()``, no ``asyncio.run``
    cancelling its tasks) while a task sat in ``wait_loaded``. ``aclose`` from a second
    loop failed that waiter's future, which raised "Event loop is closed" out of its
    clean-up: the closed event was never set, every later ``aclose`` waited for good
    and the ranks' slabs stayed. Now it ends (twice) and the ranks are reaped."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    first = asyncio.new_event_loop()
    eng = first.run_until_complete(Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                                                 device_caches=[[k] for k in ks]))
    eng._waits.expect("r")  # a load pending for "r" (its phase B accepted tokens)
    waiter = first.create_task(eng.wait_loaded("r"))
    first.run_until_complete(asyncio.sleep(0.05))  # the task now awaits its future
    assert not waiter.done()
    first.close()

    async def close_twice() -> None:
        await asyncio.wait_for(eng.aclose(), 20)
        await asyncio.wait_for(eng.aclose(), 5)
        assert eng.state is EngineState.CLOSED
        await _reaped(before)

    asyncio.run(close_twice())


def test_aclose_from_another_thread_runs_on_the_launch_loop() -> None:
    """Found by a review: ``aclose`` from a thread whose loop is not the launch loop,
    while the launch loop runs in its own thread, closed the channels and cancelled the
    ticker off that loop's thread -- a race with its callbacks. Now the close is handed
    to the launch loop and awaited there; the caller returns once it is done."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        async def launch() -> Engine:
            return await Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                                       device_caches=[[k] for k in ks])

        eng = asyncio.run_coroutine_threadsafe(launch(), loop).result(30)
        closed_on: list[threading.Thread] = []
        real_stopped = eng._stopped

        def stopped() -> None:
            closed_on.append(threading.current_thread())
            real_stopped()

        eng._stopped = stopped  # type: ignore[method-assign]
        asyncio.run(asyncio.wait_for(eng.aclose(), 20))
        assert eng.state is EngineState.CLOSED and closed_on == [thread]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    asyncio.run(_reaped(before))


def test_aclose_handed_to_a_launch_loop_that_stops_first_closes_here() -> None:
    """Found by a review: ``aclose`` from another thread is handed to the running launch
    loop; that loop, busy for 0.2 s, then stops before it ever runs the handed close.
    The caller waited for good, the engine READY and its ranks up. Now it sees the loop
    stop and closes here."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    before = live_children()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def launch() -> Engine:
        return await Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                                   device_caches=[[k] for k in ks])

    eng = asyncio.run_coroutine_threadsafe(launch(), loop).result(30)
    loop.call_soon_threadsafe(time.sleep, 0.2)  # busy: the hand-over queues behind ...
    loop.call_soon_threadsafe(loop.stop)  # ... the stop, and never runs
    try:
        asyncio.run(asyncio.wait_for(eng.aclose(), 20))
        assert eng.state is EngineState.CLOSED
    finally:
        thread.join(10)
        loop.close()
    asyncio.run(_reaped(before))


def test_statistics_from_another_thread_while_the_launch_loop_stops_are_read_there() -> None:
    """A metrics thread asks for statistics just as the launch loop stops (its snapshot
    callback queued after the loop's last batch began): the thread waited the whole
    5 s and got StateError, though with the loop stopped nothing races a direct read
    (a review). Now it waits in slices and reads the statistics itself once the loop
    no longer runs."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    loop = asyncio.new_event_loop()
    eng = loop.run_until_complete(Engine.launch(
        config(), workers=SPAWN, gpu_blocks=gpu, device_caches=[[k] for k in ks]))
    try:
        got: list[tuple[str, float] | StateError] = []

        def metrics() -> None:
            t0 = time.monotonic()
            try:
                got.append((eng.statistics().state, time.monotonic() - t0))
            except StateError as exc:
                got.append(exc)

        def busy_then_stop() -> None:  # the metrics thread asks while this runs
            time.sleep(0.5)
            loop.stop()

        th = threading.Thread(target=metrics)
        loop.call_soon(th.start)
        loop.call_soon(busy_then_stop)
        loop.run_forever()
        th.join(10)
        assert len(got) == 1, got
        answer = got[0]
        assert not isinstance(answer, StateError), answer
        assert answer[0] == "ready" and answer[1] < 2.0
    finally:
        loop.run_until_complete(eng.aclose())
        loop.close()


async def test_a_rank_busy_with_a_long_store_is_not_hung() -> None:
    """The hazard (a hostile probe at production scale): one store of 40,000 blocks
    over 100 layers whose GPU ids descend while its CPU ids ascend, so no two pairs
    coalesce: four million ``memmove`` calls, seconds of copying in one job. No Done
    comes until it ends, so with ``hang_timeout_s=1`` the rank was declared hung while
    it copied, killed, and the engine went FAILED. Now the copy stamps the rank's
    progress every few thousand calls: the engine stays READY, no hang is counted,
    and the store is acked whole."""
    n, layers = 40_000, 100
    caches = [[shared_tensor((n, 4), torch.uint8) for _ in range(layers)]]
    gpu = BlockPool(n)
    cfg = config(tp=1, num_cpu_blocks=n, hang_timeout_s=1.0)
    async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu, device_caches=caches) as eng:
        toks = tokens(n * BS, 5)
        table = list(reversed(gpu.allocate(n)))          # descending GPU ids
        hashes = chain_hashes(toks, BS)
        for b, h in zip(table, hashes):                  # the engine computed them
            gpu.add_hashes(b, [h])
        assert eng.lookup(RequestView("big", hashes, len(toks)), 0) == 0
        eng.allocated("big", [table], 0)
        t0 = time.monotonic()
        eng.step(StepInput(1, [ScheduledRequest("big", hashes, len(toks), (tuple(table),),
                                                new_or_resumed=True,
                                                num_confirmed_tokens=len(toks))]))
        while eng.has_pending_work():
            assert time.monotonic() - t0 < 120, "the store never finished"
            await asyncio.sleep(0.05)
        took = time.monotonic() - t0
        st = eng.statistics()
        assert st.state == "ready" and st.counters["hangs"] == 0, st.as_dict()["ranks"]
        assert st.counters["stored_blocks"] == n
        assert took > 1.0, f"the store took {took:.2f} s: too short to prove anything"


def test_transfer_params_before_ready_checks_its_id() -> None:
    """Every other call checks its request id before READY too; ``transfer_params``
    answered None to an id that is no str (a review): now InvalidRequest."""
    core = Runtime(config(tp=1), gpu_blocks=BlockPool(GPU_BLOCKS), device_caches=None,
                   spawned=False)
    assert core.manager is None and core.transfer_params("r") is None
    with pytest.raises(InvalidRequest, match="transfer_params"):
        core.transfer_params(["r"])  # type: ignore[arg-type]
