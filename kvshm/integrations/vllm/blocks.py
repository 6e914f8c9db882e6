"""vLLM's GPU block pool as kvshm's ``GpuBlocks``, and a rank's KV regions from vLLM's
KV cache tensors. Duck-typed (no vLLM import), so both are testable without vLLM.

:class:`VllmGpuBlocks` wraps ``vllm.v1.core.block_pool.BlockPool`` (scheduler process,
scheduler thread only: the pool is not thread-safe):

* ``touch`` / ``free`` are the pool's own ref counting (``touch`` takes a block out of
  the free queue; ``free_blocks`` appends hashed blocks at the LRU tail and prepends
  unhashed ones). vLLM has no ``evict_first``: after ``free_blocks`` each block that
  reached ref 0 is moved to the head of the free queue (``remove`` + ``prepend_n``), the
  given order kept, so the first id is evicted first.
* ``block_hashes`` are the block's primary ``block_hash`` plus its secondary hashes
  (``cached_block_hashes_by_block``), each stripped of vLLM's 4-byte group id suffix:
  kvshm qualifies plain hashes per group itself. The stripped primary is cached per block
  id with the hash object it came from: a call returns the cached tuple while the block
  still carries that very object (vLLM's hashes are immutable bytes, replaced, never
  changed in place), so the store path's two calls per block build no bytes
  (``block_hashes_of`` answers many ids in one call). A block with secondary hashes is
  built each time (rare: hybrid hash sizes). Where vLLM's
  ``KVCacheBlock.block_hash`` is the plain property over its ``_block_hash`` slot (checked
  once, on the pool's first block), the slot is read directly: the property call was a
  third of the call's cost on the store path.
* ``iter_free_from_lru`` walks the free queue from its head (next evicted first).
* ``num_blocks`` is the pool's size (its null block, id 0, included) and
  ``null_block_id`` that null block's id: vLLM puts it in a sliding-window group's table
  wherever a position holds no block, so it may appear there more than once.

:func:`kv_layout` turns ``register_kv_caches``' tensors into byte regions with blocks
as dim 0, from ``kv_cache_config.kv_cache_tensors``: layer ``l``'s block ``b`` of a
tensor starts at ``offset + l * layer_stride + b * block_stride`` bytes into its
backing storage. Layer-outermost tensors give one region per layer (rows of
``block_stride`` bytes); block-outermost tensors give one region whose rows hold every
layer's page. Regions are deduplicated by address (groups may overlay one allocation).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.shm import dtype_name

__all__ = ["KvRegions", "VllmGpuBlocks", "kv_layout", "plain_hash"]

_GROUP_SUFFIX = 4  # vLLM's BlockHashWithGroupId: hash bytes + 4-byte big-endian group id


def plain_hash(key: bytes) -> BlockHash:
    """vLLM's ``BlockHashWithGroupId`` without its group id (``get_block_hash``)."""
    return bytes(key[:-_GROUP_SUFFIX])


class VllmGpuBlocks:
    """``kvshm.types.GpuBlocks`` over a vLLM ``BlockPool`` (see the module docstring)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._blocks = pool.blocks
        self._queue = pool.free_block_queue
        self._secondary: Mapping[int, Iterable[bytes]] = getattr(
            pool, "cached_block_hashes_by_block", {})
        null = getattr(getattr(pool, "null_block", None), "block_id", None)
        self.null_block_id: int | None = null if isinstance(null, int) else None
        # by block id: vLLM's hash object last stripped, and its plain-hash tuple (two
        # lists: a hit reads one of each, a miss builds no pair); see the module docstring
        self._plain_of: list[object] = [None] * len(self._blocks)
        self._plain: list[tuple[BlockHash, ...]] = [()] * len(self._blocks)
        self._slot = _hash_in_slot(self._blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks in vLLM's pool; every id it hands out is below this."""
        return len(self._blocks)

    def touch(self, ids: Iterable[int]) -> None:
        """Ref +1 for each id (out of the free queue at its first ref)."""
        blocks = self._blocks
        self._pool.touch([blocks[i] for i in ids])

    def free(self, ids: Iterable[int], *, evict_first: bool = False) -> None:
        """Ref -1 for each id; ``evict_first``: freed blocks go to the queue's head."""
        blocks = [self._blocks[i] for i in ids]
        self._pool.free_blocks(blocks)
        if not evict_first:
            return
        freed = list({id(b): b for b in blocks if b.ref_cnt == 0 and not b.is_null}.values())
        if freed:
            for b in freed:
                self._queue.remove(b)
            self._queue.prepend_n(freed)

    def block_hashes(self, block_id: int) -> tuple[BlockHash, ...]:
        """The block's current plain hashes (primary first); empty if none."""
        b = self._blocks[block_id]
        primary = b._block_hash if self._slot else b.block_hash
        if primary is None:
            return ()
        if self._secondary:
            extra = self._secondary.get(block_id)
            if extra:
                return (plain_hash(primary), *(plain_hash(k) for k in extra))
        if self._plain_of[block_id] is primary:
            return self._plain[block_id]
        out = (primary[:-_GROUP_SUFFIX] if type(primary) is bytes else plain_hash(primary),)
        self._plain_of[block_id] = primary
        self._plain[block_id] = out
        return out

    def block_hashes_of(self, ids: Iterable[int]) -> list[tuple[BlockHash, ...]]:
        """:meth:`block_hashes` of each id, in one call: a block whose cached tuple is
        current (it still carries the hash object it was built from, or none was ever
        built and it carries none) is answered from the cache inline, any other by
        :meth:`block_hashes` (the store path's bulk reads: a selected run, a completed
        store)."""
        if self._secondary or not self._slot:
            return list(map(self.block_hashes, ids))
        blocks, plain_of, plain, one = self._blocks, self._plain_of, self._plain, self.block_hashes
        return [plain[b] if plain_of[b] is blocks[b]._block_hash else one(b) for b in ids]

    def iter_free_from_lru(self) -> Iterator[int]:
        """Ref-0 block ids, the next to be evicted first."""
        for b in self._queue.iter_blocks_after(None):
            yield b.block_id


def _hash_in_slot(blocks: Sequence[Any]) -> bool:
    """True where the blocks' ``block_hash`` is the plain property over a
    ``_block_hash`` slot (vLLM's ``KVCacheBlock``)."""
    if not blocks:
        return False
    cls = type(blocks[0])
    if (not isinstance(getattr(cls, "block_hash", None), property)
            or "_block_hash" not in getattr(cls, "__slots__", ())):
        return False
    b = blocks[0]
    return b.block_hash is getattr(b, "_block_hash", object())


def _byte_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``t``'s whole untyped storage (no copy)."""
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


def _meaning(t: torch.Tensor, num_blocks: int, block_stride: int) -> tuple[int, ...]:
    """What a layer tensor's block holds, for its region's recorded shape: the tensor's
    rank, its shape with the block dimension as -1 -- the one of ``num_blocks`` entries
    ``block_stride`` bytes apart, found by position: marking every dimension that merely
    equals ``num_blocks`` (a head size, say) made the fingerprint change with the block
    count (a review) -- and its dimensions' order in memory (largest stride first: a
    backend's permuted view is other bytes than the plain shape). Where no dimension
    has that stride, every dimension of ``num_blocks`` entries is marked."""
    size, strides = t.element_size(), tuple(t.stride())
    by_stride = [d for d in range(t.dim())
                 if t.shape[d] == num_blocks and strides[d] * size == block_stride]
    marked = set(by_stride[:1] or [d for d in range(t.dim()) if t.shape[d] == num_blocks])
    shape = [-1 if d in marked else int(n) for d, n in enumerate(t.shape)]
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    return (t.dim(), *shape, *order)


def _rows(flat: torch.Tensor, start: int, num_blocks: int, row_bytes: int,
          stride: int, what: str) -> torch.Tensor:
    end = start + (num_blocks - 1) * stride + row_bytes
    if start < 0 or end > flat.numel():
        raise ConfigError(f"{what}: blocks [{start}, {end}) fall outside the KV storage of "
                          f"{flat.numel()} bytes")
    return flat.as_strided((num_blocks, row_bytes), (stride, 1), start)


class KvRegions(NamedTuple):
    """A rank's regions (uint8 ``[num_blocks, bytes]`` rows) and what each row means:
    the dtype of the layers it covers and their shape, as the layout (and so the layout
    fingerprint) records it (:class:`kvshm.layout.KVLayout`)."""

    rows: list[torch.Tensor]
    dtypes: list[str]
    shapes: list[tuple[int, ...]]


def kv_layout(kv_caches: Mapping[str, torch.Tensor], kv_cache_tensors: Sequence[Any],
              num_blocks: int) -> KvRegions:
    """The regions covering every layer's KV (see module doc) and their meaning: each
    region's dtype, and its shape -- the count of layers it covers, then a covered layer
    tensor's (:func:`_meaning`). Two vLLM layouts of
    one model with as many bytes per block but another order (NHD against HND: other
    attention backends) are other KV: their rows alone told them apart by nothing, and
    they shared one remote tier (a review).

    ``kv_cache_tensors``: vLLM's ``KVCacheTensor`` records (``layers``, ``layer_stride``,
    ``block_stride``, ``offset``). ConfigError for a layer that is missing, a layer
    tensor that does not sit where its record says, or a layout kvshm cannot copy as
    whole blocks.
    """
    if num_blocks <= 0:
        raise ConfigError(f"vLLM's KV cache has {num_blocks} blocks")
    regions: list[torch.Tensor] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    seen: set[tuple[str, int]] = set()
    for i, rec in enumerate(kv_cache_tensors):
        layers = list(rec.layers)
        missing = [name for name in layers if name not in kv_caches]
        if missing:
            raise ConfigError(f"KV cache tensor {i}: layers {missing} were not registered")
        if not layers:
            continue
        first = kv_caches[layers[0]]
        flat = _byte_storage(first)
        start0 = first.data_ptr() - flat.data_ptr()
        lstride, bstride = int(rec.layer_stride), int(rec.block_stride)
        for li, name in enumerate(layers):
            t = kv_caches[name]
            if t.data_ptr() != flat.data_ptr() + start0 + li * lstride:
                raise ConfigError(f"KV cache tensor {i}: layer {name!r} does not start "
                                  f"layer_stride={lstride} bytes after the previous one in "
                                  "one allocation")
        shape = _meaning(first, num_blocks, bstride)
        if lstride >= num_blocks * bstride or len(layers) == 1:
            spans = [(start0 + li * lstride, bstride) for li in range(len(layers))]
            covered = 1
        elif lstride * len(layers) <= bstride:
            spans = [(start0, bstride)]
            covered = len(layers)
        else:
            raise ConfigError(f"KV cache tensor {i}: layer_stride {lstride} and block_stride "
                              f"{bstride} for {num_blocks} blocks interleave layers in a way "
                              "kvshm cannot copy as whole blocks")
        for li, (start, row) in enumerate(spans):
            key = (str(flat.device), flat.data_ptr() + start)
            if key in seen:
                continue
            seen.add(key)
            regions.append(_rows(flat, start, num_blocks, row, bstride,
                                 f"KV cache tensor {i} part {li}"))
            dtypes.append(dtype_name(first.dtype))
            shapes.append((covered, *shape))
    if not regions:
        raise ConfigError("no KV cache regions to offload")
    return KvRegions(regions, dtypes, shapes)
