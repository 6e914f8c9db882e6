"""SPSC rings of variable-length records: one shared segment per worker rank.

One segment holds a control block and two single-producer single-consumer rings: ``cmd``
(scheduler -> worker) and ``done`` (worker -> scheduler). The scheduler formats it
(:meth:`RingPair.init`), the worker validates it (:meth:`RingPair.attach`)::

    offset  field (every field a native u64; one 128-byte line per writer-owned field, so
            no two writers share a cache line or an adjacent-line prefetch pair)
    0       magic "KVSHMRNG" | layout_version | cmd_capacity | done_capacity |
            cmd_data_offset | done_data_offset | start_pos          (written once, by init)
            | revoked   scheduler writes, at most once: non-zero = this rank was declared
                        dead; the worker starts no job and publishes no Done after it
    128     cmd.head          scheduler writes    (bytes ever published into cmd)
    256     cmd.tail          worker writes       (bytes ever consumed from cmd)
    384     cmd.parked        worker writes       (park token: != 0 = ring my eventfd)
    512     done.head         worker writes
    640     done.tail         scheduler writes
    768     done.parked       scheduler writes    (park token)
    896     heartbeat | worker_state | last_progress_ns              (worker writes)
    1024    cmd data   [cmd_capacity bytes]
    ...     done data  [done_capacity bytes]  (starts on a 128-byte boundary)

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
``commit_read``. The park flags and the heartbeat are single u64 stores too; the park
handshake (a Dekker pattern: store then load of another field) needs a full fence on both
sides and lives in :mod:`kvshm.ipc.doorbell`.

Shared fields are only ever read or written through ``memoryview.cast('Q')``: never
``struct.pack_into``, which zero-fills before it writes and so exposes torn values.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Sequence
from enum import IntEnum
from typing import Final

from kvshm.errors import ConfigError, ProtocolError, UnsupportedPlatform

MAGIC: Final = int.from_bytes(b"KVSHMRNG", "little")
LAYOUT_VERSION: Final = 2  # 2: the revocation word (line 0, word 7)
LINE: Final = 128
CONTROL_SIZE: Final = 8 * LINE
RECORD_HEADER: Final = 8
#: Bytes a Transfer adds beyond its packed ids: msgpack array/tag/ints/bin headers (<= 40)
#: plus the record header and padding; generous on purpose.
TRANSFER_OVERHEAD: Final = 64
#: Smallest ring min_capacity() hands out, and the smallest init() accepts.
MIN_RING_CAPACITY: Final = 4096
#: A sensible default capacity for either ring (the engine may choose more for cmd).
DEFAULT_CAPACITY: Final = 1 << 20

_U32: Final = 0xFFFFFFFF
_SUPPORTED_MACHINES: Final = frozenset({"x86_64", "amd64", "x64"})

# u64 word indexes inside the control block.
(_W_MAGIC, _W_VERSION, _W_CMD_CAP, _W_DONE_CAP, _W_CMD_OFF, _W_DONE_OFF, _W_START,
 _W_REVOKED) = range(8)
_L = LINE // 8
_W_HEARTBEAT, _W_STATE, _W_PROGRESS = 7 * _L, 7 * _L + 1, 7 * _L + 2


class RecordKind(IntEnum):
    """High 32 bits of a record header. Zeroed or garbled memory matches neither."""

    DATA = 0x4B564441  # "ADVK"
    SKIP = 0x4B565350  # "PSVK"


_DATA: Final = int(RecordKind.DATA)
_SKIP: Final = int(RecordKind.SKIP)
_DATA_HI: Final = _DATA << 32
_SKIP_HI: Final = _SKIP << 32


class WorkerState(IntEnum):
    """Worker state word in the control block (informational; written by the worker)."""

    UNSET = 0
    RUNNING = 1
    PARKED = 2  # idle: spinning or parked, waiting for commands
    STOPPING = 3
    STOPPED = 4


class RevokeReason(IntEnum):
    """The revocation word (control block line 0, word 7); 0 = not revoked."""

    UNKNOWN = 1  # a non-zero value this side does not know
    HUNG = 2  # jobs outstanding and no completion for hang_timeout_s
    BROKEN_RING = 3  # an undecodable record or impossible framing from this rank
    DIED = 4  # its process exited or its lifeline closed (revoked for good measure)


def check_platform() -> None:
    """Raise UnsupportedPlatform unless stores/loads are ordered without fences (x86-64)."""
    machine = platform.machine().lower()
    if machine not in _SUPPORTED_MACHINES:
        raise UnsupportedPlatform(
            f"kvshm rings rely on x86-64 store ordering; this machine is {machine!r} "
            "(fenced publish/consume is not implemented for it)"
        )


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def min_capacity(num_gpu_blocks: int) -> int:
    """Smallest legal ``cmd`` capacity: 2 x (header + 8 x num_gpu_blocks), 64-aligned.

    A Transfer over every GPU block (4 + 4 bytes of packed ids per pair) is the largest
    record a step can produce; twice that makes it fit at any offset. Never below
    MIN_RING_CAPACITY.
    """
    if num_gpu_blocks < 0:
        raise ConfigError(f"num_gpu_blocks must be >= 0, got {num_gpu_blocks}")
    return max(MIN_RING_CAPACITY, _align(2 * (TRANSFER_OVERHEAD + 8 * num_gpu_blocks), 64))


def _check_capacity(name: str, capacity: int) -> None:
    if capacity < MIN_RING_CAPACITY or capacity % 8:
        raise ConfigError(
            f"{name} ring capacity must be a multiple of 8 and >= {MIN_RING_CAPACITY}, "
            f"got {capacity}"
        )
    if capacity > _U32:
        raise ConfigError(f"{name} ring capacity {capacity} exceeds 4 GiB")


def _offsets(cmd_capacity: int, done_capacity: int) -> tuple[int, int, int]:
    cmd_off = CONTROL_SIZE
    done_off = _align(cmd_off + cmd_capacity, LINE)
    return cmd_off, done_off, done_off + done_capacity


def segment_size(cmd_capacity: int, done_capacity: int) -> int:
    """Bytes of the segment holding the control block and both rings."""
    _check_capacity("cmd", cmd_capacity)
    _check_capacity("done", done_capacity)
    return _offsets(cmd_capacity, done_capacity)[2]


class Ring:
    """One direction. Each process uses one half: the writer or the reader methods.

    Writer state: ``_head`` (published), ``_staged`` (written, not yet published),
    ``_tail_cache`` (last tail it loaded). Reader state: ``_tail`` (committed) and
    ``_rpos`` (read, not yet committed). Only the owning side stores its position.
    """

    __slots__ = (
        "name", "capacity", "_half", "_ctl", "_data", "_dq", "_wh", "_wt", "_wp",
        "_head", "_staged", "_tail_cache", "_tail", "_rpos", "_broken", "_park_seq",
    )  # fmt: skip

    def __init__(self, name: str, ctl: memoryview, data: memoryview, first_line: int) -> None:
        self.name = name
        self.capacity = len(data)
        self._half = self.capacity // 2
        self._ctl = ctl
        self._data = data
        self._dq = data.cast("Q")
        self._wh, self._wt, self._wp = first_line * _L, (first_line + 1) * _L, (first_line + 2) * _L
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
        head = self._ctl[self._wh]
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
        last commit (re-walks the framing; for error reports only)."""
        found: list[int] = []
        pos, idx, cap = self._tail, 0, self.capacity
        wanted = set(indexes)
        while pos < self._rpos and len(found) < len(wanted):
            off = pos % cap
            word = self._dq[off >> 3]
            if word >> 32 == _SKIP:
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
            self._ctl[self._wt] = self._tail
        return released

    def release(self) -> None:
        """Release this ring's views of the segment (no further use)."""
        self._dq.release()
        self._data.release()


class RingPair:
    """The control block plus the ``cmd`` and ``done`` rings of one worker's segment."""

    def __init__(self, buf: memoryview) -> None:
        self._mv = buf
        self._ctl = buf[:CONTROL_SIZE].cast("Q")
        ctl = self._ctl
        cmd_cap, done_cap = ctl[_W_CMD_CAP], ctl[_W_DONE_CAP]
        cmd_off, done_off = ctl[_W_CMD_OFF], ctl[_W_DONE_OFF]
        self.cmd = Ring("cmd", ctl, buf[cmd_off : cmd_off + cmd_cap], 1)
        self.done = Ring("done", ctl, buf[done_off : done_off + done_cap], 4)
        self._beats = int(ctl[_W_HEARTBEAT])
        self._closed = False

    @classmethod
    def init(
        cls, buf: object, cmd_capacity: int, done_capacity: int, *, start_pos: int = 0
    ) -> RingPair:
        """Format a fresh segment (scheduler side) and return the pair over it.

        ``buf`` is any writable buffer of at least :func:`segment_size` bytes (an mmap).
        ``start_pos`` (multiple of 8) is where every position starts; tests use values
        near 2**32 to exercise all 64 bits. Both park flags start at 1 (ring me).
        """
        check_platform()
        size = segment_size(cmd_capacity, done_capacity)
        mv = memoryview(buf)  # type: ignore[arg-type]
        if mv.readonly or mv.nbytes < size:
            raise ConfigError(f"ring segment needs {size} writable bytes, got {mv.nbytes}")
        if start_pos % 8 or not 0 <= start_pos < 1 << 62:
            raise ConfigError(f"start_pos must be a multiple of 8 in [0, 2**62), got {start_pos}")
        mv = mv[:size]
        ctl = mv[:CONTROL_SIZE].cast("Q")
        for i in range(len(ctl)):
            ctl[i] = 0
        cmd_off, done_off, _ = _offsets(cmd_capacity, done_capacity)
        ctl[_W_VERSION], ctl[_W_START] = LAYOUT_VERSION, start_pos
        ctl[_W_CMD_CAP], ctl[_W_DONE_CAP] = cmd_capacity, done_capacity
        ctl[_W_CMD_OFF], ctl[_W_DONE_OFF] = cmd_off, done_off
        for line in (1, 2, 4, 5):
            ctl[line * _L] = start_pos
        ctl[3 * _L] = ctl[6 * _L] = 1
        ctl[_W_MAGIC] = MAGIC  # last: a half-formatted segment never validates
        ctl.release()
        return cls(mv)

    @classmethod
    def attach(cls, buf: object) -> RingPair:
        """Validate a segment another process formatted (worker side).

        Raises ProtocolError on a bad magic, layout version or geometry.
        """
        check_platform()
        mv = memoryview(buf)  # type: ignore[arg-type]
        if mv.nbytes < CONTROL_SIZE:
            raise ProtocolError(f"ring segment of {mv.nbytes} bytes is too small", ring="control")
        ctl = mv[:CONTROL_SIZE].cast("Q")
        try:
            magic, version = ctl[_W_MAGIC], ctl[_W_VERSION]
            caps = (ctl[_W_CMD_CAP], ctl[_W_DONE_CAP])
            offs = (ctl[_W_CMD_OFF], ctl[_W_DONE_OFF])
        finally:
            ctl.release()
        if magic != MAGIC:
            raise ProtocolError(f"bad ring segment magic {magic:#x}", ring="control", offset=0)
        if version != LAYOUT_VERSION:
            raise ProtocolError(
                f"ring layout version {version}, this side speaks {LAYOUT_VERSION}",
                ring="control",
                offset=8,
            )
        try:
            size = segment_size(*caps)
        except ConfigError as exc:
            raise ProtocolError(f"bad ring geometry: {exc}", ring="control", offset=16) from exc
        if offs != _offsets(*caps)[:2] or mv.nbytes < size:
            raise ProtocolError(
                f"ring geometry {caps}/{offs} does not match a {mv.nbytes}-byte segment",
                ring="control",
                offset=32,
            )
        return cls(mv[:size])

    # -- revocation (scheduler writes once, worker reads) ------------------------------
    def revoke(self, reason: RevokeReason) -> None:
        """Scheduler: this rank was declared dead. One u64 store, before the scheduler
        drops its view of the segment; the worker, which keeps its own mapping, reads it
        before starting each job and before publishing each Done (so a rank that resumes
        after a hang verdict does no new work). Never cleared: a verdict is final."""
        self._ctl[_W_REVOKED] = int(reason)

    @property
    def revoked(self) -> RevokeReason | None:
        """Why the scheduler revoked this rank, or None (garbage reads as UNKNOWN)."""
        raw = int(self._ctl[_W_REVOKED])
        if not raw:
            return None
        return RevokeReason(raw) if raw in RevokeReason._value2member_map_ \
            else RevokeReason.UNKNOWN

    # -- heartbeat and worker state (worker writes, scheduler reads) -----------------
    def beat(self) -> int:
        """Worker: bump the heartbeat counter (one u64 store); returns the new value."""
        self._beats += 1
        self._ctl[_W_HEARTBEAT] = self._beats
        return self._beats

    @property
    def heartbeat(self) -> int:
        """The heartbeat counter as last stored by the worker."""
        return int(self._ctl[_W_HEARTBEAT])

    def mark_progress(self, now_ns: int | None = None) -> None:
        """Worker: record that a job completed (CLOCK_MONOTONIC ns)."""
        self._ctl[_W_PROGRESS] = time.monotonic_ns() if now_ns is None else now_ns

    @property
    def last_progress_ns(self) -> int:
        """CLOCK_MONOTONIC ns of the worker's last completed job, 0 if none yet."""
        return int(self._ctl[_W_PROGRESS])

    @property
    def worker_state(self) -> WorkerState:
        """The worker's self-reported state (UNSET if the word holds garbage)."""
        raw = int(self._ctl[_W_STATE])
        return WorkerState(raw) if raw in WorkerState._value2member_map_ else WorkerState.UNSET

    @worker_state.setter
    def worker_state(self, state: WorkerState) -> None:
        self._ctl[_W_STATE] = int(state)

    def close(self) -> None:
        """Release every view this pair holds (idempotent); the segment owner unmaps it.

        Views returned by read_available must be gone first, or the unmap fails.
        """
        if self._closed:
            return
        self._closed = True
        self.cmd.release()
        self.done.release()
        self._ctl.release()
        self._mv.release()
