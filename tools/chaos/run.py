"""The chaos run itself: the plans, one engine after another (the next one's workers
starting while the current one runs), the summary and the command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections.abc import Sequence
from typing import Any

import torch

import tools.chaos
from kvshm.engine import ATTACH, SPAWN
from tools.chaos.engines import close, scenario, start
from tools.chaos.rig import KINDS, TP, Outcome, Plan, Rig, shm_entries


def plans(engines: int, seed: int, quick: bool) -> list[Plan]:
    """Engine i: SPAWN for even i, ATTACH for odd; kinds in rotation."""
    rng = random.Random(seed)
    return [Plan(i, engines, SPAWN if i % 2 == 0 else ATTACH, KINDS[i % len(KINDS)],
                 rng.randrange(2**32), quick) for i in range(engines)]


def catch_loop_errors(loop: asyncio.AbstractEventLoop) -> list[str]:
    """Exceptions that escape into the event loop (an engine callback that raised) are
    collected in the returned list instead of printed as tracebacks."""
    seen: list[str] = []

    def handler(_: asyncio.AbstractEventLoop, ctx: dict[str, Any]) -> None:
        exc = ctx.get("exception")
        what = f"{type(exc).__name__}: {str(exc)[:120]}" if exc is not None else ""
        seen.append(f"exception in an event-loop callback: {ctx.get('message')} {what}")

    loop.set_exception_handler(handler)
    return seen


async def finish_engine(rig: Rig | None, out: Outcome, shm_seen: set[str], t0: float) -> None:
    """Close the engine (if it started) and print its lines."""
    try:
        if rig is not None:
            await close(rig, out, shm_seen)
    finally:
        out.wall_s = time.monotonic() - t0
        print(out.line(), flush=True)
        for note in out.notes + out.api_errors + out.unusable:
            print(f"    - {note}", flush=True)


async def run(engines: int, seed: int, quick: bool) -> list[Outcome]:
    """Every engine in turn: engine i+1 starts while engine i runs its scenario, and
    engine i closes while engine i+1 runs its own."""
    shm_seen = shm_entries()
    loop_errors = catch_loop_errors(asyncio.get_running_loop())
    todo = plans(engines, seed, quick)
    outs = [Outcome(p) for p in todo]
    starts: dict[int, asyncio.Task[Rig | None]] = {}
    closing: asyncio.Task[None] | None = None

    def prefetch(j: int) -> None:
        if j < len(todo) and j not in starts:
            starts[j] = asyncio.ensure_future(start(todo[j], outs[j]))

    try:
        for i in range(len(todo)):
            prefetch(i)
            prefetch(i + 1)
            rig = await starts.pop(i)
            t0 = time.monotonic()
            if rig is not None:
                try:
                    await scenario(rig, outs[i])
                except BaseException:
                    await close(rig, outs[i], shm_seen)
                    raise
                finally:  # exceptions in the loop while this engine ran are its own
                    outs[i].notes.extend(loop_errors)
                    loop_errors.clear()
            if closing is not None:
                await closing
            closing = asyncio.ensure_future(finish_engine(rig, outs[i], shm_seen, t0))
        if closing is not None:
            await closing
        if loop_errors:
            print("\n".join(f"    - (at the end) {e}" for e in loop_errors), flush=True)
    finally:
        await _abandon(starts)
    return outs


async def _abandon(starts: dict[int, asyncio.Task[Rig | None]]) -> None:
    """After an error: stop engines started ahead (each closes what it started)."""
    for j, task in starts.items():
        task.cancel()
        with contextlib.suppress(BaseException):
            rig = await task
            if rig is not None:
                await close(rig, Outcome(Plan(j, j + 1, SPAWN, "abandoned", 0, True)), set())


def summary(outs: list[Outcome]) -> dict[str, int]:
    """The JSON line."""
    return {"engines": len(outs), "faults": sum(o.injected for o in outs),
            "survived": sum(o.survived for o in outs),
            "wrong_bytes": sum(o.wrong_bytes for o in outs),
            "hangs": sum(o.hangs for o in outs),
            "leaked_pins": sum(o.leaked_pins for o in outs),
            "shm_leftovers": sum(o.shm_leftovers for o in outs),
            "quarantined_blocks": sum(o.quarantined for o in outs)}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(prog="python -m tools.chaos",
                                 description=(tools.chaos.__doc__ or "").split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=None,
                    help="engines to run, one fault each (default 40; --quick: 5)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (default: time)")
    ap.add_argument("--quick", action="store_true", help="a handful of engines, less traffic")
    ap.add_argument("--json", action="store_true", help="end with the JSON summary line")
    args = ap.parse_args(argv)
    if args.engines is None:
        args.engines = 5 if args.quick else 40
    if args.engines < 1:
        ap.error(f"--engines must be >= 1, got {args.engines}")
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run; the exit code (0: the run completed, whatever it found)."""
    args = parse(argv)
    torch.set_num_threads(1)
    print(f"chaos: {args.engines} engines, tp={TP}, seed {args.seed}"
          f"{' (quick)' if args.quick else ''}", flush=True)
    t0 = time.monotonic()
    try:
        import uvloop

        outs = uvloop.run(run(args.engines, args.seed, args.quick))
    except ImportError:  # pragma: no cover - uvloop is a dependency
        outs = asyncio.run(run(args.engines, args.seed, args.quick))
    res = summary(outs)
    print(f"chaos: {res['faults']} faults over {res['engines']} engines in "
          f"{time.monotonic() - t0:.1f} s: survived {res['survived']}, wrong bytes "
          f"{res['wrong_bytes']}, hangs {res['hangs']}, leaked pins {res['leaked_pins']}, "
          f"shm leftovers {res['shm_leftovers']}, quarantined {res['quarantined_blocks']}",
          flush=True)
    if args.json:
        print(json.dumps(res), flush=True)
    return 0
