"""One SPSC ring of variable-length records: the framing, the positions, the store order.

A rank's shared segment holds two of them, ``cmd`` (scheduler -> worker) and ``done``
(worker -> scheduler), after a control block (:mod:`kvshm.ipc.ring_pair` draws the
segment and owns the control block). A :class:`Ring` owns three words of that block,
each on its own 128-byte line: ``head`` (its writer stores it), ``tail`` and ``parked``
(its reader stores them); the data area is its own slice of the segment.

Positions are monotonic u64 byte counts (they start at ``start_pos``, normally 0, and never
wrap in practice: 2**64 bytes). A position maps to ring offset ``pos % capacity``; the
capacity is any multiple of 8 (not necessarily a power of two). ``head - tail`` is the
number of bytes in use, ``0 <= head - tail <= capacity``.

Records, 8-byte aligned::

    pos % capacity
    v
    | u64 header: length (low 32 bits) | kind (high 32) | payload (length bytes) | pad to 8 |

A record never straddles the end of the ring. When one does not fit before the end, the
writer puts a SKIP header at the current offset (its length = bytes to the end) and the
record starts at offset 0 of the next lap. The largest payload is ``capacity // 2 - 8``
(:meth:`Ring.max_payload`): then a record always fits once the ring is empty, whatever
the offset, so a writer never waits for room that cannot appear. Larger payloads are
refused at the sender (:class:`~kvshm.errors.ConfigError`).

Order of stores (x86-64 TSO keeps stores in order and loads in order, so the data path
needs no fence; hence :func:`check_platform`)::

    writer: 1. header + payload bytes into free space [head, head + n)   (unpublished)
            2. head = head + n          one aligned 8-byte store (memoryview.cast('Q'))
    reader: 1. load head
            2. read/decode the records in [tail, head) straight from the segment
            3. tail = head              one 8-byte store, only after decoding finished

Park tokens: a reader that goes to sleep stores a fresh non-zero token (a per-reader
counter) in its ``parked`` word and 0 when it wakes. A writer rings once per token: a
second publish that finds the same token knows the eventfd is already readable.

Batches: :meth:`Ring.stage` k records, then :meth:`Ring.publish` once (one head store);
:meth:`Ring.read_available` returns every published record, :meth:`Ring.commit_read` does
one tail store. The memoryviews it returns point into the segment and stay valid until
``commit_read``. The park flags are single u64 stores too; the park handshake (a Dekker
pattern: store then load of another field) needs a full fence on both sides and lives
in :mod:`kvshm.ipc.doorbell`.

Shared fields are only ever read or written through ``memoryview.cast('Q')``: never
``struct.pack_into``, which zero-fills before it writes and so exposes torn values.
"""

from __future__ import annotations

import platform
from collections.abc import Sequence
from enum import IntEnum
from typing import Final

from kvshm.errors import ConfigError, ProtocolError, UnsupportedPlatform

RECORD_HEADER: Final = 8
#: Bytes a Transfer adds beyond its packed ids: msgpack array/tag/ints/bin headers (<= 40)
#: plus the record header and padding; generous on purpose.
TRANSFER_OVERHEAD: Final = 64
#: Smallest ring min_capacity() hands out, and the smallest capacity a segment accepts.
MIN_RING_CAPACITY: Final = 4096
#: A sensible default capacity for either ring (the engine may choose more for cmd).
DEFAULT_CAPACITY: Final = 1 << 20

_U32: Final = 0xFFFFFFFF
_SUPPORTED_MACHINES: Final = frozenset({"x86_64", "amd64", "x64"})


class RecordKind(IntEnum):
    """High 32 bits of a record header. Zeroed or garbled memory matches neither."""

    DATA = 0x4B564441  # "ADVK"
    SKIP = 0x4B565350  # "PSVK"


_DATA: Final = int(RecordKind.DATA)
_SKIP: Final = int(RecordKind.SKIP)
_DATA_HI: Final = _DATA << 32
_SKIP_HI: Final = _SKIP << 32


def check_platform() -> None:
    """Raise UnsupportedPlatform unless stores/loads are ordered without fences (x86-64)."""
    machine = platform.machine().lower()
    if machine not in _SUPPORTED_MACHINES:
        raise UnsupportedPlatform(
            f"kvshm rings rely on x86-64 store ordering; this machine is {machine!r} "
            "(fenced publish/consume is not implemented for it)"
        )


def align_up(n: int, to: int) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return (n + to - 1) // to * to


def min_capacity(num_gpu_blocks: int) -> int:
    """Smallest legal ``cmd`` capacity: 2 x (header + 8 x num_gpu_blocks), 64-aligned.

    A Transfer over every GPU block (4 + 4 bytes of packed ids per pair) is the largest
    record a step can produce; twice that makes it fit at any offset. Never below
    MIN_RING_CAPACITY.
    """
    if num_gpu_blocks < 0:
        raise ConfigError(f"num_gpu_blocks must be >= 0, got {num_gpu_blocks}")
    return max(MIN_RING_CAPACITY, align_up(2 * (TRANSFER_OVERHEAD + 8 * num_gpu_blocks), 64))


def check_capacity(name: str, capacity: int) -> None:
    """ConfigError unless ``capacity`` is a legal ring capacity: a multiple of 8, at
    least MIN_RING_CAPACITY, and below 4 GiB (a record length is 32 bits)."""
    if capacity < MIN_RING_CAPACITY or capacity % 8:
        raise ConfigError(
            f"{name} ring capacity must be a multiple of 8 and >= {MIN_RING_CAPACITY}, "
            f"got {capacity}"
        )
    if capacity > _U32:
        raise ConfigError(f"{name} ring capacity {capacity} exceeds 4 GiB")


class Ring:
    """One direction. Each process uses one half: the writer or the reader methods.

    ``ctl`` is the control block as u64 words and ``words`` the indexes of this ring's
    ``(head, tail, parked)`` in it; ``data`` is the ring's data area (its length is the
    capacity). Writer state: ``_head`` (published), ``_staged`` (written, not yet
    published), ``_tail_cache`` (last tail it loaded). Reader state: ``_tail``
    (committed) and ``_rpos`` (read, not yet committed). Only the owning side stores its
    position.
    """

    __slots__ = (
        "name", "capacity", "_half", "_ctl", "_data", "_dq", "_wh", "_wt", "_wp",
        "_head", "_staged", "_tail_cache", "_tail", "_rpos", "_broken", "_park_seq",
    )  # fmt: skip

    def __init__(
        self, name: str, ctl: memoryview, data: memoryview, words: tuple[int, int, int]
    ) -> None:
        self.name = name
        self.capacity = len(data)
        self._half = self.capacity // 2
        self._ctl = ctl
        self._data = data
        self._dq = data.cast("Q")
        self._wh, self._wt, self._wp = words
        self._head = self._staged = self._tail_cache = ctl[self._wh]
        self._tail = self._rpos = ctl[self._wt]
        self._broken: ProtocolError | None = None
        self._park_seq = max(1, int(ctl[self._wp]))

    # -- shared fields ---------------------------------------------------------------
    @property
    def head(self) -> int:
        """Published position (a shared-memory load)."""
        return int(self._ctl[self._wh])

    @property
    def tail(self) -> int:
        """Consumed position (a shared-memory load)."""
        return int(self._ctl[self._wt])

    @property
    def parked(self) -> bool:
        """True when the reader asked to be woken by the doorbell."""
        return bool(self._ctl[self._wp])

    @property
    def park_token(self) -> int:
        """The reader's current park token (0 = awake: do not ring)."""
        return self._ctl[self._wp]

    def park(self) -> int:
        """Reader: store a fresh park token (the caller fences next); returns it."""
        self._park_seq += 1
        self._ctl[self._wp] = self._park_seq
        return self._park_seq

    def unpark(self) -> None:
        """Reader: store 0 (awake; writers need not ring)."""
        self._ctl[self._wp] = 0

    def max_payload(self) -> int:
        """Largest payload this ring accepts (``capacity // 2 - 8``, 8-aligned down)."""
        return (self.capacity // 2 - RECORD_HEADER) & ~7

    # -- writer ----------------------------------------------------------------------
    def stage(self, payload: bytes | bytearray | memoryview) -> bool:
        """Copy one record into free space without publishing it; False if no room now.

        Raises ConfigError for a payload larger than :meth:`max_payload` (it could never
        fit). Staged records become visible to the reader at the next :meth:`publish`.
        """
        n = len(payload)
        total = (n + 15) & ~7  # header + payload padded to 8
        pos = self._staged
        cap = self.capacity
        off = pos % cap
        # Fast path: fits before the end of the lap, and room as of the cached tail.
        if off + total <= cap and total <= self._half and pos + total - self._tail_cache <= cap:
            # header and payload go to unpublished space: the reader sees them only after
            # publish() moves head past them (stores stay in order on x86-64)
            self._dq[off >> 3] = _DATA_HI | n
            self._data[off + RECORD_HEADER : off + RECORD_HEADER + n] = payload
            self._staged = pos + total
            return True
        return self._stage_slow(payload, n, total, pos, off)

    def _stage_slow(
        self, payload: bytes | bytearray | memoryview, n: int, total: int, pos: int, off: int
    ) -> bool:
        cap = self.capacity
        if total > self._half:
            raise ConfigError(
                f"record of {n} bytes exceeds ring {self.name!r} limit of {self.max_payload()}"
            )
        to_end = cap - off
        need = total if total <= to_end else to_end + total
        if pos + need - self._tail_cache > cap:
            self._tail_cache = self._ctl[self._wt]
            if pos + need - self._tail_cache > cap:
                return False
        if total > to_end:
            self._dq[off >> 3] = _SKIP_HI | to_end
            pos += to_end
            off = 0
        self._dq[off >> 3] = _DATA_HI | n
        self._data[off + RECORD_HEADER : off + RECORD_HEADER + n] = payload
        self._staged = pos + total
        return True

    def publish(self) -> bool:
        """Make every staged record visible with one head store; False if none staged."""
        if self._staged == self._head:
            return False
        self._head = self._staged
        # the publishing store, after every byte of the staged records: once the reader
        # loads this head, everything before it is complete
        self._ctl[self._wh] = self._head
        return True

    def try_write(self, payload: bytes | bytearray | memoryview) -> bool:
        """Stage and publish one record; False (nothing written) when the ring is full."""
        if not self.stage(payload):
            return False
        self.publish()
        return True

    def write_many(self, payloads: Sequence[bytes | bytearray | memoryview]) -> int:
        """Stage as many leading payloads as fit, publish once; returns how many."""
        done = 0
        for payload in payloads:
            if not self.stage(payload):
                break
            done += 1
        self.publish()
        return done

    def used(self) -> int:
        """Bytes in use as the writer sees them (loads tail)."""
        return self._head - int(self._ctl[self._wt])

    # -- reader ----------------------------------------------------------------------
    def is_empty(self) -> bool:
        """True when nothing beyond what this reader already read is published."""
        return self._ctl[self._wh] == self._rpos

    def read_available(self) -> list[memoryview]:
        """Views of every published record not read yet, in order (zero copy).

        The views stay valid until :meth:`commit_read`. A record whose framing is
        impossible raises ProtocolError(ring, offset=position); the ring is then broken
        (the writer's framing can no longer be trusted) and every later call raises the
        same error. Records before the bad one are returned first.
        """
        if self._broken is not None:
            raise self._broken
        head = self._ctl[self._wh]  # one load; only the records below it are complete
        pos = self._rpos
        cap = self.capacity
        if head - self._tail > cap or head < self._tail:
            return self._fail(pos, f"head {head} impossible for tail {self._tail}", [])
        out: list[memoryview] = []
        data, dq = self._data, self._dq
        while pos < head:
            off = pos % cap
            word = dq[off >> 3]
            n = word & _U32
            kind = word >> 32
            if kind == _DATA:
                step = (n + 15) & ~7
                if off + step > cap or pos + step > head:
                    return self._fail(pos, f"record length {n} runs past the data", out)
                out.append(data[off + RECORD_HEADER : off + RECORD_HEADER + n])
                pos += step
            elif kind == _SKIP and n == cap - off and pos + n <= head:
                pos += n
            else:
                return self._fail(pos, f"bad record header {word:#018x}", out)
        self._rpos = pos
        return out

    @property
    def broken(self) -> ProtocolError | None:
        """The framing error that broke this ring (reader side), or None."""
        return self._broken

    def positions_of(self, indexes: list[int]) -> list[int]:
        """Positions of records number ``indexes`` (0-based) among those read since the
        last commit (re-walks the framing; for error reports only). The headers are read
        again from shared memory, where a hostile peer may have rewritten them since
        :meth:`read_available` checked them: the walk always advances and stops at what
        was read, so it ends, possibly with fewer positions than asked."""
        found: list[int] = []
        pos, idx, cap = self._tail, 0, self.capacity
        wanted = set(indexes)
        while pos < self._rpos and len(found) < len(wanted):
            off = pos % cap
            word = self._dq[off >> 3]
            if word >> 32 == _SKIP:
                if not word & _U32:
                    break  # rewritten since it was read: a SKIP always has a length
                pos += word & _U32
                continue
            if idx in wanted:
                found.append(pos)
            idx += 1
            pos += ((word & _U32) + 15) & ~7
        return found

    def _fail(self, pos: int, why: str, out: list[memoryview]) -> list[memoryview]:
        self._broken = ProtocolError(
            f"{why} at ring offset {pos % self.capacity}", ring=self.name, offset=pos
        )
        if out:
            self._rpos = pos
            return out
        raise self._broken

    def commit_read(self) -> int:
        """Release everything read so far with one tail store; returns bytes released.

        Views from :meth:`read_available` must not be used afterwards.
        """
        released = self._rpos - self._tail
        if released:
            self._tail = self._rpos
            self._ctl[self._wt] = self._tail  # frees the space: the writer may overwrite it
        return released

    def release(self) -> None:
        """Release this ring's views of the segment (no further use)."""
        self._dq.release()
        self._data.release()
