"""Shared helpers for the engine tests: tiny shared-memory KV shards, request plumbing,
and ready engines (:func:`spawned_engine`, :func:`embedded_engine`) for a test module's
async fixtures to wrap."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import torch

from kvshm.config import EngineConfig
from kvshm.engine import ATTACH, SPAWN, Engine
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from kvshm.types import (
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
    StepPlan,
)
from workers.copy_engine import CpuFence
from workers.worker import Worker

BS = 4  # tokens per block
ROW = 1024  # bytes of one block in one shard
GPU_BLOCKS = 32


def shards(world: int = 2, blocks: int = GPU_BLOCKS) -> list[torch.Tensor]:
    """One shared-memory KV shard per rank: [blocks, ROW] uint8, random contents."""
    out = []
    for r in range(world):
        t = shared_tensor((blocks, ROW), torch.uint8)
        t.copy_(torch.randint(0, 256, (blocks, ROW), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(r)))
        out.append(t)
    return out


def config(**kw: object) -> EngineConfig:
    base: dict[str, object] = dict(block_size=BS, tp=2, num_cpu_blocks=64,
                                   hang_timeout_s=30.0, connect_timeout_s=30.0)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Client:
    """A minimal serving engine around ``eng``: prefix hashing, block tables, steps."""

    def __init__(self, eng: Engine, gpu: BlockPool) -> None:
        self.eng, self.gpu, self.step_no = eng, gpu, 0

    def step(self, *reqs: ScheduledRequest) -> StepPlan:
        self.step_no += 1
        return self.eng.step(StepInput(self.step_no, list(reqs)))

    def compute(self, req_id: str, toks: list[int]) -> tuple[list[int], StepPlan]:
        """A request whose blocks were all computed: listed once, its stores planned."""
        hashes = chain_hashes(toks, BS)
        table = self.gpu.allocate(len(toks) // BS)
        self.eng.allocated(req_id, [table], 0)
        plan = self.step(ScheduledRequest(req_id, hashes, len(toks), (tuple(table),),
                                          new_or_resumed=True, num_confirmed_tokens=len(toks)))
        return table, plan

    async def store_only(self, req_id: str, toks: list[int]) -> None:
        """Compute and finish ``req_id``, wait until its blocks are stored, then drop the
        GPU copies' hashes: from here on only the CPU tier holds that prefix."""
        table, _ = self.compute(req_id, toks)
        self.finish(req_id, table, len(toks))
        await self.settle()
        self.gpu.drop_all_hashes()

    def load(self, req_id: str, toks: list[int]) -> tuple[int | None, list[int], StepPlan]:
        """Look up ``toks`` in the CPU tier, allocate fresh blocks, plan the load."""
        hashes = chain_hashes(toks, BS)
        hit = self.eng.lookup(RequestView(req_id, hashes, len(toks)), 0)
        table = self.gpu.allocate(len(toks) // BS)
        self.eng.allocated(req_id, [table], hit or 0)
        plan = self.step(ScheduledRequest(req_id, hashes, len(toks), (tuple(table),),
                                          new_or_resumed=True, num_confirmed_tokens=0))
        return hit, table, plan

    def finish(self, req_id: str, table: Sequence[int], confirmed: int) -> None:
        self.eng.finished(req_id, confirmed, [list(table)])
        self.gpu.free(reversed(table))

    async def settle(self, timeout: float = 20.0) -> None:
        """Step with nothing listed until every job is acked."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.eng.has_pending_work():
            assert loop.time() < deadline, "engine did not settle"
            self.step()
            await asyncio.sleep(0.005)

    async def loaded(self, req_id: str) -> LoadResult:
        return await asyncio.wait_for(self.eng.wait_loaded(req_id), 20.0)


class EmbeddedRanks:
    """Two embedded Workers in this process, driven from the loop like a host engine
    that calls them every 2 ms. ``stall``: rank 1's loads wait for a fence the test
    sets (a copy stuck in the engine while the host keeps calling: a real hang)."""

    def __init__(self, name: str, ks: list[torch.Tensor]) -> None:
        self.workers = [Worker.attach(name, r, 2, [k]) for r, k in enumerate(ks)]
        self.stall: CpuFence | None = None
        self.paused = False
        self._task: asyncio.Task[None] | None = None

    async def _drive(self) -> None:
        while True:
            if self.paused:
                await asyncio.sleep(0.002)
                continue
            for w in self.workers:
                for step in w.queued_steps():
                    w.begin_step(step)
                    fence = self.stall if w.rank == 1 else None
                    w.submit_loads(step, after=fence)
                    w.submit_stores(step)
                w.poll()
            await asyncio.sleep(0.002)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._drive())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for w in self.workers:
            w.close()


@contextlib.asynccontextmanager
async def embedded_engine(**cfg: object) -> AsyncIterator[
        tuple[Engine, BlockPool, list[torch.Tensor], EmbeddedRanks]]:
    """An ATTACH engine (``config(**cfg)``) with two embedded ranks driven from the
    loop over random in-process shards; closes both on exit."""
    ks = [torch.randint(0, 256, (GPU_BLOCKS, ROW), dtype=torch.uint8) for _ in range(2)]
    gpu = BlockPool(GPU_BLOCKS)
    launch = Engine.launch(config(**cfg), workers=ATTACH, gpu_blocks=gpu)
    ranks = EmbeddedRanks(launch._args[1].name, ks)
    ranks.start()
    eng = await launch
    try:
        yield eng, gpu, ks, ranks
    finally:
        await eng.aclose()
        await ranks.stop()


class Spawned(NamedTuple):
    """A READY SPAWN engine with its GPU pool and its ranks' shared-memory shards."""

    eng: Engine
    gpu: BlockPool
    ks: list[torch.Tensor]


@contextlib.asynccontextmanager
async def spawned_engine(**cfg: object) -> AsyncIterator[Spawned]:
    """A SPAWN engine (``config(**cfg)``: tp=2) over fresh :func:`shards`; closed (its
    workers stopped and reaped) on exit."""
    ks, gpu = shards(), BlockPool(GPU_BLOCKS)
    async with Engine.launch(config(**cfg), workers=SPAWN, gpu_blocks=gpu,
                             device_caches=[[k] for k in ks]) as eng:
        yield Spawned(eng, gpu, ks)



def host_round(w: Worker) -> None:
    """One round of an embedded rank's host hooks, in a host's order: every queued
    step's jobs (begin, loads, stores), then a poll for Dones."""
    for step in w.queued_steps():
        w.begin_step(step)
        w.submit_loads(step)
        w.submit_stores(step)
    w.poll()


async def host_forever(w: Worker) -> None:
    """Play an embedded rank's host on this loop until cancelled (a round every 2 ms)."""
    while True:
        host_round(w)
        await asyncio.sleep(0.002)
