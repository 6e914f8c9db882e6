"""Chaos run: fresh engines under byte-pattern traffic, one injected fault each.

``python -m tools.chaos [--engines N] [--seed S] [--quick] [--json]``

Method
------
Engines (tp=2, CPU workers, shared-memory KV shards allocated here) run one after
another, alternating SPAWN and ATTACH; ATTACH ranks are ``python -m workers --name NAME
--tp 2`` processes started by this tool (its own process tree) and stopped by pid. The
next engine's workers start while the current engine runs, so start-up (torch imports)
overlaps the traffic.

Traffic: a request's prompt is one of a few shared prefixes plus unique blocks; its
chained block hashes name its bytes. "Compute" writes ``pattern(hash of block j, rank)``
into block j of the request's GPU blocks in each rank's shard, then a step confirms the
tokens and the engine stores them. Later requests with the same prefix look up, get GPU
blocks from a small pool (blocks freed by earlier requests are handed out again first,
so a stale copy lands in somebody else's blocks) and load; every successful load
(``LoadResult.ok``) is verified byte by byte against the pattern (``wrong_bytes``).
Before a request finishes, all its blocks are verified again: nothing may have written
into blocks a live request owns that it did not load into (the canary rule). After the
fault a canary request takes every free GPU block, writes its own pattern, waits while
any stopped rank is resumed (SIGCONT) and fenced, then checks that nothing overwrote it:
the hazard of a rank declared dead that wakes up and finishes a queued LOAD into blocks
freed and handed out again.

Faults, one per engine, kinds in rotation, details (rank, moment, variant) random:

* ``sigkill``: SIGKILL a rank mid-traffic;
* ``sigstop``: SIGSTOP a rank with a load queued on it (``hang_timeout_s`` 1 s); SIGCONT
  it only after the engine declared it dead and the canary owns the free blocks;
* ``corrupt_done``: a garbage record in a rank's done ring (an undecodable payload or an
  impossible record header), written through this process's mapping of the ring segment
  while the rank is frozen for the moment (so no real Done races it) with a store
  outstanding on it; the rank is resumed in the canary phase;
* ``rogue_conn``: connections to the rendezvous socket ``\\0kvshm.NAME``: garbage, deeply
  nested msgpack, an oversize frame, Hellos with a wrong rank / a live rank's number / a
  wrong version / a wrong world size, a StatsRequest never read, and idle connections
  beyond the pending cap, all held open until the engine is closed;
* ``bad_call``: invalid API calls among valid ones (a hash that is not bytes, GPU ids out
  of range in ``allocated`` and ``finished``, a lookup past the prompt, a request listed
  twice, unknown requests, a double finish); each exception is caught and the client
  goes on; the engine must then still serve (a store + load round trip).

After the fault: the engine must answer every call (FAILED is the documented outcome of
the first three kinds, with loads recomputed; the last two must leave it READY and
loading). Then the engine settles (no job pending, quarantine lifted), its statistics
give ``pins_held`` with every request finished: pins beyond the quarantined blocks
(``quarantined_*_blocks``, read with getattr so older engines work) are leaked. It is
closed; none of its processes may be left and no new kvshm entry may be in /dev/shm.
Every await has a deadline: one that passes counts as a hang and the tool moves on
(SIGKILLing that engine's processes where needed).

Output: one line per engine, then as the last line one JSON object ``{"engines",
"faults", "survived", "wrong_bytes", "hangs", "leaked_pins", "shm_leftovers",
"quarantined_blocks"}``; ``survived`` counts engines whose API stayed usable and whose
processes ended cleanly. Exit code 0 whenever the run completed (the numbers are the
verdict), 2 for bad usage, 1 for a bug of this tool.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, Final, TypeVar

import torch

from kvshm.config import EngineConfig
from kvshm.engine import ATTACH, SPAWN, Engine, WorkerMode
from kvshm.errors import KvshmError, PoolExhausted
from kvshm.hashing import chain_hashes
from kvshm.ipc import protocol
from kvshm.ipc.rendezvous_client import query_stats
from kvshm.ipc.ring_pair import CONTROL_SIZE, LINE, RingPair
from kvshm.offload.pool import BlockPool
from kvshm.shm import SHM_DIR, SHM_PREFIX, shared_tensor
from kvshm.stats import EngineStats, RankStats
from kvshm.types import RequestView, ScheduledRequest, StepInput, StepPlan

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
# the ring segment's control block (documented in kvshm/ipc/ring_pair.py): u64 words
_W_DONE_CAP: Final = 3
_W_DONE_OFF: Final = 5
_W_DONE_HEAD: Final = 4 * LINE // 8


# ---------------------------------------------------------------------------- records


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


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _signal(pid: int, sig: signal.Signals) -> None:
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


# ---------------------------------------------------------------------------- traffic


class Traffic:
    """A toy serving engine over one kvshm engine: prompts, block tables, steps, the
    byte patterns and their checks. Every kvshm call goes through :meth:`call`, which
    records an exception as an API error (a valid call must not raise)."""

    def __init__(self, rig: Rig, out: Outcome, rng: random.Random) -> None:
        self.rig, self.eng, self.gpu, self.out, self.rng = rig, rig.eng, rig.gpu, out, rng
        self.step_no = 0
        self.seq = 0
        self.prefixes = [self.tokens(PREFIX_BLOCKS * BS) for _ in range(PREFIXES)]
        self._patterns: dict[tuple[bytes, int], torch.Tensor] = {}

    # -- prompts and bytes -------------------------------------------------------
    def tokens(self, n: int) -> list[int]:
        """``n`` random token ids."""
        return [self.rng.randrange(50_000) for _ in range(n)]

    def prompt(self, prefix: int | None, tail_blocks: int) -> tuple[str, list[int]]:
        """A fresh request id and its tokens: prefix ``prefix`` (None: none), then
        ``tail_blocks`` unique blocks and one more token (a partial block)."""
        self.seq += 1
        self.out.requests += 1
        head = self.prefixes[prefix] if prefix is not None else []
        return (f"e{self.rig.eng.name[-6:]}-r{self.seq}",
                head + self.tokens(tail_blocks * BS + 1))

    def pattern(self, h: bytes, rank: int) -> torch.Tensor:
        """The bytes block ``h`` holds in ``rank``'s shard."""
        key = (bytes(h), rank)
        pat = self._patterns.get(key)
        if pat is None:
            seed = hashlib.blake2b(key[0] + bytes([rank]), digest_size=64).digest()
            pat = torch.frombuffer(bytearray(seed * (ROW // 64)), dtype=torch.uint8)
            self._patterns[key] = pat
        return pat

    def write(self, table: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Compute: block ``table[j]`` gets ``pattern(hashes[j], rank)`` on every rank."""
        if not table:
            return
        idx = torch.tensor(list(table), dtype=torch.long)
        for rank, k in enumerate(self.rig.ks):
            k[idx] = torch.stack([self.pattern(h, rank) for h in hashes])

    def verify(self, table: Sequence[int], hashes: Sequence[bytes]) -> int:
        """Bytes of ``table`` (every rank) that differ from their pattern."""
        if not table:
            return 0
        idx = torch.tensor(list(table), dtype=torch.long)
        bad = 0
        for rank, k in enumerate(self.rig.ks):
            want = torch.stack([self.pattern(h, rank) for h in hashes])
            bad += int((k[idx] != want).sum())
        return bad

    # -- kvshm calls -------------------------------------------------------------
    def call(self, what: str, fn: Callable[..., T], *args: Any) -> tuple[bool, T | None]:
        """``fn(*args)``; an exception is an API error (recorded): (False, None)."""
        try:
            return True, fn(*args)
        except Exception as exc:  # noqa: BLE001 - any exception of a valid call counts
            self.out.api_errors.append(f"{what}: {type(exc).__name__}: {exc}")
            return False, None

    def quiet(self, what: str, fn: Callable[..., object], *args: Any) -> None:
        """``fn(*args)`` after an invalid call the engine accepted: an exception is
        noted (the late price of that acceptance), not counted as an API error."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - noted
            self.out.notes.append(f"{what}: raised {type(exc).__name__}: {str(exc)[:160]}")

    async def quiet_wait(self, rid: str) -> None:
        """``wait_loaded(rid)`` after an accepted invalid call: an exception is noted."""
        try:
            await bounded(self.out, self.eng.wait_loaded(rid), LOAD_S, f"wait_loaded({rid})")
        except Exception as exc:  # noqa: BLE001 - noted
            self.out.notes.append(f"wait_loaded after it: raised {type(exc).__name__}")

    def next_step(self) -> int:
        """The next step number."""
        self.step_no += 1
        return self.step_no

    def step(self, *reqs: ScheduledRequest) -> StepPlan | None:
        """One step listing ``reqs`` (none: a pure flush step)."""
        return self.call("step", self.eng.step, StepInput(self.next_step(), list(reqs)))[1]

    async def lookup(self, rid: str, hashes: list[bytes], ntok: int) -> int:
        """Phase A; None (ask again) is retried after a step, then taken as 0."""
        for _ in range(3):
            ok, hit = self.call("lookup", self.eng.lookup, RequestView(rid, hashes, ntok), 0)
            if not ok or hit is not None:
                return hit or 0
            self.step()
            await asyncio.sleep(0.005)
        return 0

    async def allocate(self, n: int) -> list[int] | None:
        """``n`` GPU blocks; waits (stepping) while the pool is short; None if it stays so."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ALLOC_S
        while True:
            try:
                return self.gpu.allocate(n)
            except PoolExhausted:
                if loop.time() > deadline:
                    self.out.notes.append(f"GPU pool short of {n} blocks for {ALLOC_S:g}s")
                    return None
            self.step()
            await asyncio.sleep(0.01)

    def finish(self, rid: str, confirmed: int, table: Sequence[int]) -> None:
        """The request leaves: ``finished`` and its GPU blocks go back to the pool."""
        self.call("finished", self.eng.finished, rid, confirmed, [list(table)])
        self.gpu.free(reversed(table))

    async def wait_load(self, rid: str, table: list[int], hashes: list[bytes]) -> int:
        """Await ``rid``'s load; verify what it delivered; blocks loaded (0: recompute)."""
        res = await bounded(self.out, self.eng.wait_loaded(rid), LOAD_S, f"wait_loaded({rid})")
        if res is None:
            return 0
        if not res.ok:
            self.out.loads_failed += 1
            return 0
        self.out.loads_ok += 1
        n = min(res.num_tokens // BS, len(table))
        bad = self.verify(table[:n], hashes[:n])
        if bad:
            self.out.notes.append(f"load of {rid}: {bad} wrong bytes in {n} blocks")
        self.out.load_wrong += bad
        return n

    # -- one request ---------------------------------------------------------------
    async def request(self, prefix: int | None = None, tail: int = 1, hold_s: float = 0.0,
                      toks: list[int] | None = None) -> int:
        """A whole request: lookup, blocks, load + verify, compute, store, hold, verify
        its blocks again (canary rule), finish. Returns the blocks it loaded."""
        rid, fresh = self.prompt(prefix, tail)
        toks = fresh if toks is None else toks
        hashes = chain_hashes(toks, BS)
        hit = await self.lookup(rid, hashes, len(toks))
        table = await self.allocate(len(hashes))
        if table is None:
            self.call("finished", self.eng.finished, rid, 0, [[]])
            return 0
        try:
            return await self.run(rid, toks, hashes, table, hit, hold_s)
        finally:
            self.finish(rid, len(toks), table)

    async def run(self, rid: str, toks: list[int], hashes: list[bytes], table: list[int],
                  hit: int, hold_s: float) -> int:
        """From ``allocated`` to the last check (see :meth:`request`)."""
        ok, _ = self.call("allocated", self.eng.allocated, rid, [table], hit)
        self.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                   new_or_resumed=True, num_confirmed_tokens=0))
        loaded = await self.wait_load(rid, table, hashes) if ok and hit else 0
        self.write(table[loaded:], hashes[loaded:])
        self.step(ScheduledRequest(rid, hashes, len(toks), ((),),
                                   num_confirmed_tokens=len(toks)))
        if hold_s:
            await asyncio.sleep(hold_s)
        bad = self.verify(table, hashes)
        if bad:
            self.out.notes.append(f"live request {rid}: {bad} bytes overwritten")
        self.out.canary_wrong += bad
        return loaded

    def batch(self, n: int) -> list[asyncio.Task[int]]:
        """``n`` concurrent requests over the shared prefixes, each held a little."""
        rng = self.rng
        return [asyncio.ensure_future(self.request(
            rng.randrange(PREFIXES), rng.randint(1, 2), rng.uniform(0.0, 0.05)))
            for _ in range(n)]

    async def run_batch(self, n: int, what: str) -> None:
        """:meth:`batch` and wait for it (a deadline)."""
        await bounded(self.out, asyncio.gather(*self.batch(n)), BATCH_S, what)

    # -- phases --------------------------------------------------------------------
    async def settle(self) -> bool:
        """Flush steps until no job is pending (a deadline: a hang)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + SETTLE_S
        while self.call("has_pending_work", self.eng.has_pending_work)[1]:
            if loop.time() > deadline:
                self.out.hangs += 1
                self.out.notes.append(f"HANG: jobs still pending after {SETTLE_S:g}s")
                return False
            self.step()
            await asyncio.sleep(0.005)
        return True

    async def warm(self) -> None:
        """Store every prefix, then a batch that loads them."""
        first = [self.request(p, 1) for p in range(PREFIXES)]
        await bounded(self.out, asyncio.gather(*first), BATCH_S, "warm-up stores")
        await self.settle()
        await self.run_batch(3 if self.out.plan.quick else 5, "warm-up loads")

    async def canary(self, during: Callable[[], Awaitable[None]]) -> None:
        """Take every free GPU block, write a unique pattern, run ``during`` (resume and
        fence stopped ranks), then check that nothing overwrote it."""
        n = self.gpu.num_free
        if n == 0:
            self.out.notes.append("canary: no free GPU block")
            await during()
            return
        rid, toks = self.prompt(None, n)
        hashes = chain_hashes(toks, BS)[:n]
        table = self.gpu.allocate(n)
        try:
            self.call("allocated", self.eng.allocated, rid, [table], 0)
            self.write(table, hashes)
            self.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                       new_or_resumed=True, num_confirmed_tokens=len(toks)))
            await during()
            bad = self.verify(table, hashes)
            if bad:
                self.out.notes.append(f"canary {rid}: {bad} bytes overwritten in {n} blocks")
            self.out.canary_wrong += bad
        finally:
            self.finish(rid, len(toks), table)

    async def round_trip(self) -> bool:
        """Store a fresh prompt, then load it into fresh blocks: True if it loaded."""
        toks = self.tokens(2 * BS + 1)
        await self.request(toks=toks)
        await self.settle()
        return await self.request(toks=toks) > 0

    def rank(self, r: int) -> RankStats:
        """Rank ``r``'s statistics record."""
        return self.eng.statistics().ranks[r]

    async def until(self, pred: Callable[[], bool], seconds: float, what: str, *,
                    hang: bool) -> bool:
        """Poll ``pred`` every 10 ms for ``seconds``; a miss is a hang if ``hang``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not pred():
            if loop.time() > deadline:
                if hang:
                    self.out.hangs += 1
                    self.out.notes.append(f"HANG: {what} not within {seconds:g}s")
                return False
            await asyncio.sleep(0.01)
        return True


# ---------------------------------------------------------------------------- faults


def _victim(t: Traffic) -> tuple[int, int]:
    """A random rank and its pid."""
    r = t.rng.randrange(TP)
    return r, t.rig.pids[r]


async def fault_sigkill(t: Traffic) -> str:
    """SIGKILL a rank (ATTACH, one time in three: the kvshm-workers parent, whose ranks
    then get their parent-death SIGTERM); the engine must notice within the deadline."""
    r, pid = _victim(t)
    parent = t.rig.parent
    whom = f"rank {r} (pid {pid})"
    if parent is not None and t.rng.random() < 1 / 3:
        pid, whom = parent.pid, f"the kvshm-workers parent (pid {parent.pid})"
    _signal(pid, signal.SIGKILL)
    t0 = time.monotonic()
    await t.until(lambda: not t.rank(r).alive, VERDICT_S, f"verdict after SIGKILL of {whom}",
                  hang=True)
    return f"SIGKILL {whom}; verdict on rank {r} after {time.monotonic() - t0:.2f}s"


async def fault_sigstop(t: Traffic) -> str:
    """SIGSTOP a rank and queue a load on it; wait for the hang verdict and that load's
    result. The rank is resumed later, in the canary phase -- or, for an ATTACH rank one
    time in three, only after the engine is closed: nothing can fence it meanwhile, so
    its blocks must stay quarantined (reported, not leaked) and the close must not hang."""
    r, pid = _victim(t)
    _signal(pid, signal.SIGSTOP)
    keep = t.rig.parent is not None and t.rng.random() < 1 / 3
    (t.rig.kept_stopped if keep else t.rig.stopped).append(pid)
    t0 = time.monotonic()
    victim = asyncio.ensure_future(t.request(t.rng.randrange(PREFIXES), 1))
    await t.until(lambda: not t.rank(r).alive, HANG_S_STOP + VERDICT_S,
                  f"hang verdict on stopped rank {r}", hang=True)
    took = time.monotonic() - t0
    await bounded(t.out, victim, LOAD_S, "the request loading from the stopped rank")
    until = "the close" if keep else "the canary"
    return (f"SIGSTOP rank {r} (pid {pid}) with a load queued, resumed after {until}; "
            f"verdict after {took:.2f}s")


def _ring_segment(eng: Engine, rank: int) -> memoryview | None:
    """This process's mapping of ``rank``'s ring segment (through the engine's channel;
    private attributes, so None when they are not there)."""
    core = getattr(eng, "_core", None)
    chans = getattr(core, "_channels", None)
    chan = chans.get(rank) if isinstance(chans, dict) else None
    if chan is None or getattr(chan, "closed", True):
        return None
    mv = getattr(getattr(chan, "rings", None), "_mv", None)
    return mv if isinstance(mv, memoryview) else None


def _publish_bad_header(mv: memoryview) -> bool:
    """Write a record with an impossible header at the done ring's head and publish it."""
    ctl = mv[:CONTROL_SIZE].cast("Q")
    try:
        cap, off, head = ctl[_W_DONE_CAP], ctl[_W_DONE_OFF], ctl[_W_DONE_HEAD]
        at = head % cap
        if at + 16 > cap:
            return False
        data = mv[off + at: off + at + 16].cast("Q")
        data[0], data[1] = 0x0BAD_F00D_0000_0008, 0xFFFF_FFFF_FFFF_FFFF
        data.release()
        ctl[_W_DONE_HEAD] = head + 16
        return True
    finally:
        ctl.release()


def inject_done_garbage(eng: Engine, rank: int, variant: str) -> str:
    """Publish one garbage record in ``rank``'s done ring (its writer must be frozen);
    returns what was done."""
    mv = _ring_segment(eng, rank)
    if mv is None:
        return "ring segment not reachable: nothing injected"
    if variant == "header" and _publish_bad_header(mv):
        return "a record with an impossible header"
    pair = RingPair.attach(mv)
    try:
        pair.done.stage(b"\xc1" * 24)  # 0xc1 is never valid msgpack
        pair.done.publish()
    finally:
        pair.close()
    return "an undecodable record (0xc1 bytes)"


async def fault_corrupt_done(t: Traffic) -> str:
    """Freeze a rank, post a store to it, publish a garbage Done record in its ring and
    wait for the engine's verdict (a broken ring); the rank is resumed later."""
    r, pid = _victim(t)
    _signal(pid, signal.SIGSTOP)
    t.rig.stopped.append(pid)
    rid, toks = t.prompt(None, 2)
    hashes = chain_hashes(toks, BS)
    table = await t.allocate(len(hashes))
    if table is not None:  # a store outstanding on the frozen rank: the ring is read
        t.call("allocated", t.eng.allocated, rid, [table], 0)
        t.write(table, hashes)
        t.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                new_or_resumed=True, num_confirmed_tokens=len(toks)))
    what = inject_done_garbage(t.eng, r, t.rng.choice(("payload", "header")))
    t.out.injected = not what.startswith("ring segment")
    seen = await t.until(lambda: not t.rank(r).alive, CORRUPT_VERDICT_S,
                         "verdict on the corrupt ring", hang=False)
    if table is not None:
        t.finish(rid, len(toks), table)
    if not seen and t.out.injected:
        t.out.notes.append(f"corrupt done record not detected within {CORRUPT_VERDICT_S}s")
    return f"rank {r} frozen, done ring got {what}; verdict={'yes' if seen else 'NO'}"


def _rogue_frames(world: int) -> list[tuple[str, bytes]]:
    """What the rogue connections send, one frame each."""
    enc = protocol.control_encoder()
    v, pid = protocol.PROTOCOL_VERSION, os.getpid()

    def hello(ver: int, rank: int, ws: int) -> bytes:
        return enc.encode(protocol.Hello(ver, rank, ws, pid))

    return [("garbage", os.urandom(97)),
            ("nested msgpack", b"\x91" * 60_000 + b"\xc0"),
            ("nested map", b"\x81\xa1k" * 20_000 + b"\xc0"),
            ("oversize frame", b"\x92" + b"\x00" * (1 << 17)),
            ("empty frame", b""),
            ("hello wrong rank", hello(v, world + 3, world)),
            ("hello live rank 0", hello(v, 0, world)),
            ("hello wrong version", hello(v + 99, 1, world)),
            ("hello wrong world", hello(v, 1, world + 1)),
            ("stats request never read", enc.encode(protocol.StatsRequest()))]


def rogue_connect(name: str, world: int, idle: int) -> tuple[list[socket.socket], list[str]]:
    """Open the rogue connections (blocking calls: run in a thread); returns the sockets
    (kept open) and what failed on the way."""
    addr = b"\0kvshm." + name.encode()
    socks: list[socket.socket] = []
    errs: list[str] = []
    frames: list[tuple[str, bytes | None]] = [*_rogue_frames(world)]
    frames += [("idle", None)] * idle
    for label, frame in frames:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.settimeout(2.0)
        socks.append(s)
        try:
            s.connect(addr)
            if frame is not None:
                s.send(frame)
        except OSError as exc:
            errs.append(f"{label}: {exc.strerror or exc}")
    return socks, errs


async def fault_rogue_conn(t: Traffic) -> str:
    """Rogue connections on the rendezvous socket, held open; then ``kvshm stats`` must
    still answer and the engine must stay READY."""
    eng = t.eng
    got = await bounded(t.out, asyncio.to_thread(rogue_connect, eng.name, TP, 24), QUERY_S,
                        "rogue connections")
    if got is None:
        return "rogue connections: connect hung"
    socks, errs = got
    t.rig.held.extend(socks)
    await asyncio.sleep(0.2)
    stats = await bounded(t.out, asyncio.to_thread(query_stats, eng.name, QUERY_S), QUERY_S + 2,
                          "kvshm stats query beside rogue connections")
    refused = stats.get("counters", {}).get("refused", "?") if stats else "no answer"
    if stats is None:
        t.out.unusable.append("kvshm stats query got no answer beside rogue connections")
    sent = ", ".join(errs) if errs else "all sent"
    return f"{len(socks)} rogue connections ({sent}); engine counted refused={refused}"


# ---- invalid calls -----------------------------------------------------------------


def expect_error(t: Traffic, what: str, fn: Callable[..., object], *args: Any,
                 must_refuse: bool = True) -> str:
    """Call ``fn(*args)``, which is invalid (``must_refuse``) or at best a no-op: report
    how the engine answered; an acceptance that should have been a refusal is noted."""
    try:
        fn(*args)
    except KvshmError as exc:
        return f"{what}: {type(exc).__name__}"
    except Exception as exc:  # noqa: BLE001 - an engine that raises something else: noted
        t.out.notes.append(f"{what}: raised {type(exc).__name__} (not a KvshmError): {exc}")
        return f"{what}: {type(exc).__name__}!"
    if must_refuse:
        t.out.notes.append(f"{what}: accepted without an error")
    return f"{what}: accepted"


async def _hit_request(t: Traffic) -> tuple[str, list[int], list[bytes], int,
                                            list[int]] | None:
    """A request over a shared prefix after its lookup, with its GPU blocks."""
    rid, toks = t.prompt(t.rng.randrange(PREFIXES), 1)
    hashes = chain_hashes(toks, BS)
    hit = await t.lookup(rid, hashes, len(toks))
    table = await t.allocate(len(hashes))
    if table is None:
        t.call("finished", t.eng.finished, rid, 0, [[]])
        return None
    return rid, toks, hashes, hit, table


async def bad_step_hash(t: Traffic) -> str:
    """step() listing a new, fully computed request one of whose hashes is not bytes (its
    store walk reads every hash); the client aborts the request."""
    rid, toks = t.prompt(None, 2)
    hashes = chain_hashes(toks, BS)
    table = await t.allocate(len(hashes))
    if table is None:
        return "step(hash not bytes): skipped"
    t.call("allocated", t.eng.allocated, rid, [table], 0)
    t.write(table, hashes)
    bad: list[Any] = list(hashes)
    bad[t.rng.randrange(len(bad))] = t.rng.choice((12345, "not-bytes", None))
    req = ScheduledRequest(rid, bad, len(toks), (tuple(table),), new_or_resumed=True,
                           num_confirmed_tokens=len(toks))
    res = expect_error(t, "step(hash not bytes)", t.eng.step, StepInput(t.next_step(), [req]))
    t.finish(rid, 0, table)
    return res


async def bad_allocated_id(t: Traffic) -> str:
    """allocated() with a GPU id out of range, each kind of wrong id in turn while they
    are refused, then the valid call and the whole request. Once one is accepted, the
    client goes on with that table as a client that made the mistake would."""
    got = await _hit_request(t)
    if got is None:
        return "allocated(bad id): skipped"
    rid, toks, hashes, hit, table = got
    said = []
    for wrong in (GPU_BLOCKS, GPU_BLOCKS + 1000, -1):
        said.append(expect_error(t, f"allocated(gpu id {wrong})", t.eng.allocated, rid,
                                 [[wrong, *table[1:]]], hit))  # block 0: in the hit
        if said[-1].endswith("accepted"):
            await _go_on_tainted(t, rid, toks, hashes, table, hit)
            return "; ".join(said)
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return "; ".join(said)


async def _go_on_tainted(t: Traffic, rid: str, toks: list[int], hashes: list[bytes],
                         table: list[int], hit: int) -> None:
    """The engine accepted an invalid ``allocated``: list the request, await its load,
    finish it. What raises now is the late price of that acceptance: noted."""
    req = ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True)
    try:
        t.quiet("step after it", t.eng.step, StepInput(t.next_step(), [req]))
        if hit:
            await t.quiet_wait(rid)
    finally:
        t.quiet("finished after it", t.eng.finished, rid, 0, [table])
        t.gpu.free(reversed(table))


async def bad_finished_id(t: Traffic) -> str:
    """finished() with a GPU id out of range, then (if it was refused) the valid one."""
    got = await _hit_request(t)
    if got is None:
        return "finished(bad id): skipped"
    rid, toks, hashes, hit, table = got
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    except BaseException:
        t.finish(rid, len(toks), table)
        raise
    res = expect_error(t, "finished(gpu id 10**6)", t.eng.finished, rid, len(toks),
                       [[*table, 10**6]])
    if res.endswith("accepted"):  # the engine took it as the request's finish
        t.gpu.free(reversed(table))
    else:
        t.finish(rid, len(toks), table)
    return res


async def bad_lookup(t: Traffic) -> str:
    """lookup() with num_local_tokens past the prompt and below 0, then the whole valid
    request."""
    rid, toks = t.prompt(t.rng.randrange(PREFIXES), 1)
    hashes = chain_hashes(toks, BS)
    said = [expect_error(t, f"lookup(num_local_tokens={local})", t.eng.lookup,
                         RequestView(rid, hashes, len(toks)), local)
            for local in (len(toks) + 3 * BS, -BS)]
    hit = await t.lookup(rid, hashes, len(toks))
    table = await t.allocate(len(hashes))
    if table is None:
        t.call("finished", t.eng.finished, rid, 0, [[]])
        return "; ".join(said)
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return "; ".join(said)


async def bad_duplicate_listing(t: Traffic) -> str:
    """One step listing the same new request twice; the client aborts it."""
    got = await _hit_request(t)
    if got is None:
        return "step(listed twice): skipped"
    rid, toks, hashes, hit, table = got
    t.call("allocated", t.eng.allocated, rid, [table], hit)
    req = ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True)
    res = expect_error(t, "step(request listed twice)", t.eng.step,
                       StepInput(t.next_step(), [req, req]))
    t.finish(rid, 0, table)
    return res


async def bad_ghost(t: Traffic) -> str:
    """allocated() / finished() of a request the engine never saw, naming blocks another
    live request owns: those blocks' reference counts must not change."""
    got = await _hit_request(t)
    if got is None:
        return "ghost: skipped"
    rid, toks, hashes, hit, table = got
    ghost = f"ghost-{t.seq}"
    try:
        t.call("allocated", t.eng.allocated, rid, [table], hit)
        refs = [t.gpu.ref_cnt(b) for b in table]
        a = expect_error(t, "allocated(unknown request)", t.eng.allocated, ghost, [table],
                         len(hashes) * BS, must_refuse=False)
        if a.endswith("accepted"):
            await _ghost_wait(t, ghost)
        f = expect_error(t, "finished(unknown request)", t.eng.finished, ghost, len(toks),
                         [table], must_refuse=False)
        if [t.gpu.ref_cnt(b) for b in table] != refs:
            t.out.notes.append("ghost request calls changed a live request's block refs")
        t.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                                new_or_resumed=True))
        if hit:
            await t.wait_load(rid, table, hashes)
    finally:
        t.finish(rid, 0, table)
    return f"{a}; {f}"


async def _ghost_wait(t: Traffic, ghost: str) -> None:
    """After an accepted ``allocated`` of an unknown request with external tokens: its
    ``wait_loaded`` must resolve (a failed result or an error), not wait forever."""
    try:
        await asyncio.wait_for(t.eng.wait_loaded(ghost), 2.0)
    except KvshmError:
        pass
    except TimeoutError:
        t.out.notes.append("wait_loaded() of an unknown request whose allocated() was "
                           "accepted never resolves")


async def bad_double_finish(t: Traffic) -> str:
    """A whole request, then finished() a second time."""
    got = await _hit_request(t)
    if got is None:
        return "finished twice: skipped"
    rid, toks, hashes, hit, table = got
    try:
        await t.run(rid, toks, hashes, table, hit, 0.0)
    finally:
        t.finish(rid, len(toks), table)
    return expect_error(t, "finished twice", t.eng.finished, rid, len(toks), [table],
                        must_refuse=False)


async def bad_wait_unknown(t: Traffic) -> str:
    """wait_loaded() of a request with no load pending."""
    try:
        await asyncio.wait_for(t.eng.wait_loaded(f"nobody-{t.seq}"), 2.0)
    except KvshmError as exc:
        return f"wait_loaded(unknown): {type(exc).__name__}"
    except TimeoutError:
        t.out.notes.append("wait_loaded(unknown request) waited instead of raising")
        return "wait_loaded(unknown): waited"
    return "wait_loaded(unknown): returned"


BAD_CALLS: Final[tuple[Callable[[Traffic], Awaitable[str]], ...]] = (
    bad_step_hash, bad_allocated_id, bad_finished_id, bad_lookup, bad_duplicate_listing,
    bad_ghost, bad_double_finish, bad_wait_unknown)


async def fault_bad_call(t: Traffic) -> str:
    """Every invalid call, in random order, each after a valid request."""
    calls = list(BAD_CALLS)
    t.rng.shuffle(calls)
    said = []
    for bad in calls:
        await t.request(t.rng.randrange(PREFIXES), 1)
        said.append(await bad(t))
    return "; ".join(said)


INJECT: Final[dict[str, Callable[[Traffic], Awaitable[str]]]] = {
    "sigkill": fault_sigkill, "sigstop": fault_sigstop, "corrupt_done": fault_corrupt_done,
    "rogue_conn": fault_rogue_conn, "bad_call": fault_bad_call}


# ---------------------------------------------------------------------------- engines


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
        _signal(pid, signal.SIGCONT)

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
        _signal(pid, signal.SIGCONT)
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
        _signal(pid, signal.SIGKILL)
    if rig.parent is not None and rig.parent.poll() is None:
        rig.parent.kill()


async def wait_gone(rig: Rig, seconds: float) -> list[int]:
    """The engine's processes still alive after up to ``seconds``."""
    pids = [*rig.pids, *([rig.parent.pid] if rig.parent is not None else [])]
    deadline = time.monotonic() + seconds
    while True:
        left = [p for p in pids if _alive(p)]
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


# ---------------------------------------------------------------------------- the run


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
                                 description=(__doc__ or "").split("\n\n")[0])
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


if __name__ == "__main__":
    sys.exit(main())
