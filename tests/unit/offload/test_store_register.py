"""A store's completion on the CPU tier: ``HashIndex.add_keys`` (the pool's batch call,
used by tools and tests) leaves exactly what ``add_hashes`` + ``set_depth`` one by one
leave, and refuses before any change; ``StorePlanner._register`` checks every key before
it indexes any, so a refused job indexes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.config import Eviction
from kvshm.errors import ConfigError
from kvshm.offload.pool import BlockPool

H = [bytes([i]) * 16 for i in range(12)]


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


class _Gpu:
    """A GPU pool protocol stand-in whose blocks answer fixed hashes."""

    def __init__(self, hashes: dict[int, tuple[Any, ...]]) -> None:
        self._h = hashes

    def block_hashes(self, block_id: int) -> tuple[Any, ...]:
        return self._h.get(block_id, ())


def _planner(cpu: BlockPool, gpu: _Gpu) -> Any:
    from kvshm.offload.counters import ManagerCounters
    from kvshm.offload.groups import GroupSet
    from kvshm.offload.stores import StorePlanner
    from kvshm.types import KVGroup

    gs = GroupSet((KVGroup.full(),), 16)
    return StorePlanner(cpu, gpu, gs, 16, ManagerCounters(), 4, set())  # type: ignore[arg-type]


def _register(keys: list[Any], gh: dict[int, tuple[Any, ...]]) -> Any:
    """Register a store of ``len(keys)`` blocks (GPU id i into CPU id i, depth i): the
    refusal's name (None), the CPU tier's state, its events, the stored count."""
    cpu = BlockPool(4, enable_events=True, eviction=Eviction.DEPTH_AGED)
    cpu.allocate(len(keys))
    cpu.take_events()
    plan = _planner(cpu, _Gpu(gh))
    before = _state(cpu)
    try:
        plan._register(list(range(len(keys))), list(range(len(keys))),
                       [0] * len(keys), keys, list(range(len(keys))))
        err = None
    except ConfigError as exc:
        err = type(exc).__name__
    return err, before, _state(cpu), cpu.take_events(), plan.counters.stored_blocks


def test_register_indexes_each_block_under_its_key_with_its_depth() -> None:
    err, _, after, events, stored = _register([H[0], H[1], H[2]], {0: (H[0],), 2: (H[2],)})
    assert err is None and stored == 3 and len(events) == 3
    assert after[2][:3] == [0, 1, 2]  # get_cached of H[0..2]


def test_register_with_a_refused_key_indexes_nothing() -> None:
    """Hazard: a key that is not bytes (a lazy store's key is the GPU pool's own
    ``block_hashes(b)[0]``, unchecked) once left the blocks before it indexed; every
    key is checked before any is indexed."""
    err, before, after, events, stored = _register(
        [H[0], "h1", H[2]], {0: (H[0],), 1: ("h1",), 2: (H[2],)})
    assert err == "ConfigError"
    assert after == before and events == [] and stored == 0
