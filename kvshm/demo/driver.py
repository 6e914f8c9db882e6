"""``kvshm demo``: replay the chat trace twice on the toy model, offload off and on.

Setup (both runs): the toy model (seed 0), its KV split by heads into 2 shards, a GPU
block pool (kvshm's :class:`~kvshm.offload.pool.BlockPool`) of about a quarter of the trace's
distinct blocks, one torch thread. The offload run allocates the shards in shared
memory and launches an :class:`~kvshm.engine.Engine` with 2 SPAWN workers (TP=2), with a
CPU tier large enough for the whole trace.

Reported: CPU-tier hit rate, median time to first token on turns 2+ each way and their
ratio, wall time each way (the "on" time includes starting and stopping the worker
processes; both are reported), bytes stored and loaded, checksum results, and the
bit-exact check (see :mod:`kvshm.demo.check`). ``--json`` prints ``{"ttft_ratio",
"hit_rate", "bit_exact", ..., "per_turn", "ttft_by_turn_ms", "hit_rate_by_turn"}`` as the
last line: ``per_turn`` has one record per replayed request, in replay order, with both
arms' TTFT; the ``_by_turn`` lists are indexed by turn number (turn 1 first).
``--plot FILE.png`` draws them (:mod:`kvshm.demo.plot`, needs ``kvshm[plot]``; checked
before the replay starts). Exit status 0 when the restored bytes and logits are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import uvloop

from kvshm.config import EngineConfig
from kvshm.demo.args import add_arguments
from kvshm.demo.check import is_clean, replay_logits, with_system_chunk
from kvshm.demo.model import ToyModel
from kvshm.demo.server import ChunkCall, ToyServer, TurnResult
from kvshm.demo.trace import ChatTrace, TurnRef, make_trace
from kvshm.engine import SPAWN, Engine
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor

__all__ = ["RunReport", "main", "run_demo"]


@dataclass
class RunReport:
    """One replay of the trace."""

    label: str
    turns: dict[TurnRef, TurnResult] = field(default_factory=dict)
    logs: dict[int, list[ChunkCall]] = field(default_factory=dict)
    prefill_index: dict[TurnRef, int] = field(default_factory=dict)
    wall_s: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    checksum_ok: int = 0
    checksum_bad: int = 0
    #: Offload on only: Engine.launch until READY (spawning the workers included) and
    #: the engine's close at the end; both are inside ``wall_s``.
    start_s: float = 0.0
    stop_s: float = 0.0

    def ttft_later(self) -> float:
        """Median time to first token over turns 2+ (turn index >= 1)."""
        return statistics.median(r.ttft_s for ref, r in self.turns.items() if ref.turn >= 1)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._tty = sys.stderr.isatty()

    def tick(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._tty:
            width = 30
            fill = width * self.done // self.total
            sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total}"
                             f" turns ({label})")
            if self.done == self.total:
                sys.stderr.write("\n")
        elif self.done % 16 == 0 or self.done == self.total:
            sys.stderr.write(f"demo: {self.done}/{self.total} turns ({label})\n")
        sys.stderr.flush()


def _sizes(trace: ChatTrace, bs: int) -> tuple[int, int]:
    distinct = trace.distinct_blocks(bs)
    largest = max(-(-trace.final_length(c.index) // bs) for c in trace.conversations)
    return max(distinct // 4, 2 * largest), distinct + distinct // 4 + 64


async def _replay(trace: ChatTrace, server: ToyServer, report: RunReport,
                  progress: _Progress) -> None:
    histories = {c.index: list(trace.system_prompt) for c in trace.conversations}
    for ref in trace.order:
        conv = trace.conversations[ref.conversation]
        prompt = histories[ref.conversation] + list(conv.user_turns[ref.turn])
        res = await server.serve(f"c{ref.conversation}t{ref.turn}", prompt, trace.reply_tokens)
        log = report.logs.setdefault(ref.conversation, [])
        report.prefill_index[ref] = len(log) + len(res.calls) - (trace.reply_tokens - 1)
        log.extend(res.calls)
        report.turns[ref] = res
        histories[ref.conversation] = prompt + res.reply
        progress.tick(report.label)
    await server.drain()


async def _run(model: ToyModel, trace: ChatTrace, offload: bool, progress: _Progress,
               ) -> RunReport:
    gpu_blocks, cpu_blocks = _sizes(trace, model.config.block_size)
    report = RunReport("offload on" if offload else "offload off")
    gpu = BlockPool(gpu_blocks)
    start = time.perf_counter()
    if not offload:
        shards = model.make_kv_shards(gpu_blocks)
        await _replay(trace, ToyServer(model, shards, gpu, None, len(trace.system_prompt)),
                      report, progress)
    else:
        # CPU: shards in shared memory the spawned workers map; CUDA: device tensors the
        # workers (kvshm-workers --device cuda) open over CUDA IPC.
        on_cpu = model.device.type == "cpu"
        shards = model.make_kv_shards(gpu_blocks, shared_tensor if on_cpu else None)
        cfg = EngineConfig(block_size=model.config.block_size, tp=model.config.tp_shards,
                           num_cpu_blocks=cpu_blocks)
        async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                                 device_caches=[[s] for s in shards]) as eng:
            report.start_s = time.perf_counter() - start
            server = ToyServer(model, shards, gpu, eng, len(trace.system_prompt))
            await _replay(trace, server, report, progress)
            report.stats = eng.statistics().as_dict()
            report.checksum_ok, report.checksum_bad = server.checksum_ok, server.checksum_bad
            closing = time.perf_counter()
        report.stop_s = time.perf_counter() - closing
    report.wall_s = time.perf_counter() - start
    return report


def _bit_exact(model: ToyModel, trace: ChatTrace, on: RunReport, limit: int,
               ) -> tuple[int, int]:
    """(checked, equal) over the latest checkable CPU-served turns, at most ``limit``."""
    bs = model.config.block_size
    picked: list[tuple[TurnRef, list[ChunkCall]]] = []
    for ref in reversed(trace.order):
        res = on.turns[ref]
        if res.cpu_hit_tokens == 0 or res.load_failed or len(picked) >= limit:
            continue
        calls = with_system_chunk(trace.system_prompt,
                                  on.logs[ref.conversation][:on.prefill_index[ref]])
        if is_clean(calls, bs) and all(p[0].conversation != ref.conversation for p in picked):
            picked.append((ref, calls))
    equal = sum(torch.equal(replay_logits(model, calls), on.turns[ref].logits)
                for ref, calls in picked)
    return len(picked), equal


async def _demo(quick: bool, progress_on: bool, device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(1)  # bit-exactness needs one fixed thread count; see model.py
    trace = make_trace(0, quick=quick)
    model = ToyModel(device=device)
    progress = _Progress(2 * len(trace.order), progress_on)
    off = await _run(model, trace, False, progress)
    on = await _run(model, trace, True, progress)
    checked, equal = _bit_exact(model, trace, on, 4 if quick else 2)
    prompt_tokens = sum(trace.prompt_length(ref) for ref in trace.order)
    hit_tokens = sum(r.cpu_hit_tokens for r in on.turns.values())
    stats = on.stats
    return {
        "ttft_ratio": off.ttft_later() / on.ttft_later(),
        "hit_rate": hit_tokens / prompt_tokens,
        "bit_exact": checked > 0 and equal == checked and on.checksum_bad == 0,
        "ttft_off_ms": off.ttft_later() * 1e3, "ttft_on_ms": on.ttft_later() * 1e3,
        "wall_off_s": off.wall_s, "wall_on_s": on.wall_s,
        "stored_bytes": stats.get("stored_bytes", 0), "loaded_bytes": stats.get("loaded_bytes", 0),
        "checksums_ok": on.checksum_ok, "checksums_bad": on.checksum_bad,
        "logit_checks": checked, "logit_checks_equal": equal,
        "load_failures": sum(r.load_failed for r in on.turns.values()),
        "pins_at_end": stats.get("pins_held", -1),
        "replies_equal": sum(on.turns[r].reply == off.turns[r].reply for r in trace.order),
        "turns": len(trace.order),
        "workers": model.config.tp_shards, "device": model.device.type,
        "workers_start_s": on.start_s, "workers_stop_s": on.stop_s,
        **_per_turn(trace, off, on),
    }


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _per_turn(trace: ChatTrace, off: RunReport, on: RunReport) -> dict[str, Any]:
    """Both arms turn by turn: one record per request in replay order, and per turn
    number (index 0 = turn 1) the median TTFT of each arm and the CPU-tier hit rate
    (hit tokens / prompt tokens over that turn's requests)."""
    per_turn = [{"conversation": ref.conversation, "turn": ref.turn + 1,
                 "prompt_tokens": trace.prompt_length(ref),
                 "ttft_off_ms": off.turns[ref].ttft_s * 1e3,
                 "ttft_on_ms": on.turns[ref].ttft_s * 1e3,
                 "cpu_hit_tokens": on.turns[ref].cpu_hit_tokens} for ref in trace.order]
    numbers = sorted({ref.turn for ref in trace.order})
    refs = {t: [ref for ref in trace.order if ref.turn == t] for t in numbers}
    return {
        "per_turn": per_turn,
        "ttft_by_turn_ms": {
            "off": [_median_ms([off.turns[r].ttft_s for r in refs[t]]) for t in numbers],
            "on": [_median_ms([on.turns[r].ttft_s for r in refs[t]]) for t in numbers]},
        "hit_rate_by_turn": [sum(on.turns[r].cpu_hit_tokens for r in refs[t])
                             / sum(trace.prompt_length(r) for r in refs[t]) for t in numbers],
    }


def _print_summary(out: dict[str, Any]) -> None:
    mib = 2 ** 20
    print(f"turns replayed:        {out['turns']} each way")
    print(f"CPU-tier hit rate:     {out['hit_rate']:.1%} of prompt tokens")
    print(f"median TTFT, turns 2+: {out['ttft_off_ms']:.1f} ms recompute, "
          f"{out['ttft_on_ms']:.1f} ms offload  ->  {out['ttft_ratio']:.2f}x")
    print("TTFT by turn (median): "
          + ", ".join(f"turn {i + 1} {a:.1f} -> {b:.1f} ms" for i, (a, b) in
                      enumerate(zip(out["ttft_by_turn_ms"]["off"], out["ttft_by_turn_ms"]["on"]))))
    print(f"wall time:             {out['wall_off_s']:.1f} s off, {out['wall_on_s']:.1f} s on; "
          f"the on time includes starting the {out['workers']} worker processes "
          f"({out['workers_start_s']:.1f} s) and stopping them ({out['workers_stop_s']:.1f} s)")
    print(f"bytes moved:           {out['stored_bytes'] / mib:.1f} MiB stored, "
          f"{out['loaded_bytes'] / mib:.1f} MiB loaded")
    print(f"checksums of loads:    {out['checksums_ok']} equal, {out['checksums_bad']} differ")
    print(f"logits vs recompute:   {out['logit_checks_equal']}/{out['logit_checks']} "
          "bitwise equal (same chunk boundaries)")
    print(f"pins held at the end:  {out['pins_at_end']}")
    print(f"bit exact:             {out['bit_exact']}")


def run_demo(json_out: bool = False, quick: bool = False, plot: str | None = None,
             pd: bool = False, device: str = "cpu") -> int:
    """Entry point of ``kvshm demo``; 0 when everything restored was exact, 2 when
    ``plot`` was asked for without matplotlib, ``pd`` without the remote extra, or
    ``device`` cuda without a GPU (said before anything runs). ``pd``: the
    prefill/decode demo (:mod:`kvshm.demo.pd`, CPU only)."""
    if device == "cuda" and not torch.cuda.is_available():
        print("kvshm demo: --device cuda needs a GPU torch can see "
              "(torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    if pd:
        from kvshm.demo.pd import run_pd

        if plot is not None or device != "cpu":
            print("kvshm demo: --pd runs on the CPU alone; it goes with neither --plot "
                  "nor --device cuda", file=sys.stderr)
            return 2
        return run_pd(json_out=json_out, quick=quick)
    if plot is not None:
        from kvshm.demo.plot import PlotUnavailable, require_matplotlib

        folder = os.path.dirname(os.path.abspath(plot))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            # said now, not after the whole replay
            print(f"kvshm demo: --plot {plot}: {folder} is not a folder this user can "
                  f"write to", file=sys.stderr)
            return 2
        try:
            require_matplotlib()
        except PlotUnavailable as e:
            print(f"kvshm demo: {e}", file=sys.stderr)
            return 2
    out = uvloop.run(_demo(quick, progress_on=True, device=device))
    _print_summary(out)
    if plot is not None:
        from kvshm.demo.plot import draw

        draw(out, plot)
        print(f"plot written to {plot}")
    if json_out:
        print(json.dumps(out))
    return 0 if out["bit_exact"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvshm.demo [--json] [--quick] [--device cpu|cuda] [--plot FILE.png |
    --pd]``."""
    parser = argparse.ArgumentParser(
        prog="kvshm demo", description="replay a chat trace on a toy model, offload off and on")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_demo(json_out=args.json, quick=args.quick, plot=args.plot, pd=args.pd,
                    device=args.device)
