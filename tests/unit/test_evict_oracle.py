"""tools/evict_oracle.py: the offline limits on hand-made access sequences (a hit is a
prefix; Belady keeps the block asked for sooner; the cost-weighted limit keeps the one
that saves more per slot-time), and the cost-weighted limit's lazy heap against a
direct implementation of its rule on random sequences."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tools.evict_oracle import Access, Outcome, belady, belady_cost, oracle, unbounded


def _cost(d: int) -> float:
    return 1.0 + d


def _acc(start: int, lookup: str, offered: str) -> Access:
    return Access("r", start, tuple(c.encode() for c in lookup),
                  tuple(c.encode() for c in offered))


def test_a_hit_is_the_held_prefix_of_what_is_asked() -> None:
    acc = [_acc(0, "", "AB"), _acc(0, "AXB", "AXB")]
    assert unbounded(acc, _cost) == Outcome(1, 1.0)  # X was never stored: B cannot hit


def test_belady_keeps_the_block_asked_for_sooner() -> None:
    acc = [_acc(0, "", "A"), _acc(0, "", "B"), _acc(0, "A", "A"), _acc(0, "B", "B")]
    assert unbounded(acc, _cost) == Outcome(2, 2.0)
    assert belady(acc, 1, _cost) == Outcome(1, 1.0)  # B is not admitted


def test_the_cost_weighted_limit_keeps_the_block_that_saves_more_per_slot_time() -> None:
    """A (position 0, cost 1) is asked for at request 2, B (position 9, cost 10) at 3:
    by next use Belady keeps A; by worth (1 / 1 against 10 / 2) the weighted limit keeps
    B, and the oracle reports it."""
    acc = [_acc(0, "", "A"), _acc(9, "", "B"), _acc(0, "A", "A"), _acc(9, "B", "B")]
    plain, weighted = belady(acc, 1, _cost), belady_cost(acc, 1, _cost)
    assert plain == Outcome(1, 1.0) and weighted == Outcome(1, 10.0)
    assert oracle(plain, weighted) is weighted


def _direct(accesses: list[Access], capacity: int) -> Outcome:
    """belady_cost's rule by scanning every held block at each eviction."""
    uses: dict[bytes, list[int]] = {}
    for i, a in enumerate(accesses):
        for h in a.lookup:
            uses.setdefault(h, []).append(i)

    def nxt(h: bytes, now: int) -> int | None:
        return next((u for u in uses.get(h, []) if u > now), None)

    def worth(h: bytes, c: float, now: int) -> float:
        u = nxt(h, now)
        return 0.0 if u is None else c / (u - now)

    held: dict[bytes, tuple[float, int]] = {}  # hash -> (cost, push order)
    order = blocks = 0
    saved = 0.0
    for i, a in enumerate(accesses):
        n = 0
        for h in a.lookup:
            if h not in held:
                break
            saved += _cost(a.start + n)
            n += 1
        blocks += n
        for k, h in enumerate(a.lookup):
            if h in held:
                order += 1
                held[h] = (_cost(a.start + k), order)
        for k, h in enumerate(a.offered):
            if h in held or nxt(h, i) is None:
                continue
            c = _cost(a.start + k)
            if len(held) >= capacity:
                victim = min(held, key=lambda x: (worth(x, held[x][0], i), -held[x][1]))
                if worth(victim, held[victim][0], i) >= worth(h, c, i):
                    continue
                del held[victim]
            order += 1
            held[h] = (c, order)
    return Outcome(blocks, saved)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10**6), capacity=st.integers(1, 6))
def test_the_lazy_heap_matches_the_rule_applied_directly(seed: int, capacity: int) -> None:
    rng = random.Random(seed)
    acc = []
    for _ in range(rng.randint(1, 25)):
        start = rng.randint(0, 4)
        chain = "".join(rng.choice("ABCDEFGH") for _ in range(rng.randint(0, 4)))
        acc.append(_acc(start, chain[:rng.randint(0, len(chain))], chain))
    got, want = belady_cost(acc, capacity, _cost), _direct(acc, capacity)
    assert got.blocks == want.blocks and abs(got.saved - want.saved) < 1e-9
