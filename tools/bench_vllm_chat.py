"""``python -m tools.bench_vllm --chat``: the capacity-bound chat variant (the method and
its last line are in :mod:`tools.bench_vllm`'s docstring).

Passes, one in-process vLLM engine at a time: no connector, kvshm with an unbounded CPU
tier (the denominator of ``hit_fraction``), kvshm with each eviction order asked for,
and optionally vLLM's SimpleCPU connector through :mod:`tools.simplecpu_shim`, all with
the same CPU capacity. Hit tokens are what each connector's
``update_state_after_alloc`` was told to load; both connectors' loads are checked to
have succeeded.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tools.bench_vllm import BLOCK, SPECIALS, build_model, make_llm, one, tokens


@dataclass
class ChatSide:
    """One chat pass: TTFT of turns 2+ (the first turn of a conversation has nothing to
    reuse), wall seconds, CPU-hit tokens."""

    name: str
    ttft_later: list[float] = field(default_factory=list)
    ttft_first: list[float] = field(default_factory=list)
    wall: float = 0.0
    hit_tokens: int = 0
    stored_blocks: int = 0


SIMPLE_CPU = ("SimpleCPUShimConnector", "tools.simplecpu_shim")


@contextmanager
def cpu_pool_built_by(factory: Callable[..., Any] | None) -> Iterator[None]:
    """While open, kvshm's engine runtime builds its CPU tier with ``factory`` (called
    as ``BlockPool(num_blocks, **kw)`` is; None: unchanged). Benchmark-only: the shipped
    runtime always builds a plain :class:`~kvshm.offload.pool.BlockPool`."""
    import kvshm.engine.runtime as runtime

    attr = "BlockPool"  # the name runtime.py builds the CPU tier with
    built = getattr(runtime, attr)
    if factory is not None:
        setattr(runtime, attr, factory)
    try:
        yield
    finally:
        setattr(runtime, attr, built)


def pool_with_order(eviction: str) -> Callable[..., Any]:
    """A CPU-tier factory for :func:`cpu_pool_built_by`: kvshm's ``BlockPool`` with
    the order ``eviction`` (a :class:`kvshm.config.Eviction` value), whatever the
    engine's config says."""
    from kvshm.config import Eviction
    from kvshm.offload.pool import BlockPool

    order = Eviction(eviction)

    def pool(num_blocks: int, **kw: Any) -> Any:
        return BlockPool(num_blocks, **{**kw, "eviction": order})

    return pool


def count_accepted(llm: Any) -> list[int]:
    """A one-item list whose item grows by the tokens the engine's connector is told to
    load (``update_state_after_alloc``'s ``num_external_tokens``); stays 0 without a
    connector."""
    accepted = [0]
    conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
    if conn is not None:
        inner = conn.update_state_after_alloc

        def counted(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            accepted[0] += num_external_tokens
            return inner(request, blocks, num_external_tokens)

        conn.update_state_after_alloc = counted
    return accepted


def chat_pass(folder: Path, args: argparse.Namespace, trace: list[Any], name: str,
              extra: dict[str, Any] | None, eviction: str | None,
              connector: tuple[str, str] = ("KvshmConnector", "kvshm.integrations.vllm"),
              ) -> ChatSide:
    """Every turn of ``trace`` on one engine (``extra``: the connector's config, None:
    no connector). ``eviction``: the order kvshm's CPU pool is built with (the
    benchmark wraps the runtime's BlockPool for the pass). Hit tokens: what the
    connector's ``update_state_after_alloc`` was told to load (both connectors' loads
    are checked to succeed: kvshm's count of failed loads, the shim copies
    synchronously)."""
    side = ChatSide(name)
    factory = None if eviction is None else pool_with_order(eviction)
    with cpu_pool_built_by(factory):
        llm = make_llm(folder, args, extra is not None, extra=extra, connector=connector)
        try:
            accepted = count_accepted(llm)
            conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
            # warm-up (one-time costs): under one block, so nothing is stored
            one(llm, tokens(BLOCK - 1, 17, args.vocab - len(SPECIALS)), args, extra is not None)
            for t in trace:
                ttft, elapsed, _ = one(llm, list(t.prompt), args, extra is not None)
                (side.ttft_later if t.turn else side.ttft_first).append(ttft)
                side.wall += elapsed
            side.hit_tokens = accepted[0]
            if extra is not None and connector[0] == "KvshmConnector":
                st = conn.scheduler_side.statistics()
                assert int(st["counters"]["loads_failed"]) == 0, st["counters"]
                side.stored_blocks = int(st["counters"]["stored_blocks"])
        finally:
            llm.llm_engine.engine_core.shutdown(timeout=30)
            del llm
            gc.collect()
    return side


def run_chat(args: argparse.Namespace) -> dict[str, Any]:
    """No connector, kvshm unbounded, then kvshm with each order (module docstring)."""
    from tools.chat_trace import chat_trace, distinct_blocks

    trace = chat_trace(args.conversations, args.turns, BLOCK, 0, think=args.think,
                       vocab=args.vocab)
    distinct = distinct_blocks(trace)
    capacity = max(1, int(distinct * args.cpu_frac))
    longest = max(len(t.prompt) for t in trace) + args.answer_tokens
    args.max_model_len = -(-(longest + BLOCK) // BLOCK) * BLOCK
    sides: list[ChatSide] = []
    with tempfile.TemporaryDirectory(prefix="bench_vllm_") as tmp:
        folder = Path(tmp)
        build_model(folder, args)
        sides.append(chat_pass(folder, args, trace, "no connector", None, None))
        sides.append(chat_pass(folder, args, trace, "unbounded", {
            "num_cpu_blocks": distinct + 4 * args.device_blocks, "mode": args.mode}, "lru"))
        for ev in args.evictions:
            sides.append(chat_pass(folder, args, trace, ev, {
                "num_cpu_blocks": capacity, "mode": args.mode}, ev))
        if args.simplecpu:
            kv_bytes = (2 * args.layers * args.kv_heads * 64 * BLOCK
                        * (2 if args.dtype == "bfloat16" else 4))
            sides.append(chat_pass(folder, args, trace, "vllm_simplecpu", {
                "cpu_bytes_to_use": capacity * kv_bytes}, None, connector=SIMPLE_CPU))
    return {"sides": sides, "distinct": distinct, "capacity": capacity,
            "turns": len(trace), "args": vars(args)}


def print_chat(res: dict[str, Any]) -> dict[str, Any]:
    """The table; returns the JSON summary."""
    sides: list[ChatSide] = res["sides"]
    base, unb = sides[0], sides[1]
    a = res["args"]
    print(f"{res['turns']} turns ({a['conversations']} conversations x {a['turns']}), "
          f"{res['distinct']} distinct {BLOCK}-token blocks, CPU tier {res['capacity']} "
          f"blocks, device pool {a['device_blocks']} blocks")
    print(f"{'pass':<14} {'TTFT 2+ median':>15} {'vs none':>8} {'mean':>8} {'vs none':>8} "
          f"{'wall s':>7} {'hit tokens':>10} {'hit_fraction':>12}")
    out: dict[str, Any] = {"hit_fraction": {}, "ttft_ratio": {}, "ttft_mean_ratio": {}}
    base_t = statistics.median(base.ttft_later)
    base_m = statistics.fmean(base.ttft_later)
    for s in sides:
        t = statistics.median(s.ttft_later)
        mean = statistics.fmean(s.ttft_later)
        frac = s.hit_tokens / unb.hit_tokens if unb.hit_tokens else None
        shown = "" if s is base or frac is None else f"{frac:.3f}"
        print(f"{s.name:<14} {t * 1e3:>12.0f} ms {base_t / t:>8.2f} {mean * 1e3:>5.0f} ms "
              f"{base_m / mean:>8.2f} {s.wall:>7.1f} {s.hit_tokens:>10} {shown:>12}")
        if s is not base and s is not unb:
            out["hit_fraction"][s.name] = None if frac is None else round(frac, 4)
            out["ttft_ratio"][s.name] = round(base_t / t, 3)
            out["ttft_mean_ratio"][s.name] = round(base_m / mean, 3)
    by = {s.name: statistics.fmean(s.ttft_later) for s in sides}
    others = [name for name in a["evictions"] if name != "lru" and name in by]
    if "lru" in by and others:
        out["ttft_mean_vs_lru"] = round(by["lru"] / by[others[-1]], 3)
    return out
