"""The chaos run's shared parts: sizes, deadlines, the plan and outcome records, helpers.

Every await of the run goes through :func:`bounded` (a deadline that passes is a hang,
counted in the engine's :class:`Outcome`, and the run goes on). ``HANG_S_STOP`` is the
``hang_timeout_s`` of the SIGSTOP engines; the other deadlines are set well above the
engine's own timeouts, so only a real hang can pass them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import IO, Final, TypeVar

import torch

from kvshm.engine import Engine, WorkerMode
from kvshm.offload.pool import BlockPool
from kvshm.shm import SHM_PREFIX
from kvshm.shm_budget import SHM_DIR
from kvshm.stats import EngineStats

T = TypeVar("T")

TP: Final = 2
BS: Final = 4  # tokens per block
ROW: Final = 512  # bytes of one block in one rank's shard
GPU_BLOCKS: Final = 48
CPU_BLOCKS: Final = 40
PREFIXES: Final = 3
PREFIX_BLOCKS: Final = 3
KINDS: Final = ("sigkill", "sigstop", "corrupt_done", "rogue_conn", "bad_call")
#: kinds after which the engine is expected to be FAILED (serving without offload)
FAILING: Final = frozenset({"sigkill", "sigstop", "corrupt_done"})
HANG_S_STOP: Final = 1.0  # hang_timeout_s of the sigstop engines
HANG_S: Final = 10.0  # hang_timeout_s of the others
# deadlines (seconds) of the awaits; passing one is a hang
START_S: Final = 90.0
LOAD_S: Final = HANG_S + 10.0
BATCH_S: Final = 60.0
VERDICT_S: Final = 10.0
SETTLE_S: Final = 10.0
CLOSE_S: Final = 30.0
EXIT_S: Final = 20.0
QUERY_S: Final = 10.0
GONE_S: Final = 10.0  # after close and the parent's exit: longer is a process left
# waits that are no hang when they pass (their outcome is reported otherwise)
FENCE_S: Final = 5.0
CORRUPT_VERDICT_S: Final = 3.0
ALLOC_S: Final = 5.0




@dataclass(frozen=True)
class Plan:
    """One engine of the run: its index, worker mode, fault kind and seed."""

    index: int
    total: int
    mode: WorkerMode
    kind: str
    seed: int
    quick: bool


@dataclass
class Outcome:
    """What one engine showed."""

    plan: Plan
    injected: bool = False
    detail: str = ""
    load_wrong: int = 0
    canary_wrong: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    requests: int = 0
    hangs: int = 0
    api_errors: list[str] = field(default_factory=list)
    unusable: list[str] = field(default_factory=list)
    leaked_pins: int = 0
    quarantined: int = 0
    shm_leftovers: int = 0
    procs_left: int = 0
    state: str = "?"
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def wrong_bytes(self) -> int:
        """Bytes that differ from what they must be (loads and canaries)."""
        return self.load_wrong + self.canary_wrong

    @property
    def survived(self) -> bool:
        """API usable to the end, nothing hung, every process gone."""
        return not (self.api_errors or self.unusable or self.hangs or self.procs_left)

    def line(self) -> str:
        """The human-readable summary line."""
        p = self.plan
        head = f"[{p.index + 1:02d}/{p.total:02d}] {p.mode.name:6s} {p.kind:12s}"
        body = (f"state={self.state} reqs={self.requests} loads ok/failed="
                f"{self.loads_ok}/{self.loads_failed} wrong={self.load_wrong}+"
                f"{self.canary_wrong}(canary) hangs={self.hangs} leaked_pins="
                f"{self.leaked_pins} quarantined={self.quarantined} shm="
                f"{self.shm_leftovers} procs_left={self.procs_left}")
        verdict = "survived" if self.survived else "NOT survived"
        return f"{head} {self.detail}\n    {body} -> {verdict} ({self.wall_s:.1f} s)"


@dataclass
class Rig:
    """A started engine with its pool, shards and processes."""

    eng: Engine
    gpu: BlockPool
    ks: list[torch.Tensor]
    pids: list[int]
    parent: subprocess.Popen[bytes] | None
    parent_err: IO[bytes] | None
    held: list[socket.socket] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)  # resumed in the canary phase
    kept_stopped: list[int] = field(default_factory=list)  # resumed after the close


async def bounded(out: Outcome, aw: Awaitable[T], seconds: float, what: str) -> T | None:
    """``await aw`` within ``seconds``; a timeout is a hang (counted, noted): None."""
    try:
        return await asyncio.wait_for(aw, seconds)
    except TimeoutError:
        out.hangs += 1
        out.notes.append(f"HANG: {what} did not finish within {seconds:g}s")
        return None


def alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def send_signal(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` if it still exists."""
    if pid > 0:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def shm_entries() -> set[str]:
    """kvshm's names in /dev/shm (there should never be any)."""
    try:
        return {n for n in os.listdir(SHM_DIR) if SHM_PREFIX in n.lower()}
    except FileNotFoundError:
        return set()


def quarantined(st: EngineStats) -> tuple[int, int]:
    """(GPU, CPU) quarantined blocks; (0, 0) on an engine without those fields."""
    return (int(getattr(st, "quarantined_gpu_blocks", 0) or 0),
            int(getattr(st, "quarantined_cpu_blocks", 0) or 0))
