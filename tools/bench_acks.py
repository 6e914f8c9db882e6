"""Per-rank ack latency under a saturating soak: the data behind ``hang_timeout_s``.

``python -m tools.bench_acks [--json] [--requests N] [--blocks B] [--row BYTES]``

A SPAWN engine (tp=2, CPU workers, real shared memory) in this process tree runs a
closed loop as fast as it goes: each request computes ``--blocks`` blocks of
``--row`` bytes per rank (stored), finishes, and the next request with the same prefix
loads them back; several requests are in flight at once, so jobs queue behind each
other on every rank. The hang rule fires when a rank with jobs pending completes none
for ``hang_timeout_s``, so the numbers that matter are the per-rank ack latency (post
to Done: queueing included) and the longest gap between two completions while jobs
were pending. Reported: p50 / p99 / p99.9 / max ack latency and that gap, and the last
line ``{"ack_p50_ms": .., "ack_p99_ms": .., "ack_p999_ms": .., "ack_max_ms": ..,
"max_stall_gap_ms": .., "jobs": ..}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence

import torch

from kvshm.config import EngineConfig
from kvshm.engine import SPAWN, Engine
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from kvshm.types import RequestView, ScheduledRequest, StepInput

BS = 16


class _Soak:
    """A closed-loop toy serving engine over one kvshm Engine."""

    def __init__(self, eng: Engine, gpu: BlockPool, blocks: int) -> None:
        self.eng, self.gpu, self.blocks = eng, gpu, blocks
        self.step_no = 0
        self.gaps: list[float] = []

    def step(self, reqs: Sequence[ScheduledRequest] = ()) -> None:
        self.step_no += 1
        self.eng.step(StepInput(self.step_no, list(reqs)))

    async def one(self, i: int) -> None:
        """Compute + store prefix i, then load it back into fresh blocks."""
        toks = [(i * 7919 + j) % 50000 for j in range(self.blocks * BS + 1)]
        hashes = chain_hashes(toks, BS)
        table = await self._alloc(self.blocks)
        self.eng.allocated(f"s{i}", [table], 0)
        self.step([ScheduledRequest(f"s{i}", hashes, len(toks), (tuple(table),),
                                    new_or_resumed=True, num_confirmed_tokens=len(toks))])
        self.eng.finished(f"s{i}", len(toks), [table])
        self.gpu.free(reversed(table))
        await self._settle()
        self.gpu.drop_all_hashes()
        hit = self.eng.lookup(RequestView(f"l{i}", hashes, len(toks)), 0) or 0
        table = await self._alloc(self.blocks)
        self.eng.allocated(f"l{i}", [table], hit)
        self.step([ScheduledRequest(f"l{i}", hashes, len(toks), (tuple(table),),
                                    new_or_resumed=True, num_confirmed_tokens=0)])
        if hit:
            await self.eng.wait_loaded(f"l{i}")
        self.eng.finished(f"l{i}", 0, [table])
        self.gpu.free(reversed(table))

    async def _alloc(self, n: int) -> list[int]:
        while self.gpu.num_free < n:
            await asyncio.sleep(0.001)
        return self.gpu.allocate(n)

    async def _settle(self) -> None:
        while self.eng.has_pending_work():
            self.step()
            await asyncio.sleep(0.001)


async def _gap_watch(eng: Engine, out: list[float], stop: asyncio.Event) -> None:
    """Per rank, the longest time with jobs in flight and that rank's ack count not
    moving (sampled every millisecond): what the hang rule measures."""
    last: dict[int, tuple[int, float]] = {}
    while not stop.is_set():
        st = eng.statistics()
        now = time.monotonic()
        for r in st.ranks:
            acks, since = last.get(r.rank, (-1, now))
            if r.acks != acks or not st.jobs_in_flight:
                last[r.rank] = (r.acks, now)
            else:
                out.append(now - since)
        await asyncio.sleep(0.001)


async def run(requests: int, blocks: int, row: int, inflight: int) -> dict[str, float]:
    gpu_blocks = blocks * inflight * 2 + 8
    caches = [[shared_tensor((gpu_blocks, row), torch.uint8)] for _ in range(2)]
    cfg = EngineConfig(block_size=BS, tp=2, num_cpu_blocks=blocks * inflight * 4,
                       hang_timeout_s=60.0, connect_timeout_s=60.0)
    gpu = BlockPool(gpu_blocks)
    async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu, device_caches=caches) as eng:
        soak = _Soak(eng, gpu, blocks)
        gaps: list[float] = []
        stop = asyncio.Event()
        watch = asyncio.create_task(_gap_watch(eng, gaps, stop))
        sem = asyncio.Semaphore(inflight)

        async def bounded(i: int) -> None:
            async with sem:
                await soak.one(i)

        t0 = time.monotonic()
        await asyncio.gather(*(bounded(i) for i in range(requests)))
        wall = time.monotonic() - t0
        stop.set()
        await watch
        st = eng.statistics()
    worst = {k: max(r.ack_latency_us[k] for r in st.ranks) for k in ("p50", "p99", "p999",
                                                                      "max")}
    return {"ack_p50_ms": worst["p50"] / 1e3, "ack_p99_ms": worst["p99"] / 1e3,
            "ack_p999_ms": worst["p999"] / 1e3, "ack_max_ms": worst["max"] / 1e3,
            "max_stall_gap_ms": max(gaps, default=0.0) * 1e3,
            "jobs": float(st.counters.get("store_jobs", 0) + st.counters.get("load_jobs", 0)),
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--blocks", type=int, default=16, help="blocks per request")
    ap.add_argument("--row", type=int, default=64 * 1024, help="bytes per block per rank")
    ap.add_argument("--inflight", type=int, default=16, help="requests in flight")
    args = ap.parse_args()
    torch.set_num_threads(1)
    res = asyncio.run(run(args.requests, args.blocks, args.row, args.inflight))
    per_req = args.blocks * args.row * 2 / 2**20
    print(f"{args.requests} requests x {args.blocks} blocks x {args.row} B x 2 ranks "
          f"({per_req:.1f} MiB stored and loaded each), {args.inflight} in flight, "
          f"{res['wall_s']:.1f} s")
    print(f"ack latency (worst rank): p50 {res['ack_p50_ms']:.2f} ms, p99 "
          f"{res['ack_p99_ms']:.2f} ms, p99.9 {res['ack_p999_ms']:.2f} ms, max "
          f"{res['ack_max_ms']:.2f} ms; longest stall with jobs pending "
          f"{res['max_stall_gap_ms']:.2f} ms over {res['jobs']:.0f} jobs")
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in res.items()}))


if __name__ == "__main__":
    main()
