"""One rank's ring segment: the control block and the ``cmd`` / ``done`` rings after it.

One shared segment per worker rank holds a control block and two single-producer
single-consumer rings (:mod:`kvshm.ipc.ring`: framing, positions, store order): ``cmd``
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

:meth:`RingPair.init` stores the magic last, so a half-formatted segment never validates.
The revocation word, the heartbeat, the worker state and the progress stamp are single
u64 stores read by the other side without a lock (informational, except revocation:
final once set, and read by the worker before each job and each Done).
"""

from __future__ import annotations

import time
from enum import IntEnum
from typing import Final

from kvshm.errors import ConfigError, ProtocolError
from kvshm.ipc.ring import Ring, align_up, check_capacity, check_platform

__all__ = [
    "CONTROL_SIZE",
    "LAYOUT_VERSION",
    "LINE",
    "MAGIC",
    "RevokeReason",
    "RingPair",
    "WorkerState",
    "segment_size",
]

MAGIC: Final = int.from_bytes(b"KVSHMRNG", "little")
LAYOUT_VERSION: Final = 2  # 2: the revocation word (line 0, word 7)
LINE: Final = 128
CONTROL_SIZE: Final = 8 * LINE

# u64 word indexes inside the control block (the diagram above).
(_W_MAGIC, _W_VERSION, _W_CMD_CAP, _W_DONE_CAP, _W_CMD_OFF, _W_DONE_OFF, _W_START,
 _W_REVOKED) = range(8)
_L = LINE // 8
_CMD_LINE, _DONE_LINE = 1, 4  # each ring's head, tail, parked: this line and the next two
_W_HEARTBEAT, _W_STATE, _W_PROGRESS = 7 * _L, 7 * _L + 1, 7 * _L + 2


def _ring_words(first_line: int) -> tuple[int, int, int]:
    """Word indexes of a ring's (head, tail, parked), one line each from ``first_line``."""
    return first_line * _L, (first_line + 1) * _L, (first_line + 2) * _L


_CMD_WORDS: Final = _ring_words(_CMD_LINE)
_DONE_WORDS: Final = _ring_words(_DONE_LINE)


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
    LEFT = 5  # it said Goodbye and closed: its host closed it (a departure, not a death)


def _offsets(cmd_capacity: int, done_capacity: int) -> tuple[int, int, int]:
    cmd_off = CONTROL_SIZE
    done_off = align_up(cmd_off + cmd_capacity, LINE)
    return cmd_off, done_off, done_off + done_capacity


def segment_size(cmd_capacity: int, done_capacity: int) -> int:
    """Bytes of the segment holding the control block and both rings."""
    check_capacity("cmd", cmd_capacity)
    check_capacity("done", done_capacity)
    return _offsets(cmd_capacity, done_capacity)[2]


class RingPair:
    """The control block plus the ``cmd`` and ``done`` rings of one worker's segment."""

    def __init__(self, buf: memoryview) -> None:
        self._mv = buf
        self._ctl = buf[:CONTROL_SIZE].cast("Q")
        ctl = self._ctl
        cmd_cap, done_cap = ctl[_W_CMD_CAP], ctl[_W_DONE_CAP]
        cmd_off, done_off = ctl[_W_CMD_OFF], ctl[_W_DONE_OFF]
        self.cmd = Ring("cmd", ctl, buf[cmd_off : cmd_off + cmd_cap], _CMD_WORDS)
        self.done = Ring("done", ctl, buf[done_off : done_off + done_cap], _DONE_WORDS)
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
        for head, tail, parked in (_CMD_WORDS, _DONE_WORDS):
            ctl[head] = ctl[tail] = start_pos
            ctl[parked] = 1
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
        """Worker: record that a long Transfer copy went on (CLOCK_MONOTONIC ns; the
        CPU copy engine's, every few thousand ``memmove`` calls -- not a Done: a remote
        or disk job's Done is no progress of the rank's copies). A no-op once the pair
        is closed: a copy thread may mark while the link closes on another."""
        try:
            self._ctl[_W_PROGRESS] = time.monotonic_ns() if now_ns is None else now_ns
        except ValueError:  # the view was released by close()
            if not self._closed:
                raise

    @property
    def last_progress_ns(self) -> int:
        """CLOCK_MONOTONIC ns of the worker's last copy progress mark, 0 if none yet."""
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
