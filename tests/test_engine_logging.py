"""What an engine logs and reports at its ends, with real spawned workers: the INFO
lines of its lifecycle (name and how to query it, READY with the CPU tier, FAILED with
rank and cause, shutdown), and a clean close that is no failure (ranks_failed 0, the
CPU index kept for the final statistics, each rank detached)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

import pytest
from engine_rig import BS, ROW, Client, embedded_engine, spawned_engine, tokens

from kvshm.engine import EngineState
from kvshm.hashing import chain_hashes
from kvshm.types import LoadFailure, RequestView


def _lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kvshm.engine") and r.levelno == level]


async def test_clean_close_is_no_failure_and_keeps_the_index(
        caplog: pytest.LogCaptureFixture) -> None:
    """Store 6 blocks, close: CLOSED, ranks_failed 0, the 6 blocks still counted as
    cached, each rank detached ("the engine closed") and not dead. The log says, once
    each: where to query the engine, READY with the tier size, shutdown -- and nothing
    at WARNING or above."""
    caplog.set_level(logging.DEBUG, logger="kvshm.engine")
    async with spawned_engine(num_cpu_blocks=64) as (eng, gpu, _):
        await Client(eng, gpu).store_only("a", tokens(6 * BS + 1, seed=3))
        assert eng.statistics().cpu_blocks_cached == 6
        name = eng.name
    stats = eng.statistics()
    assert stats.state == "closed" and eng.state is EngineState.CLOSED
    assert stats.counters["ranks_failed"] == 0
    assert stats.cpu_blocks_cached == 6
    assert [(r.alive, r.detached, r.why) for r in stats.ranks] == \
        [(True, True, "the engine closed")] * 2
    info = _lines(caplog, logging.INFO)
    assert info[0] == (f"kvshm engine {name!r}: waiting for 2 rank(s); query it with "
                       f"`kvshm stats --name {name}`")
    ready = [m for m in info if "READY" in m]
    assert ready == [f"kvshm engine {name!r} READY: 2 rank(s), CPU tier 64 blocks x "
                     f"{2 * ROW} bytes = {64 * 2 * ROW / 2**30:.3g} GiB; "
                     f"`kvshm stats --name {name}`"]
    assert info[-1] == (f"kvshm engine {name!r} shut down: 6 CPU block(s) cached, "
                        "0 rank(s) failed, 0 left")
    assert len(info) == 3, info
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_killed_rank_is_logged_with_rank_and_cause(
        caplog: pytest.LogCaptureFixture) -> None:
    """SIGKILL of spawned rank 1: one ERROR line names the engine, the rank and the
    cause; the shutdown line then counts the failure."""
    caplog.set_level(logging.INFO, logger="kvshm.engine")
    async with spawned_engine() as (eng, _, _):
        pid = eng.statistics().ranks[1].pid
        os.kill(pid, signal.SIGKILL)
        for _ in range(400):
            if eng.state is EngineState.FAILED:
                break
            await asyncio.sleep(0.01)
        assert eng.state is EngineState.FAILED
        name = eng.name
    errors = _lines(caplog, logging.ERROR)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"kvshm engine {name!r} FAILED: rank 1 ")
    assert errors[0].endswith("; serving goes on without offload")
    assert ("lifeline lost" in errors[0]) or ("process exited" in errors[0])
    assert eng.statistics().counters["ranks_failed"] == 1
    assert _lines(caplog, logging.INFO)[-1].endswith("1 rank(s) failed, 0 left")


async def test_per_request_lines_are_debug_only(caplog: pytest.LogCaptureFixture) -> None:
    """A lookup logs its request and hit at DEBUG; nothing per request reaches INFO."""
    caplog.set_level(logging.DEBUG, logger="kvshm.engine")
    async with spawned_engine() as (eng, gpu, _):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=9)
        await c.store_only("a", toks)
        hit, table, _ = c.load("b", toks)
        assert (await c.loaded("b")).ok
        c.finish("b", table, 0)
        await c.settle()
        name = eng.name
    assert f"kvshm engine {name!r}: lookup 'b': {4 * BS} CPU hit token(s) beyond 0 local" \
        in _lines(caplog, logging.DEBUG)
    assert not [m for m in _lines(caplog, logging.INFO) if "'b'" in m or "'a'" in m]


async def test_a_rank_closed_by_its_host_is_a_departure_not_a_failure(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM stops its worker processes before its scheduler: each embedded Worker is
    closed by its host while the engine still runs. Here rank 1's host closes it with a
    load of request b queued on both ranks (their copies held back): the worker says
    Goodbye before its EOF, so the engine moves to STOPPED -- serving without offload,
    b's load fails (RANK_DIED: recompute), rank 1 is detached and fenced, b's pins wait
    for rank 0, which may still copy, and go once it acked -- and logs it once at INFO.
    ranks_failed stays 0, ranks_left is 1, nothing is logged at WARNING or above, and
    the shutdown line counts the departure."""
    caplog.set_level(logging.INFO, logger="kvshm.engine")
    async with embedded_engine() as (eng, gpu, _ks, ranks):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=5)
        await c.store_only("a", toks)
        ranks.paused = True  # nobody submits b's copies
        hit, table, plan = c.load("b", toks)
        assert hit == 4 * BS and plan.load is not None
        assert eng.statistics().pins_held > 0
        ranks.workers[1].close()  # its host closes it (Goodbye, then EOF)
        for _ in range(400):
            if eng.state is not EngineState.READY:
                break
            await asyncio.sleep(0.01)
        assert eng.state is EngineState.STOPPED
        res = await c.loaded("b")
        assert not res.ok and res.cause is LoadFailure.RANK_DIED
        assert sorted(res.failed_block_ids) == sorted(table)
        c.finish("b", table, 0)
        st = eng.statistics()
        assert st.state == "stopped"
        assert st.counters["ranks_failed"] == 0 and st.counters["ranks_left"] == 1
        r1 = st.ranks[1]
        assert (r1.alive, r1.detached, r1.fenced) == (False, True, True)
        assert r1.why == "left: closed by its own process"
        # rank 0 may still run b's copy: its 4 GPU and 4 CPU blocks stay pinned until it
        # acks (rank 1 is fenced: its EOF came after its last copy)
        assert st.pins_held == 8
        ranks.paused = False
        for _ in range(400):
            if eng.statistics().pins_held == 0:
                break
            await asyncio.sleep(0.01)
        assert eng.statistics().pins_held == 0
        assert eng.lookup(RequestView("c", chain_hashes(toks, BS), len(toks)), 0) == 0
        name = eng.name
    stopped = [m for m in _lines(caplog, logging.INFO) if "STOPPED" in m]
    assert stopped == [f"kvshm engine {name!r} STOPPED: rank 1 left: closed by its own "
                       "process; serving goes on without offload"]
    assert _lines(caplog, logging.INFO)[-1].endswith("0 rank(s) failed, 1 left")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
