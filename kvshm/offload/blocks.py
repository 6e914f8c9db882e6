"""Per-block records and the intrusive doubly linked free queue of a :class:`BlockPool`.

The queue orders every block whose ``ref_cnt`` is 0. Its *LRU end* (the head) is where
:meth:`FreeBlockQueue.popleft` takes the next block to reuse or evict; its *MRU end*
(the tail) is where a freed cached block goes, to be evicted last. The links live in the
blocks themselves (``prev`` / ``next``), so append, appendleft, remove and popleft are
O(1) and allocate nothing.

Invariant: a block is in the queue iff its ``prev`` and ``next`` are both set; two
sentinel records (block_id -1 and -2) bound the list so no operation special-cases an
empty queue or the ends.

Also here, for :mod:`kvshm.offload.pool`: the pool's events
(:class:`BlockStored`, :class:`BlockRemoved`), the shape of its index entries
(:data:`IndexEntry`) and its O(pool) invariant check (:func:`check_pool`); and the base of
the eviction orders of :mod:`kvshm.offload.evict` (:class:`FreeSet`: the fresh queue and
the bookkeeping they share).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvshm.errors import StateError
from kvshm.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """``block_id`` became indexed under ``hashes`` (only the newly added ones)."""

    block_id: int
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """``block_id`` stopped being indexed under ``hashes`` (evicted, removed, reset)."""

    block_id: int
    hashes: tuple[BlockHash, ...]


PoolEvent = BlockStored | BlockRemoved
IndexEntry = int | dict[int, None]
"""The ids carrying one hash (see :class:`BlockPool`): one id, or an ordered set of them."""


class Block:
    """One block: id, reference count, the hashes it is indexed under, queue links.

    ``depth``, ``slot`` and ``freq`` belong to the eviction orders of
    :mod:`kvshm.offload.evict` (plain LRU ignores them): the block's position in its
    prefix chain (set when it is indexed), which of the order's queues holds it, and
    its hit count since it was stored (-1: stored, not hit yet)."""

    __slots__ = ("block_id", "depth", "freq", "hashes", "next", "prev", "ref_cnt", "slot")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.hashes: tuple[BlockHash, ...] = ()
        self.prev: Block | None = None
        self.next: Block | None = None
        self.depth = 0
        self.slot = 0
        self.freq = -1

    @property
    def queued(self) -> bool:
        """True iff the block is linked into a free queue."""
        return self.prev is not None

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, ref={self.ref_cnt}, hashes={len(self.hashes)})"


class FreeBlockQueue:
    """Doubly linked queue of blocks, LRU end first; every operation is O(1).
    ``size``: the blocks queued (``len()``); ``head`` / ``tail``: the sentinels, touched
    only by this class."""

    __slots__ = ("head", "size", "tail")

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self.head = Block(-1)
        self.tail = Block(-2)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.size = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.size

    def _link_after(self, left: Block, b: Block) -> None:
        if b.prev is not None or b.next is not None:
            raise StateError(f"{b!r} is already in the free queue")
        right = left.next
        assert right is not None, "queue link broken"
        b.prev = left
        b.next = right
        left.next = b
        right.prev = b
        self.size += 1

    def append(self, b: Block) -> None:
        """Add ``b`` at the MRU end (taken last). (:meth:`_link_after`, inlined: a hot
        path.)"""
        if b.prev is not None or b.next is not None:
            raise StateError(f"{b!r} is already in the free queue")
        tail = self.tail
        left = tail.prev
        assert left is not None, "queue link broken"
        b.prev = left
        b.next = tail
        left.next = b
        tail.prev = b
        self.size += 1

    def extend(self, blocks: Iterable[Block]) -> None:
        """:meth:`append` each block in order (the first is taken first among them).
        StateError for a block already queued, the blocks before it appended."""
        tail = self.tail
        left = tail.prev
        assert left is not None, "queue link broken"
        n = 0
        try:
            for b in blocks:
                if b.prev is not None or b.next is not None:
                    raise StateError(f"{b!r} is already in the free queue")
                b.prev = left
                left.next = b
                left = b
                n += 1
        finally:
            left.next = tail
            tail.prev = left
            self.size += n

    def appendleft(self, b: Block) -> None:
        """Add ``b`` at the LRU end (taken next)."""
        self._link_after(self.head, b)

    def remove(self, b: Block) -> None:
        """Unlink ``b`` from wherever it is in the queue."""
        prev, nxt = b.prev, b.next
        if prev is None or nxt is None:
            raise StateError(f"{b!r} is not in the free queue")
        prev.next = nxt
        nxt.prev = prev
        b.prev = b.next = None
        self.size -= 1

    def refresh(self, b: Block) -> None:
        """``b`` was used elsewhere: move it to the MRU end."""
        self.remove(b)
        self.append(b)

    def popleft(self) -> Block:
        """Remove and return the block at the LRU end; StateError when empty."""
        head = self.head
        first = head.next
        if first is None or first is self.tail:
            raise StateError("pop from an empty free queue")
        nxt = first.next
        assert nxt is not None, "queue link broken"
        head.next = nxt
        nxt.prev = head
        first.prev = first.next = None
        self.size -= 1
        return first

    def take(self, n: int) -> list[Block]:
        """:meth:`popleft` ``n`` times, in one call (``n`` at most the size: StateError
        and nothing taken otherwise); the blocks in the order taken."""
        if not 0 <= n <= self.size:
            raise StateError(f"take {n} from a free queue of {self.size}")
        head = self.head
        out: list[Block] = []
        add = out.append
        node = head.next
        for _ in range(n):
            assert node is not None, "queue link broken"
            add(node)
            nxt = node.next
            node.prev = node.next = None
            node = nxt
        assert node is not None, "queue link broken"
        head.next = node
        node.prev = head
        self.size -= n
        return out

    def __iter__(self) -> Iterator[Block]:
        """Blocks from the LRU end. The caller may unlink the block just yielded (e.g.
        touch it); any other change to the queue during iteration raises StateError."""
        node = self.head.next
        while node is not None and node is not self.tail:
            nxt = node.next
            yield node
            if node.next is not None:
                node = node.next
            elif nxt is not None and nxt.prev is not None:
                node = nxt
            else:
                raise StateError("free queue changed during iteration")

    def check_links(self, limit: int) -> list[Block]:
        """Walk the queue (at most ``limit`` blocks) verifying every link both ways;
        returns the blocks in LRU order. Raises AssertionError on any inconsistency."""
        out: list[Block] = []
        prev = self.head
        node = self.head.next
        while node is not self.tail:
            if node is None:
                raise AssertionError(f"free queue: next of {prev!r} is None")
            if node.prev is not prev:
                raise AssertionError(f"free queue: {node!r}.prev is not {prev!r}")
            if len(out) >= limit:
                raise AssertionError(f"free queue: more than {limit} blocks (cycle?)")
            out.append(node)
            prev, node = node, node.next
        if self.tail.prev is not prev:
            raise AssertionError("free queue: tail sentinel's prev is not the last block")
        if len(out) != self.size:
            raise AssertionError(f"free queue: walked {len(out)} blocks, length says {self.size}")
        return out


FRESH = -(1 << 62) - 1
"""``Block.slot`` of a block in the fresh queue."""
NEW = -1
"""``Block.freq`` of a block stored and not yet hit."""

class FreeSet:
    """Base of the orders: the fresh queue and the bookkeeping they share."""

    def __init__(self) -> None:
        self.fresh = FreeBlockQueue()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def seed(self, blocks: Iterable[Block]) -> None:
        """A new set's first blocks, all uncached: the fresh queue, in order. Only on an
        empty set (the pool's construction)."""
        assert not self._len, "seed() is for an empty free set"
        for b in blocks:
            b.slot = FRESH
            self.fresh.append(b)
        self._len = self.fresh.size

    def appendleft(self, b: Block) -> None:
        """``b`` is taken before every block now in the set (uncached or evict_first)."""
        b.slot = FRESH
        self.fresh.appendleft(b)
        self._len += 1

    def append(self, b: Block) -> None:
        """A cached block reached ref 0: the order places it."""
        self._place(b)
        self._len += 1

    def extend(self, blocks: Iterable[Block]) -> None:
        """:meth:`append` each block in order (``BlockPool.free``'s cached blocks)."""
        for b in blocks:
            self.append(b)

    def remove(self, b: Block) -> None:
        """``b`` is pinned again (a hit): it leaves the set."""
        self._take_as_hit(b)
        self._len -= 1

    def withdraw(self, b: Block) -> None:
        """``b`` is pinned for I/O (a disk write-back, a remote PUT reads it), not used:
        it leaves the set and counts no hit (no frequency step, no use for a
        simulation)."""
        if b.slot == FRESH:
            self.fresh.remove(b)
        else:
            self._unlink(b)
        self._len -= 1

    def _take_as_hit(self, b: Block) -> None:
        """Unlink ``b`` from its queue; one the order had placed counts a hit (freq,
        capped at 3)."""
        if b.slot == FRESH:
            self.fresh.remove(b)
        else:
            self._unlink(b)
            if b.freq >= 0:
                b.freq = min(b.freq + 1, 3)

    def popleft(self) -> Block:
        """The next victim (fresh blocks first); StateError when empty."""
        if not self._len:
            raise StateError("pop from an empty free set")
        self._len -= 1
        if self.fresh.size:
            b = self.fresh.popleft()
        else:
            b = self._victim()
        b.freq = NEW
        b.depth = 0
        return b

    def take(self, n: int) -> list[Block]:
        """:meth:`popleft` ``n`` times, in one call (fresh blocks in one cut); ``n`` at
        most the length (StateError and nothing taken otherwise)."""
        if not 0 <= n <= self._len:
            raise StateError(f"take {n} from a free set of {self._len}")
        out = self.fresh.take(min(n, self.fresh.size))
        for _ in range(n - len(out)):
            out.append(self._victim())
        for b in out:
            b.freq = NEW
            b.depth = 0
        self._len -= n
        return out

    def refresh(self, b: Block) -> None:
        """``b`` (at ref 0, cached) was reused elsewhere: count it as a hit (one freed
        ``evict_first`` leaves the fresh queue for the order's own place, as LRU moves
        it to the MRU end)."""
        self._take_as_hit(b)
        self._place(b)

    def uncache_all(self) -> None:
        """Every free block lost its hashes (a reset): the ones the order placed join
        the fresh queue, after those already there, in the order's victim order -- so
        every one is taken before any block cached later. O(free blocks)."""
        placed = [b for b in self if b.slot != FRESH]
        for b in placed:
            self._unlink(b)
            b.freq = NEW
            b.depth = 0
            b.slot = FRESH
            self.fresh.append(b)

    def settle(self, limit: int = 0) -> bool:
        """Do the bookkeeping the order deferred off the hooks' path (none here;
        ``adaptive``'s simulations), oldest first, at most ``limit`` items of it (0:
        all); True while some is left. The host calls it when nothing waits on it. It
        never changes what the order evicts, only when its bookkeeping runs."""
        return False

    def __iter__(self) -> Iterator[Block]:
        """Blocks in victim order as far as the order knows it without changing anything
        (fresh first). The caller may remove the block just yielded."""
        yield from self.fresh
        for q in self._queues():
            yield from q

    def check_links(self, limit: int) -> list[Block]:
        """Every queue's links, each block's slot, and the length; blocks in set order."""
        out = self.fresh.check_links(limit)
        for b in out:
            if b.slot != FRESH:
                raise AssertionError(f"{b!r} in the fresh queue has slot {b.slot}")
        for q in self._queues():
            blocks = q.check_links(limit)
            self._check_queue(q, blocks)
            out.extend(blocks)
        if len(out) != self._len:
            raise AssertionError(f"free set: walked {len(out)} blocks, length says {self._len}")
        return out

    # ---- what an order defines -------------------------------------------------------

    def _place(self, b: Block) -> None:
        raise NotImplementedError

    def _unlink(self, b: Block) -> None:
        raise NotImplementedError

    def _victim(self) -> Block:
        raise NotImplementedError

    def _queues(self) -> list[FreeBlockQueue]:
        raise NotImplementedError

    def _check_queue(self, q: FreeBlockQueue, blocks: list[Block]) -> None:
        raise NotImplementedError


def check_pool(blocks: Sequence[Block], queued: list[Block],
               index: dict[BlockHash, IndexEntry], num_free: int) -> None:
    """:meth:`kvshm.offload.pool.BlockPool.check_invariants`: ``queued`` the free set's
    blocks (its ``check_links``), ``index`` the pool's hash index. O(pool), for tests;
    AssertionError names what is wrong."""
    queued_ids = {b.block_id for b in queued}
    if len(queued_ids) != len(queued):
        raise AssertionError("free queue holds a block twice")
    n_entries = 0
    for b in blocks:
        _check_block(blocks, index, b, b.block_id in queued_ids)
        n_entries += len(b.hashes)
    index_entries = sum(len(ids) if isinstance(ids, dict) else 1 for ids in index.values())
    if index_entries != n_entries:
        raise AssertionError(
            f"index has {index_entries} (hash, block) entries, blocks carry {n_entries}")
    for h, ids in index.items():
        if isinstance(ids, dict) and not ids:
            raise AssertionError(f"index keeps empty entry for hash {h.hex()}")
    free = sum(1 for b in blocks if b.ref_cnt == 0)
    if free != num_free:
        raise AssertionError(f"{free} blocks at ref 0 but num_free is {num_free}")


def _check_block(blocks: Sequence[Block], index: dict[BlockHash, IndexEntry], b: Block,
                 in_queue: bool) -> None:
    if blocks[b.block_id] is not b:
        raise AssertionError(f"{b!r} is not at its own index")
    if b.ref_cnt < 0:
        raise AssertionError(f"{b!r} has a negative ref count")
    if (b.ref_cnt == 0) != in_queue:
        where = "in" if in_queue else "not in"
        raise AssertionError(f"{b!r} is {where} the free queue with ref {b.ref_cnt}")
    if in_queue != b.queued:
        raise AssertionError(f"{b!r} links disagree with the queue walk")
    if len(set(b.hashes)) != len(b.hashes):
        raise AssertionError(f"{b!r} carries a hash twice")
    for h in b.hashes:
        ids = index.get(h, {})
        if b.block_id not in ids if isinstance(ids, dict) else ids != b.block_id:
            raise AssertionError(f"{b!r} carries {h.hex()} but the index lacks it")
