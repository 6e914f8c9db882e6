"""``adaptive``: a cost-aware eviction order for the CPU tier that learns, online, which
of a few fixed orders saves the most prefill compute on the traffic it sees.

No fixed order is best everywhere (``python -m tools.bench_evict``): recency (LRU) wins
on chat and agent traffic whose sessions come back soon; keeping the heads of every
chain ("deepest first") wins when many conversations are open at once and each comes
back only after the tier has turned over; a probation queue for blocks never hit
(S3-FIFO, SLRU) wins on shared documents, few-shot templates and scans of one-off
prompts. This order is one structure that can behave as each of them -- an
:class:`Expert` -- and a set of miniature simulations that score every expert on the
same requests and hand the tier to the best.

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

The simulations (:class:`Shadow`, in the spirit of miniature simulations (Waldspurger
et al., ATC '17) and SHARDS sampling). Every expert is simulated three times, at the
tier's capacity and at 0.75 and 0.5 of it, on the keys whose first two bytes fall below
a threshold: a ``1 / R`` sample with ``R = max(1, num_blocks // SHADOW_BLOCKS)``, the
capacity scaled by the same rate, so each simulation holds at most about
``SHADOW_BLOCKS`` keys. They see what the tier sees: a block stored (a miss), a block
pinned again (a hit), a GPU hit (a refresh). A store's blocks are fed head first and a
simulated victim is chosen before the new key is admitted, as the tier allocates before
it stores. Every ``num_blocks`` placements the order reads the decayed scores
(x ``DECAY`` per period) of the full-capacity simulations, then the 0.75 and the 0.5
ones, which diverge a turnover earlier: the first whose best expert leads the current
one by more than ``HYSTERESIS`` and by at least ``MIN_LEAD`` sampled hits' worth of
compute hands the tier to it, unless a larger simulation scores that expert below the
current one (a smaller one may settle what a larger one leans to or cannot tell yet,
never overrule it). A switch re-keys every free block under the new ``K`` from its
placement clock (O(free blocks), at most once per ``num_blocks`` placements: O(1)
amortized).

Deferred simulation (the simulations are off the hooks' path). A sampled event is not
simulated when it happens: it is appended to a log (``(key, depth, clock, kind)``, one
tuple, about 0.1 us) and :meth:`Adaptive.settle` replays the log into every simulation,
in order. The host calls ``settle`` when nothing waits on it (vLLM's scheduler side:
its service thread's pump, while the forward runs or the engine idles,
``BlockPool.settle``); the order itself settles before anything reads a simulation --
before each decision (:meth:`Adaptive._choose`), before :meth:`Adaptive.check_links`
-- and when the log holds more than ``max_pending`` events (memory stays bounded where
no host settles). Ordering invariant: the simulations are read only by the decision,
the decision only after a settle, and a settle applies every logged event in the order
they were logged, each with the clock it was logged at; so every simulation sees the
same events in the same order as if each were applied at once, and every decision --
hence every eviction -- is the same as the immediate version's (``max_pending=0``;
``tests/unit/offload/test_evict_adaptive.py`` compares eviction sequences). What the
tier itself does -- placing, refreshing, pinning, taking a block -- is never deferred.

Cost: placing, pinning and taking a block are O(1) but for opening a slot (a heap push:
O(log S), S the occupied slots, amortized over the ``num_blocks // 16`` placements a
slot spans when ``K = 0``, and over a turnover per chain level when ``K > 0``); each
sampled event adds a log entry on the hook's path and, at the next settle, twelve
simulation steps on heaps of at most ``SHADOW_BLOCKS`` keys (O(1)); a decision is
O(experts) and a switch O(free blocks) once per ``num_blocks`` placements.

Invariants (:meth:`Adaptive.check_links`, called by ``BlockPool.check_invariants``):
every free cached block is in exactly one slot of one segment and its ``slot`` encodes
both (``slot_id * 2 + segment``); no empty slot is kept; every occupied slot id is in
its segment's heap; segment sizes add up; each simulation holds at most its capacity,
its two segment sizes add up to the keys it holds, and its ghost keys are at most its
capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.offload.blocks import FRESH, NEW, Block, FreeBlockQueue, FreeSet
from kvshm.offload.evict_cost import ATTN_HALF_TOKENS, block_cost

__all__ = ["EXPERTS", "Adaptive", "Expert", "KeyedSegment", "Shadow"]

PROBATION = 0
MAIN = 1
SHADOW_BLOCKS = 256
"""Keys a full-capacity simulation holds at most (the sample rate follows)."""
TIERS = (1.0, 0.75, 0.5)
"""Capacities simulated, as fractions of the tier's: the first with a spread decides."""
DECAY = 0.9
"""Scores are multiplied by this every period (a memory of about ten turnovers)."""
HYSTERESIS = 0.05
"""A challenger must save this much more (relative) than the current expert."""
MIN_LEAD = 8
"""... and at least this many sampled hits of a chain's first block more (a handful of
sampled hits is noise: on agentic traffic a lead of 3 sent the tier to ``heads``)."""
SLOTS_PER_TURNOVER = 16
"""Slot width: ``num_blocks // SLOTS_PER_TURNOVER`` keys."""
MAX_PENDING = 65536
"""Logged simulation events past which the order settles at once (module docstring)."""
USE = 0
TOUCH = 1
"""Kinds of logged events: a use (stored or hit: scores), a GPU hit (a touch)."""


@dataclass(frozen=True)
class Expert:
    """One fixed order the structure can run (module docstring)."""

    name: str
    depth_weight: float
    """``K / num_blocks``: a chain level is worth this many turnovers of age."""
    probation: float | None
    """Victims from probation while it holds more than this share; None: one order."""
    refresh: bool
    """GPU hits (``refresh``) count as uses."""


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


class Shadow:
    """A miniature simulation of one expert on sampled keys (module docstring): what
    the expert would hold with ``capacity`` keys, and ``score``, the compute its hits
    would have saved (decayed by :meth:`decay`). Keys are held in two segments like the
    tier's, by exact key (``clock - K * depth``; ties: the deeper first) in lazy heaps:
    ``held`` maps a key to its tag ``seq * 2 + segment``, and a heap entry is live
    while its tag is the key's."""

    __slots__ = ("capacity", "ghost", "heaps", "held", "k", "probation", "refresh",
                 "score", "seq", "sizes")

    def __init__(self, expert: Expert, num_blocks: int, capacity: int) -> None:
        self.k = int(expert.depth_weight * num_blocks)
        self.probation = expert.probation
        self.refresh = expert.refresh
        self.capacity = max(1, capacity)
        self.held: dict[BlockHash, int] = {}  # key -> tag
        self.heaps: tuple[list[tuple[int, int, int, BlockHash]], ...] = ([], [])
        self.sizes = [0, 0]
        self.ghost: dict[BlockHash, None] = {}
        self.seq = 0
        self.score = 0.0

    def use(self, h: BlockHash, depth: int, clock: int, cost: float) -> None:
        """``h`` was asked for (stored after a miss, or hit): a simulated hit scores
        ``cost`` and moves to main; a miss is admitted (a ghost to main), evicting
        first when full."""
        held = self.held
        tag = held.get(h)
        if tag is not None:
            self.score += cost
            self.sizes[tag & 1] -= 1
            seg = MAIN
        else:
            seg = PROBATION
            if h in self.ghost:
                del self.ghost[h]
                seg = MAIN
            if len(held) >= self.capacity:
                self._evict()
        self.seq = seq = self.seq + 1
        held[h] = tag = seq * 2 + seg
        heap = self.heaps[seg]
        heapq.heappush(heap, (clock - self.k * depth, -depth, tag, h))
        n = self.sizes[seg] = self.sizes[seg] + 1
        if len(heap) > 2 * n + 64:
            self._compact(seg)

    def touch(self, h: BlockHash, depth: int, clock: int) -> None:
        """A GPU hit on ``h``: a use for an expert that counts them, no score."""
        if self.refresh and h in self.held:
            self.use(h, depth, clock, 0.0)

    def decay(self, factor: float) -> None:
        self.score *= factor

    def _compact(self, seg: int) -> None:
        held = self.held
        heap = self.heaps[seg]
        heap[:] = [e for e in heap if held.get(e[3]) == e[2]]
        heapq.heapify(heap)

    def _top(self, seg: int) -> int | None:
        heap = self.heaps[seg]
        held = self.held
        while heap:
            e = heap[0]
            if held.get(e[3]) == e[2]:
                return e[0]
            heapq.heappop(heap)
        return None

    def _evict(self) -> None:
        n_p, n_m = self.sizes
        if self.probation is None:
            kp, km = self._top(PROBATION), self._top(MAIN)
            seg = PROBATION if km is None or (kp is not None and kp <= km) else MAIN
        else:
            seg = PROBATION if n_p > self.probation * (n_p + n_m) or not n_m else MAIN
            self._top(seg)
        h = heapq.heappop(self.heaps[seg])[3]
        del self.held[h]
        self.sizes[seg] -= 1
        if seg == PROBATION:
            ghost = self.ghost
            ghost[h] = None
            if len(ghost) > self.capacity:
                del ghost[next(iter(ghost))]

    def check(self) -> None:
        """Invariant check (tests)."""
        if len(self.held) > self.capacity:
            raise AssertionError(f"shadow holds {len(self.held)} > {self.capacity}")
        if sum(self.sizes) != len(self.held) or min(self.sizes) < 0:
            raise AssertionError(f"shadow sizes {self.sizes} vs {len(self.held)} held")
        if [sum(t & 1 == s for t in self.held.values()) for s in (0, 1)] != self.sizes:
            raise AssertionError(f"shadow sizes {self.sizes} disagree with the tags")
        if len(self.ghost) > self.capacity:
            raise AssertionError("shadow ghost over capacity")


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
        self.block_tokens = block_tokens
        self.half = half
        width = max(1, num_blocks // SLOTS_PER_TURNOVER)
        self.segs = (KeyedSegment(PROBATION, width), KeyedSegment(MAIN, width))
        self.placed = [0] * num_blocks
        self.clock = 0
        self.ghost: dict[BlockHash, None] = {}
        rate = max(1, num_blocks // SHADOW_BLOCKS)
        self.sample_below = max(1, 65536 // rate)
        """A key is simulated iff its first two bytes (big endian) are below this."""
        scale = self.sample_below / 65536
        self.tiers = [[Shadow(e, num_blocks, max(1, round(num_blocks * t * scale)))
                       for e in self.experts] for t in TIERS]
        self.shadows = [s for tier in self.tiers for s in tier]
        self.max_pending = max_pending
        """Log length past which an event settles at once (0: every event at once)."""
        self._pending: list[tuple[BlockHash, int, int, int]] = []
        """Simulation events not applied yet: (key, depth, clock, USE or TOUCH)."""
        self.settled = 0
        """Logged events applied to the simulations so far."""
        self.tick = 0
        self.switches = 0
        """Times the tier was handed to another expert."""
        self.decisions = 0
        """Periods ended (a comparison each)."""
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
        """End of a period: the tier goes to :meth:`_challenger` if there is one;
        every score decays."""
        self.settle()  # the decision reads every event logged before it
        self.decisions += 1
        best = self._challenger([[s.score for s in tier] for tier in self.tiers])
        if best is not None:
            self._adopt(best)
            self._rekey()
            self.switches += 1
        for s in self.shadows:
            s.decay(DECAY)

    def _challenger(self, tiers: list[list[float]]) -> int | None:
        """The expert to hand the tier to, or None (module docstring): tiers largest
        first; the first whose best leads the current expert past ``HYSTERESIS`` and
        ``MIN_LEAD`` wins, if no larger tier scores it below the current one."""
        cur = self.cur
        need = MIN_LEAD * block_cost(0, self.block_tokens, self.half)
        for t, scores in enumerate(tiers):
            best = max(range(len(scores)), key=scores.__getitem__)
            mine, theirs = scores[cur], scores[best]
            if theirs > mine * (1 + HYSTERESIS) and theirs - mine >= need \
                    and all(larger[best] >= larger[cur] for larger in tiers[:t]):
                return best
        return None

    def _rekey(self) -> None:
        """Every free block again under the current ``K`` (slot order kept within a new
        slot): O(free blocks + S log S)."""
        placed, k = self.placed, self.k
        for seg in self.segs:
            for b in seg.drain():
                seg.add(b, placed[b.block_id] - k * b.depth)

    # ---- feeding the simulations ---------------------------------------------------

    def _sampled(self, b: Block) -> BlockHash | None:
        if not b.hashes:
            return None
        h = b.hashes[0]
        return h if int.from_bytes(h[:2], "big") < self.sample_below else None

    def _use(self, h: BlockHash, depth: int) -> None:
        """Log a use of sampled key ``h`` (applied at the next :meth:`settle`)."""
        pend = self._pending
        pend.append((h, depth, self.clock, USE))
        if len(pend) > self.max_pending:
            self.settle()

    def settle(self) -> None:
        """Apply every logged event to every simulation, in the order logged (module
        docstring: the ordering invariant). O(events x simulations)."""
        pend = self._pending
        if not pend:
            return
        self._pending = []
        self.settled += len(pend)
        bt, half = self.block_tokens, self.half
        shadows = self.shadows
        refreshing = [s for s in shadows if s.refresh]
        for h, depth, clock, kind in pend:
            if kind == USE:
                cost = block_cost(depth, bt, half)
                for s in shadows:
                    s.use(h, depth, clock, cost)
            else:
                for s in refreshing:
                    if h in s.held:
                        s.use(h, depth, clock, 0.0)

    @property
    def pending(self) -> int:
        """Logged events not applied yet."""
        return len(self._pending)

    # ---- the free-set interface ----------------------------------------------------

    def extend(self, blocks: Iterable[Block]) -> None:
        """Place each block in order (a store frees its blocks tail first); the stored
        ones are fed to the simulations head first, before any is placed."""
        blocks = blocks if type(blocks) is list else list(blocks)
        below = self.sample_below
        for b in reversed(blocks):
            if b.freq == NEW and b.hashes:
                h = b.hashes[0]
                if int.from_bytes(h[:2], "big") < below:
                    self._use(h, b.depth)
        for b in blocks:
            self._place(b)
            self._len += 1

    def append(self, b: Block) -> None:
        if b.freq == NEW:
            h = self._sampled(b)
            if h is not None:
                self._use(h, b.depth)
        self._place(b)
        self._len += 1

    def remove(self, b: Block) -> None:
        """``b`` is pinned (a hit): a use for the simulations; it leaves its segment
        (FreeSet.remove, inlined: a hit pins many blocks)."""
        if b.slot == FRESH:
            self.fresh.remove(b)
        else:
            hs = b.hashes
            if hs and int.from_bytes(hs[0][:2], "big") < self.sample_below:
                self._use(hs[0], b.depth)
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
        h = self._sampled(b)
        if h is not None:
            pend = self._pending
            pend.append((h, b.depth, self.clock, TOUCH))
            if len(pend) > self.max_pending:
                self.settle()
        if self.refresh_on:
            super().refresh(b)

    def _place(self, b: Block) -> None:
        self.clock = clock = self.clock + 1
        if b.freq == NEW:
            seg = PROBATION
            b.freq = 0
            if b.hashes:
                ghost = self.ghost
                h = b.hashes[0]
                if h in ghost:
                    del ghost[h]
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
            ghost = self.ghost
            ghost[b.hashes[0]] = None
            if len(ghost) > self.n:
                del ghost[next(iter(ghost))]
        return b

    def _queues(self) -> list[FreeBlockQueue]:
        return self.segs[PROBATION].queues() + self.segs[MAIN].queues()

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        seg = self.segs[PROBATION] if any(x is q for x in self.segs[PROBATION].slots.values()) \
            else self.segs[MAIN]
        seg.check(q, blocks)

    def check_links(self, limit: int) -> list[Block]:
        self.settle()
        out = super().check_links(limit)
        for seg in self.segs:
            seg.check_heap()
        if self.segs[0].size + self.segs[1].size + self.fresh.size != self._len:
            raise AssertionError("adaptive: segment sizes do not add up")
        if len(self.ghost) > self.n:
            raise AssertionError("adaptive: ghost over capacity")
        for s in self.shadows:
            s.check()
        return out
