"""Hazard: a rank declared dead (hang verdict, broken ring) resumes and finishes a queued
copy. Rule: a block that any rank may still touch is never handed out again until that
rank is fenced (process reaped, standalone lifeline EOF) or, for a rank that cannot be
proven gone, stays quarantined for the engine's life; the worker checks a revocation
word before each job and each Done.

Every scenario is the same story, over real processes and real shared memory, tp=2,
``hang_timeout_s=1``: request a's 6 blocks are stored; rank 1 is made to hang with b's
load still to run on it; after the verdict b's load has failed and b finishes (its GPU
blocks freed by the engine); request c then takes EVERY free GPU block and writes its
own bytes; rank 1 resumes; c's bytes on every rank must be unchanged. Before the fix the
resumed rank 1 finished b's load into blocks c now owned (15 of 16 in the original
report).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

import pytest
import torch
from engine_rig import (
    BS,
    GPU_BLOCKS,
    Client,
    EmbeddedRanks,
    config,
    embedded_engine,
    host_forever,
    shards,
    tokens,
)

from kvshm.engine import ATTACH, SPAWN, Engine, EngineState
from kvshm.ipc.protocol import Done
from kvshm.ipc.rendezvous_client import query_stats
from kvshm.offload.pool import BlockPool
from kvshm.types import LoadFailure, StepInput
from workers.copy_engine import CpuFence
from workers.worker import DetachReason, Worker

HANG_S = 2.0  # 1 s left a healthy rank on a loaded 2-core machine little room
A_BLOCKS = 6


async def _until(pred: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _fill_c(gpu: BlockPool, ks: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """Request c takes every free GPU block and writes 0xC7 into it on every rank."""
    table_c = gpu.allocate(gpu.num_free)
    for k in ks:
        k[table_c] = 0xC7
    return table_c, [k[table_c].clone() for k in ks]


async def _c_keeps_its_bytes(eng: Engine, c: Client, ks: list[torch.Tensor],
                             table_c: list[int], want: list[torch.Tensor]) -> None:
    """A moment for a rank that could still copy to do so; then c's bytes are its own
    on every rank, and once c finishes no pin is left."""
    await asyncio.sleep(0.3)
    for k, w in zip(ks, want):
        assert torch.equal(k[table_c], w)
    c.finish("c", table_c, 0)
    assert eng.statistics().pins_held == 0


async def _hang_story(eng: Engine, gpu: BlockPool, ks: list[torch.Tensor],
                      hang: Callable[[], None], *, fenced_first: bool = False,
                      ) -> tuple[Client, list[int], list[int], list[torch.Tensor]]:
    """Store a; hang rank 1; load b (fails at the verdict); finish b; (``fenced_first``:
    wait for rank 1's fence); c takes every free block."""
    c = Client(eng, gpu)
    toks = tokens(A_BLOCKS * BS + 1, seed=11)
    await c.store_only("a", toks)
    hang()
    hit, table_b, plan = c.load("b", toks)
    assert hit == A_BLOCKS * BS and plan.load is not None
    res = await asyncio.wait_for(eng.wait_loaded("b"), 10 * HANG_S)
    assert not res.ok and res.cause is LoadFailure.RANK_DIED
    assert eng.state is EngineState.FAILED
    c.finish("b", table_b, 0)  # b recomputes elsewhere and leaves: the engine frees its ids
    if fenced_first:
        await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's fence")
    table_c, want = _fill_c(gpu, ks)
    return c, table_b, table_c, want


async def test_rank_declared_dead_resumes_spawn_is_killed_before_its_blocks_go() -> None:
    """SPAWN: rank 1 is SIGSTOPped; the verdict SIGKILLs it and its pidfd fences it, so
    b's blocks may go back to the pool (c may take them): the process that could have
    written them is gone. SIGCONT finds nothing to resume; c's bytes stay."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    eng = await Engine.launch(config(hang_timeout_s=HANG_S), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    try:
        assert eng._launcher is not None
        victim = eng._launcher.workers[1].proc
        # the fence comes with the pidfd, right after the verdict: once it is in, b's
        # pins are gone and c gets every block, b's included
        c, table_b, table_c, want = await _hang_story(
            eng, gpu, ks, lambda: os.kill(victim.pid, signal.SIGSTOP), fenced_first=True)
        st = eng.statistics()
        assert st.ranks[1].fenced and not st.ranks[1].alive
        assert st.quarantined_gpu_blocks == 0 and st.quarantined_cpu_blocks == 0
        assert set(table_b) <= set(table_c)
        assert victim.wait(5) == -signal.SIGKILL  # killed, not resumed
        await _c_keeps_its_bytes(eng, c, ks, table_c, want)
    finally:
        await eng.aclose()


async def test_a_hung_kvshm_workers_rank_is_killed_at_the_verdict_and_fenced_by_its_exit(
        ) -> None:
    """ATTACH with ``kvshm-workers``: its rank processes run nothing but copies, and say
    so in their Hello (``fence_by_kill``). Rank 1 is SIGSTOPped with b's load to run;
    the verdict fails b's load, SIGKILLs rank 1 through the pidfd opened at its Hello,
    and its exit fences it: b's blocks go back (c may take them), nothing stays
    quarantined. Before, kvshm never signalled such a rank: it stayed unfenced for as
    long as it was stopped, and a probe that froze it in the middle of b's copy saw b
    -- told to recompute -- recompute into its own blocks and the resumed rank finish
    its copy over them (5 of 6 blocks; the quarantine keeps blocks from other requests
    only). Here rank 1 is stopped before b's copy exists (a freeze mid-copy needs
    rows large enough to catch in flight), so the revocation word alone would keep b's
    recompute safe too: what this shows is the kill, the fence by the exit and the
    quarantine lifted, none of which happened before."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    launch = Engine.launch(config(hang_timeout_s=HANG_S), workers=ATTACH, gpu_blocks=gpu,
                           device_caches=[[k] for k in ks])
    name = launch._args[1].name
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--name", name, "--tp", "2"],
                            stderr=subprocess.PIPE, text=True)
    eng = await launch
    try:
        rank1 = eng.statistics().ranks[1].pid
        c = Client(eng, gpu)
        toks = tokens(A_BLOCKS * BS + 1, seed=11)
        await c.store_only("a", toks)
        os.kill(rank1, signal.SIGSTOP)
        hit, table_b, plan = c.load("b", toks)
        assert hit == A_BLOCKS * BS and plan.load is not None
        res = await asyncio.wait_for(eng.wait_loaded("b"), 10 * HANG_S)
        assert not res.ok and res.cause is LoadFailure.RANK_DIED
        for k in ks:  # b recomputes into its own blocks, as the result tells it to
            k[table_b] = 0xB0
        await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's fence by its exit")
        st = eng.statistics()
        assert st.counters["ranks_killed_to_fence"] == 1 and st.counters["hangs"] == 1
        assert st.quarantined_gpu_blocks == 0 and st.quarantined_cpu_blocks == 0
        with contextlib.suppress(ProcessLookupError):  # killed: there is nothing to resume
            os.kill(rank1, signal.SIGCONT)
        await asyncio.sleep(0.3)
        for k in ks:
            assert bool((k[table_b] == 0xB0).all()), "a late copy overwrote b's recompute"
        c.finish("b", table_b, 0)
        table_c, want = _fill_c(gpu, ks)
        assert set(table_b) <= set(table_c)  # fenced: b's blocks went back to the pool
        await _c_keeps_its_bytes(eng, c, ks, table_c, want)
    finally:
        await eng.aclose()
        _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert "rank 1 exited with signal 9" in err, err


async def test_rank_declared_dead_resumes_standalone_blocks_quarantined_until_eof() -> None:
    """ATTACH with standalone ranks that did not offer to be killed (each run by a
    caller's own ``cli_main``, not the console script): kvshm never signals such a
    process, so after the verdict b's 6 GPU blocks (and the 6 CPU rows) stay pinned --
    quarantined -- and c cannot get them. SIGCONT: rank 1 reads the revocation word
    before starting b's load, starts nothing, exits 1; its lifeline EOF fences it and
    the quarantine ends."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    launch = Engine.launch(config(hang_timeout_s=HANG_S), workers=ATTACH, gpu_blocks=gpu,
                           device_caches=[[k] for k in ks])
    name = launch._args[1].name
    code = ("import sys; from workers.loop import cli_main; "
            "sys.exit(cli_main(sys.argv[1:]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, "--name", name, "--tp", "2",
                               "--rank", str(r)], stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    eng = await launch
    try:
        rank1 = eng.statistics().ranks[1].pid
        assert rank1 == procs[1].pid
        c, table_b, table_c, want = await _hang_story(
            eng, gpu, ks, lambda: os.kill(rank1, signal.SIGSTOP))
        st = eng.statistics()
        assert not st.ranks[1].alive and not st.ranks[1].fenced
        assert st.counters["ranks_killed_to_fence"] == 0
        assert st.quarantined_gpu_blocks == A_BLOCKS and st.quarantined_cpu_blocks == A_BLOCKS
        assert set(table_c).isdisjoint(table_b)
        assert [gpu.ref_cnt(b) for b in table_b] == [1] * A_BLOCKS  # the load job's pins
        remote = await asyncio.get_running_loop().run_in_executor(None, query_stats, eng.name)
        assert remote["quarantined_gpu_blocks"] == A_BLOCKS  # what `kvshm stats` prints
        b_rows = [k[table_b].clone() for k in ks]
        os.kill(rank1, signal.SIGCONT)
        await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's lifeline EOF")
        assert eng.statistics().quarantined_gpu_blocks == 0
        assert [gpu.ref_cnt(b) for b in table_b] == [0] * A_BLOCKS
        for k, w in zip(ks, want):
            assert torch.equal(k[table_c], w)
        for k, rows in zip(ks, b_rows):  # revoked before it started: b untouched too
            assert torch.equal(k[table_b], rows)
        c.finish("c", table_c, 0)
        assert eng.statistics().pins_held == 0
    finally:
        await eng.aclose()
        errs = [p.communicate(timeout=20)[1] for p in procs]
    assert procs[1].returncode == 1
    assert "the engine declared this rank dead" in errs[1]


@pytest.fixture
async def embedded() -> AsyncIterator[tuple[Engine, BlockPool, list[torch.Tensor],
                                            EmbeddedRanks]]:
    async with embedded_engine(hang_timeout_s=HANG_S) as rig:
        yield rig


async def test_rank_declared_dead_resumes_embedded_blocks_quarantined_until_it_stops(
        embedded: tuple[Engine, BlockPool, list[torch.Tensor], EmbeddedRanks]) -> None:
    """Embedded: rank 1's copy of b's load is stuck while its host keeps calling it (the
    heartbeat advances, nothing completes): verdict after 1 s. Nothing proves the rank
    stopped (its host process lives, its socket is open), so b's blocks stay quarantined
    for as long as that lasts: c never gets them, stepping on changes nothing. The copy's
    fence is then released (the rank "resumes"): the revoked worker cancels the copy
    instead of running it, and with nothing running closes its lifeline: that EOF fences
    it and the quarantine ends. c's bytes and b's stale rows are untouched."""
    eng, gpu, ks, ranks = embedded
    fence = CpuFence()
    c, table_b, table_c, want = await _hang_story(
        eng, gpu, ks, lambda: setattr(ranks, "stall", fence))
    st = eng.statistics()
    assert not st.ranks[1].alive and not st.ranks[1].fenced
    assert st.quarantined_gpu_blocks == A_BLOCKS
    assert set(table_c).isdisjoint(table_b)
    b_rows = ks[1][table_b].clone()
    for _ in range(5):  # stuck: stepping on changes nothing, and nobody is kept stepping
        eng.step(StepInput(99, []))
        await asyncio.sleep(0.05)
    assert eng.statistics().quarantined_gpu_blocks == A_BLOCKS
    assert [gpu.ref_cnt(b) for b in table_b] == [1] * A_BLOCKS
    assert not eng.has_pending_work()
    fence.set()
    await _until(lambda: ranks.workers[1].detach_reason is DetachReason.REVOKED,
                 "rank 1 to see the revocation")
    await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's EOF after its copy")
    assert eng.statistics().quarantined_gpu_blocks == 0
    assert [gpu.ref_cnt(b) for b in table_b] == [0] * A_BLOCKS
    for k, w in zip(ks, want):
        assert torch.equal(k[table_c], w)
    assert torch.equal(ks[1][table_b], b_rows)
    stats = ranks.workers[1].statistics()["counters"]
    assert stats["revocations_seen"] == 1 and stats["jobs_failed"] == 1
    c.finish("c", table_c, 0)
    assert eng.statistics().pins_held == 0


async def test_a_stray_done_fails_the_rank_and_does_not_blind_the_hang_check(
        embedded: tuple[Engine, BlockPool, list[torch.Tensor], EmbeddedRanks]) -> None:
    """Hazard "a stray Done blinds the hang check" (a hostile probe): a's store (job 1)
    was answered by both ranks; rank 1's copy of b's load is stuck, and rank 1 sends
    one more Done for job 1, then nothing. That Done lowered rank 1's count of
    unanswered Transfers from 1 (the load) to 0, so the hang check read the rank as
    idle: no verdict ever came, b's ``wait_loaded`` never returned (still pending 8 s
    later in the probe, at a 1 s hang timeout), and whatever went to rank 1 after it
    stayed pinned. Now a Done that answers nothing sent to the rank is a protocol fault:
    rank 1 is failed at once (not a hang timeout later), b's load fails and b
    recomputes; b's 6 blocks stay quarantined as for any verdict on a live rank."""
    eng, gpu, ks, ranks = embedded
    fence = CpuFence()
    c = Client(eng, gpu)
    toks = tokens(A_BLOCKS * BS + 1, seed=11)
    await c.store_only("a", toks)
    assert eng.statistics().counters["store_jobs"] == 1  # a's store is job 1
    ranks.stall = fence
    hit, table_b, plan = c.load("b", toks)
    assert hit == A_BLOCKS * BS and plan.load is not None
    await _until(lambda: ranks.workers[1].statistics()["counters"]["jobs_submitted"] >= 2,
                 "rank 1 to take b's load")
    session = ranks.workers[1]._session  # the rank misbehaves: the seam is its ring
    assert session is not None and session.channel is not None
    chan = session.channel
    chan.send_nowait(Done(1, 1, True))
    t0 = asyncio.get_running_loop().time()
    res = await asyncio.wait_for(eng.wait_loaded("b"), 10 * HANG_S)
    assert asyncio.get_running_loop().time() - t0 < HANG_S  # no hang timeout waited
    assert not res.ok and res.cause is LoadFailure.RANK_DIED
    st = eng.statistics()
    assert eng.state is EngineState.FAILED and not st.ranks[1].alive
    assert "answering nothing sent to it" in st.ranks[1].why
    assert (st.counters["protocol_errors"], st.counters["hangs"]) == (1, 0)
    assert st.quarantined_gpu_blocks == A_BLOCKS
    c.finish("b", table_b, 0)
    assert [gpu.ref_cnt(b) for b in table_b] == [1] * A_BLOCKS  # quarantined, not free
    fence.set()
    await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's EOF after its copy")
    assert [gpu.ref_cnt(b) for b in table_b] == [0] * A_BLOCKS
    assert eng.statistics().pins_held == 0


# ---- a rank killed with a job outstanding, in each mode -----------------------------------


def _host_embedded_rank1(name: str, k: torch.Tensor, held: str) -> None:
    """Child process (forked): an embedded rank 1 whose host engine never submits its
    ``held`` jobs ("load" or "store": they stay queued) until it is SIGKILLed."""
    import time

    w = Worker.attach(name, 1, 2, [k])
    while True:
        for step in w.queued_steps():
            w.begin_step(step)
            if held != "load":
                w.submit_loads(step)
            if held != "store":
                w.submit_stores(step)
        w.poll()
        time.sleep(0.002)


async def _kill_story(eng: Engine, gpu: BlockPool, ks: list[torch.Tensor],
                      direction: str, stop: Callable[[], None],
                      kill: Callable[[], None]) -> None:
    """A job of ``direction`` is outstanding on rank 1 when it is killed: the job fails
    (a load: recompute), nothing hangs, the rank is fenced by its exit, and once every
    request has finished no pin and no quarantined block is left: at once for the killed
    rank's share, and as soon as the live rank has finished its copy or been fenced for
    the rest (waited for: on a loaded machine rank 0 may still be copying when the
    request finishes -- CI saw 12 pins held at the first look)."""
    c = Client(eng, gpu)
    toks = tokens(A_BLOCKS * BS + 1, seed=13)
    if direction == "load":
        await c.store_only("a", toks)
        stop()
        hit, table, plan = c.load("b", toks)
        assert plan.load is not None
    else:
        stop()
        table, plan = c.compute("b", toks)
        assert plan.store is not None
    kill()
    await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's fence")
    if direction == "load":
        res = await asyncio.wait_for(eng.wait_loaded("b"), 5.0)
        assert not res.ok and res.cause is LoadFailure.RANK_DIED
    c.finish("b", table, 0)
    await _until(lambda: eng.statistics().pins_held == 0 and gpu.num_pinned == 0,
                 "the pins' release")
    st = eng.statistics()
    assert st.state == "failed" and st.quarantined_gpu_blocks == 0


@pytest.mark.parametrize("direction", ["load", "store"])
async def test_rank_killed_mid_job_spawn(direction: str) -> None:
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    eng = await Engine.launch(config(), workers=SPAWN, gpu_blocks=gpu,
                              device_caches=[[k] for k in ks])
    try:
        assert eng._launcher is not None
        pid = eng._launcher.workers[1].pid
        await _kill_story(eng, gpu, ks, direction, lambda: os.kill(pid, signal.SIGSTOP),
                          lambda: os.kill(pid, signal.SIGKILL))
    finally:
        await eng.aclose()


@pytest.mark.parametrize("direction", ["load", "store"])
async def test_rank_killed_mid_job_standalone(direction: str) -> None:
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    launch = Engine.launch(config(), workers=ATTACH, gpu_blocks=gpu,
                           device_caches=[[k] for k in ks])
    proc = subprocess.Popen([sys.executable, "-m", "workers", "--name", launch._args[1].name,
                             "--tp", "2"], stderr=subprocess.DEVNULL)
    eng = await launch
    try:
        pid = eng.statistics().ranks[1].pid
        await _kill_story(eng, gpu, ks, direction, lambda: os.kill(pid, signal.SIGSTOP),
                          lambda: os.kill(pid, signal.SIGKILL))
    finally:
        await eng.aclose()
        proc.wait(20)


@pytest.mark.parametrize("direction", ["load", "store"])
async def test_rank_killed_mid_job_embedded_host_process_exits(direction: str) -> None:
    """Embedded rank 1 lives in a forked host process that never submits its jobs; the
    host is SIGKILLed: its lifeline EOF (and the pidfd kvshm opened at its Hello) fence
    it, so nothing stays quarantined."""
    import multiprocessing

    ks = [shards(1)[0], shards(1)[0]]
    gpu = BlockPool(GPU_BLOCKS)
    launch = Engine.launch(config(), workers=ATTACH, gpu_blocks=gpu)
    name = launch._args[1].name
    child = multiprocessing.get_context("fork").Process(
        target=_host_embedded_rank1, args=(name, ks[1], direction), daemon=True)
    child.start()
    rank0 = Worker.attach(name, 0, 2, [ks[0]])
    task = asyncio.get_running_loop().create_task(host_forever(rank0))
    eng = await launch
    try:
        await _kill_story(eng, gpu, ks, direction, lambda: None,
                          lambda: os.kill(child.pid or 0, signal.SIGKILL))
    finally:
        await eng.aclose()
        task.cancel()
        rank0.close()
        child.join(10)


async def test_rank_lost_by_the_servers_own_close_is_not_a_fence(
        embedded: tuple[Engine, BlockPool, list[torch.Tensor], EmbeddedRanks]) -> None:
    """Rank 1's load copy is stuck on its fence when rank 1 sends garbage on its
    lifeline: the server refuses it and closes the connection itself. That is a verdict
    (RANK_LOST) but no proof the rank stopped -- it never closed its end -- so b's blocks
    stay quarantined and c cannot take them. (Taking it as a fence let the released copy
    overwrite 6 of c's blocks in review.) The fence is then set: the revoked worker's
    gate cancels the copy; c's bytes stay."""
    eng, gpu, ks, ranks = embedded
    fence = CpuFence()

    def stall_then_garbage() -> None:
        ranks.stall = fence
        client = ranks.workers[1]._client
        assert client is not None
        sock = client._sock
        assert sock is not None
        sock.send(b"\xff\xff not a control message")

    c, table_b, table_c, want = await _hang_story(eng, gpu, ks, stall_then_garbage)
    st = eng.statistics()
    assert not st.ranks[1].alive and not st.ranks[1].fenced
    assert st.quarantined_gpu_blocks == A_BLOCKS and set(table_c).isdisjoint(table_b)
    fence.set()
    await _until(lambda: ranks.workers[1].detach_reason is not None, "rank 1 to detach")
    await asyncio.sleep(0.3)
    for k, w in zip(ks, want):
        assert torch.equal(k[table_c], w)
