"""The chaos run's engines: start (SPAWN or ATTACH with ``python -m workers``), the
fault scenario, the checks after it (usable, invariants, statistics), close, and the
proof that nothing is left (processes gone by pid, no new /dev/shm entry).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import IO, Final

import torch

from kvshm.config import EngineConfig
from kvshm.engine import ATTACH, Engine
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from tools.chaos.bad_calls import fault_bad_call
from tools.chaos.faults import fault_corrupt_done, fault_rogue_conn, fault_sigkill, fault_sigstop
from tools.chaos.rig import (
    BATCH_S,
    BS,
    CLOSE_S,
    CPU_BLOCKS,
    EXIT_S,
    FAILING,
    FENCE_S,
    GONE_S,
    GPU_BLOCKS,
    HANG_S,
    HANG_S_STOP,
    ROW,
    START_S,
    TP,
    Outcome,
    Plan,
    Rig,
    alive,
    bounded,
    quarantined,
    send_signal,
    shm_entries,
)
from tools.chaos.traffic import Traffic

INJECT: Final[dict[str, Callable[[Traffic], Awaitable[str]]]] = {
    "sigkill": fault_sigkill, "sigstop": fault_sigstop, "corrupt_done": fault_corrupt_done,
    "rogue_conn": fault_rogue_conn, "bad_call": fault_bad_call}




def spawn_workers(name: str) -> tuple[subprocess.Popen[bytes], IO[bytes]]:
    """``python -m workers --name NAME --tp 2`` (ATTACH), stderr to a temporary file."""
    err = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [sys.executable, "-m", "workers", "--name", name, "--tp", str(TP)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    return proc, err


def make_shards() -> list[torch.Tensor]:
    """One shared-memory shard per rank, random bytes."""
    out = []
    for _ in range(TP):
        k = shared_tensor((GPU_BLOCKS, ROW), torch.uint8)
        k.copy_(torch.randint(0, 256, (GPU_BLOCKS, ROW), dtype=torch.uint8))
        out.append(k)
    return out


async def start(plan: Plan, out: Outcome) -> Rig | None:
    """Launch the engine of ``plan`` (and, ATTACH, its kvshm-workers); None on failure."""
    hang = HANG_S_STOP if plan.kind == "sigstop" else HANG_S
    cfg = EngineConfig(block_size=BS, tp=TP, num_cpu_blocks=CPU_BLOCKS, hang_timeout_s=hang,
                       connect_timeout_s=START_S - 10)
    ks, gpu = make_shards(), BlockPool(GPU_BLOCKS)
    launch = Engine.launch(cfg, workers=plan.mode, gpu_blocks=gpu,
                           device_caches=[[k] for k in ks])

    async def launched() -> Engine:
        return await launch

    task = asyncio.ensure_future(launched())  # listening before the ATTACH ranks connect
    parent, err = spawn_workers(cfg.name) if plan.mode is ATTACH else (None, None)
    try:
        eng = await bounded(out, task, START_S, "engine start")
    except Exception as exc:  # noqa: BLE001 - a start that fails is this engine's outcome
        out.unusable.append(f"start failed: {type(exc).__name__}: {exc}")
        eng = None
    if eng is None:
        await _reap_parent(out, parent, err)
        return None
    pids = [r.pid for r in eng.statistics().ranks]
    return Rig(eng, gpu, ks, pids, parent, err)


async def _reap_parent(out: Outcome, parent: subprocess.Popen[bytes] | None,
                       err: IO[bytes] | None) -> None:
    """Wait for an ATTACH kvshm-workers parent to exit (a deadline; then SIGKILL)."""
    if parent is None:
        return
    code = await bounded(out, asyncio.to_thread(parent.wait), EXIT_S, "kvshm-workers exit")
    if code is None:
        parent.kill()
        await bounded(out, asyncio.to_thread(parent.wait), EXIT_S, "SIGKILLed kvshm-workers")
    elif code not in (0, 1, 128 + signal.SIGKILL, -signal.SIGKILL):
        out.notes.append(f"kvshm-workers exited {code}: {_tail(err)}")
    if err is not None:
        err.close()


def _tail(err: IO[bytes] | None, n: int = 400) -> str:
    """The last ``n`` bytes of a captured stderr, on one line."""
    if err is None:
        return ""
    err.seek(0, os.SEEK_END)
    err.seek(max(0, err.tell() - n))
    return err.read().decode(errors="replace").replace("\n", " | ").strip()


async def resume_and_fence(t: Traffic) -> None:
    """SIGCONT every rank stopped by the fault, then wait until each rank declared dead
    is fenced (where the engine reports fencing), then give a resumed rank time to do
    whatever it still would."""
    for pid in t.rig.stopped:
        send_signal(pid, signal.SIGCONT)

    kept = set(t.rig.kept_stopped)

    def fenced() -> bool:
        return all(r.alive or r.pid in kept or getattr(r, "fenced", True)
                   for r in t.eng.statistics().ranks)

    if not await t.until(fenced, FENCE_S, "fence of the dead ranks", hang=False):
        t.out.notes.append(f"a dead rank was not fenced within {FENCE_S:g}s")
    await asyncio.sleep(0.5)


async def scenario(rig: Rig, out: Outcome) -> None:
    """Traffic, the fault mid-traffic, the canary, the usability check, settle, stats."""
    plan = out.plan
    t = Traffic(rig, out, random.Random(plan.seed))
    await t.warm()
    batch = t.batch(4 if plan.quick else 6)
    await asyncio.sleep(t.rng.uniform(0.0, 0.06))
    out.injected = True
    out.detail = await INJECT[plan.kind](t)
    await bounded(out, asyncio.gather(*batch), BATCH_S, "requests in flight at the fault")
    await t.canary(lambda: resume_and_fence(t))
    await check_usable(t)
    await t.settle()
    if not rig.kept_stopped:
        await t.until(lambda: sum(quarantined(rig.eng.statistics())) == 0, FENCE_S,
                      "quarantine to end", hang=False)
    read_stats(t)


async def check_usable(t: Traffic) -> None:
    """The engine answers every call; after a non-failing fault it is READY and a store
    + load round trip loads."""
    loaded = await t.round_trip()
    await t.run_batch(2, "requests after the fault")
    state = t.eng.statistics().state
    if t.out.plan.kind not in FAILING:
        if state != "ready":
            t.out.unusable.append(f"engine {state} after a {t.out.plan.kind} fault")
        elif not loaded:
            t.out.unusable.append("round trip after the fault did not load")


def broken_invariants(t: Traffic) -> list[str]:
    """The GPU pool's and (where it is reachable) the manager's consistency checks."""
    checks: list[tuple[str, Callable[[], object] | None]] = [
        ("GPU pool", t.gpu.check_invariants),
        ("manager", getattr(getattr(getattr(t.eng, "_core", None), "manager", None),
                            "check_invariants", None))]
    broken = []
    for what, check in checks:
        if check is None:
            continue
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - AssertionError names the fault
            broken.append(f"{what} invariants broken: {type(exc).__name__}: "
                          f"{str(exc)[:200]}")
    return broken


def read_stats(t: Traffic) -> None:
    """Leaked pins (beyond the quarantine) with every request finished; invariants."""
    t.out.unusable.extend(broken_invariants(t))
    st = t.eng.statistics()
    q_gpu, q_cpu = quarantined(st)
    out = t.out
    out.state = st.state
    out.quarantined = q_gpu + q_cpu
    out.leaked_pins = max(st.pins_held - q_gpu - q_cpu, t.gpu.num_pinned - q_gpu, 0)
    if out.leaked_pins:
        out.notes.append(f"pins_held={st.pins_held} quarantined={q_gpu}+{q_cpu} "
                         f"gpu_pinned={t.gpu.num_pinned} jobs_in_flight={st.jobs_in_flight}")


async def close(rig: Rig, out: Outcome, shm_seen: set[str]) -> None:
    """Close the engine, reap its processes, look for leftovers."""
    async def closed() -> bool:
        await rig.eng.aclose()
        return True

    if await bounded(out, closed(), CLOSE_S, "aclose") is None:
        kill_all(rig)
    for s in rig.held:
        s.close()
    for pid in rig.stopped + rig.kept_stopped:  # a stopped rank would block its parent
        send_signal(pid, signal.SIGCONT)
    await _reap_parent(out, rig.parent, rig.parent_err)
    t0 = time.monotonic()
    left = await wait_gone(rig, GONE_S)
    if time.monotonic() - t0 > 3.0:
        out.notes.append(f"its processes took {time.monotonic() - t0:.1f}s to exit after close")
    if left:
        out.procs_left = len(left)
        out.notes.append(f"processes left after close: {left}")
        kill_all(rig)
    out.shm_leftovers = await new_shm(shm_seen)


def kill_all(rig: Rig) -> None:
    """SIGKILL every process of the engine (ranks, then the ATTACH parent), by pid."""
    for pid in rig.pids:
        send_signal(pid, signal.SIGKILL)
    if rig.parent is not None and rig.parent.poll() is None:
        rig.parent.kill()


async def wait_gone(rig: Rig, seconds: float) -> list[int]:
    """The engine's processes still alive after up to ``seconds``."""
    pids = [*rig.pids, *([rig.parent.pid] if rig.parent is not None else [])]
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.05)


async def new_shm(seen: set[str]) -> int:
    """kvshm entries in /dev/shm that were not there before and stay (counted once)."""
    fresh = shm_entries() - seen
    if fresh:
        await asyncio.sleep(0.2)  # a segment exists for microseconds while it is created
        fresh &= shm_entries()
    seen |= fresh
    return len(fresh)
