"""A store completion's batch call decides exactly what the general path decides:
``BlockPool.add_keys`` against ``add_hashes`` + ``set_depth`` one by one."""

from __future__ import annotations

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


