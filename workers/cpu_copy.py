"""CPU copy engine: copies between a CPU device layout and the host pool on copy threads.

``submit`` only queues; a copy thread waits for the job's fence, then copies every pair in
every region and publishes the job's ``Done`` (tracker flag + one eventfd write: the only
signals that cross threads). The owner collects with ``poll``/``wait`` and may watch
:meth:`CpuCopyEngine.notify_fd` (readable when something finished) in its own poll().

Copy methods (:class:`CpuCopyMethod`), chosen by measurement (tools/bench_copy.py):

* ``MEMMOVE`` (default): one libc ``memmove`` per (region, run of consecutive pairs), via
  ``ctypes`` which releases the GIL during the copy. Single pass over the bytes; ~0.4 us
  of Python per call (libc's function with declared argtypes, not ``ctypes.memmove``),
  so even 32 KiB fragments run near a large contiguous copy. Every address comes from
  validated ids and from tensors the engine keeps alive.
* ``INDEX``: ``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))`` per region.
  Two passes through a temporary and an element-wise kernel: 5-10x slower here; kept as
  a cross-check.

With ``num_threads > 1`` jobs copy concurrently and may finish out of order; reporting
stays FIFO per direction (:class:`~workers.copy_engine.CompletionTracker`).

``inline``: a job submitted without a fence (and without fault injection), load or
store, is copied by the caller inside ``submit`` instead of on a copy thread: an
embedded worker on the CPU (vLLM's forward runs in the submitting thread, finished
before its hooks) saves the hand-off to a copy thread. The hand-off is what costs: the
thread needs the GIL back after each ``memmove`` (one per region and run of
consecutive pairs: hundreds a store), and while the host runs Python -- vLLM's engine
loop stepping, a request waiting for its blocks' store to free them -- each wait for
the GIL lasts up to the interpreter's switch interval (5 ms). Measured in
``tools.bench_e2e``'s chat workload (100 requests, 2 cores): a store on the thread
finished 42-58 ms after the request's first token (vLLM stepped 138-150 times
meanwhile), inline in 2.5 ms, with the same time to first token, and the arm's wall
time fell from 19-20 s to 13.5 s (vLLM's own CPU connector copies in the caller too).
Loads on the thread had medians of 0.04-1 ms and outliers of 3-65 ms. An inline job
goes through the same checks as a copy thread (closing, cancelled, gate) and is
reported the same way; a job with a fence still goes to the threads. Loads and stores
never share a block (the scheduler pins every block a job uses), so a job copied now
beside one on a thread is safe.
"""

from __future__ import annotations

import ctypes
import enum
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Final, NamedTuple, Self

import torch

from kvshm.errors import ConfigError, CopyError
from kvshm.ipc.protocol import Direction, Done
from kvshm.layout import KVLayout
from workers.copy_engine import (
    CompletionTracker,
    CopyJob,
    Fence,
    Run,
    check_ids,
    describe_error,
    pieces,
)
from workers.host_pool import HostPool

__all__ = ["CpuCopyEngine", "CpuCopyMethod", "FaultInjection"]

#: How often a fence wait re-checks for close() and its deadline.
_FENCE_SLICE_S: Final = 0.05


def _libc_memmove() -> Callable[[int, int, int], None]:
    """libc's ``memmove`` with declared argument types, or ``ctypes.memmove``.

    Measured here: ``ctypes.memmove`` costs ~0.7 us of Python per call (it converts and
    returns a pointer object); the same libc function with ``argtypes`` set and no
    result costs ~0.4 us. At 32 KiB per call (~3 us of copying) that is the difference
    between ~0.65 and ~0.75 of one large copy. Both release the GIL during the copy.
    """
    try:
        fn = ctypes.CDLL(None).memmove
    except (OSError, AttributeError):
        return ctypes.memmove  # type: ignore[return-value]
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = None
    return fn


_MEMMOVE: Final = _libc_memmove()

PROGRESS_PIECES: Final = 4096
"""A long copy marks the rank's progress after each such many ``memmove`` calls ..."""
PROGRESS_BYTES: Final = 256 << 20
"""... or each such many bytes, whichever comes first (a run longer than that is copied
in calls of at most this much): tens of milliseconds of copying, far below any hang
timeout, and one mark in thousands of calls."""


def _copy_marking(todo: list[Run], dst: tuple[int, int], src: tuple[int, int], n: int,
                  budget: tuple[int, int], mark: Callable[[], None]) -> tuple[int, int]:
    """Copy ``todo``'s pieces (rows of ``n`` bytes; ``dst`` / ``src``: base address and
    row stride), calling ``mark`` whenever ``budget`` (calls, bytes left) runs out; a
    piece over ``PROGRESS_BYTES`` goes in several calls. Returns the budget left."""
    move = _MEMMOVE
    (db, ds), (sb, ss) = dst, src
    calls, left = budget
    most = max(1, PROGRESS_BYTES // n)  # rows in one call
    for s, d, k in todo:
        while k > 0:
            c = k if k <= most else most
            move(db + d * ds, sb + s * ss, c * n)
            s, d, k = s + c, d + c, k - c
            calls, left = calls - 1, left - c * n
            if calls <= 0 or left <= 0:
                mark()
                calls, left = PROGRESS_PIECES, PROGRESS_BYTES
    return calls, left


class CpuCopyMethod(enum.Enum):
    """How a job's pairs are copied (see the module docstring)."""

    MEMMOVE = "memmove"
    INDEX = "index"


@dataclass(frozen=True)
class FaultInjection:
    """Test hooks. Delays and failures are decided at submit time, so they are seeded
    and independent of thread timing.

    ``max_delay_s``: each job sleeps uniform ``[0, max_delay_s)`` after copying, before
    it is marked finished. ``fail_job_ids``: jobs with these ids fail instead of copying.
    ``fail_nth``: the n-th submitted job (0-based) fails.
    """

    seed: int = 0
    max_delay_s: float = 0.0
    fail_job_ids: frozenset[int] = field(default_factory=frozenset)
    fail_nth: int | None = None


class _Region(NamedTuple):
    dev: torch.Tensor
    host: torch.Tensor
    nbytes: int  # bytes per block
    dense: bool  # both sides' rows are back to back: a run copies as one piece


class _Item(NamedTuple):
    seq: int
    job: CopyJob
    fence: Fence | None
    delay_s: float
    fail: bool


class CpuCopyEngine:
    """The CPU :class:`~workers.copy_engine.CopyEngine` (contract in copy_engine.py)."""

    def __init__(self, rank: int, device_layout: KVLayout, host: HostPool, *,
                 num_threads: int = 1, fault: FaultInjection | None = None,
                 method: CpuCopyMethod = CpuCopyMethod.MEMMOVE,
                 fence_timeout_s: float = 60.0, inline: bool = False,
                 progress: Callable[[], None] | None = None) -> None:
        if device_layout.device.type != "cpu":
            raise ConfigError(f"CpuCopyEngine needs a CPU device layout, got "
                              f"{device_layout.device}")
        if len(host.regions) != len(device_layout.regions):
            raise ConfigError(f"host pool has {len(host.regions)} regions, the device layout "
                              f"{len(device_layout.regions)}")
        if num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {num_threads}")
        regions = []
        for i, (dev, hst) in enumerate(zip(device_layout.regions, host.regions)):
            if dev.shape[1] != hst.shape[1]:
                raise ConfigError(f"region {i}: device blocks of {dev.shape[1]} bytes, host "
                                  f"blocks of {hst.shape[1]}")
            nbytes = int(dev.shape[1])
            dense = dev.stride(0) == nbytes and hst.stride(0) == nbytes
            regions.append(_Region(dev, hst, nbytes, dense))
        self.rank = rank
        self.method = method
        self.inline = inline
        self._progress = progress
        self._regions = tuple(regions)  # keeps every tensor (and so every mapping) alive
        self._dev_rows = device_layout.num_blocks
        self._host_rows = host.num_cpu_blocks
        self._fault = fault
        self._rng = random.Random(fault.seed if fault else 0)
        self._nth = 0
        self._fence_timeout_s = fence_timeout_s
        self._tracker = CompletionTracker()
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._rung = 0  # eventfd rings so far (:meth:`poll`)
        self._drained = 0  # ... as of the last drain
        self._rung_lock = threading.Lock()  # publishers on several threads: no lost count
        self._closing = threading.Event()
        self._cancel_upto = -1  # items with seq <= this fail instead of starting
        self._gate: Callable[[], bool] | None = None
        self._closed = False
        self._threads = [threading.Thread(target=self._run, name=f"kvshm-copy-{rank}.{i}",
                                          daemon=True) for i in range(num_threads)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ owner side

    def submit(self, job: CopyJob, after: Fence | None = None) -> None:
        """Queue ``job``; it copies once ``after`` is set. Returns at once, never raises."""
        seq = self._tracker.add(job.job_id, job.direction)
        if self._closed or self._closing.is_set():
            self._tracker.count_rejected_closed()
            self._publish(seq, Done(job.job_id, self.rank, False, "CopyError: engine closed"))
            return
        delay, fail = 0.0, False
        if self._fault is not None:
            f = self._fault
            delay = self._rng.uniform(0.0, f.max_delay_s) if f.max_delay_s > 0 else 0.0
            fail = job.job_id in f.fail_job_ids or self._nth == f.fail_nth
        self._nth += 1
        item = _Item(seq, job, after, delay, fail)
        if self.inline and after is None and self._fault is None:
            self._execute(item)  # module docstring: the caller copies it now
            return
        self._queue.put(item)

    def set_gate(self, gate: Callable[[], bool] | None) -> None:
        """See CopyEngine.set_gate (asked on the copy thread, after the job's fence)."""
        self._gate = gate

    def cancel_queued(self) -> None:
        """Every job submitted so far and not started fails instead (see CopyEngine)."""
        self._cancel_upto = self._tracker.last_seq()

    def poll(self) -> list[Done]:
        """Finished jobs not yet reported, FIFO per direction; never waits.

        Drains :meth:`notify_fd` first, so a job finishing meanwhile rings it again --
        only when a job finished since the last drain (``_rung``, counted after each
        ring: a ring whose count is not yet visible is drained by the next poll, and
        its fd stays readable until then, so no wake-up is lost): the read is a syscall,
        and one that finds nothing hands the GIL to the copy threads for nothing.
        """
        rung = self._rung
        if rung != self._drained and not self._closed:
            self._drained = rung
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
        return self._tracker.take_ready()

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until exactly ``job_ids`` have finished (or ``timeout``); their ``Done``s."""
        ids = frozenset(job_ids)
        self._tracker.wait_finished(ids, timeout)
        return self._tracker.take(ids)

    def notify_fd(self) -> int:
        """An eventfd that becomes readable when a job finishes (drained by :meth:`poll`).

        Valid until :meth:`close`. Readability is a hint: poll() may then return nothing
        (the finished job waits behind an earlier one, or ``wait`` took it).
        """
        if self._closed:
            raise ConfigError("engine is closed")
        return self._efd

    def stats(self) -> dict[str, int]:
        """Counters (see :class:`~workers.copy_engine.CopyStats`) plus ``jobs_outstanding``."""
        return self._tracker.snapshot()

    def close(self) -> None:
        """Fail queued jobs not yet started, finish the running copies, join the threads.

        Idempotent. Every job submitted is still reported once by poll/wait afterwards.
        """
        if self._closed:
            return
        self._closing.set()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._closed = True
        os.close(self._efd)
        # no copy runs any more: drop the tensors, so the host pool's mapping goes with
        # the session, not with whoever still holds this engine (an embedding host)
        self._regions = ()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ copy threads

    def _publish(self, seq: int, done: Done, nbytes: int = 0, pairs: int = 0) -> None:
        self._tracker.finish(seq, done, nbytes=nbytes, pairs=pairs)
        if not self._closed:
            os.eventfd_write(self._efd, 1)
            # after the ring (see poll), under a lock: the inline caller and the copy
            # threads publish concurrently, and a lost increment could leave the count
            # equal to a drain's while the fd is readable (a parked loop would spin)
            with self._rung_lock:
                self._rung += 1

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._execute(item)

    def _execute(self, item: _Item) -> None:
        """Copy one job (a copy thread, or ``submit`` for an inline job) and publish
        its Done; never raises."""
        job = item.job
        nbytes = 0
        try:
            if self._closing.is_set():
                raise CopyError("engine closed before the copy started")
            if item.seq <= self._cancel_upto:
                raise CopyError("cancelled before the copy started (worker revoked)")
            self._await_fence(item.fence)
            gate = self._gate
            if item.seq <= self._cancel_upto or (gate is not None and not gate()):
                raise CopyError("cancelled before the copy started (worker revoked)")
            if item.fail:
                raise CopyError(f"injected failure of job {job.job_id}")
            nbytes = self._copy(job)
            done = Done(job.job_id, self.rank, True)
        except Exception as exc:  # noqa: BLE001 - every error becomes a failed Done
            done = Done(job.job_id, self.rank, False, describe_error(exc))
        if item.delay_s:
            time.sleep(item.delay_s)
        self._publish(item.seq, done, nbytes, len(job) if done.ok else 0)

    def _await_fence(self, fence: Fence | None) -> None:
        if fence is None:
            return
        deadline = time.monotonic() + self._fence_timeout_s
        while not fence.wait(_FENCE_SLICE_S):
            if self._closing.is_set():
                raise CopyError("engine closed while the job waited for its fence")
            if time.monotonic() >= deadline:
                self._tracker.count_fence_timeout()
                raise CopyError(f"fence not signalled within {self._fence_timeout_s} s")

    def _copy(self, job: CopyJob) -> int:
        """Copy every pair in every region; returns the bytes copied."""
        store = job.direction == Direction.STORE
        src_rows, dst_rows = (self._dev_rows, self._host_rows) if store else \
            (self._host_rows, self._dev_rows)
        src_ids, dst_ids = check_ids(job, src_rows, dst_rows)
        if not src_ids:
            return 0
        if self.method is CpuCopyMethod.INDEX:
            self._copy_index(store, job)
        else:
            self._copy_memmove(store, src_ids, dst_ids)
        return len(src_ids) * sum(r.nbytes for r in self._regions)

    def _copy_memmove(self, store: bool, src_ids: list[int], dst_ids: list[int]) -> None:
        """One ``memmove`` per region and piece; with ``progress``, a mark after every
        ``PROGRESS_PIECES`` calls or ``PROGRESS_BYTES`` copied, whichever comes first (the
        rank's copy progress stamp: a copy that runs for seconds is not a hung rank). A
        region whose pieces fit the budgets left is copied without counting."""
        runs, singles = pieces(src_ids, dst_ids)
        move, mark = _MEMMOVE, self._progress
        calls, left = PROGRESS_PIECES, PROGRESS_BYTES
        pairs = len(src_ids)
        for r in self._regions:
            src, dst = (r.dev, r.host) if store else (r.host, r.dev)
            sb, ss, n = src.data_ptr(), src.stride(0), r.nbytes
            db, ds = dst.data_ptr(), dst.stride(0)
            todo = runs if r.dense else singles
            if mark is None or (len(todo) < calls and pairs * n < left):
                for s, d, k in todo:
                    move(db + d * ds, sb + s * ss, k * n)
                calls, left = calls - len(todo), left - pairs * n
                continue
            calls, left = _copy_marking(todo, (db, ds), (sb, ss), n, (calls, left), mark)

    def _copy_index(self, store: bool, job: CopyJob) -> None:
        for r in self._regions:
            src, dst = (r.dev, r.host) if store else (r.host, r.dev)
            dst.index_copy_(0, job.dst_ids, src.index_select(0, job.src_ids))
