"""The CPU tier's eviction orders on the chat trace, through the real OffloadManager.

``python -m tools.bench_evict [--json] [trace options]``

The trace is :func:`tools.chat_trace.chat_trace` (64 conversations x 6 turns by
default), one request at a time in arrival order. For each turn the toy engine plays
vLLM's part on a ``BlockPool`` GPU pool of ``--gpu-blocks`` (256) blocks with plain LRU
(vLLM's own prefix cache): its GPU hit (the longest cached prefix, capped so one prompt
token is computed) is touched; ``lookup`` and ``allocated`` ask the CPU tier for the
rest; a first step lists the request (the load goes out and is acked); then the engine
computes the prompt and the answer, hashes every full block, and a second step lists it
with every token confirmed (the eager store goes out and is acked); ``finished`` and a
last step flush; the engine frees the request's blocks tail first. Every job is acked at
once by the one rank, so only the eviction order differs between runs.

The CPU tier holds ``--cpu-frac`` (0.5) of the trace's distinct blocks. Reported per
order (:class:`kvshm.config.Eviction`; ``+refresh``: the same order with
``refresh_gpu_hits``): CPU-tier hit tokens, ``hit_fraction`` = those over an unbounded
tier's on the same trace and GPU pool (:func:`tools.chat_trace.hit_fraction`), and
Belady's MIN on the same accesses as the limit (the accesses are recorded from the
unbounded run: the GPU pool behaves the same whatever the CPU tier holds).

Last line with ``--json``: ``{"hit_fraction": {"lru": .., "<order>": .., ...,
"belady": ..}, "kvshm": <the default order's>, "capacity": .., "distinct": ..}``.
Target (issue 15): the default order >= 0.55 (vLLM's LRU: 0.466).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvshm.config import DEFAULT_EVICTION, Eviction
from kvshm.ipc.protocol import Transfer
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.types import RequestView, ScheduledRequest, StepInput
from tools.chat_trace import (
    CpuAccess,
    Turn,
    belady_hit_tokens,
    chat_trace,
    distinct_blocks,
    hit_fraction,
)


@dataclass
class Run:
    """One order's result on the trace."""

    name: str
    hit_tokens: int
    evictions: int
    seconds: float
    accesses: list[CpuAccess]


def _ack(m: OffloadManager, t: Transfer | None) -> None:
    if t is not None:
        m.on_done(t.job_id, 0, True)


def replay(trace: Sequence[Turn], *, gpu_blocks: int, cpu: BlockPool,
           check_every: int = 0) -> Run:
    """The trace through a real manager over ``cpu`` (module docstring)."""
    bs = trace[0].block_size
    gpu = BlockPool(gpu_blocks)
    m = OffloadManager(cpu, gpu, block_size=bs)
    step = 0
    hits = 0
    acc: list[CpuAccess] = []
    t0 = time.perf_counter()
    for i, t in enumerate(trace):
        hs = t.block_hashes
        n_prompt = len(t.prompt)
        cap = (n_prompt - 1) // bs
        g_ids: list[int] = []
        for h in hs[:cap]:
            b = gpu.get_cached(h)
            if b is None:
                break
            g_ids.append(b)
        g = len(g_ids)
        gpu.touch(g_ids)
        live = list(hs[:t.prompt_blocks])
        got = m.lookup(RequestView(t.req_id, live, n_prompt, None), g * bs)
        n_ext = got or 0
        need = -(-len(t.tokens) // bs) - g
        new = gpu.allocate(need)
        table = g_ids + new
        m.allocated(t.req_id, [table], n_ext)
        acc.append(CpuAccess(t.req_id, tuple(hs[g:cap]), tuple(hs[g:])))
        step += 1
        plan = m.build_step(StepInput(step, (ScheduledRequest(
            t.req_id, live, n_prompt, (tuple(table),), True, g * bs),), (), frozenset(new)))
        _ack(m, plan.store)
        _ack(m, plan.load)
        for r in m.take_load_results():
            if r.ok:
                hits += r.num_tokens
        # the engine computed (or loaded) the rest: every full block is hashed
        for p in range(g, len(hs)):
            if not gpu.block_hashes(table[p]):
                gpu.add_hashes(table[p], [hs[p]])
        live.extend(hs[t.prompt_blocks:])
        step += 1
        plan = m.build_step(StepInput(step, (ScheduledRequest(
            t.req_id, live, len(t.tokens), ((),), False, len(t.tokens)),)))
        _ack(m, plan.store)
        m.finished(t.req_id, len(t.tokens), [table], block_hashes=hs)
        step += 1
        plan = m.build_step(StepInput(step, ()))
        _ack(m, plan.store)
        gpu.free(reversed(table))
        if check_every and i % check_every == 0:
            m.check_invariants()
    m.check_invariants()
    assert not m.has_pending_work() and m.pins_held() == 0
    return Run(cpu.eviction.value, hits, cpu.evictions, time.perf_counter() - t0, acc)


ORDERS: tuple[tuple[str, Eviction, bool | None], ...] = (
    ("lru", Eviction.LRU, None),
    ("lru_refresh", Eviction.LRU_REFRESH, None),
    ("deepest", Eviction.DEEPEST, None),
    ("slru", Eviction.SLRU, None),
    ("s3fifo", Eviction.S3FIFO, None),
    ("depth_aged", Eviction.DEPTH_AGED, None),
    ("depth_aged+refresh", Eviction.DEPTH_AGED, True),
)


def run(args: argparse.Namespace) -> dict[str, object]:
    trace = chat_trace(args.conversations, args.turns, args.block_size, args.seed,
                       think=args.think, think_shape=args.think_shape,
                       arrival_gap=args.arrival_gap)
    distinct = distinct_blocks(trace)
    capacity = args.cpu_blocks or max(1, int(distinct * args.cpu_frac))
    bs = args.block_size
    ub = replay(trace, gpu_blocks=args.gpu_blocks,
                cpu=BlockPool(distinct + args.gpu_blocks))
    rows: list[tuple[str, int, float, int, float]] = []
    fractions: dict[str, float] = {}
    for name, ev, refresh in ORDERS:
        if args.orders and name not in args.orders:
            continue
        r = replay(trace, gpu_blocks=args.gpu_blocks,
                   cpu=BlockPool(capacity, eviction=ev, refresh_gpu_hits=refresh),
                   check_every=args.check_every)
        assert r.accesses == ub.accesses, "the GPU pool behaved differently"
        f = hit_fraction(r.hit_tokens, ub.hit_tokens)
        fractions[name] = round(f, 4)
        rows.append((name, r.hit_tokens, f, r.evictions, r.seconds))
    bel = belady_hit_tokens(ub.accesses, capacity, bs)
    fractions["belady"] = round(hit_fraction(bel, ub.hit_tokens), 4)
    rows.append(("belady", bel, fractions["belady"], -1, 0.0))
    return {"rows": rows, "hit_fraction": fractions, "unbounded_tokens": ub.hit_tokens,
            "capacity": capacity, "distinct": distinct, "turns": len(trace)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--think", type=float, default=64.0)
    ap.add_argument("--think-shape", type=float, default=8.0)
    ap.add_argument("--arrival-gap", type=float, default=1.0)
    ap.add_argument("--gpu-blocks", type=int, default=256)
    ap.add_argument("--cpu-frac", type=float, default=0.5)
    ap.add_argument("--cpu-blocks", type=int, default=0, help="overrides --cpu-frac")
    ap.add_argument("--orders", nargs="*", default=[], help="only these (names as shown)")
    ap.add_argument("--check-every", type=int, default=0,
                    help="check the manager's invariants every N turns (slow)")
    args = ap.parse_args(argv)
    res = run(args)
    print(f"{res['turns']} turns, {res['distinct']} distinct blocks, CPU tier "
          f"{res['capacity']} blocks, GPU {args.gpu_blocks}; unbounded tier: "
          f"{res['unbounded_tokens']} hit tokens")
    print(f"{'order':<20} {'hit tokens':>10} {'hit_frac':>8} {'of belady':>9} "
          f"{'evictions':>9} {'s':>6}")
    rows = res["rows"]
    assert isinstance(rows, list)
    fr = res["hit_fraction"]
    assert isinstance(fr, dict)
    for name, tokens, f, ev, sec in rows:
        mark = " (default)" if name == DEFAULT_EVICTION.value else ""
        print(f"{name:<20} {tokens:>10} {f:>8.3f} {f / fr['belady']:>9.2f} "
              f"{ev if ev >= 0 else '':>9} {sec:>6.2f}{mark}")
    if args.json:
        out = {"hit_fraction": fr, "kvshm": fr.get(DEFAULT_EVICTION.value),
               "capacity": res["capacity"], "distinct": res["distinct"]}
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
