"""The hot paths' shortcuts (issue 15, "O(changed) per step") answer exactly what the
general paths answer: VllmGpuBlocks' slot read and bulk read."""

from __future__ import annotations

from typing import Any

import pytest

from kvshm.integrations.vllm.blocks import VllmGpuBlocks, plain_hash

H = [bytes([i]) * 16 for i in range(24)]


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


