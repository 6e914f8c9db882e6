"""The hand-inlined fast paths that stay, each against the general path it shortcuts:
the one-group store walk; a store's one-group completion (``add_keys`` in one call
after one bulk read of the GPU hashes, ``VllmGpuBlocks.block_hashes_of``);
``VllmGpuBlocks``' slot read; the hash index's int-or-dict entries. (The vLLM
listing's ``_known`` shortcut also stays; its reference comparison is
``tests/vllm/test_vllm_listing_changed.py``.)

Issue 30 point 5: a fast path stays only where ``tools.bench_vs_vllm``'s realistic trace
shows it worth >= 5 % of kvshm's step at 1k or 4k running requests. Each path was
routed, alone, to its general path (monkeypatched; ``--clock cpu --traces realistic
--sizes 1000,4000 --no-chat --runs 1`` per invocation, alternated with unchanged runs;
2 cores shared with other work). Worth = the rise of kvshm's step µs *over vLLM's in
the same run* (both contenders run interleaved, so load cancels: the unchanged runs'
quotient still spread +-5 %), against the adjacent unchanged runs; median over the
runs (2, the listing 4) per phase, then the mean of the phases all / changed:

=====================================  ======  ======
path (switched off)                    1k      4k
=====================================  ======  ======
one-group store walk (kept)            +6.3 %  +13.0 %
one-group completion (restored)        +4.1 %  +3.2 %
listing's ``_known`` (restored)        +3.6 %  -2.9 %
VllmGpuBlocks' slot read (restored)    +3.5 %  +1.7 %
VllmGpuBlocks' bulk read (restored)    +3.3 %  +0.8 %
FreeBlockQueue's inlined ``extend``    +3.3 %  -1.3 %
one-pass ``free`` with undo            +2.7 %  -2.2 %
free set's ``take``                    +2.0 %  -4.6 %
facade's skipped no-op after-hooks     +1.8 %  -3.1 %
phase-B pin hand-over                  -2.1 %  +2.8 %
one-group hit search / pairing         -1.3 %  +2.9 %
one-group finish-time pin              -2.2 %  +1.1 %
decode step's one-pass check           -0.6 %  -3.6 %
``pick_run``                           -2.0 %  -1.5 %
``add_keys``' bulk update              -2.8 %  -3.1 %
``add_hashes``' single-key branch      -1.1 %  -2.3 %
=====================================  ======  ======

Only the walk passes alone. Folding all the others cost, against the tree before (the
same quotient, 4 alternated pairs), +12.0 % / +15.9 % (all / changed) at 1k and
+10.9 % / +13.0 % at 4k: over issue 30's "within 5 % of before". So the folds measured
nearest 5 % were restored (the one-group
completion, the listing's shortcut, the two vLLM reads): with them back, +0.2 % /
+4.9 % at 1k and +4.9 % / +12.8 % at 4k against before (6 pairs: the changed phase at
4k is still over; the next candidates are the hit search, finish pin and pick_run). ``DepthAged``'s
inlined ``extend`` / ``remove`` are not on that path (the default order is adaptive):
worth 0, folded. Not measured, kept: the hash index's int-or-dict entries (an entry
is the block id itself until a second block carries the hash: a data layout, not a
branch that can be switched off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.config import Eviction
from kvshm.errors import ConfigError, PoolExhausted
from kvshm.integrations.vllm.blocks import VllmGpuBlocks, plain_hash
from kvshm.offload.blocks import Block
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import Selection
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import KVGroup

H = [bytes([i]) * 16 for i in range(12)]


# ---- the one-group store walk --------------------------------------------------------

@dataclass
class _Cur:
    """A request's store tracking as the planner reads it."""

    tables: list[list[int]]
    hashes: Sequence[bytes]
    cursor: int = 0


def _planner(single: bool, gpu: BlockPool, cpu: BlockPool, load_dst: set[int]) -> StorePlanner:
    """One full-attention group; ``single`` False: the shortcut switched off."""
    gs = GroupSet((KVGroup.full(),), 16)
    gs.single = single
    return StorePlanner(cpu, gpu, gs, 16, ManagerCounters(), 8, load_dst)


def _state(single: bool, gpu_h: list[int | None], cached: set[int], inflight: set[int],
           keys_inflight: set[int], loading: set[int]) -> tuple[BlockPool, StorePlanner]:
    """A 12-block GPU pool hashed as ``gpu_h`` says, a CPU tier holding ``cached``, and a
    planner with those GPU ids and keys in flight and ``loading`` being loaded."""
    gpu, cpu = BlockPool(12), BlockPool(16)
    gpu.allocate(12)
    for b, h in enumerate(gpu_h):
        if h is not None:
            gpu.add_hashes(b, [H[h]])
    for c, h in zip(cpu.allocate(len(cached)), sorted(cached)):
        cpu.add_hashes(c, [H[h]])
    plan = _planner(single, gpu, cpu, loading)
    plan.inflight_gpu.update(inflight)
    plan.inflight_keys.update(H[k] for k in keys_inflight)
    return gpu, plan


@settings(max_examples=300, deadline=None)
@given(gpu_h=st.lists(st.one_of(st.none(), st.integers(0, 11)), min_size=12, max_size=12),
       seq=st.lists(st.integers(0, 11), max_size=10), cached=st.sets(st.integers(0, 11)),
       inflight=st.sets(st.integers(0, 11)), keys_inflight=st.sets(st.integers(0, 11)),
       loading=st.sets(st.integers(0, 11)), order=st.permutations(list(range(12))),
       cursor=st.integers(0, 4), ready=st.integers(0, 12), avail=st.integers(0, 6),
       calls=st.integers(1, 3))
def test_one_group_walk_equals_the_general_walk(
        gpu_h: list[int | None], seq: list[int], cached: set[int], inflight: set[int],
        keys_inflight: set[int], loading: set[int], order: list[int], cursor: int,
        ready: int, avail: int, calls: int) -> None:
    """The same picks, declines (counted alike), cursor and marks, call after call."""
    out = []
    for single in (True, False):
        gpu, plan = _state(single, gpu_h, cached, inflight, keys_inflight, loading)
        cur = _Cur([order], [H[i] for i in seq], cursor)
        sel = Selection()
        left = avail
        for _ in range(calls):
            left = plan.walk(cur, ready, left, (), sel)
        out.append((left, cur.cursor, sel.gpu_ids, sel.groups, sel.keys, sel.depths,
                    sel.to_touch, sorted(plan.inflight_gpu), sorted(plan.inflight_keys),
                    plan.counters.as_dict()))
    assert out[0] == out[1]


# ---- the hash index's int-or-dict entries ----------------------------------------------

@pytest.mark.parametrize("eviction", list(Eviction), ids=lambda e: e.value)
def test_int_entry_to_dict_and_back_keeps_earliest_registered(eviction: Eviction) -> None:
    """Two blocks under one hash (int -> dict), the first evicted (dict of one), a third
    added, the second removed: get_cached always names the earliest still carrying it."""
    pool = BlockPool(4, eviction=eviction)
    a, b, c, d = pool.allocate(4)
    pool.add_hashes(a, [H[0]])
    assert pool.get_cached(H[0]) == a
    pool.add_hashes(b, [H[0], H[0]])
    assert pool.get_cached(H[0]) == a and pool.block_hashes(b) == (H[0],)
    pool.remove_hashes(a)
    assert pool.get_cached(H[0]) == b and pool.cached_run(H, 0, 2) == [b]
    pool.add_hashes(c, [H[0]])
    pool.remove_hashes(b)
    assert pool.get_cached(H[0]) == c
    pool.free([c, d])
    assert pool.allocate(1) == [d]  # uncached first, every order
    assert pool.allocate(1) == [c] and pool.get_cached(H[0]) is None
    pool.check_invariants()
    assert [pool.ref_cnt(i) for i in range(4)] == [1, 1, 1, 1]


def test_block_zero_as_an_int_entry_is_a_hit() -> None:
    """An int entry 0 (block 0) is falsy: every reader must still answer it."""
    pool = BlockPool(2)
    assert pool.allocate(1) == [0]
    pool.add_hashes(0, [H[1]])
    assert pool.get_cached(H[1]) == 0
    assert pool.cached_run(H, 1, 3) == [0]
    assert pool.is_cached(H[1]) and H[1] in pool.cached_keys
    pool.drop_all_hashes()
    assert pool.get_cached(H[1]) is None
    pool.check_invariants()


def test_index_entry_is_the_id_until_a_second_block_shares_the_hash() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.add_hashes(a, [H[0]])
    assert pool.index.entries[H[0]] == a and pool.get_cached(H[0]) == a
    pool.add_hashes(b, [H[0]])
    pool.add_hashes(c, [H[0]])
    assert pool.cached_run([H[0]], 0, 1) == [a] and pool.num_hashes == 1
    pool.remove_hashes(a)
    assert pool.get_cached(H[0]) == b
    pool.remove_hashes(b)
    assert pool.get_cached(H[0]) == c and pool.cached_run([H[0], H[1]], 0, 2) == [c]
    pool.check_invariants()
    pool.remove_hashes(c)
    assert pool.get_cached(H[0]) is None and pool.num_hashes == 0
    pool.add_hashes(a, [H[1]])
    pool.add_hashes(b, [H[2]])
    pool.drop_all_hashes()
    assert pool.num_hashes == 0
    pool.check_invariants()


# ---- VllmGpuBlocks' slot read and bulk read (from test_perf_fast_paths.py) ----

H_PERF = [bytes([i]) * 16 for i in range(24)]


class _perf_SlotBlock:
    __slots__ = ("_block_hash", "block_id")

    def __init__(self, i: int, h: bytes | None) -> None:
        self.block_id = i
        self._block_hash = h

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash


class _perf_OtherBlock(_perf_SlotBlock):
    __slots__ = ()

    @property
    def block_hash(self) -> bytes | None:  # not the slot: the property must be called
        return None if self._block_hash is None else b"x" * 20


class _perf_Pool:
    def __init__(self, blocks: list[Any]) -> None:
        self.blocks = blocks
        self.free_block_queue = None


@pytest.mark.parametrize("cls", [_perf_SlotBlock, _perf_OtherBlock])
def test_vllm_blocks_read_the_slot_only_where_it_is_the_property(cls: type) -> None:
    blocks = [cls(0, None), cls(1, b"a" * 36)]
    gpu = VllmGpuBlocks(_perf_Pool(blocks))
    assert gpu._slot is (cls is _perf_SlotBlock)
    assert gpu.block_hashes(0) == ()
    want = (plain_hash(blocks[1].block_hash),)
    assert gpu.block_hashes(1) == want and gpu.block_hashes(1) is gpu.block_hashes(1)
    blocks[1]._block_hash = b"b" * 36  # re-hashed: a new object, a new answer
    assert gpu.block_hashes(1) == (plain_hash(blocks[1].block_hash),)


@pytest.mark.parametrize("cls", [_perf_SlotBlock, _perf_OtherBlock])
def test_vllm_blocks_bulk_read_answers_what_one_by_one_answers(cls: type) -> None:
    """``block_hashes_of`` against ``block_hashes`` per id, through re-hashes, a hash
    dropped, blocks never read, and secondary hashes appearing."""
    blocks = [cls(i, None if i % 3 == 0 else bytes([i]) * 36) for i in range(6)]
    pool = _perf_Pool(blocks)
    secondary: dict[int, list[bytes]] = {}
    pool.cached_block_hashes_by_block = secondary  # type: ignore[attr-defined]
    gpu = VllmGpuBlocks(pool)
    ids = [5, 0, 1, 1, 4, 2, 3]

    def one_by_one() -> list[tuple[bytes, ...]]:
        return [gpu.block_hashes(b) for b in ids]

    assert gpu.block_hashes_of(ids) == one_by_one()  # nothing cached yet
    gpu.block_hashes(1)
    assert gpu.block_hashes_of(ids) == one_by_one()  # 1 from the cache
    blocks[1]._block_hash = b"z" * 36  # re-hashed
    blocks[2]._block_hash = None  # freed and reset
    blocks[3]._block_hash = b"y" * 36  # hashed for the first time
    assert gpu.block_hashes_of(ids) == one_by_one()
    secondary[4] = [b"s" * 36]
    assert gpu.block_hashes_of(ids) == one_by_one()
    assert gpu.block_hashes_of([4])[0] == (plain_hash(blocks[4].block_hash),
                                           plain_hash(b"s" * 36))


# ---- the pool's batch add_keys and the one-group completion (from test_pool_fast_paths.py) ----

N_POOL = 8
H_POOL = [bytes([i]) * 16 for i in range(10)]
ORDERS_POOL = list(Eviction)


# ---- the general paths (the code before the change), on the pool's primitives ------

def _pool_old_allocate(pool: BlockPool, n: int) -> list[int]:
    if n < 0:
        raise ConfigError(f"cannot allocate {n} blocks")
    q: Any = pool._queue
    if n > len(q):
        pool.exhausted += 1
        raise PoolExhausted(n, len(q))
    out: list[int] = []
    for _ in range(n):
        b = q.popleft()
        if b.hashes:
            pool.evictions += 1
            pool.index.unindex(b)
        b.ref_cnt = 1
        out.append(b.block_id)
    return out


def _pool_old_free(pool: BlockPool, ids: list[int], evict_first: bool = False) -> None:
    all_blocks = pool._blocks
    n = len(all_blocks)
    blocks: list[Block] = []
    low = False
    for i in ids:
        if not 0 <= i < n:
            raise ConfigError(f"unknown block id {i!r} (pool has {n} blocks)")
        b = all_blocks[i]
        if b.ref_cnt < 1:
            low = True
        blocks.append(b)
    if low or (len(blocks) > 1 and len(set(map(id, blocks))) != len(blocks)):
        pool._check_freeable(blocks)
    to_lru: list[Block] = []
    q: Any = pool._queue
    for b in blocks:
        b.ref_cnt -= 1
        if b.ref_cnt == 0:
            if evict_first or not b.hashes:
                to_lru.append(b)
            else:
                q.append(b)
    for b in reversed(to_lru):
        q.appendleft(b)


def _pool_old_add_keys(pool: BlockPool, ids: list[int], keys: list[bytes],
                  depths: list[int] | None) -> None:
    for c, k in zip(ids, keys, strict=True):
        pool.add_hashes(c, [k])
    for c, d in zip(ids, depths or ()):
        pool.set_depth(c, d)


def _pool_state(pool: BlockPool) -> Any:
    blocks = pool._blocks
    return (
        [b.ref_cnt for b in blocks],
        list(pool.iter_free_from_lru()),
        [pool.get_cached(h) for h in H_POOL],
        [pool.cached_run(H_POOL, s, len(H_POOL)) for s in range(len(H_POOL))],
        [b.hashes for b in blocks],
        [(b.depth, b.slot, b.freq) for b in blocks],
        pool.evictions, pool.exhausted, pool.num_free, pool.num_hashes,
        getattr(pool._queue, "clock", None),
        dict(getattr(pool._queue, "ghost", {})),
    )


def _pool_core(state: Any) -> Any:
    s = state if isinstance(state, tuple) else _pool_state(state)
    return s[:7] + s[8:]


# ---- the operations, drawn -----------------------------------------------------------

ids_st_POOL = st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, 7, 8]), max_size=6)
op_st_POOL = st.one_of(
    st.tuples(st.just("allocate"), st.integers(-1, N_POOL + 1)),
    st.tuples(st.just("free"), ids_st_POOL, st.booleans()),
    st.tuples(st.just("free_pinned"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("touch"), st.lists(st.integers(0, N_POOL - 1), max_size=4)),
    st.tuples(st.just("add_keys"), st.lists(st.tuples(st.integers(0, N_POOL - 1),
                                                      st.sampled_from(H_POOL)), max_size=5),
              st.sampled_from(["none", "same", "short", "empty"])),
    st.tuples(st.just("add_hashes"), st.integers(0, N_POOL - 1),
              st.lists(st.sampled_from(H_POOL), max_size=3)),
    st.tuples(st.just("remove"), st.integers(0, N_POOL - 1)),
    st.tuples(st.just("refresh"), st.lists(st.integers(0, N_POOL - 1), max_size=3)),
    st.tuples(st.just("drop_all"),),
)


def _pool_run(pool: BlockPool, op: Any, old: bool) -> Any:
    kind = op[0]
    try:
        if kind == "allocate":
            return (_pool_old_allocate if old else BlockPool.allocate)(pool, op[1])
        if kind == "free":
            (_pool_old_free if old else BlockPool.free)(pool, op[1], evict_first=op[2])
        elif kind == "free_pinned":  # the pinned ids, as a tail-first release would name them
            pinned = [b.block_id for b in pool._blocks if b.ref_cnt][: op[1]]
            (_pool_old_free if old else BlockPool.free)(pool, pinned[::-1], evict_first=op[2])
        elif kind == "touch":
            pool.touch(op[1])
        elif kind == "add_keys":
            ids = [c for c, _ in op[1]]
            keys = [k for _, k in op[1]]
            depths = {"none": None, "same": [3 * c + 1 for c in ids],
                      "short": [5] * (len(ids) // 2), "empty": []}[op[2]]
            if old:
                _pool_old_add_keys(pool, ids, keys, depths)
            else:
                pool.add_keys(ids, keys, depths)
        elif kind == "add_hashes":
            pool.add_hashes(op[1], list(op[2]))
        elif kind == "remove":
            pool.remove_hashes(op[1])
        elif kind == "refresh":
            pool.refresh(op[1])
        else:
            pool.drop_all_hashes()
    except (ConfigError, PoolExhausted) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("size", [N_POOL, 12])
@pytest.mark.parametrize("eviction", ORDERS_POOL, ids=lambda e: e.value)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st_POOL, max_size=40))
def test_pool_fast_paths_match_the_general_paths(eviction: Eviction, size: int,
                                                 ops: list[Any]) -> None:
    new = BlockPool(size, enable_events=True, eviction=eviction)
    old = BlockPool(size, enable_events=True, eviction=eviction)
    for op in ops:
        before = _pool_state(new)
        got = _pool_run(new, op, old=False)
        want = _pool_run(old, op, old=True)
        assert got == want, op
        assert _pool_state(new) == _pool_state(old), op
        assert new.take_events() == old.take_events(), op
        new.check_invariants()
        old.check_invariants()
        if got is not None and isinstance(got, tuple):  # refused: nothing changed
            assert _pool_core(new) == _pool_core(before), op  # (exhausted counts a refusal)


# ---- edge cases the fast paths once got wrong -----------------------------------------

def test_add_keys_non_int_id_midway_changes_nothing() -> None:
    """Hazard: ``add_keys`` promises 'everything is checked first: ConfigError and nothing
    changed', but checks ids only by ``min``/``max``: an id of another numeric type inside
    the range (``1.0``) passes, and the loop indexes ``ids[0]`` before ``blocks[1.0]``
    raises TypeError -- a refused call that changed the index (and not ConfigError)."""
    pool = BlockPool(4, enable_events=True)
    pool.allocate(2)
    before = _pool_state(pool)
    with pytest.raises(ConfigError):
        pool.add_keys([0, 1.0], [H_POOL[0], H_POOL[1]])  # type: ignore[list-item]
    assert _pool_state(pool) == before
    assert pool.get_cached(H_POOL[0]) is None
    assert pool.take_events() == []


# ---- a store's completion: add_keys (one group) against the pairs one by one ---------

class _pool_Gpu:
    """A GPU pool protocol stand-in whose blocks answer fixed hashes."""

    def __init__(self, hashes: dict[int, tuple[Any, ...]]) -> None:
        self._h = hashes

    def block_hashes(self, block_id: int) -> tuple[Any, ...]:
        return self._h.get(block_id, ())


def _pool_planner(cpu: BlockPool, gpu: _pool_Gpu, single: bool) -> Any:
    from kvshm.offload.counters import ManagerCounters
    from kvshm.offload.groups import GroupSet
    from kvshm.offload.stores import StorePlanner
    from kvshm.types import KVGroup

    gs = GroupSet((KVGroup.full(),), 16)
    gs.single = single  # False: the general pairs-one-by-one path
    return StorePlanner(cpu, gpu, gs, 16, ManagerCounters(), 4, set())  # type: ignore[arg-type]


def _pool_register_both(keys: list[Any], gh: dict[int, tuple[Any, ...]]) -> list[Any]:
    out = []
    for single in (True, False):
        cpu = BlockPool(4, enable_events=True, eviction=Eviction.DEPTH_AGED)
        cpu.allocate(len(keys))
        plan = _pool_planner(cpu, _pool_Gpu(gh), single)
        try:
            plan._register(list(range(len(keys))), list(range(len(keys))),
                           [0] * len(keys), keys, list(range(len(keys))))
            err = None
        except ConfigError as exc:
            err = type(exc).__name__
        out.append((err, _pool_state(cpu), cpu.take_events(), plan.counters.stored_blocks))
    return out


def test_register_one_group_matches_general_for_good_keys() -> None:
    fast, general = _pool_register_both([H_POOL[0], H_POOL[1], H_POOL[2]],
                                        {0: (H_POOL[0],), 2: (H_POOL[2],)})
    assert fast == general
    assert fast[1][2][:3] == [0, 1, 2]


def test_register_refused_key_changes_the_same_in_both_paths() -> None:
    """Hazard (the two paths diverged): a key that is not bytes (a lazy store's key is the GPU
    pool's own ``block_hashes(b)[0]``, unchecked) makes the one-group path's
    ``add_keys`` refuse the whole job (nothing indexed), while the general path
    ``add_hashes`` pair by pair indexes the blocks before it and then refuses: the two
    paths leave different CPU indexes. The rule (a refused call changes nothing) says the
    general path is the one to fix: check every key before indexing any."""
    fast, general = _pool_register_both([H_POOL[0], "h1", H_POOL[2]],
                                        {0: (H_POOL[0],), 1: ("h1",), 2: (H_POOL[2],)})
    assert fast[0] == general[0] == "ConfigError"
    assert fast[1] == general[1]  # general indexed block 0 under H_POOL[0]; fast nothing


# ---- add_keys against add_hashes one by one (from test_store_fast_paths.py) ----

H_STORE = [bytes([i]) * 16 for i in range(12)]


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5), st.integers(0, 9)),
                      max_size=12),
       pre=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 5)), max_size=4),
       with_depths=st.booleans(), events=st.booleans())
def test_add_keys_equals_add_hashes_one_by_one(
        pairs: list[tuple[int, int, int]], pre: list[tuple[int, int]],
        with_depths: bool, events: bool) -> None:
    """Without events and with depths, a completion's usual call (distinct new keys on
    unhashed blocks) takes the bulk path; the rest the per-block loop."""
    pools = [BlockPool(8, enable_events=events, eviction=Eviction.DEPTH_AGED)
             for _ in range(2)]
    for pool in pools:
        pool.allocate(8)
        for b, h in pre:
            pool.add_hashes(b, [H_STORE[h]])
        pool.take_events()
    ids, keys, depths = [b for b, _, _ in pairs], [H_STORE[h] for _, h, _ in pairs], \
        [d for _, _, d in pairs]
    pools[0].add_keys(ids, keys, depths if with_depths else None)
    for b, k in zip(ids, keys):
        pools[1].add_hashes(b, [k])
    if with_depths:
        for b, d in zip(ids, depths):
            pools[1].set_depth(b, d)
    got = [([(pool.block_hashes(b), pool._blocks[b].depth) for b in range(8)],
            [pool.get_cached(h) for h in H_STORE], pool.take_events()) for pool in pools]
    assert got[0] == got[1]
    for pool in pools:
        pool.check_invariants()


def test_add_keys_refuses_before_any_change() -> None:
    pool = BlockPool(4, enable_events=True)
    a, b = pool.allocate(2)
    with pytest.raises(ConfigError, match="unknown block id 9"):
        pool.add_keys([a, 9], [H_STORE[0], H_STORE[1]])
    with pytest.raises(ConfigError, match="unknown block id -1"):
        pool.add_keys([a, -1], [H_STORE[0], H_STORE[1]])
    with pytest.raises(ConfigError, match="must be bytes"):
        pool.add_keys([a, b], [H_STORE[0], "x"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="2 block ids but 1 keys"):
        pool.add_keys([a, b], [H_STORE[0]])
    assert pool.num_hashes == 0 and pool.take_events() == []
    pool.add_keys([], [])
    pool.check_invariants()


# ---- a store's completion in bulk (from test_completion_bulk.py) ---------

H_COMPL = [bytes([i]) * 16 for i in range(8)]


class _compl_Gpu:
    """A GPU pool stand-in whose blocks answer fixed hashes; ``bulk``: it also has the
    one-call read."""

    def __init__(self, hashes: dict[int, tuple[bytes, ...]], bulk: bool) -> None:
        self._h = hashes
        if bulk:
            self.block_hashes_of = lambda ids: [self.block_hashes(b) for b in ids]

    def block_hashes(self, block_id: int) -> tuple[bytes, ...]:
        return self._h.get(block_id, ())


def _compl_complete(keys: list[bytes], gh: dict[int, tuple[bytes, ...]], single: bool,
              events: bool, bulk: bool) -> Any:
    """Register a 3-block store (GPU ids 0, 1, 2 into CPU ids 0, 1, 2, depths 0, 1, 2);
    the CPU tier's state after it."""
    cpu = BlockPool(4, enable_events=events, eviction=Eviction.DEPTH_AGED)
    cpu.allocate(len(keys))
    gs = GroupSet((KVGroup.full(),), 16)
    gs.single = single  # False: the general pairs-one-by-one path
    plan = StorePlanner(cpu, _compl_Gpu(gh, bulk), gs, 16, ManagerCounters(), 4,  # type: ignore[arg-type]
                        set())
    n = len(keys)
    plan._register(list(range(n)), list(range(n)), [0] * n, keys, list(range(n)))
    cpu.check_invariants()
    return ([(cpu.block_hashes(b), cpu._blocks[b].depth) for b in range(4)],
            [cpu.get_cached(h) for h in H_COMPL], cpu.take_events(), plan.counters.stored_blocks)


@pytest.mark.parametrize("gh", [
    {},  # no GPU block hashed: stored under the keys
    {0: (H_COMPL[0],), 1: (H_COMPL[1],), 2: (H_COMPL[2],)},  # each carries exactly its key
    {0: (H_COMPL[0],), 1: (H_COMPL[5],)},  # block 1 re-hashed for other content: both indexed
    {1: (H_COMPL[1], H_COMPL[6])},  # block 1 carries a second hash
    {2: (H_COMPL[5], H_COMPL[2])},  # its key second
])
@pytest.mark.parametrize("events", [True, False])
@pytest.mark.parametrize("bulk", [True, False])
def test_one_group_completion_indexes_what_the_pairs_one_by_one_index(
        gh: dict[int, tuple[bytes, ...]], events: bool, bulk: bool) -> None:
    keys = [H_COMPL[0], H_COMPL[1], H_COMPL[2]]
    assert _compl_complete(keys, gh, True, events, bulk) == _compl_complete(keys, gh, False, events,
                                                                bulk)
