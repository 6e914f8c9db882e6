"""The block pool's hash index: which blocks carry which prefix hashes.

:class:`HashIndex` is a component :class:`~kvshm.offload.pool.BlockPool` holds as
``pool.index`` (as vLLM's ``BlockPool`` holds its ``BlockHashToBlockMap``). It owns the
map from hash to block ids (``entries``) and writes only the ``hashes`` (and, in
:meth:`add_keys`, the ``depth``) of the pool's ``Block`` records, which it is handed
with the pool's event list; the reference counts and the free queue stay the pool's.
The pool keeps the index's calls as one-line hand-overs (its public API, the
``GpuBlocks`` protocol's ``block_hashes``); the manager's hot paths call ``pool.index``
directly.

Invariants (checked by :func:`kvshm.offload.blocks.check_pool`):

* The index maps a hash to the ids carrying it, in registration order: an entry is the
  id itself while one block carries the hash, else a dict used as an ordered set of the
  ids (once a second block carried the hash it stays a dict, of one id or more); never
  empty. :meth:`get_cached` answers the earliest registered block
  still carrying the hash.
* A block's ``hashes`` and the index agree both ways, at every return.
* Indexing never moves a block in the free queue; a call that refuses (``ConfigError``)
  has changed nothing (:meth:`add_keys` checks every id and key first).
* With ``enable_events``, every hash added or removed is one event, in call order.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Sequence
from itertools import repeat
from operator import attrgetter

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.offload.blocks import Block, BlockRemoved, BlockStored, IndexEntry, PoolEvent

__all__ = ["HashIndex"]

_HASHES = attrgetter("hashes")


class HashIndex:
    """See the module docstring. ``blocks``: the pool's records (id ``i`` at ``i``);
    ``events``: the pool's event list, appended to (None: events off)."""

    def __init__(self, blocks: list[Block], events: list[PoolEvent] | None) -> None:
        self._blocks = blocks
        self._events = events
        self.entries: dict[BlockHash, IndexEntry] = {}

    def __len__(self) -> int:
        """Distinct hashes indexed (what a lookup can hit)."""
        return len(self.entries)

    def block(self, block_id: int) -> Block:
        """The record of ``block_id`` (ConfigError for an unknown id)."""
        n = len(self._blocks)
        if type(block_id) is not int or not 0 <= block_id < n:
            raise ConfigError(f"unknown block id {block_id!r} (pool has {n} blocks)")
        return self._blocks[block_id]

    def block_hashes(self, block_id: int) -> tuple[BlockHash, ...]:
        """The hashes ``block_id`` is indexed under, in the order added; () if none."""
        return self.block(block_id).hashes

    def add_hashes(self, block_id: int, hashes: Iterable[BlockHash]) -> None:
        """Index ``block_id`` under each hash (ones it already carries are skipped).
        The block's place in the free queue does not change."""
        blocks = self._blocks
        if type(block_id) is not int or not 0 <= block_id < len(blocks):
            raise ConfigError(f"unknown block id {block_id!r} (pool has {len(blocks)} "
                              "blocks)")
        b = blocks[block_id]
        have = b.hashes
        new: list[BlockHash]
        if type(hashes) is list and len(hashes) == 1 and type(hashes[0]) is bytes:
            new = [] if hashes[0] in have else hashes  # a store's usual single key
        else:
            new = []
            for h in hashes:
                if not isinstance(h, bytes):
                    raise ConfigError(f"block hash must be bytes, got {type(h).__name__}")
                if h not in have and h not in new:
                    new.append(h)
        if not new:
            return
        index = self.entries
        for h in new:
            ids = index.get(h)
            if ids is None:
                index[h] = block_id
            elif isinstance(ids, dict):
                ids[block_id] = None
            else:
                index[h] = {ids: None, block_id: None}
        added = tuple(new)
        b.hashes = b.hashes + added
        if self._events is not None:
            self._events.append(BlockStored(block_id, added))

    def add_keys(self, ids: Sequence[int], keys: Sequence[BlockHash],
                 depths: Sequence[int] | None = None) -> None:
        """:meth:`add_hashes` ``(ids[i], [keys[i]])`` for each ``i`` in order, then
        :meth:`set_depth` ``(ids[i], depths[i])`` (as many as ``depths`` has; None:
        none): a store's completion, one call. Everything is checked first (ids,
        lengths, every key bytes): ConfigError and nothing changed. The index and the
        events end up exactly as the calls one by one leave them."""
        blocks = self._blocks
        n = len(blocks)
        if len(keys) != len(ids):
            raise ConfigError(f"{len(ids)} block ids but {len(keys)} keys")
        if not ids:
            return
        if set(map(type, ids)) != {int}:  # 1.0 or True would pass the range test
            bad_id = next(i for i in ids if type(i) is not int)
            raise ConfigError(f"block id must be an int, got {bad_id!r}")
        if min(ids) < 0 or max(ids) >= n:
            bad = next(i for i in ids if not 0 <= i < n)
            raise ConfigError(f"unknown block id {bad!r} (pool has {n} blocks)")
        if depths and (set(map(type, depths)) != {int} or min(depths) < 0):
            bad_d = next(d for d in depths if type(d) is not int or d < 0)
            raise ConfigError(f"a depth must be an int >= 0, got {bad_d!r}")
        if not all(map(isinstance, keys, repeat(bytes))):
            bad_key = next(k for k in keys if not isinstance(k, bytes))
            raise ConfigError(f"block hash must be bytes, got {type(bad_key).__name__}")
        setdefault = self.entries.setdefault
        events = self._events
        dep: Iterable[int] = repeat(0)
        fused = depths is not None and len(depths) == len(ids)  # else set after
        if fused and depths is not None:
            dep = depths
            if events is None and self._add_new_keys(ids, keys, depths):
                return
        for c, k, d in zip(ids, keys, dep):
            b = blocks[c]
            if fused:
                b.depth = d
            have = b.hashes
            if k in have:
                continue
            b.hashes = (*have, k) if have else (k,)
            got = setdefault(k, c)  # one probe: c itself where k was not indexed
            if got is not c:
                if isinstance(got, dict):
                    got[c] = None
                else:
                    self.entries[k] = {got: None, c: None}
            if events is not None:
                events.append(BlockStored(c, (k,)))
        if depths and not fused:
            for c, d in zip(ids, depths):
                blocks[c].depth = d

    def _add_new_keys(self, ids: Sequence[int], keys: Sequence[BlockHash],
                      depths: Sequence[int]) -> bool:
        """:meth:`add_keys`' usual case, a store's completion without events, in bulk:
        when the ids and keys are distinct, no key is indexed and no block carries a
        hash, each block gets its key and depth and the index its entries in one
        ``update`` (what the calls one by one do then); else False, nothing changed."""
        index = self.entries
        n = len(ids)
        if (len(set(keys)) != n or len(set(ids)) != n or not index.keys().isdisjoint(keys)):
            return False
        blocks = list(map(self._blocks.__getitem__, ids))
        if any(map(_HASHES, blocks)):
            return False
        for b, k, d in zip(blocks, keys, depths):
            b.hashes = (k,)
            b.depth = d
        index.update(zip(keys, ids))
        return True

    def remove_hashes(self, block_id: int) -> None:
        """Drop every hash of ``block_id`` (BlockRemoved); it stays where it is."""
        b = self.block(block_id)
        if b.hashes:
            self.unindex(b)

    def unindex(self, b: Block) -> None:
        """Drop every hash of ``b`` (it has one or more): BlockRemoved."""
        index = self.entries
        for h in b.hashes:
            ids = index[h]
            if isinstance(ids, dict):
                del ids[b.block_id]
                if not ids:
                    del index[h]
            else:
                assert ids == b.block_id, "index entry names another block"
                del index[h]
        if self._events is not None:
            self._events.append(BlockRemoved(b.block_id, b.hashes))
        b.hashes = ()

    def get_cached(self, h: BlockHash) -> int | None:
        """The earliest registered block still carrying ``h``, or None."""
        ids = self.entries.get(h)
        if isinstance(ids, dict):
            return next(iter(ids))
        return ids

    def cached_run(self, hashes: Sequence[BlockHash], start: int, end: int) -> list[int]:
        """:meth:`get_cached` of ``hashes[start]``, ``hashes[start + 1]``, ... up to the
        first hash not cached or ``end`` (exclusive): one call for a lookup's whole run
        (the index never keeps an empty entry, so a present entry names a block)."""
        get = self.entries.get
        out: list[int] = []
        for p in range(start, end):
            ids = get(hashes[p])
            if ids is None:
                break
            out.append(next(iter(ids)) if isinstance(ids, dict) else ids)
        return out

    def is_cached(self, h: BlockHash) -> bool:
        return h in self.entries

    @property
    def cached_keys(self) -> KeysView[BlockHash]:
        """A live view of the hashes :meth:`is_cached` answers True for (``h in view``
        is the same test without a call: the store planner's hot path)."""
        return self.entries.keys()

    def drop_all_hashes(self) -> None:
        """Make every block uncached (reset): BlockRemoved for each hashed block. Free
        blocks keep their queue order; none is cached any more, so all of them are
        plain reuse-first blocks. O(hashed blocks)."""
        seen: dict[int, None] = {}
        for ids in self.entries.values():
            if isinstance(ids, dict):
                seen.update(ids)
            else:
                seen[ids] = None
        for block_id in seen:
            self.unindex(self._blocks[block_id])
        assert not self.entries, "index not empty after dropping every block's hashes"
