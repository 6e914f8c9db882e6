"""Closing an Engine while other calls run: a ``reset`` in flight, a second
``aclose``, and a launch that fails after its remote index started."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest
from engine_rig import GPU_BLOCKS, Client, config, embedded_engine, spawned_engine, tokens

from kvshm.engine import ATTACH, Engine
from kvshm.engine.runtime import Runtime
from kvshm.errors import NameInUse, StateError
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.types import ScheduledRequest


async def test_a_reset_waiting_when_the_engine_closes_raises() -> None:
    """``reset()`` waits for the jobs in flight to end; the ranks are paused, so a store
    job stays unacked, and ``aclose()`` closes the engine meanwhile (it does not wait
    past its grace). The reset used to poll forever (the job table is left as it was
    at close); now it raises StateError."""
    async with embedded_engine(shutdown_grace_s=0.3) as (eng, gpu, _, ranks):
        c = Client(eng, gpu)
        ranks.paused = True
        _, plan = c.compute("a", tokens(16, 1))
        assert plan.store is not None
        waiting = asyncio.ensure_future(eng.reset())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await eng.aclose()
        ranks.paused = False
        with pytest.raises(StateError, match="CLOSED"):
            await asyncio.wait_for(waiting, 10)


async def test_a_second_aclose_returns_only_once_the_ranks_are_reaped() -> None:
    """Two ``aclose()`` calls at once, rank 1 stopped (SIGSTOP) with a store job out.
    The second used to return while the first was still stopping the ranks (both
    drained; the second found the stop under way and left): a caller could see its
    engine closed and its workers alive. Now each returns with every rank reaped."""
    async with spawned_engine(shutdown_grace_s=1.0) as (eng, gpu, _):
        c = Client(eng, gpu)
        launcher = eng._launcher
        assert launcher is not None
        pids = [w.pid for w in launcher.workers]
        os.kill(pids[1], signal.SIGSTOP)
        c.compute("a", tokens(16, 1))
        first = asyncio.ensure_future(eng.aclose())
        second = asyncio.ensure_future(eng.aclose())
        done, _ = await asyncio.wait([first, second], return_when=asyncio.FIRST_COMPLETED)
        assert [p for p in pids if _alive(p)] == []
        await asyncio.gather(first, second)


def _alive(pid: int) -> bool:
    """``pid`` runs and is not a zombie (a reaped pid is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_a_launch_refused_its_name_stops_its_remote_index() -> None:
    """The name is held by another engine: each launch with a remote tier fails
    (NameInUse). The remote index had started its thread before the listener was
    refused, and nothing closed it: one thread left per failed launch."""
    name = f"close-{os.getpid()}"
    holder = Runtime(config(name=name, tp=1), gpu_blocks=BlockPool(GPU_BLOCKS))
    holder.open()
    try:
        before = {t.ident for t in threading.enumerate()}
        for _ in range(3):
            with pytest.raises(NameInUse):
                await Engine.launch(config(name=name, tp=1, remote_url="valkey://127.0.0.1:1"),
                                    workers=ATTACH, gpu_blocks=BlockPool(GPU_BLOCKS))
        left = [t.name for t in threading.enumerate() if t.ident not in before]
        assert left == []
    finally:
        holder.begin_close()
        holder.close()


async def test_a_close_returns_every_pin_it_held_on_the_hosts_gpu_pool() -> None:
    """The hazard (a hostile probe): kvshm pins blocks of the host's GPU pool -- a
    finished request's blocks until its finish-time store is sent, a load's and a
    store's until every rank acked -- and a close released none of them: after a
    server's last request and ``aclose()`` the host's pool kept 6 of 64 blocks at ref 1
    for good, and a server that launched another engine on the same pool lost blocks at
    every close. Now the close drops what no rank holds (the queued store here) at
    once, and, once it has reaped its spawned ranks, the pins of their jobs: here A's
    finish-time store is still queued and B's store is in flight on a stopped rank 1
    (SIGSTOP: the close SIGKILLs and reaps it). Afterwards every GPU block is free."""
    async with spawned_engine(shutdown_grace_s=0.3) as (eng, gpu, _):
        c = Client(eng, gpu)
        launcher = eng._launcher
        assert launcher is not None
        toks = tokens(4 * 16, 2)
        table = gpu.allocate(4)
        eng.allocated("a", [table], 0)   # computed, listed before any token confirmed
        c.step(ScheduledRequest("a", chain_hashes(toks, 16), len(toks), (tuple(table),),
                                new_or_resumed=True, num_confirmed_tokens=0))
        c.finish("a", table, len(toks))  # its 4 blocks: pinned for the next step's store
        assert [gpu.ref_cnt(b) for b in table] == [1, 1, 1, 1]
        os.kill(launcher.workers[1].pid, signal.SIGSTOP)
        b_table, plan = c.compute("b", tokens(2 * 16, 3))
        assert plan.store is not None    # (A's store goes in this step too)
        c.finish("b", b_table, 2 * 16)
        assert gpu.num_free < GPU_BLOCKS
        await eng.aclose()
        assert eng.statistics().pins_held == 0 and not eng.has_pending_work()
        assert gpu.num_free == GPU_BLOCKS and gpu.allocate(GPU_BLOCKS)


async def test_a_close_whose_pin_release_raises_still_closes_everything(
        caplog: pytest.LogCaptureFixture) -> None:
    """The close releases what no rank holds through the manager (a re-read of that
    fix): a bug raised there came first and left the channels, segments and the
    rendezvous open. It runs last now, and what it raises is logged; the engine is
    CLOSED and leaves nothing in /dev/shm (this file's leak check)."""
    async with embedded_engine() as (eng, gpu, _, _):
        manager = eng._core.manager
        assert manager is not None

        def boom(stopped: object = ()) -> None:
            raise RuntimeError("a bug in the release")
        manager.close = boom  # type: ignore[method-assign]
        await eng.aclose()
        assert eng.state.value == "closed"
    assert "releasing pins at close failed" in caplog.text
