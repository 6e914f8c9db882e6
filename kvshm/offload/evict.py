"""Eviction orders of the CPU tier other than plain LRU: what a :class:`BlockPool` takes
when it must reuse a cached block.

Each order is a *free set* with the interface of
:class:`~kvshm.offload.blocks.FreeBlockQueue` (``append`` / ``extend`` for cached blocks
reaching ref 0, ``appendleft`` for an uncached or ``evict_first`` one, ``remove`` when a block is
pinned again, ``popleft`` for the next victim, iteration in victim order, ``__len__``,
``check_links``), plus ``refresh`` (a cached block at ref 0 was reused elsewhere: the
GPU copy of it hit). The pool keeps the rest: ref counts, the hash index, and the rule
that only blocks at ref 0 are ever in the free set, so a pinned or in-flight block is
never a victim. Blocks reaching ref 0 without hashes, or with ``evict_first``, go to a
``fresh`` queue that every order empties first, as LRU does. Their base,
:class:`~kvshm.offload.blocks.FreeSet` (with ``FRESH`` and ``NEW``), lives next to the
queue in :mod:`kvshm.offload.blocks`.

The orders (:class:`kvshm.config.Eviction`). ``python -m tools.bench_evict`` measures
each on six workloads (:mod:`tools.workloads`) at a quarter, half and three quarters of
their distinct blocks: no fixed order is best on all of them (LRU on chat and agent
sessions that come back soon, ``deepest`` when every conversation is open at once,
``s3fifo`` / ``slru`` on shared documents, templates and scans), so the default is
:class:`~kvshm.offload.evict_adaptive.Adaptive` (``adaptive``, its own module), which
simulates a few of them on a sample of the keys and follows the one that saves the
most prefill compute. The fixed orders here:

* :class:`DepthAged` (``depth_aged``, the default before ``adaptive``; on the chat
  trace of :mod:`tools.chat_trace` it kept 0.74 of the hit tokens, LRU 0.47): LRU
  where one level deeper in a prefix chain counts as ``num_blocks // 16`` blocks' worth
  of being older.
  A block's key is ``clock - K * depth`` (``clock``: +1 each time a cached block joins
  the set, ``depth``: its position in its request's block sequence); the smallest key
  goes first. Under a capacity squeeze every chain keeps its head and loses its tail (a
  hit is a prefix: a tail without its head is dead weight, and a returning chain still
  gets its head back), while a chain nobody uses ages out as under LRU. Keys are
  bucketed in slots of width ``K`` (FIFO inside a slot, so blocks freed tail-first keep
  that order); a min-heap of the occupied slot ids finds the lowest.
* ``lru`` and ``lru_refresh``: plain LRU (the pool's own
  :class:`~kvshm.offload.blocks.FreeBlockQueue`, vLLM's order); ``lru_refresh`` also
  moves a block to the MRU end when the engine's own prefix cache hits its GPU copy
  (the manager calls :meth:`~kvshm.offload.pool.BlockPool.refresh` from ``lookup``).
  On the chat trace that GPU hit is mostly the shared system prompt, which the GPU keeps
  anyway: no gain.
* ``deepest``: depth_aged with no aging (key ``-depth``, slot width 1): the deepest
  block goes first, LRU among equal depths. Measured to lose to LRU on a long stream of
  conversations: the tier fills with the heads of finished ones.
* :class:`Slru` (``slru``): admission by probation. A newly stored block joins the
  probation segment; one that was hit (pinned by a lookup or load, or refreshed) joins
  the protected segment (at most 80 % of the pool; its oldest are demoted to probation).
  Victims come from probation first, so one-off blocks cycle through probation without
  flushing shared prefixes.
* :class:`S3Fifo` (``s3fifo``): S3-FIFO (Yang et al., SOSP '23). New blocks enter a small
  FIFO (10 %); one hit while there moves on to the main FIFO, the others are evicted and
  their keys remembered in a ghost FIFO (as many keys as the pool has blocks); a block
  stored under a ghost key enters main directly. Main is a CLOCK with a 2-bit frequency.
  A pinned block has left its queue, so a hit re-enters at the tail of its segment.

Cost: every operation is O(1) (the CLOCK passes amortized), but for :class:`DepthAged`
opening a slot (a heap push, and its pop once emptied): O(log S), S the occupied slots,
at most the deepest chain plus 16 per ``num_blocks`` ticks that the free blocks' ages
span. Emptied slots leave their ids in the heap until they surface or the heap holds
twice the occupied slots, when it is rebuilt (amortized O(1)).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from kvshm.config import Eviction
from kvshm.errors import ConfigError
from kvshm.offload.blocks import FRESH, NEW, Block, FreeBlockQueue, FreeSet
from kvshm.offload.evict_adaptive import Adaptive
from kvshm.offload.ghost import GhostKeys

__all__ = ["DepthAged", "S3Fifo", "Slru", "make_free_set"]

DEPTH_AGED_DIV = 16
"""``depth_aged``: one chain level counts as ``num_blocks // DEPTH_AGED_DIV`` ticks of
age (8 / 16 / 32 measured by tools.bench_evict: 16 is within 0.03 of the best of the
three on each of four traces)."""


class DepthAged(FreeSet):
    """Smallest ``clock_weight * clock - k * depth`` first, bucketed by ``slot_width``
    (module docstring)."""

    def __init__(self, *, k: int, slot_width: int, clock_weight: int = 1) -> None:
        super().__init__()
        if k < 0 or slot_width < 1 or clock_weight < 0:
            raise ConfigError(f"bad DepthAged parameters: k={k}, slot_width={slot_width}, "
                              f"clock_weight={clock_weight}")
        self.k = k
        self.width = slot_width
        self.clock_weight = clock_weight
        self.clock = 0
        self.slots: dict[int, FreeBlockQueue] = {}
        self.heap: list[int] = []  # occupied slot ids (and some emptied ones: lazy)
        self.spare: list[FreeBlockQueue] = []  # emptied queues, reused for new slots

    def _place(self, b: Block) -> None:
        self.clock += 1
        s = (self.clock_weight * self.clock - self.k * b.depth) // self.width
        slots = self.slots
        q = slots.get(s)
        if q is None:
            q = slots[s] = self.spare.pop() if self.spare else FreeBlockQueue()
            heap = self.heap
            if len(heap) > 2 * len(slots) + 64:  # drop the ids of emptied slots
                heap[:] = slots
                heapq.heapify(heap)
            else:
                heapq.heappush(heap, s)
        b.slot = s
        q.append(b)

    def _unlink(self, b: Block) -> None:
        q = self.slots[b.slot]
        q.remove(b)
        if not q.size:
            del self.slots[b.slot]
            self.spare.append(q)

    def remove(self, b: Block) -> None:
        """The base's, without the hit count."""
        if b.slot == FRESH:
            self.fresh.remove(b)
        else:
            self._unlink(b)
        self._len -= 1

    def _victim(self) -> Block:
        slots = self.slots
        heap = self.heap
        while (q := slots.get(heap[0])) is None:
            heapq.heappop(heap)
        b = q.popleft()
        if not q.size:
            del slots[heapq.heappop(heap)]
            self.spare.append(q)
        return b

    def _queues(self) -> list[FreeBlockQueue]:
        return [self.slots[s] for s in sorted(self.slots)]

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        want = next(s for s, x in self.slots.items() if x is q)
        if not blocks:
            raise AssertionError(f"empty slot {want} kept")
        for b in blocks:
            if b.slot != want:
                raise AssertionError(f"{b!r} in slot {want} says slot {b.slot}")

    def check_links(self, limit: int) -> list[Block]:
        out = super().check_links(limit)
        missing = set(self.slots) - set(self.heap)
        if missing:
            raise AssertionError(f"occupied slots {sorted(missing)} not in the heap")
        return out


PROBATION = 0
PROTECTED = 1
SMALL = 0
MAIN = 1


class Slru(FreeSet):
    """Probation then protected (module docstring); ``protected_max`` blocks at most."""

    def __init__(self, *, protected_max: int) -> None:
        super().__init__()
        self.protected_max = protected_max
        self.seg = (FreeBlockQueue(), FreeBlockQueue())

    def _place(self, b: Block) -> None:
        if b.freq <= 0:
            b.freq = 0
            b.slot = PROBATION
            self.seg[PROBATION].append(b)
            return
        b.slot = PROTECTED
        prot = self.seg[PROTECTED]
        prot.append(b)
        if len(prot) > self.protected_max:
            d = prot.popleft()
            d.freq = 0
            d.slot = PROBATION
            self.seg[PROBATION].append(d)

    def _unlink(self, b: Block) -> None:
        self.seg[b.slot].remove(b)

    def _victim(self) -> Block:
        q = self.seg[PROBATION]
        return q.popleft() if len(q) else self.seg[PROTECTED].popleft()

    def _queues(self) -> list[FreeBlockQueue]:
        return list(self.seg)

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        _check_slots(self.seg.index(q), blocks, "segment")


class S3Fifo(FreeSet):
    """S3-FIFO over the free blocks (module docstring)."""

    def __init__(self, *, small_frac: float, ghost_max: int) -> None:
        super().__init__()
        self.small_frac = small_frac
        self.q = (FreeBlockQueue(), FreeBlockQueue())
        self.ghost = GhostKeys(ghost_max)

    def _place(self, b: Block) -> None:
        if b.freq == NEW:
            b.freq = 0
            seg = SMALL
            if b.hashes and b.hashes[0] in self.ghost:  # (a miss: no call)
                self.ghost.take(b.hashes[0])
                seg = MAIN
        else:
            seg = MAIN if b.slot == MAIN else SMALL
        b.slot = seg
        self.q[seg].append(b)

    def _unlink(self, b: Block) -> None:
        self.q[b.slot].remove(b)

    def refresh(self, b: Block) -> None:
        """A hit leaves the block where it is (S3-FIFO's rule); only its count grows."""
        if b.slot == FRESH:
            super().refresh(b)
        elif b.freq >= 0:
            b.freq = min(b.freq + 1, 3)

    def _victim(self) -> Block:
        small, main = self.q
        while True:
            if len(small) and (len(small) >= self.small_frac * (len(small) + len(main))
                               or not len(main)):
                b = small.popleft()
                if b.freq > 0:
                    b.freq = 0
                    b.slot = MAIN
                    main.append(b)
                    continue
                if b.hashes:
                    self.ghost.remember(b.hashes[0])
                return b
            b = main.popleft()
            if b.freq > 0:
                b.freq -= 1
                main.append(b)
                continue
            return b

    def _queues(self) -> list[FreeBlockQueue]:
        return list(self.q)

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        _check_slots(self.q.index(q), blocks, "queue")


def make_free_set(eviction: Eviction, blocks: Iterable[Block], num_blocks: int, *,
                  block_tokens: int = 16) -> FreeBlockQueue | FreeSet:
    """The free set of ``eviction`` holding ``blocks`` (uncached, taken in order);
    ``block_tokens`` (tokens per block) weighs the ``adaptive`` order's cost model."""
    fs: FreeSet
    if eviction is Eviction.LRU or eviction is Eviction.LRU_REFRESH:
        return FreeBlockQueue(blocks)
    if eviction is Eviction.DEPTH_AGED:
        k = max(1, num_blocks // DEPTH_AGED_DIV)
        fs = DepthAged(k=k, slot_width=k)
    elif eviction is Eviction.DEEPEST:
        fs = DepthAged(k=1, slot_width=1, clock_weight=0)
    elif eviction is Eviction.SLRU:
        fs = Slru(protected_max=max(1, num_blocks * 4 // 5))
    elif eviction is Eviction.S3FIFO:
        fs = S3Fifo(small_frac=0.1, ghost_max=num_blocks)
    elif eviction is Eviction.ADAPTIVE:
        fs = Adaptive(num_blocks, block_tokens=block_tokens)
    else:
        raise ConfigError(f"unknown eviction order {eviction!r}")
    fs.seed(blocks)
    return fs


def _check_slots(want: int, blocks: list[Block], what: str) -> None:
    """Invariant check (tests): every block of queue ``want`` says it is in ``want``."""
    for b in blocks:
        if b.slot != want:
            raise AssertionError(f"{b!r} in {what} {want} says {b.slot}")
