"""The hand-inlined fast paths that stay, each against the general path it shortcuts.

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
one-group store walk (KEPT)            +6.3 %  +13.0 %
one-group completion (add_keys)        +4.1 %  +3.2 %
listing's ``_known`` shortcut          +3.6 %  -2.9 %
VllmGpuBlocks' slot read               +3.5 %  +1.7 %
VllmGpuBlocks' bulk read               +3.3 %  +0.8 %
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

All but the walk were folded back. Each is under the noise alone, but together they
cost: the folded tree against the one before, the same quotient, 4 alternated pairs:
+12.0 % / +15.9 % (all / changed) at 1k, +10.9 % / +13.0 % at 4k -- over issue 30's
"within 5 % of before" (the folds measured nearest 5 % -- the completion, the
listing's shortcut, the vLLM reads -- are the ones to restore first). ``DepthAged``'s
inlined ``extend`` / ``remove`` are not on that path (the default order is adaptive):
worth 0, folded. Not measured, kept:
the hash index's int-or-dict entries (an entry is the block id itself until a second
block carries the hash: a data layout, not a branch that can be switched off).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.config import Eviction
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
