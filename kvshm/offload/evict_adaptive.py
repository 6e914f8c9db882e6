"""``adaptive``: a cost-aware eviction order for the CPU tier that learns, online, which
of a few fixed orders saves the most prefill compute on the traffic it sees.

No fixed order is best everywhere (``python -m tools.bench_evict``): recency (LRU) wins
on chat and agent traffic whose sessions come back soon; keeping the heads of every
chain ("deepest first") wins when many conversations are open at once and each comes
back only after the tier has turned over; a probation queue for blocks never hit
(S3-FIFO, SLRU) wins on shared documents, few-shot templates and scans of one-off
prompts. This order is one structure that can behave as each of them -- an
:class:`~kvshm.offload.evict_panel.Expert` -- and a panel of miniature simulations that
score every expert on the same requests and hand the tier to the best.

The structure. Two segments of cached blocks at ref 0: *probation* (stored, never hit)
and *main* (hit at least once, or stored again under a key probation evicted lately: a
ghost, remembered for as many keys as the pool has blocks). Within a segment a block's
key is ``clock - K * depth`` (``clock``: +1 per placement; ``depth``: its position in
its chain; ``K = depth_weight * num_blocks``: how many placements of age one chain level
is worth), lowest first, kept in slots of ``num_blocks // 16`` keys (FIFO within a slot;
a heap of the occupied slot ids finds the lowest, :class:`KeyedSegment`). The victim
comes from probation while it holds more than ``probation`` of the free set (or main is
empty), else from main; with ``probation=None`` it is the lower key of the two. The
experts (:data:`EXPERTS`):

* ``recency``: ``K = 0``, one order, GPU hits refresh: LRU (``lru_refresh``).
* ``heads``: ``K = num_blocks``, one order: the deepest block first, a chain level
  worth one turnover of the tier, so finished chains still age out (``deepest`` with
  aging).
* ``heads_probation``: ``heads`` with a 3 % probation segment (10 % until 2026-11-27:
  3 % lifts e2e-sized scans, ``tools.bench_evict --e2e --fracs 0.5``, 0.863 -> 0.880
  saved on seed 0 and 0.816 -> 0.846 on seed 2, and leaves the other rows as they were).
* ``probation``: ``K = 0`` with a 5 % probation segment and refresh (S3-FIFO-like).

Cost awareness: every simulated hit scores the compute its block saves,
:func:`kvshm.offload.evict_cost.block_cost` (prefill at its position: ``1 + p / half``
per token), so the tier follows the expert that saves the most *time*, not the most
blocks.

The panel (:class:`~kvshm.offload.evict_panel.Panel`, an object the order holds:
``Adaptive.panel``) simulates every expert on a sample of the keys, at the tier's
capacity and at 0.75 and 0.5 of it, and once a period (every ``num_blocks``
placements) gives its verdict: the expert to hand the tier to, or none (its module
states the rule, the sampling and the deferred simulation). The order feeds it what the
tier sees -- a block stored, a block pinned again, a GPU hit -- as one log entry each
on the hooks' path (:meth:`Adaptive.settle` is the panel's), and adopts the verdict: a
switch re-keys every free block under the new ``K`` from its placement clock (O(free
blocks), at most once per ``num_blocks`` placements: O(1) amortized). What the tier
itself does -- placing, refreshing, pinning, taking a block -- is never deferred, and
since every verdict equals the one of applying each event at once, so does every
eviction.

Cost: placing, pinning and taking a block are O(1) but for opening a slot (a heap push:
O(log S), S the occupied slots, amortized over the ``num_blocks // 16`` placements a
slot spans when ``K = 0``, and over a turnover per chain level when ``K > 0``); each
sampled event adds a log entry (the panel's cost: its module); a switch is O(free
blocks) once per ``num_blocks`` placements.

Invariants (:meth:`Adaptive.check_links`, called by ``BlockPool.check_invariants``):
every free cached block is in exactly one slot of one segment and its ``slot`` encodes
both (``slot_id * 2 + segment``); no empty slot is kept; every occupied slot id is in
its segment's heap; segment sizes add up; the ghost keys are at most ``num_blocks``;
and the panel's own (:meth:`~kvshm.offload.evict_panel.Panel.check`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence

from kvshm.errors import ConfigError
from kvshm.offload.blocks import FRESH, NEW, Block, FreeBlockQueue, FreeSet
from kvshm.offload.evict_cost import ATTN_HALF_TOKENS
from kvshm.offload.evict_panel import MAIN, MAX_PENDING, PROBATION, Expert, Panel
from kvshm.offload.ghost import GhostKeys

__all__ = ["EXPERTS", "Adaptive", "KeyedSegment"]

SLOTS_PER_TURNOVER = 16
"""Slot width: ``num_blocks // SLOTS_PER_TURNOVER`` keys."""


EXPERTS: tuple[Expert, ...] = (
    Expert("recency", 0.0, None, True),
    Expert("heads", 1.0, None, False),
    Expert("heads_probation", 1.0, 0.03, False),
    Expert("probation", 0.0, 0.05, True),
)
"""The experts, the first the one a new tier starts with."""


class KeyedSegment:
    """Blocks by integer key, lowest first, FIFO among the keys of one slot of ``width``
    keys. ``slots``: slot id -> its queue (never empty); ``heap``: the occupied slot
    ids and lazily some emptied ones (dropped when they surface, or all at once when the
    heap holds more than twice the slots plus 64)."""

    __slots__ = ("heap", "seg", "size", "slots", "spare", "width")

    def __init__(self, seg: int, width: int) -> None:
        self.seg = seg
        self.width = width
        self.slots: dict[int, FreeBlockQueue] = {}
        self.heap: list[int] = []
        self.spare: list[FreeBlockQueue] = []
        self.size = 0

    def add(self, b: Block, key: int) -> None:
        """Queue ``b`` under ``key`` (``b.slot`` set to ``slot_id * 2 + seg``)."""
        s = key // self.width
        q = self.slots.get(s)
        if q is None:
            q = self.slots[s] = self.spare.pop() if self.spare else FreeBlockQueue()
            heap = self.heap
            if len(heap) > 2 * len(self.slots) + 64:
                heap[:] = self.slots
                heapq.heapify(heap)
            else:
                heapq.heappush(heap, s)
        b.slot = s * 2 + self.seg
        q.append(b)
        self.size += 1

    def unlink(self, b: Block) -> None:
        s = b.slot >> 1
        q = self.slots[s]
        q.remove(b)
        self.size -= 1
        if not q.size:
            del self.slots[s]
            self.spare.append(q)

    def min_slot(self) -> int | None:
        """The lowest occupied slot id (None when empty); drops emptied ids on top."""
        heap, slots = self.heap, self.slots
        while heap and heap[0] not in slots:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def pop(self) -> Block:
        """Take the first block of the lowest slot (the segment is not empty)."""
        s = self.min_slot()
        assert s is not None, "pop from an empty segment"
        q = self.slots[s]
        b = q.popleft()
        self.size -= 1
        if not q.size:
            del self.slots[s]
            heapq.heappop(self.heap)
            self.spare.append(q)
        return b

    def drain(self) -> list[Block]:
        """Every block, slot by slot in key order, leaving the segment empty."""
        out: list[Block] = []
        for s in sorted(self.slots):
            q = self.slots[s]
            while q.size:
                out.append(q.popleft())
            self.spare.append(q)
        self.slots.clear()
        self.heap.clear()
        self.size = 0
        return out

    def queues(self) -> list[FreeBlockQueue]:
        return [self.slots[s] for s in sorted(self.slots)]

    def check(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        """Invariant check of one of :meth:`queues` (tests)."""
        sid = next(s for s, x in self.slots.items() if x is q)
        if not blocks:
            raise AssertionError(f"segment {self.seg}: empty slot {sid} kept")
        for b in blocks:
            if b.slot != sid * 2 + self.seg:
                raise AssertionError(f"{b!r} in segment {self.seg} slot {sid} says {b.slot}")

    def check_heap(self) -> None:
        missing = set(self.slots) - set(self.heap)
        if missing:
            raise AssertionError(f"segment {self.seg}: slots {sorted(missing)} not in the heap")
        if sum(q.size for q in self.slots.values()) != self.size:
            raise AssertionError(f"segment {self.seg}: size {self.size} disagrees")


class Adaptive(FreeSet):
    """The ``adaptive`` free set (module docstring)."""

    def __init__(self, num_blocks: int, *, block_tokens: int = 16,
                 half: float = ATTN_HALF_TOKENS, experts: Sequence[Expert] = EXPERTS,
                 start: int = 0, max_pending: int = MAX_PENDING) -> None:
        super().__init__()
        if num_blocks < 1 or block_tokens < 1 or half <= 0 or not experts \
                or not 0 <= start < len(experts) or max_pending < 0:
            raise ConfigError(f"bad Adaptive parameters: num_blocks={num_blocks}, "
                              f"block_tokens={block_tokens}, half={half}, "
                              f"{len(experts)} experts, start={start}, "
                              f"max_pending={max_pending}")
        self.n = num_blocks
        self.experts = tuple(experts)
        width = max(1, num_blocks // SLOTS_PER_TURNOVER)
        self.segs = (KeyedSegment(PROBATION, width), KeyedSegment(MAIN, width))
        self.placed = [0] * num_blocks
        self.clock = 0
        self.ghost = GhostKeys(num_blocks)
        self.panel = Panel(self.experts, num_blocks, block_tokens=block_tokens, half=half,
                           max_pending=max_pending)
        """The experts' simulations and their verdict (fed on the hooks' path)."""
        self.tick = 0
        self.switches = 0
        """Times the tier was handed to another expert."""
        self.cur = start
        self.k = 0
        self.probation: float | None = None
        self.refresh_on = False
        self._adopt(start)

    # ---- the expert in charge ------------------------------------------------------

    @property
    def expert(self) -> Expert:
        """The expert the tier follows now."""
        return self.experts[self.cur]

    def _adopt(self, i: int) -> None:
        e = self.experts[i]
        self.cur = i
        self.k = int(e.depth_weight * self.n)
        self.probation = e.probation
        self.refresh_on = e.refresh

    def _choose(self) -> None:
        """End of a period: the tier goes to the panel's verdict if there is one."""
        best = self.panel.verdict(self.cur)
        if best is not None:
            self._adopt(best)
            self._rekey()
            self.switches += 1

    def _rekey(self) -> None:
        """Every free block again under the current ``K`` (slot order kept within a new
        slot): O(free blocks + S log S)."""
        placed, k = self.placed, self.k
        for seg in self.segs:
            for b in seg.drain():
                seg.add(b, placed[b.block_id] - k * b.depth)

    def settle(self, limit: int = 0) -> bool:
        """The panel's deferred simulation work (:meth:`Panel.settle`)."""
        return self.panel.settle(limit)

    # ---- the free-set interface ----------------------------------------------------

    def extend(self, blocks: Iterable[Block]) -> None:
        """Place each block in order (a store frees its blocks tail first); the stored
        ones are fed to the simulations head first, before any is placed."""
        blocks = blocks if type(blocks) is list else list(blocks)
        panel, clock = self.panel, self.clock
        below = panel.sample_below
        for b in reversed(blocks):
            if b.freq == NEW and b.hashes:
                h = b.hashes[0]
                if int.from_bytes(h[:2], "big") < below:
                    panel.use(h, b.depth, clock)
        for b in blocks:
            self._place(b)
            self._len += 1

    def append(self, b: Block) -> None:
        if b.freq == NEW:
            h = self.panel.sampled(b)
            if h is not None:
                self.panel.use(h, b.depth, self.clock)
        self._place(b)
        self._len += 1

    def remove(self, b: Block) -> None:
        """``b`` is pinned (a hit): a use for the simulations; it leaves its segment
        (FreeSet.remove, inlined: a hit pins many blocks)."""
        if b.slot == FRESH:
            self.fresh.remove(b)
        else:
            hs = b.hashes
            if hs and int.from_bytes(hs[0][:2], "big") < self.panel.sample_below:
                self.panel.use(hs[0], b.depth, self.clock)
            self.segs[b.slot & 1].unlink(b)
            if b.freq >= 0:
                b.freq = min(b.freq + 1, 3)
        self._len -= 1

    def refresh(self, b: Block) -> None:
        """A GPU hit: a use for the experts that count them, and for the tier when
        the current one does."""
        if b.slot == FRESH:
            super().refresh(b)
            return
        h = self.panel.sampled(b)
        if h is not None:
            self.panel.touch(h, b.depth, self.clock)
        if self.refresh_on:
            super().refresh(b)

    def _place(self, b: Block) -> None:
        self.clock = clock = self.clock + 1
        if b.freq == NEW:
            seg = PROBATION
            b.freq = 0
            if b.hashes and b.hashes[0] in self.ghost:  # (a miss: no call)
                self.ghost.take(b.hashes[0])
                seg = MAIN
                b.freq = 1
        else:
            seg = MAIN if b.freq >= 1 else PROBATION
        self.placed[b.block_id] = clock
        self.segs[seg].add(b, clock - self.k * b.depth)
        self.tick = tick = self.tick + 1
        if tick >= self.n:
            self.tick = 0
            self._choose()

    def _unlink(self, b: Block) -> None:
        self.segs[b.slot & 1].unlink(b)

    def _victim(self) -> Block:
        prob, main = self.segs
        if self.probation is None:
            sp, sm = prob.min_slot(), main.min_slot()
            seg = prob if sm is None or (sp is not None and sp <= sm) else main
        elif prob.size and (prob.size > self.probation * (prob.size + main.size)
                            or not main.size):
            seg = prob
        else:
            seg = main if main.size else prob
        b = seg.pop()
        if seg is prob and b.hashes:
            self.ghost.remember(b.hashes[0])
        return b

    def _queues(self) -> list[FreeBlockQueue]:
        return self.segs[PROBATION].queues() + self.segs[MAIN].queues()

    def __iter__(self) -> Iterator[Block]:
        """The blocks in the order :meth:`_victim` takes them (fresh first): with no
        probation share, the two segments' slots merged by slot id (probation first on
        a tie); else the share rule played on the segments' sizes. (The base class's
        walk, all of probation then all of main, made write-back and on-evict PUTs pick
        blocks that were not next to go.) The caller may remove the block just
        yielded."""
        yield from self.fresh
        prob, main = self.segs
        if self.probation is None:
            for s, i in sorted([(s, PROBATION) for s in prob.slots]
                               + [(s, MAIN) for s in main.slots]):
                q = self.segs[i].slots.get(s)
                if q is not None:
                    yield from q
            return
        ps, ms = prob.size, main.size
        prob_blocks = (b for q in prob.queues() for b in q)
        main_blocks = (b for q in main.queues() for b in q)
        while ps or ms:
            if ps and (ps > self.probation * (ps + ms) or not ms):
                ps -= 1
                b = next(prob_blocks, None)
            else:
                ms -= 1
                b = next(main_blocks, None)
            if b is not None:
                yield b

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        seg = self.segs[PROBATION] if any(x is q for x in self.segs[PROBATION].slots.values()) \
            else self.segs[MAIN]
        seg.check(q, blocks)

    def check_links(self, limit: int) -> list[Block]:
        self.panel.check()
        out = super().check_links(limit)
        for seg in self.segs:
            seg.check_heap()
        if self.segs[0].size + self.segs[1].size + self.fresh.size != self._len:
            raise AssertionError("adaptive: segment sizes do not add up")
        if len(self.ghost) > self.n:
            raise AssertionError("adaptive: ghost over capacity")
        return out
