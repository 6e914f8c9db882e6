"""The CPU tier's eviction orders (kvshm/offload/evict.py) in a BlockPool.

A narrated test through the real manager shows ``depth_aged`` keeping a shared prefix
that LRU loses; unit tests pin down each order's choices with exact ids;
a Hypothesis state machine per order checks what every order must keep: a pinned block
is never taken, uncached and ``evict_first`` blocks are taken before the others, the
counts add up, and the pool's own check passes after every operation.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from manager_rig import BS, Req, Rig, hashes, pairs

from kvshm.config import DEFAULT_EVICTION, EngineConfig, Eviction
from kvshm.errors import ConfigError, PoolExhausted
from kvshm.hashing import chain_hashes
from kvshm.offload.blocks import Block
from kvshm.offload.evict import DepthAged
from kvshm.offload.pool import BlockPool


def _store(rig: Rig, req: Req, n_blocks: int) -> list[int]:
    """The engine computes ``req`` (``n_blocks`` full blocks), its eager store goes out
    and is acked, the request finishes and the engine frees its GPU blocks. Returns the
    CPU ids the store used."""
    g = rig.alloc(n_blocks, req.h)
    plan = rig.step(req.sched(g, confirmed=n_blocks * BS, new=True))
    cpu_ids = pairs(plan.store)[1]
    rig.ack(plan.store)
    rig.m.finished(req.rid, n_blocks * BS, [g])
    rig.gpu.free(reversed(g))
    return cpu_ids


@pytest.mark.parametrize("eviction", [Eviction.LRU, Eviction.DEPTH_AGED])
def test_depth_aged_keeps_a_shared_prefix_that_lru_loses(eviction: Eviction) -> None:
    """A 32-block CPU tier (depth_aged: one chain level = 32 // 16 = 2 ticks of age).

    1. Request ``a`` stores S0..S3 (a system prompt every conversation shares) and its
       own A4..A7: CPU blocks 0..7 (S0 in 0), freed tail first.
    2. A one-off request ``b`` stores 24 blocks B0..B23 into CPU blocks 8..31: the tier
       is full.
    3. A one-off request ``c`` needs 8 CPU blocks. LRU takes the 8 least recently freed:
       ``a``'s, 7 down to 0 -- the shared prefix is gone. depth_aged takes the 8 deepest
       relative to their age: ``b``'s tail B23..B16, blocks 31 down to 24 (B16 freed at
       tick 16 has key 16 - 2*16 = -16; S3 freed at tick 5 has 5 - 2*3 = -1).
    4. A new conversation ``d`` starts with the shared prompt: depth_aged gives it the
       16 tokens of S0..S3 from the CPU tier, LRU nothing.
    """
    rig = Rig(cpu=32, gpu=64, eviction=eviction)
    a = Req("a", 8 * BS + 1)
    assert _store(rig, a, 8) == list(range(8))
    b = Req("b", 24 * BS + 1, base=1000)
    assert _store(rig, b, 24) == list(range(8, 32))
    assert rig.cpu.num_free == 32 and rig.cpu.num_hashes == 32
    c = Req("c", 8 * BS + 1, base=2000)
    taken = _store(rig, c, 8)
    d = Req("d", 8 * BS + 1, base=5000)
    d.toks = list(range(4 * BS)) + d.toks[4 * BS:]  # S0..S3, then its own
    d.h = chain_hashes(d.toks, BS)
    assert d.h[:4] == a.h[:4] and d.h[4] != a.h[4]
    if eviction is Eviction.LRU:
        assert taken == [7, 6, 5, 4, 3, 2, 1, 0]
        assert [rig.cpu.is_cached(h) for h in a.h[:4]] == [False] * 4
        assert rig.m.lookup(d.view(), 0) == 0
    else:
        assert taken == [31, 30, 29, 28, 27, 26, 25, 24]
        assert [rig.cpu.get_cached(h) for h in a.h] == list(range(8))
        assert [rig.cpu.is_cached(h) for h in b.h] == [True] * 16 + [False] * 8
        assert rig.m.lookup(d.view(), 0) == 4 * BS
    rig.m.finished("d", 0, [[]])
    rig.m.check_invariants()


def test_the_default_order_is_adaptive_and_configurable() -> None:
    assert DEFAULT_EVICTION is Eviction.ADAPTIVE
    assert EngineConfig(block_size=16).eviction is Eviction.ADAPTIVE
    assert EngineConfig(block_size=16, eviction=Eviction.LRU).eviction is Eviction.LRU
    with pytest.raises(ConfigError, match="eviction must be an Eviction"):
        EngineConfig(block_size=16, eviction="lru")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="eviction must be an Eviction"):
        BlockPool(4, eviction="lru")  # type: ignore[arg-type]
    assert BlockPool(4).eviction is Eviction.LRU  # a bare pool (a GPU pool) keeps LRU
    # the orders that read the engine's own GPU hits get them by default
    assert BlockPool(4, eviction=Eviction.ADAPTIVE).refresh_gpu_hits
    assert not BlockPool(4, eviction=Eviction.DEPTH_AGED).refresh_gpu_hits


@pytest.mark.parametrize("eviction", [Eviction.LRU_REFRESH, Eviction.ADAPTIVE])
def test_a_waiting_request_refreshes_the_engines_prefix_once_per_admission(
        eviction: Eviction) -> None:
    """The engine's own prefix hit refreshes the CPU copies of its blocks once while the
    request waits: its lookup is asked again every step it is not admitted, and a
    refresh at each would make a waiting prefix ever younger (and cost ~6 us a block in
    ``adaptive``'s simulations). A lookup after its phase B (a re-admission) is a new
    use and refreshes again.

    An 8-block tier: ``d``'s prefix P0, P1 in blocks 0, 1, then X0, X1 in 2, 3, each
    freed tail first. The engine holds P0, P1; ``d`` is looked up: P1, P0 are refreshed
    (victims 3, 2, 1, 0). Y is stored (block 4). ``d`` is looked up again while it
    waits: P0, P1 stay older than Y (victims 3, 2, 1, 0, 4). Admitted in between, the
    second lookup refreshes them again: younger than Y (3, 2, 4, 1, 0)."""
    d = Req("d", 3 * BS + 1)
    for readmitted, victims in ((False, [3, 2, 1, 0, 4]), (True, [3, 2, 4, 1, 0])):
        rig = Rig(cpu=8, gpu=16, eviction=eviction)
        assert rig.seed_cpu(*d.h[:2]) == [0, 1]
        assert rig.seed_cpu(*hashes(2 * BS, base=1000)) == [2, 3]
        assert rig.m.lookup(d.view(), 2 * BS) == 0   # refreshes 1, then 0
        assert rig.seed_cpu(*hashes(BS, base=2000)) == [4]
        if readmitted:
            rig.m.allocated("d", [[]], 0)            # admitted; later preempted
        assert rig.m.lookup(d.view(), 2 * BS) == 0   # still waiting / a new use
        rig.m.check_invariants()
        rig.cpu.allocate(3)                          # the uncached blocks first
        assert rig.cpu.allocate(5) == victims, readmitted



@pytest.mark.parametrize("eviction", [Eviction.LRU_REFRESH, Eviction.ADAPTIVE])
def test_a_waiting_request_whose_prefix_hit_grew_refreshes_it_whole_head_last(
        eviction: Eviction) -> None:
    """A waiting request's own prefix hit grows from one block to three: the second
    lookup refreshes the whole prefix tail first, so its head stays the last to go (a
    refresh of only the new blocks would leave the head older than its tail, and an
    evicted head makes the whole kept tail unusable).

    An 8-block tier: P0, P2 in blocks 0, 1 (freed tail first; P1 and P3 are not in the
    tier, so no lookup finds a CPU hit), X in 2: victims 1, 0, 2. Lookup with one local
    block refreshes P0 (1, 2, 0); with three it refreshes P2, then P0: victims 2, 1, 0
    (a refresh of the new blocks alone would give 2, 0, 1)."""
    d = Req("d", 4 * BS + 1)
    rig = Rig(cpu=8, gpu=16, eviction=eviction)
    assert rig.seed_cpu(d.h[0], d.h[2]) == [0, 1]
    assert rig.seed_cpu(*hashes(BS, base=1000)) == [2]
    assert rig.m.lookup(d.view(), BS) == 0
    assert rig.m.lookup(d.view(), 3 * BS) == 0
    rig.m.check_invariants()
    rig.cpu.allocate(5)                              # the uncached blocks first
    assert rig.cpu.allocate(3) == [2, 1, 0]


def _cached(pool: BlockPool, depths: list[int]) -> list[int]:
    """Allocate one block per depth, index it and free them all in one call in the
    given order (as a store's completion frees tail first)."""
    ids = pool.allocate(len(depths))
    for b, d in zip(ids, depths):
        pool.add_hashes(b, [f"h{b}".encode()])
        pool.set_depth(b, d)
    pool.free(ids)
    return ids


def test_depth_aged_takes_the_smallest_clock_minus_k_depth_first() -> None:
    pool = BlockPool(32, eviction=Eviction.DEPTH_AGED)  # k = slot width = 2
    ids = _cached(pool, [3, 2, 1, 0])            # ticks 1..4: keys -5, -2, 1, 4
    more = _cached(pool, [9, 0])                 # ticks 5, 6: keys -13, 6
    assert list(pool.iter_free_from_lru())[:24] == list(range(6, 30))  # uncached first
    pool.allocate(26)
    assert pool.allocate(6) == [more[0], ids[0], ids[1], ids[2], ids[3], more[1]]
    pool.check_invariants()


def test_depth_aged_refresh_and_a_hit_make_a_block_young_again() -> None:
    pool = BlockPool(32, eviction=Eviction.DEPTH_AGED)
    ids = _cached(pool, [0, 0, 0])               # keys 1, 2, 3 (slots 0, 1, 1)
    pool.refresh([ids[0]])                       # tick 4: key 4
    pool.touch([ids[1]])
    pool.free([ids[1]])                          # tick 5: key 5
    pool.allocate(29)
    assert pool.allocate(3) == [ids[2], ids[0], ids[1]]
    with pytest.raises(PoolExhausted):
        pool.allocate(1)


def test_depth_aged_heap_is_rebuilt_when_emptied_slots_pile_up() -> None:
    fs = DepthAged(k=1, slot_width=1)
    blocks = [Block(i) for i in range(4)]
    for b in blocks:
        b.hashes = (b"x",)
    for _ in range(200):  # place and pin again: each place opens a new slot
        for b in blocks:
            fs.append(b)
        for b in blocks:
            fs.remove(b)
    assert len(fs.heap) <= 2 * 4 + 64 + 1
    for b in blocks:
        fs.append(b)
    assert [fs.popleft() for _ in range(4)] == blocks
    fs.check_links(10)


def test_deepest_takes_the_deepest_first_lru_among_equals() -> None:
    pool = BlockPool(8, eviction=Eviction.DEEPEST)
    ids = _cached(pool, [1, 5, 1, 0, 5])
    pool.allocate(3)
    assert pool.allocate(5) == [ids[1], ids[4], ids[0], ids[2], ids[3]]


def test_slru_keeps_hit_blocks_over_one_off_ones() -> None:
    pool = BlockPool(8, eviction=Eviction.SLRU)
    shared = _cached(pool, [0, 1])
    pool.touch(shared)                           # a hit: protected once freed
    pool.free(reversed(shared))
    one_off = _cached(pool, [0, 0, 0])
    pool.allocate(3)
    assert pool.allocate(5) == [*one_off, shared[1], shared[0]]


def test_slru_demotes_the_oldest_protected_block_past_its_share() -> None:
    pool = BlockPool(5, eviction=Eviction.SLRU)  # protected: at most 4
    ids = _cached(pool, [0] * 5)
    pool.touch(ids)
    pool.free(ids)                               # the 5th hit demotes ids[0]
    assert pool.allocate(5) == [ids[0], *ids[1:]]


def test_s3fifo_one_hit_in_small_moves_to_main_and_a_ghost_comes_back_to_main() -> None:
    pool = BlockPool(10, eviction=Eviction.S3FIFO)  # small: 10 % of the free blocks
    a = _cached(pool, [0] * 10)
    pool.refresh([a[1]])                         # hit while in small
    got = pool.allocate(2)
    assert got == [a[0], a[2]]                   # a[1] moved to main, a[0] and a[2] out
    # a[0]'s key is a ghost now: stored again, the block enters main directly
    pool.add_hashes(got[0], [b"h" + str(a[0]).encode()])
    pool.free([got[0]])
    fs = pool._queue
    assert got[0] in [b.block_id for b in fs.q[1]]  # type: ignore[union-attr]
    pool.check_invariants()


# ---- every order: the state machine ------------------------------------------------------

N = 8


class PoolMachine(RuleBasedStateMachine):
    """A model of ref counts and hashes beside a pool of one order."""

    eviction = Eviction.LRU

    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(N, eviction=self.eviction)
        self.ref = [0] * N
        self.hashes: list[tuple[bytes, ...]] = [()] * N
        self.first: set[int] = set(range(N))  # at ref 0, uncached or evict_first
        self.n_hash = 0

    def _free_ids(self) -> list[int]:
        return [b for b in range(N) if self.ref[b] == 0]

    @rule(n=st.integers(0, N))
    def allocate(self, n: int) -> None:
        free = self._free_ids()
        if n > len(free):
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
            return
        got = self.pool.allocate(n)
        assert len(set(got)) == n
        for b in got:
            assert self.ref[b] == 0, f"pinned block {b} handed out"
        # blocks taken first: every uncached / evict_first one before any other
        k = min(n, len(self.first))
        assert set(got[:k]) <= self.first, (got, self.first)
        for b in got:
            self.ref[b] = 1
            self.hashes[b] = ()
            self.first.discard(b)

    @rule(data=st.data())
    def add_hashes(self, data: st.DataObject) -> None:
        pinned = [b for b in range(N) if self.ref[b] > 0]
        if not pinned:
            return
        b = data.draw(st.sampled_from(pinned))
        self.n_hash += 1
        h = f"k{self.n_hash}".encode()
        self.pool.add_hashes(b, [h])
        self.pool.set_depth(b, data.draw(st.integers(0, 40)))
        self.hashes[b] = (*self.hashes[b], h)

    @rule(data=st.data(), evict_first=st.booleans())
    def free(self, data: st.DataObject, evict_first: bool) -> None:
        pinned = [b for b in range(N) if self.ref[b] > 0]
        if not pinned:
            return
        ids = data.draw(st.lists(st.sampled_from(pinned), min_size=1, max_size=4, unique=True))
        self.pool.free(ids, evict_first=evict_first)
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0 and (evict_first or not self.hashes[b]):
                self.first.add(b)

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True))
        self.pool.touch(ids)
        for b in ids:
            self.ref[b] += 1
            self.first.discard(b)

    @rule(data=st.data())
    def refresh(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.integers(0, N - 1), max_size=3, unique=True))
        self.pool.refresh(ids)
        for b in ids:  # a use: a cached block at ref 0 leaves the take-first end
            if self.ref[b] == 0 and self.hashes[b]:
                self.first.discard(b)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert [self.pool.ref_cnt(b) for b in range(N)] == self.ref
        assert [self.pool.block_hashes(b) for b in range(N)] == self.hashes
        assert self.pool.num_free == len(self._free_ids())
        assert self.pool.num_free + self.pool.num_pinned == N
        assert sorted(self.pool.iter_free_from_lru()) == self._free_ids()


def _machine(ev: Eviction) -> type[PoolMachine]:
    cls: type[PoolMachine] = type(f"PoolMachine_{ev.value}", (PoolMachine,), {"eviction": ev})
    cls.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
    return cls


test_pool_lru = _machine(Eviction.LRU).TestCase
test_pool_lru_refresh = _machine(Eviction.LRU_REFRESH).TestCase
test_pool_depth_aged = _machine(Eviction.DEPTH_AGED).TestCase
test_pool_deepest = _machine(Eviction.DEEPEST).TestCase
test_pool_slru = _machine(Eviction.SLRU).TestCase
test_pool_s3fifo = _machine(Eviction.S3FIFO).TestCase
test_pool_adaptive = _machine(Eviction.ADAPTIVE).TestCase


@pytest.mark.parametrize("eviction", list(Eviction))
def test_blocks_a_reset_uncached_are_taken_before_any_cached_later(
        eviction: Eviction) -> None:
    """The hazard: a reset (or a rank's death) drops every hash, but under every order
    but LRU the free blocks stayed where the order had placed them -- protected, main,
    a deep slot -- so the blocks cached after the reset were evicted while worthless
    uncached ones stayed (SLRU: 10 of 12 new blocks lost, 13 dead blocks kept). Now
    they join the fresh queue: 15 chain blocks hit once, 5 in use, a reset, then 6
    stores of 2 blocks into the 15 free: every new block stays cached."""
    pool = BlockPool(20, eviction=eviction)
    ids = pool.allocate(15)
    pool.add_keys(ids, [b"old%02d" % i for i in range(15)], list(range(15)))
    pool.free(ids[::-1])
    pool.touch(ids)
    pool.free(ids[::-1])
    pool.allocate(5)
    pool.drop_all_hashes()
    pool.check_invariants()
    new: list[bytes] = []
    for r in range(6):
        got = pool.allocate(2)
        keys = [b"new%d-%d" % (r, j) for j in range(2)]
        pool.add_keys(got, keys, [2 * r + 15, 2 * r + 16])
        pool.free(got[::-1])
        new += keys
        pool.check_invariants()
    assert [k for k in new if not pool.is_cached(k)] == []
    assert sum(1 for b in range(20) if pool.ref_cnt(b) == 0 and not pool.block_hashes(b)) == 3


@pytest.mark.parametrize("eviction", list(Eviction))
def test_allocating_a_count_that_is_not_an_int_changes_nothing(eviction: Eviction) -> None:
    """The hazard: ``allocate(2.5)`` passed the ``n < 0`` check; the orders took the
    fresh blocks, then failed on ``range(0.5)``, leaving those blocks at ref 0 in no
    queue (lost for good: "free set: walked 2 blocks, length says 4"). Refused first
    now, with nothing taken."""
    pool = BlockPool(4, eviction=eviction)
    ids = pool.allocate(2)
    pool.add_keys(ids, [b"a", b"b"], [0, 1])
    pool.free(ids[::-1])
    before = (pool.num_free, list(pool.iter_free_from_lru()))
    for bad in (2.5, "2", None):
        with pytest.raises(ConfigError, match="cannot allocate"):
            pool.allocate(bad)  # type: ignore[arg-type]
    assert (pool.num_free, list(pool.iter_free_from_lru())) == before
    pool.check_invariants()
