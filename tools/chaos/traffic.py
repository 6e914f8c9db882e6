"""The chaos run's traffic: byte-pattern requests over a few shared prefixes.

Block j of a request holds ``pattern(hash of block j, rank)`` in each rank's shard;
every successful load is compared byte by byte (``wrong_bytes``), and every block a
live request owns is checked again before it finishes (the canary rule: nothing may
write into blocks a request owns that it did not load into). Freed GPU blocks are
handed out again first, so a stale copy would land in somebody else's blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

from kvshm.errors import PoolExhausted
from kvshm.hashing import chain_hashes
from kvshm.stats import RankStats
from kvshm.types import RequestView, ScheduledRequest, StepInput, StepPlan
from tools.chaos.rig import (
    ALLOC_S,
    BATCH_S,
    BS,
    LOAD_S,
    PREFIX_BLOCKS,
    PREFIXES,
    ROW,
    SETTLE_S,
    Outcome,
    Rig,
    T,
    bounded,
)


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
