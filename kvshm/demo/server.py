"""The demo's custom server: one request at a time over the toy model and kvshm.

It does what a serving engine's scheduler and worker do, in one asyncio task:

1. GPU prefix cache: the longest run of the prompt's block hashes cached in its
   :class:`~kvshm.offload.pool.BlockPool` (touched), capped so at least one token is computed;
2. ``engine.lookup`` for a CPU hit beyond it (phase A; while it answers None, "ask
   again", the engine is stepped with nothing scheduled: a remote tier's GET job is
   planned by a step), then the block table is allocated (local hits + fresh blocks
   for the rest of the prompt and the reply) and ``engine.allocated`` (phase B);
3. the first ``engine.step`` lists the request (``new_or_resumed``); its plan's load is
   awaited with ``wait_loaded`` (a failed load recomputes from the first failed block);
4. prefill in 512-token chunks from the hit, then the reply token by token; every chunk
   and decode step is one engine step listing the request with its confirmed tokens, so
   full blocks are stored while the request runs;
5. ``engine.finished``, then the table is freed (full blocks stay cached in the pool).

Without an engine (offload off) steps 2-3 and the stores are skipped: the same server,
only the GPU prefix cache. Checksums: every block a plan stores is hashed (crc32 of its
bytes in every shard) when the plan is made -- its GPU block is pinned from then until
the copy is acked, so the bytes cannot change -- and every block a plan loads is hashed
again once its load has completed; a difference is counted as a mismatch.

Canonical system prompt: a prefill that starts at position 0 computes the shared system
prompt as a chunk of its own, so its KV bytes are the same whichever conversation
computes them (the bit-exact check depends on it; see :mod:`kvshm.demo.check`).
"""

from __future__ import annotations

import asyncio
import ctypes
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvshm.demo.model import ToyModel, greedy
from kvshm.engine import Engine
from kvshm.hashing import chain_hashes
from kvshm.ipc.protocol import RemoteOp, Transfer, unpack_ids
from kvshm.offload.pool import BlockPool
from kvshm.types import RequestView, ScheduledRequest, StepInput, StepPlan, no_new_blocks

__all__ = ["ChunkCall", "ToyServer", "TurnResult"]

CHUNK_TOKENS = 512


@dataclass(frozen=True)
class ChunkCall:
    """One ``forward_chunk`` a conversation ran: positions ``[start, start + len)``."""

    start: int
    tokens: tuple[int, ...]


@dataclass
class TurnResult:
    """What serving one turn produced."""

    reply: list[int]
    ttft_s: float
    logits: torch.Tensor
    local_tokens: int
    cpu_hit_tokens: int
    load_failed: bool
    calls: list[ChunkCall] = field(default_factory=list)
    #: Phases of ``ttft_s``: the lookup (first ``engine.lookup`` until it answered; with
    #: a remote tier it includes the index query and the GET job), of which
    #: ``query_s`` until the step that planned a remote GET (0: none planned), and the
    #: wait for the load; the rest is compute.
    lookup_s: float = 0.0
    query_s: float = 0.0
    load_s: float = 0.0


class ToyServer:
    """See the module docstring. ``engine`` None: offload off."""

    def __init__(self, model: ToyModel, shards: Sequence[torch.Tensor], gpu: BlockPool,
                 engine: Engine | None, system_tokens: int) -> None:
        self.model = model
        self.shards = list(shards)
        self.gpu = gpu
        self.engine = engine
        self.bs = model.config.block_size
        self.system_tokens = system_tokens
        self._step = 0
        self._stored_sums: dict[int, int] = {}
        self.checksum_ok = 0
        self.checksum_bad = 0

    # -- checksums ---------------------------------------------------------------------
    def _block_sum(self, gpu_id: int) -> int:
        crc = 0
        for shard in self.shards:
            row = shard[gpu_id]  # dim 0 is the block: one contiguous row per shard
            if row.device.type != "cpu":
                row = row.cpu()  # the CRC reads host bytes
            nbytes = row.numel() * row.element_size()
            crc = zlib.crc32((ctypes.c_char * nbytes).from_address(row.data_ptr()), crc)
        return crc

    def _record_stores(self, t: Transfer | None) -> None:
        if t is None:
            return
        for g, c in zip(unpack_ids(t.src_ids), unpack_ids(t.dst_ids)):
            self._stored_sums[c] = self._block_sum(g)

    def _verify_loads(self, t: Transfer, failed: set[int]) -> None:
        for c, g in zip(unpack_ids(t.src_ids), unpack_ids(t.dst_ids)):
            if g in failed:
                continue
            if self._stored_sums.get(c) == self._block_sum(g):
                self.checksum_ok += 1
            else:
                self.checksum_bad += 1

    # -- engine steps ------------------------------------------------------------------
    async def _step_engine(self, req: ScheduledRequest | None) -> StepPlan | None:
        eng = self.engine
        self._step += 1
        if eng is None:  # still a suspension point: the offload-off pass never yielded,
            await asyncio.sleep(0)  # so a Ctrl-C (a cancel of the main task) waited
            return None  # for its whole replay
        plan = eng.step(StepInput(self._step, [req] if req is not None else []))
        self._record_stores(plan.store)
        await asyncio.sleep(0)  # let Done callbacks run between compute chunks
        return plan

    async def _wait_for_space(self, n: int, timeout_s: float = 30.0) -> None:
        """Step with nothing scheduled while fewer than ``n`` device blocks are free and
        stores still pin some, as a serving engine's request waits for KV space. On the
        CPU copies finish within a step; on a GPU a store's blocks stay pinned until its
        CUDA event is seen, after the next request may already want them."""
        eng = self.engine
        deadline = time.monotonic() + timeout_s
        while (eng is not None and self.gpu.num_free < n and eng.has_pending_work()
               and time.monotonic() < deadline):
            await self._step_engine(None)
            await asyncio.sleep(0.001)

    async def drain(self, timeout_s: float = 30.0) -> None:
        """Step with nothing scheduled until every store is acked."""
        eng = self.engine
        deadline = time.monotonic() + timeout_s
        while eng is not None and eng.has_pending_work() and time.monotonic() < deadline:
            await self._step_engine(None)
            await asyncio.sleep(0.002)

    # -- one turn ----------------------------------------------------------------------
    def _local_hit(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        ids: list[int] = []
        for h in hashes:
            b = self.gpu.get_cached(h)
            if b is None:
                break
            ids.append(b)
        while ids and len(ids) * self.bs >= num_tokens:
            ids.pop()  # at least one token is computed (its logits are the answer)
        self.gpu.touch(ids)
        return ids

    async def serve(self, req_id: str, prompt: Sequence[int], reply_tokens: int) -> TurnResult:
        """Serve one turn: prefill ``prompt``, generate ``reply_tokens`` tokens greedily."""
        t0 = time.perf_counter()
        bs, n = self.bs, len(prompt)
        hashes = chain_hashes(prompt, bs)
        local = self._local_hit(hashes, n)
        hit, query_s, lookup_s = await self._lookup(req_id, hashes, n, len(local) * bs)
        total_blocks = -(-(n + reply_tokens) // bs)
        await self._wait_for_space(total_blocks - len(local))
        table = local + self.gpu.allocate(total_blocks - len(local))
        start = len(local) * bs + hit
        if self.engine is not None:
            self.engine.allocated(req_id, [table], hit)
        seq_hashes = list(hashes)
        req = ScheduledRequest(req_id, seq_hashes, n, (tuple(table),), new_or_resumed=True,
                               num_confirmed_tokens=len(local) * bs)
        plan = await self._step_engine(req)
        load_failed = False
        loading = time.perf_counter()
        if hit and plan is not None and self.engine is not None:
            start, load_failed = await self._await_load(req_id, plan, table, start,
                                                        len(local) * bs)
        result = TurnResult([], 0.0, torch.empty(0), len(local) * bs, hit, load_failed,
                            lookup_s=lookup_s, query_s=query_s,
                            load_s=time.perf_counter() - loading)
        logits = await self._prefill(req_id, prompt, start, table, seq_hashes, result)
        result.ttft_s, result.logits = time.perf_counter() - t0, logits
        await self._decode(req_id, prompt, greedy(logits), reply_tokens, table, seq_hashes,
                           result)
        self._finish(req_id, n + reply_tokens - 1, table, seq_hashes, prompt, result.reply)
        return result

    async def _lookup(self, req_id: str, hashes: list[bytes], n: int, local: int,
                      ) -> tuple[int, float, float]:
        """(hit tokens, seconds until a remote GET was planned or 0, seconds in all)."""
        eng = self.engine
        if eng is None:
            return 0, 0.0, 0.0
        view = RequestView(req_id, hashes, n)
        t0 = time.perf_counter()
        get_at = 0.0
        while True:
            hit = eng.lookup(view, local)
            if hit is not None:
                return hit, (get_at - t0 if get_at else 0.0), time.perf_counter() - t0
            # "ask again": another request is loading this prefix, or the remote tier is
            # being asked (its GET job is planned by a step, so step while waiting)
            plan = await self._step_engine(None)
            if not get_at and plan is not None and any(
                    m.op is RemoteOp.GET for m in plan.remote):
                get_at = time.perf_counter()
            await asyncio.sleep(0.001)

    async def _await_load(self, req_id: str, plan: StepPlan, table: list[int], start: int,
                          local: int) -> tuple[int, bool]:
        assert self.engine is not None
        res = await self.engine.wait_loaded(req_id)
        failed = set(res.failed_block_ids)
        if plan.load is not None:
            self._verify_loads(plan.load, failed)
        if res.ok:
            return start, False
        first_bad = min((table.index(b) for b in failed if b in table), default=local // self.bs)
        return min(start, first_bad * self.bs), True

    def _chunk(self, calls: list[ChunkCall], tokens: Sequence[int], start: int,
               table: list[int]) -> torch.Tensor:
        calls.append(ChunkCall(start, tuple(tokens)))
        return self.model.forward_chunk(self.shards, tokens, start, table)

    def _bounds(self, start: int, n: int) -> list[tuple[int, int]]:
        cuts, pos = [], start
        if pos == 0 and 0 < self.system_tokens < n:
            cuts.append((0, self.system_tokens))
            pos = self.system_tokens
        while pos < n:
            cuts.append((pos, min(n, pos + CHUNK_TOKENS)))
            pos += CHUNK_TOKENS
        return cuts

    async def _prefill(self, req_id: str, prompt: Sequence[int], start: int, table: list[int],
                       seq_hashes: list[bytes], result: TurnResult) -> torch.Tensor:
        logits = torch.empty(0)
        for a, b in self._bounds(start, len(prompt)):
            logits = self._chunk(result.calls, prompt[a:b], a, table)
            await self._step_engine(self._listed(req_id, seq_hashes, len(prompt), b))
        return logits

    def _listed(self, req_id: str, hashes: list[bytes], num_tokens: int,
                confirmed: int) -> ScheduledRequest:
        return ScheduledRequest(req_id, hashes, num_tokens, no_new_blocks(1),
                                num_confirmed_tokens=confirmed)

    async def _decode(self, req_id: str, prompt: Sequence[int], first: int, count: int,
                      table: list[int], seq_hashes: list[bytes], result: TurnResult) -> None:
        seq = list(prompt)
        token = first
        result.reply.append(token)
        for _ in range(count - 1):
            pos = len(seq)
            seq.append(token)
            if len(seq) % self.bs == 0:
                seq_hashes.extend(chain_hashes(seq[-self.bs:], self.bs,
                                               parent=seq_hashes[-1] if seq_hashes else None))
            token = greedy(self._chunk(result.calls, [token], pos, table))
            result.reply.append(token)
            await self._step_engine(self._listed(req_id, seq_hashes, len(seq), len(seq)))

    def _finish(self, req_id: str, computed: int, table: list[int], seq_hashes: list[bytes],
                prompt: Sequence[int], reply: list[int]) -> None:
        full = computed // self.bs
        for i in range(full):
            if not self.gpu.block_hashes(table[i]):
                self.gpu.add_hashes(table[i], [seq_hashes[i]])
        if self.engine is not None:
            self.engine.finished(req_id, computed, [table])
        self.gpu.free(reversed(table))
