"""tools/oracle_pool: the benchmark-only Belady order on a real BlockPool (furthest next
use first, never-used first of all, deeper first among equals, keys recomputed once
the clock passes a use that did not hit) and its clock."""

from __future__ import annotations

from kvshm.offload.pool import BlockPool
from tools.oracle_pool import NEVER, NextUse, oracle_pool


def h(i: int) -> bytes:
    return i.to_bytes(8, "little")


def stored(clock: NextUse, keys: dict[int, int], num_blocks: int = 4) -> BlockPool:
    """A pool whose blocks 0.. hold hashes ``keys`` (block -> hash) at ref 0, stored in
    block order, depth = block id."""
    pool: BlockPool = oracle_pool(clock)(num_blocks)
    ids = pool.allocate(len(keys))
    pool.add_keys(ids, [h(keys[i]) for i in ids], ids)
    pool.free(ids)
    pool.check_invariants()
    return pool


def evicted(pool: BlockPool, n: int = 1) -> list[int]:
    """Which cached blocks ``allocate`` takes (their ids), the uncached ones first."""
    ids = pool.allocate(n)
    pool.check_invariants()
    return ids


def test_next_use_is_the_first_use_after_the_clock() -> None:
    clock = NextUse.from_asks({3: [h(1), h(2)], 7: [h(1)], 0: [h(2)]})
    assert clock.uses == {h(1): [3, 7], h(2): [0, 3]}
    assert clock.after([h(1)]) == 3
    assert clock.after([h(1), h(2)]) == 0
    clock.now = 3
    assert clock.after([h(1)]) == 7 and clock.after([h(2)]) == NEVER
    assert clock.after([h(9)]) == NEVER


def test_furthest_next_use_goes_first_and_never_used_before_all() -> None:
    clock = NextUse({h(10): [5], h(11): [2], h(12): [9]})
    pool = stored(clock, {0: 10, 1: 11, 2: 12, 3: 13}, num_blocks=4)
    assert evicted(pool) == [3]  # hash 13: never asked for
    assert evicted(pool) == [2]  # next use 9
    assert evicted(pool) == [0]  # 5
    assert evicted(pool) == [1]  # 2


def test_equal_next_uses_lose_the_deepest_block_first() -> None:
    clock = NextUse({h(10): [4], h(11): [4], h(12): [4]})
    pool = stored(clock, {0: 10, 1: 11, 2: 12}, num_blocks=3)
    assert evicted(pool, 3) == [2, 1, 0]


def test_a_use_that_passed_without_a_hit_is_recomputed() -> None:
    """Hash 10 is asked for at 1 (the lookup stopped before it) and again at 10; hash
    11 at 5. Before 1, hash 10's block is kept over 11's; once the clock passes 1 it
    is the one used furthest away."""
    clock = NextUse({h(10): [1, 10], h(11): [5]})
    before = stored(clock, {0: 10, 1: 11}, num_blocks=2)
    assert evicted(before) == [1]
    clock2 = NextUse({h(10): [1, 10], h(11): [5]})
    after = stored(clock2, {0: 10, 1: 11}, num_blocks=2)
    clock2.now = 1
    assert evicted(after) == [0]


def test_a_hit_block_is_placed_again_by_its_next_use() -> None:
    """A lookup pins the block (it leaves the set); freed after the clock moved, its
    key is its use after that."""
    clock = NextUse({h(10): [1, 8], h(11): [5]})
    pool = stored(clock, {0: 10, 1: 11}, num_blocks=2)
    clock.now = 0
    pool.touch([0])  # request 1's hit
    clock.now = 1
    pool.free([0])
    pool.check_invariants()
    assert evicted(pool) == [0]  # next use 8 now, after 11's 5
