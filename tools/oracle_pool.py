"""Belady's order for kvshm's CPU tier, replayed from a recorded access sequence: the
benchmark-only oracle of :mod:`tools.bench_e2e`.

Not one of kvshm's eviction orders (:class:`kvshm.config.Eviction` does not name it and
no config selects it): it needs the future. The benchmark records which block hashes
each request's CPU-tier lookup asks for on a pass with an unbounded tier (the engine's
own device pool behaves the same whatever the CPU tier holds, so the sequence is the
same on every pass) and hands it to :class:`NextUse`; :func:`oracle_pool` builds a
:class:`~kvshm.offload.pool.BlockPool` whose free set is an :class:`OracleFreeSet`
(the pool's own ``_queue``, swapped after construction: kvshm's code is not changed).

Time is the request index of the workload: :attr:`NextUse.now` is ``i - 1`` while
request ``i`` waits for its lookup and ``i`` once the lookup has been answered (the
benchmark sets both), so a use at request ``j`` is in the future while ``j > now``.

The order (:class:`OracleFreeSet`): the cached block at ref 0 whose next use is
furthest goes first (never used again: first of all), the deepest one in its chain
among equals (a hit is a prefix, so of one chain the tail is worth least), oldest
first among equals of both. A block's key is fixed when it joins the set; a key whose
use has passed without the block being hit (a lookup that stopped before it) is
recomputed when the clock passes it, before the next placement or victim.

It is Belady's MIN as an eviction order, not as an admission policy: the pool still
stores every block the manager offers it (a block never used again is the next
victim). With prefix hits it is the classic offline reference, not a proven optimum.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvshm.config import Eviction
from kvshm.offload.blocks import Block, FreeBlockQueue, FreeSet
from kvshm.offload.pool import BlockPool

__all__ = ["NEVER", "NextUse", "OracleFreeSet", "oracle_pool"]

NEVER = 1 << 40
"""The next use of a hash never asked for again (later than every request index)."""
_DEPTHS = 1 << 20
"""Keys are ``next_use * _DEPTHS + depth``: depth breaks ties on the next use."""


class NextUse:
    """Each hash's request indices (ascending) and the clock :attr:`now`."""

    def __init__(self, uses: Mapping[bytes, Sequence[int]]) -> None:
        self.uses = {h: sorted(v) for h, v in uses.items()}
        self.now = -1

    @classmethod
    def from_asks(cls, asks: Mapping[int, Sequence[bytes]]) -> NextUse:
        """From ``{request index: the hashes its lookup asked for}``."""
        uses: dict[bytes, list[int]] = {}
        for i, hs in asks.items():
            for h in hs:
                uses.setdefault(h, []).append(i)
        return cls(uses)

    def after(self, hashes: Iterable[bytes]) -> int:
        """The earliest use of any of ``hashes`` later than :attr:`now` (NEVER: none)."""
        best = NEVER
        now = self.now
        for h in hashes:
            lst = self.uses.get(h)
            if lst:
                k = bisect.bisect_right(lst, now)
                if k < len(lst) and lst[k] < best:
                    best = lst[k]
        return best


class OracleFreeSet(FreeSet):
    """Furthest next use first (module docstring); buckets per key, a max-heap of the
    occupied keys (lazy: emptied keys leave their entry until it surfaces)."""

    def __init__(self, clock: NextUse) -> None:
        super().__init__()
        self.clock = clock
        self.seen = clock.now
        self.slots: dict[int, FreeBlockQueue] = {}
        self.heap: list[int] = []  # negated keys

    def _sync(self) -> None:
        """Recompute the keys whose use the clock has passed (their blocks were not hit
        then: a hit pins a block, which leaves the set)."""
        now = self.clock.now
        if now == self.seen:
            return
        self.seen = now
        stale = [s for s in self.slots if s // _DEPTHS <= now]
        for s in stale:
            q = self.slots.pop(s)
            while q.size:
                self._place(q.popleft())

    def _place(self, b: Block) -> None:
        self._sync()
        key = self.clock.after(b.hashes) * _DEPTHS + min(b.depth, _DEPTHS - 1)
        q = self.slots.get(key)
        if q is None:
            q = self.slots[key] = FreeBlockQueue()
            heapq.heappush(self.heap, -key)
        b.slot = key
        q.append(b)

    def _unlink(self, b: Block) -> None:
        q = self.slots[b.slot]
        q.remove(b)
        if not q.size:
            del self.slots[b.slot]

    def _victim(self) -> Block:
        self._sync()
        heap, slots = self.heap, self.slots
        while (q := slots.get(-heap[0])) is None:
            heapq.heappop(heap)
        b = q.popleft()
        if not q.size:
            del slots[-heapq.heappop(heap)]
        return b

    def _queues(self) -> list[FreeBlockQueue]:
        return [self.slots[s] for s in sorted(self.slots, reverse=True)]

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        want = next(s for s, x in self.slots.items() if x is q)
        for b in blocks:
            if b.slot != want:
                raise AssertionError(f"{b!r} in slot {want} says slot {b.slot}")


def oracle_pool(clock: NextUse) -> Any:
    """A CPU-tier factory (``BlockPool(num_blocks, **kw)``'s signature) for
    :func:`tools.bench_vllm_chat.cpu_pool_built_by`: a pool whose free set is an
    :class:`OracleFreeSet` on ``clock``. Built with a depth-aware order so the store
    planner records each block's depth (it skips that for plain LRU), then its free
    set (every block fresh: the pool is new) is replaced."""

    def pool(num_blocks: int, **kw: Any) -> BlockPool:
        p = BlockPool(num_blocks, **{**kw, "eviction": Eviction.DEEPEST})
        fs = OracleFreeSet(clock)
        for b in reversed(p._blocks):  # block 0 is taken first, as in a new pool
            b.prev = b.next = None
            fs.appendleft(b)
        p._queue = fs
        return p

    return pool
