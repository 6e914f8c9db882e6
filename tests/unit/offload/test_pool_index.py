"""The block pool's hash index alone (kvshm.offload.pool_index.HashIndex): entries per
hash in registration order, the blocks' ``hashes`` kept in agreement, events, and
refusals that change nothing -- over plain ``Block`` records, without a ``BlockPool``."""

from __future__ import annotations

import pytest

from kvshm.errors import ConfigError
from kvshm.offload.blocks import Block, BlockRemoved, BlockStored, PoolEvent
from kvshm.offload.pool_index import HashIndex

H = [bytes([i]) * 32 for i in range(8)]


def _index(n: int = 4, *, events: bool = True) -> tuple[HashIndex, list[Block],
                                                        list[PoolEvent]]:
    blocks = [Block(i) for i in range(n)]
    log: list[PoolEvent] = []
    return HashIndex(blocks, log if events else None), blocks, log


def test_the_earliest_registered_block_answers_a_hash_until_it_is_unindexed() -> None:
    idx, blocks, _ = _index()
    idx.add_hashes(2, [H[0]])
    idx.add_hashes(1, [H[0], H[1]])
    assert idx.get_cached(H[0]) == 2 and idx.entries[H[0]] == {2: None, 1: None}
    idx.remove_hashes(2)
    assert idx.get_cached(H[0]) == 1 and idx.entries[H[0]] == {1: None}
    assert blocks[2].hashes == () and blocks[1].hashes == (H[0], H[1])
    assert len(idx) == 2


def test_a_run_stops_at_the_first_hash_not_indexed() -> None:
    idx, _, _ = _index()
    idx.add_keys([3, 0, 1], [H[0], H[1], H[3]])
    assert idx.cached_run(H, 0, 4) == [3, 0]
    assert idx.cached_run(H, 3, 4) == [1]
    assert H[1] in idx.cached_keys and idx.is_cached(H[3]) and not idx.is_cached(H[2])


def test_every_change_is_one_event_in_call_order() -> None:
    idx, _, log = _index()
    idx.add_hashes(0, [H[0], H[1]])
    idx.add_keys([1], [H[2]])
    idx.drop_all_hashes()
    assert log == [BlockStored(0, (H[0], H[1])), BlockStored(1, (H[2],)),
                   BlockRemoved(0, (H[0], H[1])), BlockRemoved(1, (H[2],))]
    assert not idx.entries


def test_add_keys_sets_the_depths_and_matches_the_one_by_one_calls_without_events() -> None:
    idx, blocks, _ = _index(events=False)
    idx.add_keys([2, 3], [H[4], H[5]], [7, 8])
    assert [b.depth for b in blocks[2:]] == [7, 8]
    one, blocks1, _ = _index(events=False)
    one.add_hashes(2, [H[4]])
    one.add_hashes(3, [H[5]])
    assert one.entries == idx.entries
    assert [b.hashes for b in blocks1] == [b.hashes for b in blocks]


def test_a_refused_add_keys_changes_nothing() -> None:
    idx, blocks, log = _index()
    with pytest.raises(ConfigError, match="unknown block id 9"):
        idx.add_keys([0, 9], [H[0], H[1]])
    with pytest.raises(ConfigError, match="must be bytes"):
        idx.add_keys([0, 1], [H[0], "x"])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="2 block ids but 1 keys"):
        idx.add_keys([0, 1], [H[0]])
    assert not idx.entries and not log and all(b.hashes == () for b in blocks)
    with pytest.raises(ConfigError, match="unknown block id"):
        idx.block_hashes(4)
