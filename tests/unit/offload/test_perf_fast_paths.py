"""The hot paths' shortcuts (issue 15, "O(changed) per step") answer exactly what the
general paths answer: the one-group hit search and phase-B pairing, ``cached_run`` and
VllmGpuBlocks' slot read."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.errors import ConfigError
from kvshm.integrations.vllm.blocks import VllmGpuBlocks, plain_hash
from kvshm.offload.groups import GroupSet
from kvshm.offload.hits import Hit, assign, find_hit
from kvshm.offload.pool import BlockPool
from kvshm.types import KVGroup

H = [bytes([i]) * 16 for i in range(24)]


def _general(gs: GroupSet) -> GroupSet:
    """The same groups, with the one-group shortcut switched off."""
    out = GroupSet(gs.groups, 16)
    out.single = False
    return out


def _fields(hit: Hit | None) -> Any:
    if hit is None:
        return None
    return hit.start, hit.end, hit.cpu, hit.pinned, tuple(hit.hashes), hit.cause


@settings(max_examples=200, deadline=None)
@given(cached=st.sets(st.integers(0, 23)), seq=st.lists(st.integers(0, 23), max_size=12),
       start=st.integers(0, 12), cap=st.integers(0, 12), k=st.integers(1, 12))
def test_one_group_hit_and_assignment_equal_the_general_path(
        cached: set[int], seq: list[int], start: int, cap: int, k: int) -> None:
    pool = BlockPool(32)
    ids = pool.allocate(len(cached))
    for b, h in zip(ids, sorted(cached)):
        pool.add_hashes(b, [H[h]])
    gs = GroupSet((KVGroup.full(),), 16)
    assert gs.single
    hashes = [H[i] for i in seq]
    fast, slow = find_hit(pool, gs, hashes, start, cap), find_hit(pool, _general(gs), hashes,
                                                                  start, cap)
    assert _fields(fast) == _fields(slow)
    if fast is None or slow is None:
        return
    k = min(k, fast.end - fast.start)
    table = [[100 + p for p in range(fast.end + 2)]]
    one, other = assign(pool, gs, fast, table, k), assign(pool, _general(gs), slow, table, k)
    assert (one.cpu_ids, one.gpu_ids, one.failed) == (other.cpu_ids, other.gpu_ids,
                                                      other.failed)
    with pytest.raises(ConfigError):
        assign(pool, gs, fast, [table[0][:fast.start + k - 1]], k)


def test_cached_run_is_get_cached_up_to_the_first_miss() -> None:
    pool = BlockPool(8)
    ids = pool.allocate(3)
    for b, h in zip(ids, H):
        pool.add_hashes(b, [h])
    seq = [H[0], H[1], H[5], H[2]]
    assert pool.cached_run(seq, 0, 4) == [ids[0], ids[1]]
    assert pool.cached_run(seq, 1, 2) == [ids[1]]
    assert pool.cached_run(seq, 2, 4) == []
    assert pool.cached_run(seq, 3, 4) == [pool.get_cached(H[2])]


class _SlotBlock:
    __slots__ = ("_block_hash", "block_id")

    def __init__(self, i: int, h: bytes | None) -> None:
        self.block_id = i
        self._block_hash = h

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash


class _OtherBlock(_SlotBlock):
    __slots__ = ()

    @property
    def block_hash(self) -> bytes | None:  # not the slot: the property must be called
        return None if self._block_hash is None else b"x" * 20


class _Pool:
    def __init__(self, blocks: list[Any]) -> None:
        self.blocks = blocks
        self.free_block_queue = None


@pytest.mark.parametrize("cls", [_SlotBlock, _OtherBlock])
def test_vllm_blocks_read_the_slot_only_where_it_is_the_property(cls: type) -> None:
    blocks = [cls(0, None), cls(1, b"a" * 36)]
    gpu = VllmGpuBlocks(_Pool(blocks))
    assert gpu._slot is (cls is _SlotBlock)
    assert gpu.block_hashes(0) == ()
    want = (plain_hash(blocks[1].block_hash),)
    assert gpu.block_hashes(1) == want and gpu.block_hashes(1) is gpu.block_hashes(1)
    blocks[1]._block_hash = b"b" * 36  # re-hashed: a new object, a new answer
    assert gpu.block_hashes(1) == (plain_hash(blocks[1].block_hash),)


@pytest.mark.parametrize("cls", [_SlotBlock, _OtherBlock])
def test_vllm_blocks_bulk_read_answers_what_one_by_one_answers(cls: type) -> None:
    """``block_hashes_of`` against ``block_hashes`` per id, through re-hashes, a hash
    dropped, blocks never read, and secondary hashes appearing."""
    blocks = [cls(i, None if i % 3 == 0 else bytes([i]) * 36) for i in range(6)]
    pool = _Pool(blocks)
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


