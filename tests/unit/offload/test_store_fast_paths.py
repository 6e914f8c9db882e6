"""The store path's shortcuts (issue 15) decide exactly what the general paths decide:
the one-group walk against the general one, ``BlockPool.add_keys``
against ``add_hashes`` + ``set_depth`` one by one, ``FreeBlockQueue.extend`` against ``append``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.config import Eviction
from kvshm.errors import ConfigError
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import Selection
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import KVGroup

H = [bytes([i]) * 16 for i in range(12)]


@dataclass
class _Cur:
    tables: list[list[int]]
    hashes: Sequence[bytes]
    cursor: int = 0
    extra: list[int] = field(default_factory=list)


def _planner(single: bool, gpu: BlockPool, cpu: BlockPool, load_dst: set[int]) -> StorePlanner:
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
            pool.add_hashes(b, [H[h]])
        pool.take_events()
    ids, keys, depths = [b for b, _, _ in pairs], [H[h] for _, h, _ in pairs], \
        [d for _, _, d in pairs]
    pools[0].add_keys(ids, keys, depths if with_depths else None)
    for b, k in zip(ids, keys):
        pools[1].add_hashes(b, [k])
    if with_depths:
        for b, d in zip(ids, depths):
            pools[1].set_depth(b, d)
    got = [([(pool.block_hashes(b), pool._blocks[b].depth) for b in range(8)],
            [pool.get_cached(h) for h in H], pool.take_events()) for pool in pools]
    assert got[0] == got[1]
    for pool in pools:
        pool.check_invariants()


def test_add_keys_refuses_before_any_change() -> None:
    pool = BlockPool(4, enable_events=True)
    a, b = pool.allocate(2)
    with pytest.raises(ConfigError, match="unknown block id 9"):
        pool.add_keys([a, 9], [H[0], H[1]])
    with pytest.raises(ConfigError, match="unknown block id -1"):
        pool.add_keys([a, -1], [H[0], H[1]])
    with pytest.raises(ConfigError, match="must be bytes"):
        pool.add_keys([a, b], [H[0], "x"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="2 block ids but 1 keys"):
        pool.add_keys([a, b], [H[0]])
    assert pool.num_hashes == 0 and pool.take_events() == []
    pool.add_keys([], [])
    pool.check_invariants()


def test_index_entry_is_the_id_until_a_second_block_shares_the_hash() -> None:
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.add_keys([a], [H[0]])
    assert pool.index.entries[H[0]] == a and pool.get_cached(H[0]) == a
    pool.add_hashes(b, [H[0]])
    pool.add_keys([c], [H[0]])
    assert pool.cached_run([H[0]], 0, 1) == [a] and pool.num_hashes == 1
    pool.remove_hashes(a)
    assert pool.get_cached(H[0]) == b
    pool.remove_hashes(b)
    assert pool.get_cached(H[0]) == c and pool.cached_run([H[0], H[1]], 0, 2) == [c]
    pool.check_invariants()
    pool.remove_hashes(c)
    assert pool.get_cached(H[0]) is None and pool.num_hashes == 0
    pool.add_keys([a, b], [H[1], H[2]])
    pool.drop_all_hashes()
    assert pool.num_hashes == 0
    pool.check_invariants()


