"""The layout fingerprint (:mod:`kvshm.remote.fingerprint`): what two engines must share
to read each other's blocks from one server or one disk directory.

Hazard "a layout fingerprint that missed the shape and covered the device block count"
(a hostile probe, narrated per test)."""

from __future__ import annotations

import torch

from kvshm.ipc.protocol import LayoutSpec
from kvshm.layout import KVLayout
from kvshm.remote.fingerprint import layout_fingerprint
from kvshm.types import KVGroup

GROUPS = (KVGroup.full(),)


def spec(*shape: int, blocks: int = 32, dtype: torch.dtype = torch.float16) -> LayoutSpec:
    """A rank's layout: one region of ``blocks`` blocks of ``shape``."""
    return KVLayout.from_tensors([torch.zeros((blocks, *shape), dtype=dtype)]).to_spec()


def fp(layouts: dict[int, LayoutSpec], parallel: tuple[int, int] = (1, 1),
       model: str = "") -> str:
    return layout_fingerprint(model, 16, GROUPS, layouts, parallel)


def test_regions_of_equal_size_but_another_block_shape_do_not_share() -> None:
    """Engine A's blocks are [2, 4, 2, 32] fp16 (1,024 bytes), engine B's [2, 4, 4, 16]
    and C's [4, 2, 1, 64]: as many bytes, other KV. The fingerprint covered bytes per
    block, block count and dtype only, so B and C hit A's prompt through one Valkey
    server (and one disk directory) and loaded its 8 blocks bit for bit: wrong KV,
    no error. The block shape is covered now."""
    a, b, c = spec(2, 4, 2, 32), spec(2, 4, 4, 16), spec(4, 2, 1, 64)
    assert a.bytes_per_block == b.bytes_per_block == c.bytes_per_block == 1024
    assert len({fp({0: a}), fp({0: b}), fp({0: c})}) == 3


def test_a_model_split_over_tp_or_over_pp_does_not_share() -> None:
    """One model (4 layers x 4 heads), each rank one tensor flattened per block: at
    tp=2 a rank holds 2 heads of every layer, at pp=2 every head of 2 layers -- the
    same shapes and bytes, other KV. The probe's pp engine loaded the tp shards (16 of
    16 rows foreign). The degrees are covered now."""
    ranks = {0: spec(256), 1: spec(256)}
    assert fp(ranks, (2, 1)) != fp(ranks, (1, 2))


def test_the_device_block_count_does_not_change_the_fingerprint() -> None:
    """The count of a rank's device blocks says nothing about what a block holds
    (vLLM's moves with gpu_memory_utilization, profiling and the GPU), but it was
    covered: a replica with 48 device blocks missed everything a 32-block one had put
    on the server, and a restart that only changed the count re-initialised the disk
    tier's slabs (every slot lost, for good). Equal now; the dtype still counts."""
    assert fp({0: spec(2, 4, 2, 32, blocks=32)}) == fp({0: spec(2, 4, 2, 32, blocks=48)})
    assert fp({0: spec(2, 4, 2, 32)}) != fp({0: spec(2, 4, 2, 32, dtype=torch.bfloat16)})
