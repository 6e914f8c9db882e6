"""BlockPool: allocation and eviction order, ref counts, the hash index, events, errors,
plus a stateful property test against a plain-list reference model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvshm.errors import ConfigError, PoolExhausted, StateError
from kvshm.offload.blocks import Block, BlockRemoved, BlockStored, FreeBlockQueue
from kvshm.offload.pool import BlockPool

H = [bytes([i]) * 16 for i in range(16)]


def free_order(pool: BlockPool) -> list[int]:
    return list(pool.iter_free_from_lru())


# ---- FreeBlockQueue ------------------------------------------------------------------


def test_queue_append_appendleft_remove_popleft() -> None:
    bs = [Block(i) for i in range(5)]
    q = FreeBlockQueue(bs[:3])
    assert [b.block_id for b in q] == [0, 1, 2]
    q.appendleft(bs[3])
    q.append(bs[4])
    assert [b.block_id for b in q] == [3, 0, 1, 2, 4]
    q.remove(bs[1])
    assert not bs[1].queued and len(q) == 4
    assert q.popleft() is bs[3]
    assert [b.block_id for b in q] == [0, 2, 4]
    assert [b.block_id for b in q.check_links(10)] == [0, 2, 4]
    with pytest.raises(StateError):
        q.remove(bs[1])
    with pytest.raises(StateError):
        q.append(bs[0])
    for _ in range(3):
        q.popleft()
    with pytest.raises(StateError):
        q.popleft()
    assert len(q) == 0 and q.check_links(0) == []


def test_queue_iteration_survives_removing_the_yielded_block_only() -> None:
    bs = [Block(i) for i in range(4)]
    q = FreeBlockQueue(bs)
    seen: list[int] = []
    for b in q:
        seen.append(b.block_id)
        if b.block_id % 2 == 0:
            q.remove(b)
    assert seen == [0, 1, 2, 3]
    assert [b.block_id for b in q] == [1, 3]
    with pytest.raises(StateError):
        for b in q:
            q.remove(b)
            q.remove(bs[3])


def test_check_links_detects_corruption() -> None:
    bs = [Block(i) for i in range(3)]
    q = FreeBlockQueue(bs)
    bs[1].prev = bs[2]
    with pytest.raises(AssertionError, match="prev"):
        q.check_links(10)


# ---- allocation and free order -------------------------------------------------------


def test_construction_and_sizes() -> None:
    p = BlockPool(4)
    assert (p.num_blocks, p.num_free, p.num_pinned) == (4, 4, 0)
    assert free_order(p) == [0, 1, 2, 3]
    p.check_invariants()
    for bad in (0, -3):
        with pytest.raises(ConfigError):
            BlockPool(bad)


def test_allocate_pops_lru_end_all_or_nothing() -> None:
    p = BlockPool(4)
    assert p.allocate(0) == []
    assert p.allocate(3) == [0, 1, 2]
    assert [p.ref_cnt(i) for i in range(4)] == [1, 1, 1, 0]
    assert (p.num_free, p.num_pinned) == (1, 3)
    with pytest.raises(PoolExhausted) as ei:
        p.allocate(2)
    assert (ei.value.wanted, ei.value.available) == (2, 1)
    assert p.exhausted == 1
    assert p.num_free == 1 and free_order(p) == [3]  # nothing changed
    with pytest.raises(ConfigError):
        p.allocate(-1)
    p.check_invariants()


def test_uncached_free_goes_to_lru_end_and_is_reused_first() -> None:
    p = BlockPool(4)
    p.allocate(2)  # 0, 1
    p.free([1])
    assert free_order(p) == [1, 2, 3]
    assert p.allocate(1) == [1]
    p.check_invariants()


def test_cached_free_goes_to_mru_end_and_is_evicted_last() -> None:
    p = BlockPool(4)
    p.allocate(4)
    p.add_hashes(0, [H[0]])
    p.free([0])
    p.free([2, 3])  # uncached: in front of the cached block
    assert free_order(p) == [2, 3, 0]
    assert p.allocate(2) == [2, 3]
    assert p.is_cached(H[0])
    assert p.allocate(1) == [0]  # evicted now
    assert not p.is_cached(H[0]) and p.block_hashes(0) == () and p.evictions == 1
    p.check_invariants()


def test_evict_first_puts_a_cached_block_at_the_lru_end() -> None:
    p = BlockPool(6)
    p.allocate(6)
    p.add_hashes(0, [H[0]])
    p.add_hashes(1, [H[1]])
    p.free([0])
    p.free([4, 5])
    p.free([1], evict_first=True)
    assert free_order(p) == [1, 4, 5, 0]
    assert p.get_cached(H[1]) == 1  # still cached until taken
    assert p.allocate(1) == [1]
    assert not p.is_cached(H[1]) and p.is_cached(H[0])
    p.check_invariants()


def test_within_one_free_earlier_ids_are_taken_first_at_both_ends() -> None:
    p = BlockPool(8)
    p.allocate(8)
    for i in range(4):
        p.add_hashes(i, [H[i]])
    # a cached prefix 0,1,2,3 freed tail-first: tail evicted before head
    p.free([3, 2, 1, 0])
    assert free_order(p) == [3, 2, 1, 0]
    # uncached blocks freed in one call keep their order at the LRU end
    p.free([6, 4, 5])
    assert free_order(p) == [6, 4, 5, 3, 2, 1, 0]
    assert p.allocate(5) == [6, 4, 5, 3, 2]
    assert p.is_cached(H[1]) and p.is_cached(H[0]) and not p.is_cached(H[3])
    p.check_invariants()


def test_evict_first_within_one_call_keeps_tail_before_head() -> None:
    p = BlockPool(8)
    p.allocate(8)
    for i in range(3):
        p.add_hashes(i, [H[i]])
    p.free([7])
    p.free([2, 1, 0], evict_first=True)
    assert free_order(p) == [2, 1, 0, 7]
    p.check_invariants()


def test_free_to_nonzero_does_not_queue_even_with_evict_first() -> None:
    p = BlockPool(4)
    p.allocate(1)
    p.touch([0])
    p.free([0], evict_first=True)
    assert p.ref_cnt(0) == 1 and free_order(p) == [1, 2, 3]
    p.free([0])
    assert free_order(p) == [0, 1, 2, 3]
    p.check_invariants()


def test_touch_pins_a_free_cached_block_and_keeps_it_cached() -> None:
    p = BlockPool(4)
    p.allocate(2)
    p.add_hashes(1, [H[1]])
    p.free([0, 1])
    assert free_order(p) == [0, 2, 3, 1]
    p.touch([1])
    assert p.ref_cnt(1) == 1 and p.get_cached(H[1]) == 1 and free_order(p) == [0, 2, 3]
    assert p.num_free == 3 and p.num_pinned == 1
    p.touch([1, 1])
    assert p.ref_cnt(1) == 3
    p.free([1, 1, 1])
    assert free_order(p) == [0, 2, 3, 1]
    p.check_invariants()


def test_touch_and_free_repeats_count_and_errors_change_nothing() -> None:
    p = BlockPool(4)
    p.allocate(2)  # refs 1, 1
    with pytest.raises(ConfigError):
        p.free([0, 0])  # second would take it below 0
    with pytest.raises(ConfigError):
        p.free([0, 2])  # 2 is at ref 0
    with pytest.raises(ConfigError):
        p.free([0, 9])  # unknown
    with pytest.raises(ConfigError):
        p.free([-1])
    with pytest.raises(ConfigError):
        p.touch([1, 4])
    assert [p.ref_cnt(i) for i in range(4)] == [1, 1, 0, 0]
    assert free_order(p) == [2, 3]
    for call in (p.ref_cnt, p.block_hashes, p.remove_hashes):
        with pytest.raises(ConfigError):
            call(4)
    with pytest.raises(ConfigError):
        p.add_hashes(4, [H[0]])
    p.check_invariants()


# ---- hash index ----------------------------------------------------------------------


def test_multi_hash_block_and_shared_hash() -> None:
    p = BlockPool(4)
    p.allocate(3)
    p.add_hashes(0, [H[0], H[1]])
    p.add_hashes(0, [H[1], H[2]])  # H[1] already there: skipped
    assert p.block_hashes(0) == (H[0], H[1], H[2])
    p.add_hashes(2, [H[1]])
    p.add_hashes(1, [H[1]])
    assert p.get_cached(H[1]) == 0  # earliest registered still present
    p.remove_hashes(0)
    assert p.block_hashes(0) == () and not p.is_cached(H[0]) and not p.is_cached(H[2])
    assert p.get_cached(H[1]) == 2
    p.remove_hashes(2)
    assert p.get_cached(H[1]) == 1
    p.remove_hashes(1)
    assert p.get_cached(H[1]) is None and not p.is_cached(H[1])
    assert p.get_cached(b"nope") is None
    p.check_invariants()


def test_eviction_of_one_sharer_keeps_the_other() -> None:
    p = BlockPool(4)
    p.allocate(2)
    p.add_hashes(0, [H[5]])
    p.add_hashes(1, [H[5], H[6]])
    p.free([0, 1])
    p.allocate(2)  # 2, 3 (uncached first)
    assert p.allocate(1) == [0]
    assert p.get_cached(H[5]) == 1 and p.block_hashes(1) == (H[5], H[6])
    p.check_invariants()


def test_add_hashes_rejects_non_bytes() -> None:
    p = BlockPool(4)
    with pytest.raises(ConfigError):
        p.add_hashes(0, ["str-hash"])  # type: ignore[list-item]
    assert p.block_hashes(0) == ()
    p.check_invariants()


def test_drop_all_hashes_makes_everything_uncached() -> None:
    p = BlockPool(6, enable_events=True)
    p.allocate(4)
    p.add_hashes(0, [H[0], H[1]])
    p.add_hashes(1, [H[1]])
    p.add_hashes(3, [H[3]])
    p.free([0, 1])
    p.take_events()
    p.drop_all_hashes()
    assert all(p.block_hashes(i) == () for i in range(6))
    assert not any(p.is_cached(h) for h in H)
    ev = p.take_events()
    assert sorted((e.block_id, e.hashes) for e in ev) == [
        (0, (H[0], H[1])), (1, (H[1],)), (3, (H[3],))]
    assert all(isinstance(e, BlockRemoved) for e in ev)
    assert p.ref_cnt(3) == 1  # pins survive a reset
    # freed blocks are now plain uncached blocks: reused before nothing is evicted
    p.free([3])
    assert free_order(p) == [3, 4, 5, 0, 1]
    assert p.allocate(5) == [3, 4, 5, 0, 1] and p.evictions == 0
    p.check_invariants()


# ---- events --------------------------------------------------------------------------


def test_events_for_store_evict_and_remove() -> None:
    p = BlockPool(2, enable_events=True)
    p.allocate(2)
    p.add_hashes(0, [H[0], H[1]])
    p.add_hashes(0, [H[1], H[2]])
    p.add_hashes(1, [H[3]])
    p.add_hashes(1, [])  # nothing new: no event
    p.free([0])
    p.allocate(1)  # evicts block 0
    p.remove_hashes(1)
    p.remove_hashes(1)  # nothing left: no event
    assert p.take_events() == [
        BlockStored(0, (H[0], H[1])),
        BlockStored(0, (H[2],)),
        BlockStored(1, (H[3],)),
        BlockRemoved(0, (H[0], H[1], H[2])),
        BlockRemoved(1, (H[3],)),
    ]
    assert p.take_events() == []


def test_no_events_collected_when_disabled() -> None:
    p = BlockPool(2)
    p.allocate(1)
    p.add_hashes(0, [H[0]])
    p.remove_hashes(0)
    assert p.take_events() == []


# ---- iteration and invariants ---------------------------------------------------------


def test_iter_free_from_lru_allows_touching_the_yielded_block() -> None:
    p = BlockPool(6)
    p.allocate(6)
    for i in range(6):
        p.add_hashes(i, [H[i]])
    p.free([4, 2, 0, 1])
    picked: list[int] = []
    for bid in p.iter_free_from_lru():
        if len(picked) == 2:
            break
        p.touch([bid])
        picked.append(bid)
    assert picked == [4, 2] and free_order(p) == [0, 1]
    p.check_invariants()


def test_check_invariants_names_the_broken_rule() -> None:
    p = BlockPool(4)
    p.allocate(1)
    p._blocks[0].ref_cnt = 0  # pinned-looking block with ref 0, not queued
    with pytest.raises(AssertionError, match="not in the free queue"):
        p.check_invariants()
    q = BlockPool(4)
    q.allocate(1)
    q._blocks[0].hashes = (H[0],)  # hash not in the index
    with pytest.raises(AssertionError, match="index"):
        q.check_invariants()
    r = BlockPool(4)
    r.index.entries[H[1]] = {2: None}  # index entry the block does not carry
    with pytest.raises(AssertionError, match="entries"):
        r.check_invariants()


# ---- stateful property test ------------------------------------------------------------

N = 8
HASHES = H[:6]
Event = tuple[str, int, tuple[bytes, ...]]


class Model:
    """The pool's rules written with plain lists (O(n) everywhere, obviously right)."""

    def __init__(self) -> None:
        self.ref = [0] * N
        self.hashes: list[list[bytes]] = [[] for _ in range(N)]
        self.queue = list(range(N))  # LRU first
        self.index: dict[bytes, list[int]] = {}
        self.events: list[Event] = []

    def unindex(self, i: int) -> None:
        if self.hashes[i]:
            for h in self.hashes[i]:
                self.index[h].remove(i)
                if not self.index[h]:
                    del self.index[h]
            self.events.append(("removed", i, tuple(self.hashes[i])))
            self.hashes[i] = []

    def allocate(self, n: int) -> list[int]:
        out, self.queue = self.queue[:n], self.queue[n:]
        for i in out:
            self.unindex(i)
            self.ref[i] = 1
        return out

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] == 0:
                self.queue.remove(i)
            self.ref[i] += 1

    def free(self, ids: list[int], evict_first: bool) -> None:
        front = []
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                if evict_first or not self.hashes[i]:
                    front.append(i)
                else:
                    self.queue.append(i)
        self.queue = front + self.queue

    def add(self, i: int, hs: list[bytes]) -> None:
        new = []
        for h in hs:
            if h not in self.hashes[i] and h not in new:
                new.append(h)
        for h in new:
            self.index.setdefault(h, []).append(i)
        self.hashes[i] += new
        if new:
            self.events.append(("stored", i, tuple(new)))


def _events(pool: BlockPool) -> list[Event]:
    return [("stored" if isinstance(e, BlockStored) else "removed", e.block_id, e.hashes)
            for e in pool.take_events()]


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(N, enable_events=True)
        self.model = Model()

    def pinned(self) -> list[int]:
        return [i for i in range(N) if self.model.ref[i] > 0]

    @rule(n=st.integers(0, N + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.model.queue):
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
        else:
            assert self.pool.allocate(n) == self.model.allocate(n)

    @rule(ids=st.lists(st.integers(0, N - 1), max_size=4))
    def touch(self, ids: list[int]) -> None:
        self.pool.touch(ids)
        self.model.touch(ids)

    @precondition(lambda self: any(r > 0 for r in self.model.ref))
    @rule(data=st.data(), evict_first=st.booleans())
    def free(self, data: st.DataObject, evict_first: bool) -> None:
        pool_of_refs = [i for i in self.pinned() for _ in range(self.model.ref[i])]
        ids = data.draw(st.permutations(pool_of_refs).flatmap(
            lambda p: st.integers(1, len(p)).map(lambda k: p[:k])))
        self.pool.free(ids, evict_first=evict_first)
        self.model.free(ids, evict_first)

    @rule(data=st.data())
    def free_too_much_changes_nothing(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, N - 1))
        others = data.draw(st.lists(st.sampled_from(self.pinned() or [i]), max_size=2))
        ids = [*others, *[i] * (self.model.ref[i] + 1)]  # one more than i's ref
        with pytest.raises(ConfigError):
            self.pool.free(ids, evict_first=data.draw(st.booleans()))

    @rule(i=st.integers(0, N - 1), hs=st.lists(st.sampled_from(HASHES), max_size=3))
    def add_hashes(self, i: int, hs: list[bytes]) -> None:
        self.pool.add_hashes(i, hs)
        self.model.add(i, hs)

    @rule(i=st.integers(0, N - 1))
    def remove_hashes(self, i: int) -> None:
        self.pool.remove_hashes(i)
        self.model.unindex(i)

    @rule()
    def drop_all_hashes(self) -> None:
        self.pool.drop_all_hashes()
        for i in range(N):
            self.model.unindex(i)
        # the order of one reset's events is not part of the contract
        assert sorted(_events(self.pool)) == sorted(self.model.events)
        self.model.events.clear()

    @rule(k=st.integers(0, 3))
    def lazy_walk_touches_lru_blocks(self, k: int) -> None:
        picked: list[int] = []
        for bid in self.pool.iter_free_from_lru():
            if len(picked) == k:
                break
            self.pool.touch([bid])
            picked.append(bid)
        assert picked == self.model.queue[:k]
        self.model.touch(picked)

    @invariant()
    def agrees_with_model(self) -> None:
        p, m = self.pool, self.model
        p.check_invariants()
        assert free_order(p) == m.queue
        assert p.num_free == len(m.queue) and p.num_pinned == N - len(m.queue)
        assert [p.ref_cnt(i) for i in range(N)] == m.ref
        assert [list(p.block_hashes(i)) for i in range(N)] == m.hashes
        for h in HASHES:
            assert p.get_cached(h) == (m.index[h][0] if h in m.index else None)
            assert p.is_cached(h) == (h in m.index)
        assert _events(p) == m.events
        m.events.clear()


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


def test_ids_and_depths_of_the_wrong_type_are_refused_and_change_nothing() -> None:
    """The hazards (the pool is public: a custom server's GPU pool): ``touch``,
    ``refresh``, ``add_hashes``, ``set_depth``, ``block_hashes``, ``ref_cnt`` gave a
    bare TypeError for ``1.0``, ``'a'`` or ``None``; and ``add_keys(ids, keys, [0,
    "a"])`` or ``set_depth(b, None)`` was accepted, so the next ``free`` of that block
    raised a TypeError in the depth-aware orders after its ref count had reached 0:
    the block in no queue. Each is a ConfigError now, before any change. (A bool is an
    int here, as in Python: ``True`` is block 1.)"""
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    calls: list[tuple[Callable[..., object], tuple[Any, ...]]] = []
    for bad in (1.0, "a", None):
        calls += [(pool.touch, ([a, bad],)), (pool.free, ([a, bad],)),
                  (pool.refresh, ([bad],)), (pool.add_hashes, (bad, [H[0]])),
                  (pool.set_depth, (bad, 1)), (pool.block_hashes, (bad,)),
                  (pool.ref_cnt, (bad,))]
    for d in ("a", None, -1, 2.0):
        calls += [(pool.set_depth, (a, d)), (pool.add_keys, ([a, b], [H[0], H[1]], [0, d]))]
    for call, args in calls:
        with pytest.raises(ConfigError):
            call(*args)
        assert [pool.ref_cnt(i) for i in (a, b)] == [1, 1] and pool.num_free == 2
        assert pool.block_hashes(a) == () and pool.block_hashes(b) == ()
    pool.add_keys([a, b], [H[0], H[1]], [0, 1])
    pool.free([a, b])
    assert pool.num_free == 4
    pool.check_invariants()
