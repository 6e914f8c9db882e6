"""`BlockPool`: a ref-counted pool of fixed-size blocks with a prefix-hash index.

The same class is kvshm's CPU tier and a custom server's GPU pool; it structurally
implements the ``GpuBlocks`` protocol (``touch``, ``free(..., evict_first)``,
``block_hashes``, ``iter_free_from_lru``).

States (exactly one per block, checked by :meth:`BlockPool.check_invariants`):

* **free-uncached**: ``ref_cnt == 0``, no hashes, in the free queue;
* **cached-evictable**: ``ref_cnt == 0``, one or more hashes, in the free queue;
* **pinned**: ``ref_cnt > 0``, not in the free queue (never reused or evicted; its
  hashes change only through explicit ``add_hashes`` / ``remove_hashes`` calls).

Ordering (``eviction=Eviction.LRU``, the default of a bare pool and the order a GPU pool
keeps): :meth:`allocate` takes blocks from the LRU end of the free queue. A block
freed to ref 0 goes to the LRU end when it has no hashes (reused first) or when
``evict_first`` is given, and to the MRU end (evicted last) when it is cached. Within
one :meth:`free` call, ids listed earlier are taken before ids listed later among the
blocks sent to the same end, so freeing a prefix tail-first evicts its tail first.
Another ``eviction`` (:class:`kvshm.config.Eviction`) puts the cached blocks at ref 0 in
one of the orders of :mod:`kvshm.offload.evict` instead; uncached and ``evict_first``
blocks are still taken first, and only blocks at ref 0 are ever taken.
:meth:`refresh` counts a GPU-side reuse of cached blocks (the manager calls it for the
engine's own prefix hit where :attr:`BlockPool.refresh_gpu_hits`); :meth:`set_depth`
tells the orders a block's position in its prefix chain, and ``block_tokens`` (tokens
per block, 16 unless given) weighs the ``adaptive`` order's cost model.

Cost: every operation is O(1) per block named (plus O(hashes) per block); nothing scans
the pool except :meth:`drop_all_hashes` (O(hashed blocks)) and :meth:`check_invariants`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, KeysView, Sequence
from typing import NoReturn

from kvshm.config import Eviction
from kvshm.errors import ConfigError, PoolExhausted
from kvshm.hashing import BlockHash
from kvshm.offload.blocks import (
    Block,
    FreeBlockQueue,
    FreeSet,
    PoolEvent,
    check_pool,
)
from kvshm.offload.evict import make_free_set
from kvshm.offload.pool_index import HashIndex

__all__ = ["BlockPool"]


class BlockPool:
    """Ref-counted blocks ``0 .. num_blocks-1``, a free queue and a hash index
    (``self.index``: its calls and invariants, :mod:`kvshm.offload.pool_index`; the
    pool's methods of the same names hand over to it in one line)."""

    def __init__(self, num_blocks: int, *, enable_events: bool = False,
                 eviction: Eviction = Eviction.LRU,
                 refresh_gpu_hits: bool | None = None, block_tokens: int = 16) -> None:
        if num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
        if not isinstance(eviction, Eviction):
            raise ConfigError(f"eviction must be an Eviction, got {eviction!r}")
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._queue: FreeBlockQueue | FreeSet = make_free_set(
            eviction, self._blocks, num_blocks, block_tokens=block_tokens)
        self.eviction = eviction
        self.refresh_gpu_hits = (eviction in (Eviction.LRU_REFRESH, Eviction.ADAPTIVE)
                                 if refresh_gpu_hits is None else refresh_gpu_hits)
        """The manager calls :meth:`refresh` for the engine's own prefix hits (by
        default for the orders that read them: ``lru_refresh``, ``adaptive``)."""
        self._events: list[PoolEvent] = []
        self.index = HashIndex(self._blocks, self._events if enable_events else None)
        self.evictions = 0
        """Cached blocks whose hashes ``allocate`` dropped to reuse them."""
        self.exhausted = 0
        """``allocate`` calls declined with PoolExhausted."""

    # ---- sizes ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_free(self) -> int:
        """Blocks at ref 0: free-uncached plus cached-evictable."""
        return len(self._queue)

    @property
    def num_pinned(self) -> int:
        return len(self._blocks) - len(self._queue)

    @property
    def num_hashes(self) -> int:
        """Distinct hashes in the index (what a lookup can hit)."""
        return len(self.index.entries)

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, free={self.num_free}, "
                f"hashes={len(self.index.entries)})")

    # ---- reference counts ----------------------------------------------------------

    def _resolve(self, ids: Iterable[int]) -> list[Block]:
        blocks = self._blocks
        n = len(blocks)
        out: list[Block] = []
        add = out.append
        i: object = None
        try:  # (no type test per id: 1.0, "a", None fail the compare or the index)
            for i in ids:
                if not 0 <= i < n:
                    raise ConfigError(f"unknown block id {i!r} (pool has {n} blocks)")
                add(blocks[i])
        except TypeError:
            raise ConfigError(f"unknown block id {i!r}: a block id is an int") from None
        return out

    def allocate(self, n: int, evicted: list[tuple[int, BlockHash]] | None = None
                 ) -> list[int]:
        """Take ``n`` blocks from the LRU end, all or nothing; each returned block has
        ref 1 and no hashes (a cached block loses its hashes: BlockRemoved).
        ``evicted``: where given, each cached block taken is appended as (block id, its
        first hash), in the order taken (what a lower tier may still write down)."""
        if not isinstance(n, int) or n < 0:  # (2.5: the orders took blocks, then failed)
            raise ConfigError(f"cannot allocate {n!r} blocks")
        if n > len(self._queue):
            self.exhausted += 1
            raise PoolExhausted(n, len(self._queue))
        blocks = self._queue.take(n)  # the victims are chosen before any is unindexed
        for b in blocks:
            if b.hashes:
                self.evictions += 1
                if evicted is not None:
                    evicted.append((b.block_id, b.hashes[0]))
                self.index.unindex(b)
            b.ref_cnt = 1
        return [b.block_id for b in blocks]

    def touch(self, ids: Iterable[int], *, use: bool = True) -> None:
        """ref += 1 for each id (repeats count); a block at ref 0 leaves the free queue
        first and keeps its hashes. ``use=False``: a pin for I/O (a lower tier reads
        the block), which the eviction order does not count as a hit
        (:meth:`FreeSet.withdraw`). Unknown ids: ConfigError before any change."""
        blocks = self._resolve(ids)
        queue = self._queue
        remove = queue.withdraw if not use and isinstance(queue, FreeSet) else queue.remove
        for b in blocks:
            if b.ref_cnt == 0:
                remove(b)
            b.ref_cnt += 1

    def free(self, ids: Iterable[int], *, evict_first: bool = False) -> None:
        """ref -= 1 for each id (repeats count). A block reaching 0 joins the free
        queue: LRU end when uncached or ``evict_first``, MRU end when cached; earlier ids
        are taken before later ones at either end. Freeing below 0 or an unknown id:
        ConfigError before any change.

        One pass resolves, checks and decrements (a repeat sees its earlier decrement);
        the first id that fails undoes the pass's decrements and :meth:`_refuse_free`
        raises what checking first names. The cached blocks reaching 0 join the MRU
        end in one ``extend`` (the order of one ``append`` each), after the pass."""
        all_blocks = self._blocks
        n = len(all_blocks)
        ids = ids if type(ids) is list else list(ids)
        to_mru: list[Block] = []
        to_lru: list[Block] = []
        done = 0
        try:
            for i in ids:
                if not 0 <= i < n:
                    break
                b = all_blocks[i]
                r = b.ref_cnt - 1
                if r < 0:
                    break
                b.ref_cnt = r
                done += 1
                if not r:
                    if evict_first or not b.hashes:
                        to_lru.append(b)
                    else:
                        to_mru.append(b)
        except TypeError:  # an id that is no int (1.0, "a", None): named below
            pass
        finally:
            if done != len(ids):  # refused (or a bad id type): nothing changes
                for i in ids[:done]:
                    all_blocks[i].ref_cnt += 1
        if done != len(ids):
            self._refuse_free(ids)
        if to_mru:
            self._queue.extend(to_mru)
        if to_lru:
            appendleft = self._queue.appendleft
            for b in reversed(to_lru):
                appendleft(b)

    def _refuse_free(self, ids: list[int]) -> NoReturn:
        """The ConfigError of a refused :meth:`free` (refs as before the call): the
        first unknown id, else the first block freed more often than its ref."""
        n = len(self._blocks)
        for i in ids:
            if type(i) is not int or not 0 <= i < n:  # (1.0, True, None: refused)
                raise ConfigError(f"unknown block id {i!r} (pool has {n} blocks)")
        self._check_freeable([self._blocks[i] for i in ids])
        raise AssertionError("free refused with every id freeable")

    @staticmethod
    def _check_freeable(blocks: list[Block]) -> None:
        if len(blocks) == 1:
            if blocks[0].ref_cnt < 1:
                raise ConfigError(f"free of block {blocks[0].block_id} at ref 0")
            return
        wanted: dict[int, int] = {}
        for b in blocks:
            k = wanted.get(b.block_id, 0) + 1
            if k > b.ref_cnt:
                raise ConfigError(
                    f"free of block {b.block_id} {k} time(s) in one call, ref is {b.ref_cnt}")
            wanted[b.block_id] = k

    def ref_cnt(self, block_id: int) -> int:
        return self.index.block(block_id).ref_cnt

    def refresh(self, ids: Iterable[int]) -> None:
        """The blocks were reused elsewhere (their GPU copies hit): each cached one at
        ref 0 counts as used now (LRU: to the MRU end; earlier ids end up evicted
        before later ones). Pinned or uncached ids are left alone."""
        queue = self._queue
        for b in self._resolve(ids):
            if b.ref_cnt == 0 and b.hashes:
                queue.refresh(b)

    def settle(self, limit: int = 0) -> bool:
        """The eviction order's deferred bookkeeping, now, at most ``limit`` items of it
        (0: all; :meth:`FreeSet.settle`); True while some is left. Call it off the
        serving path (an idle pump); what the pool evicts is the same either way."""
        q = self._queue
        return isinstance(q, FreeSet) and q.settle(limit)

    def set_depth(self, block_id: int, depth: int) -> None:
        """``block_id`` holds position ``depth`` of its prefix chain (read by the
        depth-aware orders when the block is next freed)."""
        blocks = self._blocks
        if type(block_id) is not int or not 0 <= block_id < len(blocks):
            raise ConfigError(f"unknown block id {block_id!r} (pool has {len(blocks)} "
                              "blocks)")
        if type(depth) is not int or depth < 0:  # the orders compare it when freed
            raise ConfigError(f"a depth must be an int >= 0, got {depth!r}")
        blocks[block_id].depth = depth

    # ---- free queue ----------------------------------------------------------------

    def iter_free_from_lru(self) -> Iterator[int]:
        """Ids of ref-0 blocks, the next one ``allocate`` would take first. The caller
        may touch the id just yielded; other changes during iteration: StateError."""
        for b in self._queue:
            yield b.block_id

    # ---- the hash index (self.index) ---------------------------------------------

    def block_hashes(self, block_id: int) -> tuple[BlockHash, ...]:
        """The hashes ``block_id`` is indexed under, in the order added; () if none (the
        ``GpuBlocks`` read a store makes per block: the record read here, no hand-over)."""
        blocks = self._blocks
        if type(block_id) is not int or not 0 <= block_id < len(blocks):
            raise ConfigError(f"unknown block id {block_id!r} (pool has {len(blocks)} blocks)")
        return blocks[block_id].hashes

    def add_hashes(self, block_id: int, hashes: Iterable[BlockHash]) -> None:
        """:meth:`HashIndex.add_hashes`: index ``block_id`` under each hash."""
        self.index.add_hashes(block_id, hashes)

    def add_keys(self, ids: Sequence[int], keys: Sequence[BlockHash],
                 depths: Sequence[int] | None = None) -> None:
        """:meth:`HashIndex.add_keys`: a store's completion, one call."""
        self.index.add_keys(ids, keys, depths)

    def remove_hashes(self, block_id: int) -> None:
        """Drop every hash of ``block_id`` (BlockRemoved); it stays where it is."""
        self.index.remove_hashes(block_id)

    def get_cached(self, h: BlockHash) -> int | None:
        """The earliest registered block still carrying ``h``, or None."""
        return self.index.get_cached(h)

    def cached_run(self, hashes: Sequence[BlockHash], start: int, end: int) -> list[int]:
        """:meth:`HashIndex.cached_run`: the cached blocks of a run of hashes."""
        return self.index.cached_run(hashes, start, end)

    def is_cached(self, h: BlockHash) -> bool:
        return h in self.index.entries

    @property
    def cached_keys(self) -> KeysView[BlockHash]:
        """A live view of the indexed hashes (:attr:`HashIndex.cached_keys`)."""
        return self.index.entries.keys()

    def drop_all_hashes(self) -> None:
        """Make every block uncached (reset): :meth:`HashIndex.drop_all_hashes`; the
        free ones are taken first from now on (an order other than LRU moves them to
        its fresh queue: :meth:`FreeSet.uncache_all`; LRU's already precede every block
        cached later)."""
        self.index.drop_all_hashes()
        if isinstance(self._queue, FreeSet):
            self._queue.uncache_all()

    # ---- events and checks ---------------------------------------------------------

    def take_events(self) -> list[PoolEvent]:
        """Events since the last call, oldest first (always empty without
        ``enable_events``)."""
        events = self._events[:]  # the list itself is the index's too: emptied in place
        self._events.clear()
        return events

    def check_invariants(self) -> None:
        """O(pool) consistency check for tests; AssertionError names what is wrong
        (:func:`kvshm.offload.blocks.check_pool`)."""
        check_pool(self._blocks, self._queue.check_links(limit=len(self._blocks)),
                   self.index.entries, self.num_free)
