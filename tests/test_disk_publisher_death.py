"""Hazard: an embedded rank dies while its mover publisher is sending a disk job's Done.

The parts: an ATTACH engine with a disk tier (real slab files under tmp_path, O_DIRECT),
rank 0 an embedded Worker in this process, rank 1 an embedded Worker in a forked host
process (as vLLM's: it runs only when its host calls it, so its disk Dones go out on the
:class:`~workers.mover_publisher.MoverPublisher`'s thread). The one seam faked, in the
child only, to control timing: rank 1's host calls leave disk Dones to the publisher,
and the publisher stops its whole process (SIGSTOP) the moment it has taken its first
WRITE's Done out of the mover -- holding the worker's lock, before the Done is on the
ring -- and the test then SIGKILLs it there.

The story: prompts are stored until write-back sends a WRITE; rank 0 acks it, rank 1 is
stopped mid-send. An embedded rank whose host does not run is not hung (its heartbeat
stands still: :mod:`kvshm.engine.supervision`), so no verdict comes; meanwhile the
WRITE's slots and CPU rows stay pinned and are never handed to another job while more
prompts are stored, and lookups answer at once. Then rank 1 dies mid-send (SIGKILL):
its lifeline EOF and pidfd bring the verdict and the fence together. Rule: the dead
rank's jobs fail (its WRITE -- acked ok by rank 0 -- indexes no slot), the blocks it
could touch went to no one before the fence and are released by it, nothing hangs
(lookups, steps and the engine's close return), no pin is left.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
from collections.abc import Callable
from pathlib import Path

import torch
from engine_rig import BS, GPU_BLOCKS, Client, config, host_forever, host_round, shards, tokens

from kvshm.disk import PAGE
from kvshm.engine import ATTACH, Engine, EngineState
from kvshm.hashing import chain_hashes
from kvshm.ipc.protocol import Done
from kvshm.offload.jobs import DiskJob
from kvshm.offload.pool import BlockPool
from kvshm.types import RequestView
from workers.worker import Worker

HANG_S = 2.0  # 1 s left a healthy rank on a loaded 2-core machine little room
SLOTS = 64


def _rank1_host(name: str, k: torch.Tensor, wfd: int) -> None:
    """Child process (forked): embedded rank 1 and its host's loop. Its disk mover's
    Dones are taken only by the publisher thread, which writes a byte to ``wfd`` and
    stops this process as soon as it holds one."""
    import threading
    import time

    from workers.disk_mover import DiskMover

    take = DiskMover.poll

    def poll(self: DiskMover) -> list[Done]:
        if not threading.current_thread().name.startswith("kvshm-publish"):
            return []  # the host's hooks leave disk Dones to the publisher
        dones = take(self)
        if dones:
            os.write(wfd, b"x")
            os.kill(os.getpid(), signal.SIGSTOP)  # mid-send: the Dones are in hand
            threading.Event().wait()  # the stop may land a little later: never go on
        return dones

    DiskMover.poll = poll  # type: ignore[method-assign]
    w = Worker.attach(name, 1, 2, [k])
    while True:
        host_round(w)
        time.sleep(0.002)


async def _until(pred: Callable[[], bool], what: str, tick: Callable[[], object],
                 timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        tick()
        await asyncio.sleep(0.01)


async def test_a_rank_killed_while_its_publisher_sends_fails_its_jobs_and_leaks_nothing(
        tmp_path: Path) -> None:
    ks = [shards(1)[0], shards(1)[0]]
    gpu = BlockPool(GPU_BLOCKS)
    launch = Engine.launch(
        config(num_cpu_blocks=8, disk_path=str(tmp_path),
               disk_bytes_per_rank=PAGE + SLOTS * 2 * PAGE, hang_timeout_s=HANG_S),
        workers=ATTACH, gpu_blocks=gpu)
    name = launch._args[1].name
    rfd, wfd = os.pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_rank1_host, args=(name, ks[1], wfd), daemon=True)
    child.start()
    os.close(wfd)
    rank0 = Worker.attach(name, 0, 2, [ks[0]])
    task = asyncio.get_running_loop().create_task(host_forever(rank0))
    eng = await launch
    try:
        c = Client(eng, gpu)
        manager = eng._core.manager
        assert manager is not None and manager.disk is not None
        book = manager.disk

        def stopped_mid_send() -> bool:
            return bool(select.select([rfd], [], [], 0)[0])

        async def store(i: int) -> list[int]:
            toks = tokens(4 * BS + 1, seed=60 + i)
            table, _ = c.compute(f"p{i}", toks)
            c.finish(f"p{i}", table, len(toks))
            for _ in range(10):
                c.step()
                await asyncio.sleep(0.01)
            return toks

        # 1. 4-block prompts through a CPU tier of 8 until write-back sends a WRITE and
        #    rank 1's publisher is caught holding its Done
        prompts = []
        for i in range(8):
            prompts.append(await store(i))
            if stopped_mid_send():
                break
        await _until(stopped_mid_send, "rank 1's publisher to hold a WRITE's Done", c.step)
        stuck = [j for j in book._jobs.jobs.values() if isinstance(j, DiskJob)]
        assert stuck
        slots = {s for j in stuck for s in j.slots}
        rows = {b for j in stuck for b in j.cpu_ids}
        d = eng.statistics().disk
        assert d["slots_used"] == 0 and d["write_jobs"] >= 1, d  # acked by rank 0 only

        # 2. rank 1 stopped, not hung: serving goes on and never hands its blocks out
        for i in range(8, 12):
            prompts.append(await store(i))
            book.check_invariants()
            assert all(book.slots.ref_cnt(s) >= 1 for s in slots)
            assert all(manager.cpu.ref_cnt(b) >= 1 for b in rows)
        for i, toks in enumerate(prompts):
            view = RequestView(f"q{i}", chain_hashes(toks, BS), len(toks))
            eng.lookup(view, 0)  # answers (a hit, a miss or "ask again"), never blocks
            eng.finished(f"q{i}", 0, [[]])
        st = eng.statistics()
        assert st.state == "ready" and st.ranks[1].alive
        assert st.disk["slots_used"] == 0, st.disk  # nothing written is indexed yet

        # 3. rank 1 dies mid-send: the verdict and the fence together
        os.kill(child.pid or 0, signal.SIGKILL)
        await _until(lambda: eng.statistics().ranks[1].fenced, "rank 1's fence", c.step)
        assert eng.state is EngineState.FAILED
        st = eng.statistics()
        assert st.disk["write_failed_jobs"] >= 1, st.disk
        assert st.disk["slots_used"] == 0, st.disk  # rank 0's ok ack indexed nothing
        assert st.disk["quarantined_slots"] == 0 and st.disk["slots_pinned"] == 0, st.disk
        assert st.quarantined_cpu_blocks == 0 and st.quarantined_gpu_blocks == 0
        await _until(lambda: eng.statistics().pins_held == 0 and gpu.num_pinned == 0,
                     "the pins' release", c.step)
        book.check_invariants()
        for i, toks in enumerate(prompts):  # FAILED: every lookup answers 0 at once
            assert eng.lookup(RequestView(f"r{i}", chain_hashes(toks, BS), len(toks)), 0) == 0
    finally:
        await asyncio.wait_for(eng.aclose(), 30)
        task.cancel()
        rank0.close()
        if child.is_alive():
            os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
        os.close(rfd)
    assert child.exitcode == -signal.SIGKILL
