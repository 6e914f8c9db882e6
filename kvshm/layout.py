"""A rank's KV layout: byte regions with blocks as dim 0, and host-pool sizing from specs.

A *region* is a ``uint8`` view ``[num_blocks, bytes_per_block]`` of one KV tensor: row
``b`` holds block ``b``'s bytes in that tensor (opaque bytes; their inner layout depends on
dtype and platform). Block id ``b`` means row ``b`` of *every* region, so every region of a
rank has the same ``num_blocks``. Rows may be further apart than ``bytes_per_block``
(``row_stride >= bytes_per_block``) but each row is contiguous.

K/V-outer tensors are detected by an explicit argument, never by a shape rule:
``KVLayout.from_tensors(ts, kv_outer=True)`` (or one flag per tensor) says dim 0 of that
tensor is the K/V index and dim 1 the block index; it then gives one region per leading
index. Regions are deduplicated by ``(device, data_ptr)``: vLLM sometimes hands the same
tensor to several layers.

Scheduler side (specs only, no tensors): :func:`host_pool_plan` lays out one rank's host
pool (each region's rows contiguous, every region starting 4096-aligned);
:func:`max_cpu_blocks` and :func:`reconcile` size the CPU tier. This module is a leaf: it
imports only torch, :mod:`kvshm.ipc.protocol`, :mod:`kvshm.errors` and :mod:`kvshm.shm`
(dtype names; ``shm`` is the lower leaf and never imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import torch

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import LayoutSpec, RegionSpec
from kvshm.shm import dtype_name

__all__ = [
    "HOST_ALIGN",
    "KVLayout",
    "host_pool_plan",
    "max_cpu_blocks",
    "reconcile",
]

#: Every host-pool region starts at a multiple of this (and the pool's size is one).
HOST_ALIGN: Final = 4096


def _byte_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """``t`` (blocks as dim 0, each block contiguous) as a uint8 ``[n, bytes_per_block]`` view."""
    if t.dim() < 1 or t.shape[0] == 0 or t[0].numel() == 0:
        raise ConfigError(f"{what}: a KV tensor needs blocks of at least one byte as dim 0, "
                          f"got shape {tuple(t.shape)}")
    if not t[0].is_contiguous():
        raise ConfigError(f"{what}: each block must be contiguous in memory "
                          f"(shape {tuple(t.shape)}, strides {t.stride()})")
    n = t.shape[0]
    # A contiguous block makes this a view (never a copy); a 1-element row may report any
    # inner stride, so pin it to 1 for the dtype view.
    rows = t.reshape(n, -1)
    rows = rows.as_strided((n, rows.shape[1]), (rows.stride(0), 1))
    return rows.view(torch.uint8)


class KVLayout:
    """A rank's KV regions (device side). Immutable after construction.

    Invariants: at least one region; every region is a uint8 tensor ``[num_blocks,
    bytes_per_block_r]`` with ``stride(1) == 1`` on one device; all regions have the same
    ``num_blocks``; no two regions share ``(device, data_ptr)``.
    """

    __slots__ = ("device", "dtypes", "regions", "shapes")

    def __init__(self, regions: Sequence[torch.Tensor],
                 dtypes: Sequence[str] | None = None,
                 shapes: Sequence[tuple[int, ...]] | None = None) -> None:
        if not regions:
            raise ConfigError("a KV layout needs at least one region")
        for i, r in enumerate(regions):
            if r.dtype != torch.uint8 or r.dim() != 2 or (r.shape[1] > 1 and r.stride(1) != 1):
                raise ConfigError(f"region {i} must be a uint8 [num_blocks, bytes] view with "
                                  f"contiguous rows, got {r.dtype} {tuple(r.shape)} {r.stride()}")
        devices = {r.device for r in regions}
        if len(devices) != 1:
            raise ConfigError(f"KV regions span several devices: {sorted(map(str, devices))}")
        counts = sorted({int(r.shape[0]) for r in regions})
        if len(counts) != 1:
            raise ConfigError(f"KV regions disagree on the number of blocks: {counts}")
        if counts[0] <= 0:
            raise ConfigError("KV regions have zero blocks")
        #: uint8 ``[num_blocks, bytes_per_block_r]`` views, in first-seen order.
        self.regions: tuple[torch.Tensor, ...] = tuple(regions)
        #: The source tensors' dtype names (informational; blocks are opaque bytes).
        self.dtypes: tuple[str, ...] = (tuple(dtypes) if dtypes is not None
                                        else ("uint8",) * len(regions))
        if len(self.dtypes) != len(self.regions):
            raise ConfigError(f"{len(self.dtypes)} dtype names for {len(self.regions)} regions")
        #: Each region's block shape in its source dtype (C order: what a row's bytes
        #: mean; without the source tensors, its bytes).
        self.shapes: tuple[tuple[int, ...], ...] = (
            tuple(tuple(map(int, sh)) for sh in shapes) if shapes is not None
            else tuple((int(r.shape[1]),) for r in regions))
        if len(self.shapes) != len(self.regions):
            raise ConfigError(f"{len(self.shapes)} block shapes for {len(self.regions)} regions")
        #: The device every region lives on.
        self.device: torch.device = next(iter(devices))

    @classmethod
    def from_tensors(cls, tensors: Sequence[torch.Tensor], *,
                     kv_outer: bool | Sequence[bool] = False) -> KVLayout:
        """Regions of ``tensors`` (blocks as dim 0; with ``kv_outer``, K/V as dim 0, blocks dim 1).

        ``kv_outer`` is one flag for all tensors or one per tensor. Duplicates by
        ``(device, data_ptr)`` are dropped (first kept); two regions at one address with
        different shapes or strides are a :class:`ConfigError`.
        """
        flags = [kv_outer] * len(tensors) if isinstance(kv_outer, bool) else list(kv_outer)
        if len(flags) != len(tensors):
            raise ConfigError(f"{len(flags)} kv_outer flags for {len(tensors)} tensors")
        seen: dict[tuple[str, int], torch.Tensor] = {}
        regions: list[torch.Tensor] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        for i, (t, outer) in enumerate(zip(tensors, flags)):
            parts = [(f"tensor {i}", t)] if not outer else [
                (f"tensor {i}[{j}]", t[j]) for j in range(t.shape[0] if t.dim() else 0)]
            if outer and (t.dim() < 2 or not parts):
                raise ConfigError(f"tensor {i}: a K/V-outer tensor needs shape [kv, blocks, ...], "
                                  f"got {tuple(t.shape)}")
            for what, part in parts:
                view = _byte_rows(part, what)
                key = (str(view.device), view.data_ptr())
                twin = seen.get(key)
                if twin is None:
                    seen[key] = view
                    regions.append(view)
                    dtypes.append(dtype_name(t.dtype))
                    shapes.append(tuple(part.shape[1:]))
                elif twin.shape != view.shape or twin.stride() != view.stride():
                    raise ConfigError(f"{what} starts where an earlier region does but has another "
                                      f"shape: {tuple(view.shape)} vs {tuple(twin.shape)}")
        return cls(regions, dtypes, shapes)

    @property
    def num_blocks(self) -> int:
        """Blocks per region (the same for every region)."""
        return int(self.regions[0].shape[0])

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id covers across every region."""
        return sum(int(r.shape[1]) for r in self.regions)

    def to_spec(self) -> LayoutSpec:
        """The layout as wire data (bytes per block, block count, dtype and block shape
        per region)."""
        return LayoutSpec(tuple(RegionSpec(int(r.shape[1]), int(r.shape[0]), d, sh)
                                for r, d, sh in zip(self.regions, self.dtypes, self.shapes,
                                                    strict=True)))

    def check_spec(self, spec: LayoutSpec) -> None:
        """Raise :class:`ConfigError` unless ``spec`` has this layout's region byte sizes."""
        ours = [r.bytes_per_block for r in self.to_spec().regions]
        theirs = [r.bytes_per_block for r in spec.regions]
        if ours != theirs:
            raise ConfigError(f"layout mismatch: this rank has regions of {ours} bytes per block, "
                              f"the spec says {theirs}")

    def __repr__(self) -> str:
        return (f"KVLayout({len(self.regions)} regions, {self.num_blocks} blocks x "
                f"{self.bytes_per_block} B, device={self.device})")


def _align(n: int) -> int:
    return -(-n // HOST_ALIGN) * HOST_ALIGN


def _check_spec(spec: LayoutSpec) -> None:
    if not spec.regions:
        raise ConfigError("a layout spec needs at least one region")
    bad = [r.bytes_per_block for r in spec.regions if r.bytes_per_block <= 0]
    if bad:
        raise ConfigError(f"layout spec has regions of non-positive size: {bad}")


def host_pool_plan(spec: LayoutSpec, num_cpu_blocks: int) -> tuple[tuple[int, ...], int]:
    """Per-region byte offsets in a rank's host pool, and the pool's total size.

    Region ``r`` holds ``num_cpu_blocks`` contiguous rows of ``spec.regions[r]
    .bytes_per_block`` bytes from ``offsets[r]``; offsets and the total are multiples of
    :data:`HOST_ALIGN`; regions are in spec order and do not overlap.
    """
    _check_spec(spec)
    if num_cpu_blocks <= 0:
        raise ConfigError(f"num_cpu_blocks must be positive, got {num_cpu_blocks}")
    offsets = []
    end = 0
    for r in spec.regions:
        start = _align(end)
        offsets.append(start)
        end = start + num_cpu_blocks * r.bytes_per_block
    return tuple(offsets), _align(end)


#: The scheduler's own memory per CPU block, beside the block's bytes: its record in the
#: pool and the eviction order (137 B measured on an empty LRU pool), an index entry and
#: its hash key once filled, a ghost entry once evicted -- rounded up. Counted in the fit
#: of all ranks' pools: with tiny blocks (a 2-byte shard) this was the larger part, and
#: a 1 GiB tier of them (512M blocks) ended the scheduler in the OOM killer instead of a
#: ConfigError (a hostile probe).
SCHEDULER_BYTES_PER_BLOCK: Final = 512


def _fits(specs: Sequence[LayoutSpec], n: int, available_bytes: int, extra: int) -> bool:
    """``n`` blocks of every rank's host pool, plus ``extra`` bytes a block, fit."""
    return sum(host_pool_plan(s, n)[1] for s in specs) + n * extra <= available_bytes


def _max_fitting(specs: Sequence[LayoutSpec], available_bytes: int, *,
                 scheduler: bool = False) -> int:
    """Largest ``n`` whose host pools for all ``specs`` together fit (0 if none); with
    ``scheduler``, the scheduler's bookkeeping of them too (the machine's whole budget:
    :data:`SCHEDULER_BYTES_PER_BLOCK`; a per-rank byte budget counts the pools only)."""
    extra = SCHEDULER_BYTES_PER_BLOCK if scheduler else 0
    per_block = sum(s.bytes_per_block for s in specs) + extra
    lo, hi = 0, max(0, available_bytes) // per_block  # the answer is in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(specs, mid, available_bytes, extra):
            lo = mid
        else:
            hi = mid - 1
    return lo


def max_cpu_blocks(spec: LayoutSpec, available_bytes: int) -> int:
    """Most CPU blocks whose :func:`host_pool_plan` fits in ``available_bytes`` (>= 0)."""
    _check_spec(spec)
    return _max_fitting([spec], available_bytes)


def reconcile(specs: Sequence[LayoutSpec], cpu_bytes_per_rank: int | None,
              num_cpu_blocks: int | None, available_bytes: int) -> int:
    """The CPU tier's block count for all ranks (CPU block ``b`` is row ``b`` on every rank).

    ``available_bytes`` is what the host can give to *all* ranks' host pools together
    (every pool lives in this host's /dev/shm; the caller has already taken its margin).

    * ``num_cpu_blocks`` given: it must be positive and every rank's pool must fit
      together, else :class:`ConfigError` naming the count asked for and the count that
      fits. It takes precedence over ``cpu_bytes_per_rank``.
    * else ``cpu_bytes_per_rank`` given (positive): the minimum over ranks of what fits in
      that budget, lowered further if all pools together would not fit.
    * else: as many blocks as fit in ``available_bytes``.

    A result of zero blocks is a :class:`ConfigError`, never a silent empty tier.
    """
    if not specs:
        raise ConfigError("reconcile needs the layout of at least one rank")
    for s in specs:
        _check_spec(s)
    fitting = _max_fitting(specs, available_bytes, scheduler=True)
    where = (f"{available_bytes} bytes available for {len(specs)} rank(s) and the "
             f"scheduler's {SCHEDULER_BYTES_PER_BLOCK} bytes a block")
    if num_cpu_blocks is not None:
        if num_cpu_blocks <= 0:
            raise ConfigError(f"num_cpu_blocks must be positive, got {num_cpu_blocks}")
        if num_cpu_blocks > fitting:
            raise ConfigError(f"num_cpu_blocks={num_cpu_blocks} does not fit: at most {fitting} "
                              f"blocks fit in {where}")
        return num_cpu_blocks
    n = fitting
    if cpu_bytes_per_rank is not None:
        if cpu_bytes_per_rank <= 0:
            raise ConfigError(f"cpu_bytes_per_rank must be positive, got {cpu_bytes_per_rank}")
        n = min(n, min(_max_fitting([s], cpu_bytes_per_rank) for s in specs))
    if n <= 0:
        budget = f" (budget {cpu_bytes_per_rank} bytes per rank)" if cpu_bytes_per_rank else ""
        raise ConfigError(f"not even one CPU block fits in {where}{budget}; largest block is "
                          f"{max(s.bytes_per_block for s in specs)} bytes")
    return n
