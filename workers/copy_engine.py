"""The copy-engine contract shared by the CPU and CUDA implementations.

A :class:`CopyJob` copies row ``src_ids[i]`` to row ``dst_ids[i]`` in every region of the
rank (STORE: device layout -> host pool; LOAD: host pool -> device layout). An engine:

* ``submit(job, after)`` returns at once; the copy starts only after ``after`` (a
  :class:`Fence`) is signalled: a store after the compute that writes its blocks, a load
  into a reused block after that block's previous reader.
* ``poll()`` returns the :class:`~kvshm.ipc.protocol.Done` of finished jobs without waiting.
  Order: within one direction, jobs are reported in submission order (a finished job
  waits behind an unfinished earlier one of its direction); loads never wait behind stores
  or the reverse (they run on separate CUDA streams).
* ``wait(job_ids, timeout)`` blocks until exactly those jobs have finished (or the timeout
  passes) and returns their ``Done``s; other jobs are left for ``poll``.
* every submitted job is reported exactly once, by ``poll`` or ``wait``.
* errors never escape ``submit``/``poll``/``wait``: an exception while copying a job
  becomes ``Done(ok=False, error=...)`` for that job, and later jobs still run.

Engines order *completion reporting*, not copies: two jobs may copy concurrently. That is
safe because the scheduler never lets a job read a block another in-flight job writes
(in-flight blocks are pinned and a CPU block being written is never looked up).
"""

from __future__ import annotations

import abc
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field, fields
from typing import Protocol, runtime_checkable

import torch

from kvshm.errors import CopyError, ProtocolError
from kvshm.ipc.protocol import Direction, Done, Transfer, ids_array

__all__ = [
    "CompletionTracker",
    "CopyEngine",
    "CopyJob",
    "CopyStats",
    "CpuFence",
    "Fence",
    "check_ids",
    "describe_error",
    "pair_runs",
    "pieces",
]


@dataclass(frozen=True, slots=True)
class CopyJob:
    """One transfer for this rank: ``src_ids[i]`` -> ``dst_ids[i]`` in every region.

    ``src_ids``/``dst_ids`` are 1-D int64 CPU tensors of equal length; engines validate
    them (shape, bounds) while copying and report bad ones as a failed job.
    """

    job_id: int
    direction: Direction
    src_ids: torch.Tensor
    dst_ids: torch.Tensor

    @classmethod
    def from_ids(cls, job_id: int, direction: Direction, src_ids: Iterable[int],
                 dst_ids: Iterable[int]) -> CopyJob:
        """A job from Python ints (tests, tools)."""
        return cls(job_id, direction, torch.tensor(list(src_ids), dtype=torch.int64),
                   torch.tensor(list(dst_ids), dtype=torch.int64))

    @classmethod
    def from_transfer(cls, msg: Transfer) -> CopyJob:
        """A job from a wire ``Transfer`` (packed little-endian u32 ids).

        Raises :class:`ProtocolError` for a ragged id payload.
        """
        return cls(msg.job_id, Direction(msg.direction), _unpack(msg.src_ids, "src"),
                   _unpack(msg.dst_ids, "dst"))

    def __len__(self) -> int:
        return int(self.src_ids.numel())


def _unpack(data: bytes, what: str) -> torch.Tensor:
    """Wire ids (:func:`~kvshm.ipc.protocol.ids_array`: the ragged-length check and the
    u32 decode) as a 1-D int64 tensor; the ProtocolError names the side (``src``/``dst``)."""
    try:
        ids = ids_array(data)
    except ProtocolError as exc:
        raise ProtocolError(f"{what} {exc}") from None
    if not ids:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(ids, dtype=torch.uint32).to(torch.int64)


class Fence(abc.ABC):
    """What a copy must wait for before it starts (the writer or previous reader is done)."""

    @abc.abstractmethod
    def is_set(self) -> bool:
        """True once the fence is signalled (never goes back to False)."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> bool:
        """Block the calling thread until signalled or ``timeout`` s; True iff signalled."""


class CpuFence(Fence):
    """A host-side fence: the compute calls :meth:`set` once it has written its blocks."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        """Signal the fence (idempotent; any thread)."""
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)


@runtime_checkable
class CopyEngine(Protocol):
    """What a worker drives (see the module docstring for ordering and error rules)."""

    def submit(self, job: CopyJob, after: Fence | None = None) -> None:
        """Queue ``job`` to start once ``after`` is signalled; returns at once, never raises."""

    def poll(self) -> list[Done]:
        """Finished jobs not yet reported, FIFO per direction; never waits."""

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until every job in ``job_ids`` has finished or ``timeout`` s passed.

        Returns the ``Done``s of the named jobs that finished (all of them unless the
        timeout passed). Ids not outstanding (already reported, or never submitted) are
        ignored and counted in ``stats()["wait_unknown_ids"]``.
        """

    def stats(self) -> dict[str, int]:
        """Counters: jobs submitted/ok/failed, bytes copied, and every declined outcome."""

    def set_gate(self, gate: Callable[[], bool] | None) -> None:
        """``gate()`` is asked right before a job starts copying (after its fence), from
        whatever thread starts it; False fails the job instead ("gate closed"). A worker
        gates on its revocation word, so a copy that waited while the rank was declared
        dead never starts. Engines that enqueue at submit ask it there."""

    def cancel_queued(self) -> None:
        """Jobs submitted but not started yet fail ("cancelled"); running copies finish;
        later submits still run. Never blocks. A revoked worker calls it so that nothing
        it queued before the verdict starts afterwards."""

    def close(self) -> None:
        """Stop: jobs not yet started fail ("engine closed"); idempotent; poll still works."""


@dataclass(slots=True)
class CopyStats:
    """Counters every engine keeps (mutated under the tracker's lock)."""

    jobs_submitted: int = 0
    jobs_ok: int = 0
    jobs_failed: int = 0
    bytes_copied: int = 0
    pairs_copied: int = 0
    fence_timeouts: int = 0
    rejected_closed: int = 0
    wait_unknown_ids: int = 0
    wait_timeouts: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


def describe_error(exc: BaseException) -> str:
    """The ``Done.error`` text for an exception."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True, eq=False)
class _Entry:
    seq: int
    job_id: int
    done: Done | None = None


@dataclass(slots=True)
class CompletionTracker:
    """Thread-safe FIFO completion bookkeeping, one lane per :class:`Direction`.

    ``add`` (submission order) -> ``finish`` (any thread, any order) -> ``take_ready`` /
    ``take`` (owner). A job leaves the tracker exactly once. ``take_ready`` releases a
    lane's finished jobs from its head up to the first unfinished one.
    """

    stats: CopyStats = field(default_factory=CopyStats)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _lanes: dict[Direction, deque[_Entry]] = field(
        default_factory=lambda: {d: deque() for d in Direction})
    _by_seq: dict[int, _Entry] = field(default_factory=dict)
    _next_seq: int = 0

    def add(self, job_id: int, lane: Direction) -> int:
        """Record a submitted job; returns its ticket (submission sequence number)."""
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            entry = _Entry(seq, job_id)
            self._lanes[lane].append(entry)
            self._by_seq[seq] = entry
            self.stats.jobs_submitted += 1
            return seq

    def last_seq(self) -> int:
        """The ticket of the latest ``add`` (-1 before the first)."""
        with self._lock:
            return self._next_seq - 1

    def finish(self, seq: int, done: Done, *, nbytes: int = 0, pairs: int = 0) -> None:
        """Mark ticket ``seq`` finished with ``done`` (counts it); wakes waiters."""
        with self._lock:
            entry = self._by_seq[seq]
            assert entry.done is None, f"job ticket {seq} finished twice"
            entry.done = done
            if done.ok:
                self.stats.jobs_ok += 1
                self.stats.bytes_copied += nbytes
                self.stats.pairs_copied += pairs
            else:
                self.stats.jobs_failed += 1
            self._lock.notify_all()

    def take_ready(self) -> list[Done]:
        """Remove and return finished jobs at each lane's head, in submission order.
        Nothing outstanding: [] without the lock (only the owner adds jobs, so an
        empty book stays empty while it looks)."""
        if not self._by_seq:
            return []
        out: list[tuple[int, Done]] = []
        with self._lock:
            for lane in self._lanes.values():
                while lane and lane[0].done is not None:
                    entry = lane.popleft()
                    del self._by_seq[entry.seq]
                    assert entry.done is not None
                    out.append((entry.seq, entry.done))
        out.sort(key=lambda p: p[0])
        return [d for _, d in out]

    def unfinished(self, job_ids: Collection[int]) -> list[int]:
        """Tickets of outstanding jobs with these ids that have not finished yet."""
        with self._lock:
            return [e.seq for e in self._by_seq.values() if e.job_id in job_ids and e.done is None]

    def take(self, job_ids: Collection[int]) -> list[Done]:
        """Remove and return the finished outstanding jobs with these ids (any position).

        Ids with no outstanding job at all are counted in ``stats.wait_unknown_ids``.
        """
        with self._lock:
            hits = sorted((e for e in self._by_seq.values() if e.job_id in job_ids),
                          key=lambda e: e.seq)
            known = {e.job_id for e in hits}
            self.stats.wait_unknown_ids += sum(1 for j in set(job_ids) if j not in known)
            out = []
            for e in hits:
                if e.done is None:
                    continue
                del self._by_seq[e.seq]
                for lane in self._lanes.values():
                    if e in lane:
                        lane.remove(e)
                        break
                out.append(e.done)
            return out

    def wait_finished(self, job_ids: Collection[int], timeout: float | None) -> bool:
        """Block until no outstanding job with these ids is unfinished (needs ``finish`` from
        another thread); True unless the timeout passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while any(e.job_id in job_ids and e.done is None for e in self._by_seq.values()):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.stats.wait_timeouts += 1
                    return False
                self._lock.wait(left)
            return True

    def count_rejected_closed(self) -> None:
        with self._lock:
            self.stats.rejected_closed += 1

    def count_wait_timeout(self) -> None:
        with self._lock:
            self.stats.wait_timeouts += 1

    def count_fence_timeout(self) -> None:
        with self._lock:
            self.stats.fence_timeouts += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            d = self.stats.as_dict()
            d["jobs_outstanding"] = len(self._by_seq)
            return d

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_seq)


Run = tuple[int, int, int]


def pieces(src_ids: list[int], dst_ids: list[int]) -> tuple[list[Run], list[Run]]:
    """``(runs, singles)``: :func:`pair_runs`, and every pair as a run of one (for regions
    whose rows are padded). The same list when no pairs coalesce."""
    runs = pair_runs(src_ids, dst_ids)
    if len(runs) == len(src_ids):
        return runs, runs
    return runs, [(s, d, 1) for s, d in zip(src_ids, dst_ids)]


def pair_runs(src_ids: list[int], dst_ids: list[int]) -> list[Run]:
    """Group pairs into runs ``(src_start, dst_start, length)`` where both sides are consecutive.

    Keeps the pairs' order; ``sum(length) == len(src_ids)``. A run may only be copied as
    one piece where both sides' rows are dense (row stride == bytes per block).
    """
    runs: list[Run] = []
    if not src_ids:
        return runs
    s0, d0, n = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:]):
        if s == s0 + n and d == d0 + n:
            n += 1
        else:
            runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    runs.append((s0, d0, n))
    return runs


def check_ids(job: CopyJob, src_rows: int, dst_rows: int) -> tuple[list[int], list[int]]:
    """The job's ids as Python lists, validated; :class:`CopyError` names the first bad id."""
    src, dst = job.src_ids, job.dst_ids
    if src.dim() != 1 or dst.dim() != 1 or src.numel() != dst.numel():
        raise CopyError(f"job {job.job_id}: src/dst ids must be 1-D and of equal length, got "
                        f"{tuple(src.shape)} and {tuple(dst.shape)}")
    if src.dtype.is_floating_point or dst.dtype.is_floating_point:
        raise CopyError(f"job {job.job_id}: block ids must be integers, got "
                        f"{src.dtype}/{dst.dtype}")
    src_l: list[int] = src.tolist()
    dst_l: list[int] = dst.tolist()
    for name, ids, rows in (("src", src_l, src_rows), ("dst", dst_l, dst_rows)):
        if ids and (min(ids) < 0 or max(ids) >= rows):
            bad = next(i for i in ids if not 0 <= i < rows)
            raise CopyError(f"job {job.job_id}: {name} block id {bad} out of range [0, {rows})")
    return src_l, dst_l
