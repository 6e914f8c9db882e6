"""Offline limits of a CPU tier on a recorded access sequence: an unbounded tier,
Belady's MIN, and a cost-weighted Belady.

An :class:`Access` is one request as the CPU tier sees it (recorded by
``tools.bench_evict`` from the real manager): the hashes it is asked for, from chain
position ``start`` (the engine's own GPU hit ends there), and the hashes the request then
offers it. A hit is the longest run of ``lookup`` the tier holds from its first hash, as
kvshm's lookup answers; a block at chain position ``d`` saves ``cost(d)`` when it hits
(:func:`kvshm.offload.evict_cost.block_cost`: its tokens' prefill compute).

* :func:`unbounded`: a tier that never evicts (the denominator of every fraction).
* :func:`belady`: Belady's MIN by next use: on offering a block to a full tier, drop
  whichever of the held blocks and the new one is next asked for furthest in the future
  (never again: first; ties: the one offered latest, the deeper); a block never asked
  for again is not admitted. Optimal for hits when every block is asked for alone; a
  prefix cache's chains make it a heuristic limit (a held tail whose head was dropped
  counts for nothing), and it ignores cost.
* :func:`belady_cost`: the same rule with a block's worth ``cost / (next use - now)``
  (the compute it saves per request-slot of capacity it holds until then): drop the
  lowest worth, admit only above the lowest. ``now`` advances one per request, so the
  worths of the held blocks grow at different rates; a lazy heap keeps it exact (a
  held block's key is its worth when pushed, a lower bound of its worth now: the
  popped block is re-keyed and pushed back until its worth now is at most the next
  key). An exact optimum of saved compute over prefix chains is a hard problem; this is
  the greedy limit, and :func:`oracle` reports the better of the two.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvshm.hashing import BlockHash

__all__ = ["Access", "Outcome", "belady", "belady_cost", "oracle", "unbounded"]

_NEVER = 1 << 62


@dataclass(frozen=True)
class Access:
    """One request at the CPU tier (module docstring)."""

    req_id: str
    start: int
    lookup: tuple[BlockHash, ...]
    offered: tuple[BlockHash, ...]


@dataclass(frozen=True)
class Outcome:
    """Hit blocks and the compute they saved (in :func:`block_cost` units)."""

    blocks: int
    saved: float


CostOf = Callable[[int], float]
"""A block's saved compute by its chain position."""


def _hits(a: Access, held: object, cost_of: CostOf) -> tuple[int, float]:
    n = 0
    saved = 0.0
    for h in a.lookup:
        if h not in held:  # type: ignore[operator]
            break
        saved += cost_of(a.start + n)
        n += 1
    return n, saved


def unbounded(accesses: Sequence[Access], cost_of: CostOf) -> Outcome:
    """A tier that keeps every block it is offered."""
    held: set[BlockHash] = set()
    blocks, saved = 0, 0.0
    for a in accesses:
        n, s = _hits(a, held, cost_of)
        blocks += n
        saved += s
        held.update(a.offered)
    return Outcome(blocks, saved)


class _NextUse:
    """Each hash's asks, in request order; :meth:`after` the first after ``now``."""

    def __init__(self, accesses: Sequence[Access]) -> None:
        self.uses: dict[BlockHash, list[int]] = {}
        for i, a in enumerate(accesses):
            for h in a.lookup:
                self.uses.setdefault(h, []).append(i)
        self.ptr: dict[BlockHash, int] = {}

    def after(self, h: BlockHash, now: int) -> int:
        lst = self.uses.get(h)
        if not lst:
            return _NEVER
        k = self.ptr.get(h, 0)
        while k < len(lst) and lst[k] <= now:
            k += 1
        self.ptr[h] = k
        return lst[k] if k < len(lst) else _NEVER


def belady(accesses: Sequence[Access], capacity: int, cost_of: CostOf) -> Outcome:
    """Belady's MIN by next use (module docstring)."""
    nxt = _NextUse(accesses)
    held: dict[BlockHash, int] = {}  # hash -> its next use as last pushed
    heap: list[tuple[int, int, BlockHash]] = []  # (-next use, -seq, hash), lazy
    seq = 0
    blocks, saved = 0, 0.0
    for i, a in enumerate(accesses):
        n, s = _hits(a, held, cost_of)
        blocks += n
        saved += s
        for h in a.lookup:  # asked now (hit, or held past the first miss): next use
            if h in held:
                nu = nxt.after(h, i)
                held[h] = nu
                seq += 1
                heapq.heappush(heap, (-nu, -seq, h))
        for h in a.offered:
            if h in held:
                continue
            nu = nxt.after(h, i)
            if nu == _NEVER:
                continue
            if len(held) >= capacity:
                while True:
                    neg, _, victim = heap[0]
                    if held.get(victim) == -neg:
                        break
                    heapq.heappop(heap)
                if -neg <= nu:
                    continue  # the new block is the one used furthest: not admitted
                heapq.heappop(heap)
                del held[victim]
            held[h] = nu
            seq += 1
            heapq.heappush(heap, (-nu, -seq, h))
    return Outcome(blocks, saved)


def belady_cost(accesses: Sequence[Access], capacity: int, cost_of: CostOf) -> Outcome:
    """Belady weighted by cost: the lowest ``cost / (next use - now)`` goes (module
    docstring)."""
    nxt = _NextUse(accesses)
    held: dict[BlockHash, tuple[int, float, int]] = {}  # hash -> (next use, cost, seq)
    heap: list[tuple[float, int, BlockHash]] = []  # (worth when pushed, -seq, hash)
    seq = 0
    blocks, saved = 0, 0.0

    def worth(nu: int, c: float, now: int) -> float:
        return c / (nu - now) if nu != _NEVER else 0.0

    def lowest(now: int) -> tuple[float, BlockHash]:
        """The held block of least worth now (ties: the one pushed last)."""
        while True:
            key, neg_seq, h = heap[0]
            rec = held.get(h)
            if rec is None or rec[2] != -neg_seq:  # dropped, or pushed again since
                heapq.heappop(heap)
                continue
            w = worth(rec[0], rec[1], now)
            if (w, neg_seq) <= _bound(heap):  # by worth, then pushed last: the rule's order
                return w, h
            heapq.heapreplace(heap, (w, neg_seq, h))

    def push(h: BlockHash, nu: int, c: float, now: int) -> None:
        nonlocal seq
        seq += 1
        held[h] = (nu, c, seq)
        heapq.heappush(heap, (worth(nu, c, now), -seq, h))

    for i, a in enumerate(accesses):
        n, s = _hits(a, held, cost_of)
        blocks += n
        saved += s
        for k, h in enumerate(a.lookup):  # asked now: a held one's next use moves on
            if h in held:
                push(h, nxt.after(h, i), cost_of(a.start + k), i)
        for k, h in enumerate(a.offered):
            if h in held:
                continue
            nu = nxt.after(h, i)
            if nu == _NEVER:
                continue
            c = cost_of(a.start + k)
            if len(held) >= capacity:
                w, victim = lowest(i)
                if w >= worth(nu, c, i):
                    continue  # the new block is worth least: not admitted
                del held[victim]
            push(h, nu, c, i)
    return Outcome(blocks, saved)


def _bound(heap: list[tuple[float, int, BlockHash]]) -> tuple[float, int]:
    """A lower bound of every entry but the top's, as (key, -seq): the smaller of its
    children's (compared whole, so a tie in worth goes to the one pushed last, as the
    rule says; comparing keys alone returned the top on a tie with a later push)."""
    if len(heap) < 2:
        return (float("inf"), 0)
    kids = heap[1:3]
    return min((k, s) for k, s, _ in kids)


def oracle(plain: Outcome, weighted: Outcome) -> Outcome:
    """The better limit by saved compute."""
    return weighted if weighted.saved > plain.saved else plain
