"""The CPU pool's fast paths (``add_keys``, the int-or-dict index entries): each is run
against the general path it shortcuts -- the pre-change code, re-implemented here on
the pool's own primitives -- on the same operation sequence, for every eviction order,
and the whole observable state (ref counts, free order, index answers, hashes, depths,
eviction bookkeeping, events, counters) must agree after every call, refused or not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.config import Eviction
from kvshm.errors import ConfigError, PoolExhausted
from kvshm.offload.blocks import Block
from kvshm.offload.pool import BlockPool

N = 8
H = [bytes([i]) * 16 for i in range(10)]
ORDERS = list(Eviction)


# ---- the general paths (the code before the change), on the pool's primitives ------

def _old_allocate(pool: BlockPool, n: int) -> list[int]:
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


def _old_free(pool: BlockPool, ids: list[int], evict_first: bool = False) -> None:
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


def _old_add_keys(pool: BlockPool, ids: list[int], keys: list[bytes],
                  depths: list[int] | None) -> None:
    for c, k in zip(ids, keys, strict=True):
        pool.add_hashes(c, [k])
    for c, d in zip(ids, depths or ()):
        pool.set_depth(c, d)


def _state(pool: BlockPool) -> Any:
    blocks = pool._blocks
    return (
        [b.ref_cnt for b in blocks],
        list(pool.iter_free_from_lru()),
        [pool.get_cached(h) for h in H],
        [pool.cached_run(H, s, len(H)) for s in range(len(H))],
        [b.hashes for b in blocks],
        [(b.depth, b.slot, b.freq) for b in blocks],
        pool.evictions, pool.exhausted, pool.num_free, pool.num_hashes,
        getattr(pool._queue, "clock", None),
        dict(getattr(pool._queue, "ghost", {})),
    )


def _core(state: Any) -> Any:
    s = state if isinstance(state, tuple) else _state(state)
    return s[:7] + s[8:]


# ---- the operations, drawn -----------------------------------------------------------

ids_st = st.lists(st.sampled_from([-1, 0, 1, 2, 3, 5, 7, 8]), max_size=6)
op_st = st.one_of(
    st.tuples(st.just("allocate"), st.integers(-1, N + 1)),
    st.tuples(st.just("free"), ids_st, st.booleans()),
    st.tuples(st.just("free_pinned"), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("touch"), st.lists(st.integers(0, N - 1), max_size=4)),
    st.tuples(st.just("add_keys"), st.lists(st.tuples(st.integers(0, N - 1),
                                                      st.sampled_from(H)), max_size=5),
              st.sampled_from(["none", "same", "short", "empty"])),
    st.tuples(st.just("add_hashes"), st.integers(0, N - 1),
              st.lists(st.sampled_from(H), max_size=3)),
    st.tuples(st.just("remove"), st.integers(0, N - 1)),
    st.tuples(st.just("refresh"), st.lists(st.integers(0, N - 1), max_size=3)),
    st.tuples(st.just("drop_all"),),
)


def _run(pool: BlockPool, op: Any, old: bool) -> Any:
    kind = op[0]
    try:
        if kind == "allocate":
            return (_old_allocate if old else BlockPool.allocate)(pool, op[1])
        if kind == "free":
            (_old_free if old else BlockPool.free)(pool, op[1], evict_first=op[2])
        elif kind == "free_pinned":  # the pinned ids, as a tail-first release would name them
            pinned = [b.block_id for b in pool._blocks if b.ref_cnt][: op[1]]
            (_old_free if old else BlockPool.free)(pool, pinned[::-1], evict_first=op[2])
        elif kind == "touch":
            pool.touch(op[1])
        elif kind == "add_keys":
            ids = [c for c, _ in op[1]]
            keys = [k for _, k in op[1]]
            depths = {"none": None, "same": [3 * c + 1 for c in ids],
                      "short": [5] * (len(ids) // 2), "empty": []}[op[2]]
            if old:
                _old_add_keys(pool, ids, keys, depths)
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


@pytest.mark.parametrize("size", [N, 12])
@pytest.mark.parametrize("eviction", ORDERS, ids=lambda e: e.value)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(op_st, max_size=40))
def test_pool_fast_paths_match_the_general_paths(eviction: Eviction, size: int,
                                                 ops: list[Any]) -> None:
    new = BlockPool(size, enable_events=True, eviction=eviction)
    old = BlockPool(size, enable_events=True, eviction=eviction)
    for op in ops:
        before = _state(new)
        got = _run(new, op, old=False)
        want = _run(old, op, old=True)
        assert got == want, op
        assert _state(new) == _state(old), op
        assert new.take_events() == old.take_events(), op
        new.check_invariants()
        old.check_invariants()
        if got is not None and isinstance(got, tuple):  # refused: nothing changed
            assert _core(new) == _core(before), op  # (exhausted counts a refusal)


# ---- edge cases the fast paths once got wrong -----------------------------------------

def test_add_keys_non_int_id_midway_changes_nothing() -> None:
    """Hazard: ``add_keys`` promises 'everything is checked first: ConfigError and nothing
    changed', but checks ids only by ``min``/``max``: an id of another numeric type inside
    the range (``1.0``) passes, and the loop indexes ``ids[0]`` before ``blocks[1.0]``
    raises TypeError -- a refused call that changed the index (and not ConfigError)."""
    pool = BlockPool(4, enable_events=True)
    pool.allocate(2)
    before = _state(pool)
    with pytest.raises(ConfigError):
        pool.add_keys([0, 1.0], [H[0], H[1]])  # type: ignore[list-item]
    assert _state(pool) == before
    assert pool.get_cached(H[0]) is None
    assert pool.take_events() == []


# ---- phase B's hand-over ------------------------------------------------------------

# ---- a store's completion: add_keys (one group) against the pairs one by one ---------

class _Gpu:
    """A GPU pool protocol stand-in whose blocks answer fixed hashes."""

    def __init__(self, hashes: dict[int, tuple[Any, ...]]) -> None:
        self._h = hashes

    def block_hashes(self, block_id: int) -> tuple[Any, ...]:
        return self._h.get(block_id, ())


def _planner(cpu: BlockPool, gpu: _Gpu, single: bool) -> Any:
    from kvshm.offload.counters import ManagerCounters
    from kvshm.offload.groups import GroupSet
    from kvshm.offload.stores import StorePlanner
    from kvshm.types import KVGroup

    gs = GroupSet((KVGroup.full(),), 16)
    gs.single = single  # False: the general pairs-one-by-one path
    return StorePlanner(cpu, gpu, gs, 16, ManagerCounters(), 4, set())  # type: ignore[arg-type]


def _register_both(keys: list[Any], gh: dict[int, tuple[Any, ...]]) -> list[Any]:
    out = []
    for single in (True, False):
        cpu = BlockPool(4, enable_events=True, eviction=Eviction.DEPTH_AGED)
        cpu.allocate(len(keys))
        plan = _planner(cpu, _Gpu(gh), single)
        try:
            plan._register(list(range(len(keys))), list(range(len(keys))),
                           [0] * len(keys), keys, list(range(len(keys))))
            err = None
        except ConfigError as exc:
            err = type(exc).__name__
        out.append((err, _state(cpu), cpu.take_events(), plan.counters.stored_blocks))
    return out


def test_register_one_group_matches_general_for_good_keys() -> None:
    fast, general = _register_both([H[0], H[1], H[2]], {0: (H[0],), 2: (H[2],)})
    assert fast == general
    assert fast[1][2][:3] == [0, 1, 2]


def test_register_refused_key_changes_the_same_in_both_paths() -> None:
    """Hazard (the two paths diverged): a key that is not bytes (a lazy store's key is the GPU
    pool's own ``block_hashes(b)[0]``, unchecked) makes the one-group path's
    ``add_keys`` refuse the whole job (nothing indexed), while the general path
    ``add_hashes`` pair by pair indexes the blocks before it and then refuses: the two
    paths leave different CPU indexes. The rule (a refused call changes nothing) says the
    general path is the one to fix: check every key before indexing any."""
    fast, general = _register_both([H[0], "h1", H[2]], {0: (H[0],), 1: ("h1",), 2: (H[2],)})
    assert fast[0] == general[0] == "ConfigError"
    assert fast[1] == general[1]  # general indexed block 0 under H[0]; fast nothing
