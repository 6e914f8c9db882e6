"""Per-block records and the intrusive doubly linked free queue of a :class:`BlockPool`.

The queue orders every block whose ``ref_cnt`` is 0. Its *LRU end* (the head) is where
:meth:`FreeBlockQueue.popleft` takes the next block to reuse or evict; its *MRU end*
(the tail) is where a freed cached block goes, to be evicted last. The links live in the
blocks themselves (``prev`` / ``next``), so append, appendleft, remove and popleft are
O(1) and allocate nothing.

Invariant: a block is in the queue iff its ``prev`` and ``next`` are both set; two
sentinel records (block_id -1 and -2) bound the list so no operation special-cases an
empty queue or the ends.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvshm.errors import StateError
from kvshm.hashing import BlockHash


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
    ``size``: the blocks queued (``len()``); ``head`` / ``tail``: the sentinels. Outside
    this class only :class:`kvshm.offload.evict.DepthAged`'s inlined copies of
    :meth:`append` and :meth:`remove` (its hot paths) touch them."""

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
