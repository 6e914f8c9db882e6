"""The panel that picks ``adaptive``'s expert: one miniature simulation per expert and
capacity, fed sampled events off the hooks' path, and the decision they inform.

The simulations (:class:`Shadow`, in the spirit of miniature simulations (Waldspurger
et al., ATC '17) and SHARDS sampling). Every expert is simulated three times, at the
tier's capacity and at 0.75 and 0.5 of it, on the keys whose first two bytes fall below
a threshold (:attr:`Panel.sample_below`): a ``1 / R`` sample with ``R = max(1,
num_blocks // SHADOW_BLOCKS)``, the capacity scaled by the same rate, so each simulation
holds at most about ``SHADOW_BLOCKS`` keys. They see what the tier sees: a block stored
(a miss), a block pinned again (a hit), a GPU hit (a touch). A store's blocks are fed
head first and a simulated victim is chosen before the new key is admitted, as the tier
allocates before it stores. Every simulated hit scores the compute its block saves,
:func:`kvshm.offload.evict_cost.block_cost`, so the panel prefers the expert that saves
the most *time*, not the most blocks.

The decision (:meth:`Panel.verdict`, once a period: the tier calls it every
``num_blocks`` placements). It reads the decayed scores (x ``DECAY`` per period) of the
full-capacity simulations, then the 0.75 and the 0.5 ones, which diverge a turnover
earlier: the first whose best expert leads the current one by more than
``HYSTERESIS`` and by at least ``MIN_LEAD`` sampled hits' worth of compute is the
verdict, unless a larger simulation scores that expert below the current one (a smaller
one may settle what a larger one leans to or cannot tell yet, never overrule it).

Deferred simulation (off the hooks' path). A sampled event is not simulated when it
happens: :meth:`Panel.use` and :meth:`Panel.touch` append it to a log (``(key, depth,
clock, kind)``, one tuple, about 0.1 us) and :meth:`Panel.settle` replays the log into
every simulation, in order. The host calls ``settle`` when nothing waits on it (vLLM's
scheduler side: its service thread's pump, while the forward runs or the engine idles,
``BlockPool.settle``), a few events at a time where it holds a lock the hooks need
(``settle(limit)`` applies the oldest ``limit`` and leaves the rest first in the log);
the panel itself settles before :meth:`Panel.verdict` and :meth:`Panel.check` read a
simulation, and when the log holds more than ``max_pending`` events (memory stays
bounded where no host settles). Ordering invariant: the simulations are read only by
the verdict, the verdict only after a full settle, and a settle applies logged events
oldest first, in the order they were logged, each with the clock it was logged at (a
limited one the oldest few: the log stays in order); so every simulation sees the same
events in the same order as if each were applied at once, and every verdict -- hence
every eviction -- is the same as the immediate version's (``max_pending=0``;
``tests/unit/offload/test_evict_adaptive.py`` compares eviction sequences).

Cost: each sampled event adds a log entry on the hook's path and, at the next settle,
one step per simulation on heaps of at most ``SHADOW_BLOCKS`` keys (O(1)); a verdict
is O(experts x capacities).

Invariants (:meth:`Panel.check`): each simulation holds at most its capacity, its two
segment sizes add up to the keys it holds, and its ghost keys are at most its capacity.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvshm.hashing import BlockHash
from kvshm.offload.blocks import Block
from kvshm.offload.evict_cost import block_cost
from kvshm.offload.ghost import GhostKeys

__all__ = ["MAX_PENDING", "MIN_LEAD", "SHADOW_BLOCKS", "Expert", "Panel", "Shadow"]

PROBATION = 0
MAIN = 1
"""Segments, of the tier's free set and of each simulation."""
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
MAX_PENDING = 65536
"""Logged simulation events past which the panel settles at once (module docstring)."""
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
        self.ghost = GhostKeys(capacity)
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
            if h in self.ghost:  # (a miss: no call)
                self.ghost.take(h)
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
            self.ghost.remember(h)

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


class Panel:
    """The experts' simulations and the verdict they inform (module docstring), for a
    tier of ``num_blocks`` blocks of ``block_tokens`` tokens; ``half``: the cost
    model's position where attention doubles a token's cost."""

    def __init__(self, experts: Sequence[Expert], num_blocks: int, *, block_tokens: int,
                 half: float, max_pending: int) -> None:
        self.block_tokens = block_tokens
        self.half = half
        rate = max(1, num_blocks // SHADOW_BLOCKS)
        self.sample_below = max(1, 65536 // rate)
        """A key is simulated iff its first two bytes (big endian) are below this."""
        scale = self.sample_below / 65536
        self.tiers = [[Shadow(e, num_blocks, max(1, round(num_blocks * t * scale)))
                       for e in experts] for t in TIERS]
        self.shadows = [s for tier in self.tiers for s in tier]
        self.max_pending = max_pending
        """Log length past which an event settles at once (0: every event at once)."""
        self._pending: deque[tuple[BlockHash, int, int, int]] = deque()
        """Simulation events not applied yet: (key, depth, clock, USE or TOUCH)."""
        self.settled = 0
        """Logged events applied to the simulations so far."""
        self.decisions = 0
        """Verdicts given (periods ended)."""

    # ---- feeding the simulations ---------------------------------------------------

    def sampled(self, b: Block) -> BlockHash | None:
        """``b``'s key if it is simulated, else None."""
        if not b.hashes:
            return None
        h = b.hashes[0]
        return h if int.from_bytes(h[:2], "big") < self.sample_below else None

    def use(self, h: BlockHash, depth: int, clock: int) -> None:
        """Log a use (stored or hit) of sampled key ``h`` (applied at the next
        :meth:`settle`)."""
        pend = self._pending
        pend.append((h, depth, clock, USE))
        if len(pend) > self.max_pending:
            self.settle()

    def touch(self, h: BlockHash, depth: int, clock: int) -> None:
        """Log a GPU hit on sampled key ``h`` (a use for the experts that count them)."""
        pend = self._pending
        pend.append((h, depth, clock, TOUCH))
        if len(pend) > self.max_pending:
            self.settle()

    def settle(self, limit: int = 0) -> bool:
        """Apply the logged events to every simulation, oldest first, in the order
        logged (module docstring: the ordering invariant) -- all of them, or the oldest
        ``limit`` (> 0), the rest staying first in the log; True while some are left.
        O(events x simulations): 30-36 us an event at 12 simulations, measured in
        vLLM (``tools.bench_e2e``, rag at half capacity), which is why a host that
        holds a lock while it settles passes a ``limit`` (the vLLM side's pump)."""
        pend = self._pending
        if not pend:
            return False
        if 0 < limit < len(pend):
            batch: Iterable[tuple[BlockHash, int, int, int]] = [
                pend.popleft() for _ in range(limit)]
            n = limit
        else:  # the whole log: hand it over, no copy
            batch, n = pend, len(pend)
            self._pending = pend = deque()
        self.settled += n
        bt, half = self.block_tokens, self.half
        shadows = self.shadows
        refreshing = [s for s in shadows if s.refresh]
        for h, depth, clock, kind in batch:
            if kind == USE:
                cost = block_cost(depth, bt, half)
                for s in shadows:
                    s.use(h, depth, clock, cost)
            else:
                for s in refreshing:
                    if h in s.held:
                        s.use(h, depth, clock, 0.0)
        return bool(pend)

    @property
    def pending(self) -> int:
        """Logged events not applied yet."""
        return len(self._pending)

    # ---- the verdict ---------------------------------------------------------------

    def verdict(self, cur: int) -> int | None:
        """End of a period, the tier following expert ``cur``: the expert to hand it
        to (:meth:`challenger` over every event logged so far), or None; then every
        score decays."""
        self.settle()  # the verdict reads every event logged before it
        self.decisions += 1
        best = self.challenger([[s.score for s in tier] for tier in self.tiers], cur)
        for s in self.shadows:
            s.decay(DECAY)
        return best

    def challenger(self, tiers: list[list[float]], cur: int) -> int | None:
        """The expert to hand the tier to, or None (module docstring): tiers largest
        first; the first whose best leads expert ``cur`` past ``HYSTERESIS`` and
        ``MIN_LEAD`` wins, if no larger tier scores it below ``cur``."""
        need = MIN_LEAD * block_cost(0, self.block_tokens, self.half)
        for t, scores in enumerate(tiers):
            best = max(range(len(scores)), key=scores.__getitem__)
            mine, theirs = scores[cur], scores[best]
            if theirs > mine * (1 + HYSTERESIS) and theirs - mine >= need \
                    and all(larger[best] >= larger[cur] for larger in tiers[:t]):
                return best
        return None

    def check(self) -> None:
        """Invariant check of every simulation (settles first: tests)."""
        self.settle()
        for s in self.shadows:
            s.check()
