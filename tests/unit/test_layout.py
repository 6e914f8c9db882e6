"""KVLayout regions (dedup, K/V-outer split, byte views) and host-pool sizing from specs."""

from __future__ import annotations

import pytest
import torch

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import LayoutSpec, RegionSpec
from kvshm.layout import HOST_ALIGN, KVLayout, host_pool_plan, max_cpu_blocks, reconcile
from kvshm.layout import SCHEDULER_BYTES_PER_BLOCK as SCHED


def spec(*sizes: int, blocks: int = 8) -> LayoutSpec:
    return LayoutSpec(tuple(RegionSpec(s, blocks, "uint8") for s in sizes))


def test_regions_are_byte_rows_of_each_block() -> None:
    t = torch.randn(10, 4, 8, dtype=torch.float32)
    layout = KVLayout.from_tensors([t])
    (r,) = layout.regions
    assert r.dtype == torch.uint8 and tuple(r.shape) == (10, 128)
    assert r.data_ptr() == t.data_ptr()
    assert torch.equal(r[3].view(torch.float32), t[3].flatten())
    assert layout.num_blocks == 10 and layout.bytes_per_block == 128
    assert layout.to_spec() == LayoutSpec((RegionSpec(128, 10, "float32", (4, 8)),))


def test_dedup_by_data_ptr() -> None:
    shared = torch.zeros(6, 16, dtype=torch.bfloat16)
    other = torch.zeros(6, 16, dtype=torch.bfloat16)
    layout = KVLayout.from_tensors([shared, other, shared, shared.view(6, 2, 8)])
    assert len(layout.regions) == 2
    assert [r.data_ptr() for r in layout.regions] == [shared.data_ptr(), other.data_ptr()]
    assert layout.bytes_per_block == 64


def test_same_address_with_another_shape_is_refused() -> None:
    base = torch.zeros(6, 16, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="another shape"):
        KVLayout.from_tensors([base, base[:, :8]])


def test_kv_outer_split_gives_one_region_per_leading_index() -> None:
    t = torch.arange(2 * 5 * 3, dtype=torch.int16).view(2, 5, 3)
    layout = KVLayout.from_tensors([t], kv_outer=True)
    assert len(layout.regions) == 2 and layout.num_blocks == 5
    assert torch.equal(layout.regions[1][4].view(torch.int16), t[1, 4])
    # Without the flag the K/V dim would be taken for blocks: a different layout.
    flat = KVLayout.from_tensors([t])
    assert flat.num_blocks == 2 and len(flat.regions) == 1


def test_kv_outer_per_tensor_flags() -> None:
    kv = torch.zeros(2, 4, 8)
    plain = torch.zeros(4, 3)
    layout = KVLayout.from_tensors([kv, plain], kv_outer=[True, False])
    assert [tuple(r.shape) for r in layout.regions] == [(4, 32), (4, 32), (4, 12)]
    with pytest.raises(ConfigError, match="flags"):
        KVLayout.from_tensors([kv, plain], kv_outer=[True])
    with pytest.raises(ConfigError, match="K/V-outer"):
        KVLayout.from_tensors([torch.zeros(4)], kv_outer=True)


def test_padded_rows_keep_their_stride() -> None:
    base = torch.arange(8 * 40, dtype=torch.int32).to(torch.uint8).view(8, 40)
    layout = KVLayout.from_tensors([base[:, :33]])
    (r,) = layout.regions
    assert tuple(r.shape) == (8, 33) and r.stride() == (40, 1)
    assert torch.equal(r[5], base[5, :33])


def test_bad_tensors_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="contiguous"):
        KVLayout.from_tensors([torch.zeros(8, 4, 4).transpose(1, 2)])
    with pytest.raises(ConfigError, match="number of blocks"):
        KVLayout.from_tensors([torch.zeros(8, 4), torch.zeros(9, 4)])
    with pytest.raises(ConfigError, match="at least one region"):
        KVLayout.from_tensors([])
    with pytest.raises(ConfigError, match="blocks of at least one byte"):
        KVLayout.from_tensors([torch.zeros(0, 4)])


def test_check_spec() -> None:
    layout = KVLayout.from_tensors([torch.zeros(4, 8, dtype=torch.uint8)])
    layout.check_spec(spec(8, blocks=4))
    with pytest.raises(ConfigError, match="layout mismatch"):
        layout.check_spec(spec(8, 8))


def test_host_pool_plan_aligns_regions() -> None:
    offsets, total = host_pool_plan(spec(100, 5000, 1), 3)
    assert offsets == (0, 4096, 4096 + 16384)
    assert total == 4096 + 16384 + 4096
    assert all(o % HOST_ALIGN == 0 for o in offsets) and total % HOST_ALIGN == 0
    ends = [o + 3 * r.bytes_per_block for o, r in zip(offsets, spec(100, 5000, 1).regions)]
    assert all(e <= n for e, n in zip(ends, offsets[1:] + (total,)))


@pytest.mark.parametrize("n", [0, -1])
def test_host_pool_plan_refuses_empty(n: int) -> None:
    with pytest.raises(ConfigError, match="positive"):
        host_pool_plan(spec(64), n)


def test_max_cpu_blocks_is_exact() -> None:
    s = spec(3000, 5000)
    for avail in (0, 4095, 8192, 123_456, 10_000_000):
        n = max_cpu_blocks(s, avail)
        assert n == 0 or host_pool_plan(s, n)[1] <= avail
        assert host_pool_plan(s, n + 1)[1] > avail


def test_reconcile_takes_the_minimum_over_ranks() -> None:
    small, big = spec(4096), spec(8192)
    assert reconcile([small, big], 64 * 4096, None, 1 << 30) == 32  # big fits 32 in 256 KiB
    # Everything that fits in the host's memory for both pools together, and the
    # scheduler's bookkeeping of each block.
    assert reconcile([small, big], None, None, (3 * 4096 + SCHED) * 10) == 10
    assert reconcile([small, big], None, None, (3 * 4096 + SCHED) * 10 - 1) == 9


def test_reconcile_is_capped_by_available_memory() -> None:
    assert reconcile([spec(4096)] * 2, 1 << 30, None, (2 * 4096 + SCHED) * 7) == 7


def test_reconcile_explicit_count() -> None:
    assert reconcile([spec(4096)] * 2, None, 5, 1 << 20) == 5
    with pytest.raises(ConfigError, match=r"num_cpu_blocks=200 does not fit: at most 120"):
        reconcile([spec(4096)] * 2, None, 200, 1 << 20)
    for bad in (0, -3):
        with pytest.raises(ConfigError, match="positive"):
            reconcile([spec(4096)], None, bad, 1 << 20)


def test_tiny_blocks_count_the_schedulers_bookkeeping() -> None:
    """A 2-byte shard per block (a tiny model) and a 1 GiB tier: 512M blocks whose
    shared memory fit, but whose records in the scheduler (pool, order, index: hundreds
    of bytes each) did not -- the OOM killer ended the scheduler 20 s into its start (a
    hostile probe). The fit counts :data:`SCHEDULER_BYTES_PER_BLOCK` per block: at most
    what the budget holds of both, and the explicit count is refused in one line."""
    tiny = LayoutSpec((RegionSpec(2, 64, "uint8"),))
    budget = 8 << 30
    n = reconcile([tiny], 1 << 30, None, budget)
    assert budget // (SCHED + 2) - 4096 <= n <= budget // (SCHED + 2)  # (pool alignment)
    with pytest.raises(ConfigError, match="the scheduler's 512 bytes a block"):
        reconcile([tiny], None, 512 << 20, budget)


def test_reconcile_errors() -> None:
    with pytest.raises(ConfigError, match="at least one rank"):
        reconcile([], None, None, 1 << 20)
    with pytest.raises(ConfigError, match="cpu_bytes_per_rank"):
        reconcile([spec(4096)], 0, None, 1 << 20)
    with pytest.raises(ConfigError, match="not even one CPU block"):
        reconcile([spec(1 << 20)], None, None, 1 << 19)
    with pytest.raises(ConfigError, match="non-positive"):
        reconcile([spec(0)], None, None, 1 << 20)
