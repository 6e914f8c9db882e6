"""CUDA copy engine: device KV regions <-> the pinned host pool, on low-priority streams.

The only worker module that needs CUDA; it imports (and type-checks) without it, and the
engine's constructor raises :class:`~kvshm.errors.ConfigError` where CUDA is missing.

* Two streams at the lowest CUDA priority (0; higher priorities are negative), one for
  stores (D2H) and one for loads (H2D), so KV I/O yields to compute and a load never
  queues behind a store.
* ``submit(job, after)``: the job's stream waits on ``after`` (a :class:`CudaFence`: an
  event the compute stream recorded), then every copy of the job is enqueued, then an
  event (timing disabled) is recorded. All of it is asynchronous: submit returns once the
  copies are enqueued; nothing waits on the device.
* Completion is found by polling those events in FIFO order per stream (``event.query()``);
  ``wait`` synchronizes only the named jobs' events. No device-wide synchronize, no
  Python callbacks from CUDA.

Copy method (:class:`CudaCopyMethod`, chosen by measurement on an H100 with
``tools/bench_copy.py``, numbers in the README): ``BATCH`` (the default where the driver
has it) enqueues a job's pieces -- per region, each run of pairs consecutive on both
sides, or each pair where rows are padded -- with one ``cuMemcpyBatchAsync`` call
(:mod:`workers.cuda_batch`); ``INDEXED`` issues one ``copy_(non_blocking=True)`` (one
``cudaMemcpyAsync``) per piece. Both run on the DMA copy engines (no SMs taken from
compute). Whole-block regions move near the PCIe limit either way; for many small
per-layer fragments (64 regions x 64 pairs = 4,096 pieces a job) the per-call host cost
of ``INDEXED`` dominates. If the driver refuses a batch, that job is enqueued again with
indexed copies (re-copying a piece is harmless: same bytes to the same place), the
engine stays on ``INDEXED`` and counts ``batch_fallbacks``.

A job whose enqueueing fails part-way is reported failed only once what was enqueued has
finished (its event completes), so the scheduler never reuses a block a copy still uses.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, Final, NamedTuple, Protocol, Self

import torch

from kvshm.errors import ConfigError, CopyError
from kvshm.ipc.protocol import Direction, Done
from kvshm.layout import KVLayout
from workers.copy_engine import (
    CompletionTracker,
    CopyJob,
    Fence,
    check_ids,
    describe_error,
    pieces,
)
from workers.cuda_batch import BatchMemcpy, RegionGroup, load_batch_memcpy
from workers.host_pool import HostPool

__all__ = ["STREAM_PRIORITY", "CudaCopyEngine", "CudaCopyMethod", "CudaEvent", "CudaFence"]

#: CUDA's least (lowest) stream priority; greater priorities are negative numbers.
STREAM_PRIORITY: Final = 0
#: Longest sleep between event queries in a wait with a timeout.
_MAX_NAP_S: Final = 0.001


class CudaCopyMethod(enum.Enum):
    """How a job's pieces are enqueued (see the module docstring)."""

    BATCH = "batch"
    INDEXED = "indexed"


class CudaEvent(Protocol):
    """What the engine uses of ``torch.cuda.Event`` (typed here: torch's stubs leave it bare)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def record(self, stream: Any = None) -> None: ...


#: ``torch.cuda`` seen as Any: its Event/Stream constructors are untyped in torch's stubs.
_cuda: Any = torch.cuda


def _new_event() -> CudaEvent:
    """An event with timing disabled (cheaper to record and query)."""
    event: CudaEvent = _cuda.Event(enable_timing=False)
    return event


def _wait_event(event: CudaEvent, timeout: float | None) -> bool:
    """Wait for ``event`` on the host: synchronize it, or query with short naps until timeout."""
    if timeout is None:
        event.synchronize()
        return True
    deadline = time.monotonic() + timeout
    nap = 1e-5
    while not event.query():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(nap, left))
        nap = min(nap * 2, _MAX_NAP_S)
    return True


class CudaFence(Fence):
    """A CUDA event some stream records when the blocks' writer (or last reader) is done."""

    __slots__ = ("event",)

    def __init__(self, event: CudaEvent) -> None:
        self.event = event

    @classmethod
    def record(cls, stream: torch.cuda.Stream | None = None) -> CudaFence:
        """Record a fresh event (timing disabled) on ``stream`` (default: the current one)."""
        event = _new_event()
        event.record(stream)
        return cls(event)

    def is_set(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout: float | None = None) -> bool:
        return _wait_event(self.event, timeout)


class _Region(NamedTuple):
    dev: torch.Tensor
    host: torch.Tensor
    dense: bool  # both sides' rows back to back: a run copies as one piece


class _Pending(NamedTuple):
    seq: int
    job_id: int
    event: CudaEvent
    nbytes: int
    pairs: int
    error: str  # "" unless enqueueing failed part-way (reported once the event completes)
    keep: object  # the batch descriptors, alive until the copies are done


class CudaCopyEngine:
    """The CUDA :class:`~workers.copy_engine.CopyEngine` (contract in copy_engine.py).

    All methods run on the owner's thread (no threads of its own).
    """

    def __init__(self, rank: int, device_layout: KVLayout, host: HostPool, *,
                 priority: int = STREAM_PRIORITY, method: CudaCopyMethod | None = None) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("CudaCopyEngine needs CUDA (torch.cuda.is_available() is False)")
        if device_layout.device.type != "cuda":
            raise ConfigError(f"CudaCopyEngine needs a CUDA device layout, got "
                              f"{device_layout.device}")
        if not host.pinned:
            raise ConfigError("CudaCopyEngine needs a pinned host pool (HostPool(..., pin=True))")
        if len(host.regions) != len(device_layout.regions):
            raise ConfigError(f"host pool has {len(host.regions)} regions, the device layout "
                              f"{len(device_layout.regions)}")
        regions = []
        for i, (dev, hst) in enumerate(zip(device_layout.regions, host.regions)):
            n = int(dev.shape[1])
            if n != hst.shape[1]:
                raise ConfigError(f"region {i}: device blocks of {n} bytes, host blocks of "
                                  f"{hst.shape[1]}")
            regions.append(_Region(dev, hst, dev.stride(0) == n and hst.stride(0) == n))
        self.rank = rank
        self.device = device_layout.device
        self._regions = tuple(regions)  # keeps the tensors (and the host mapping) alive
        self._block_bytes = device_layout.bytes_per_block
        self._rows = {Direction.STORE: (device_layout.num_blocks, host.num_cpu_blocks),
                      Direction.LOAD: (host.num_cpu_blocks, device_layout.num_blocks)}
        self._streams: dict[Direction, Any] = {
            d: _cuda.Stream(self.device, priority=priority) for d in Direction}
        self._pending: dict[Direction, deque[_Pending]] = {d: deque() for d in Direction}
        self._tracker = CompletionTracker()
        self._closed = False
        self._gate: Callable[[], bool] | None = None
        self._fallbacks = 0
        self._batch, self.method = self._pick_method(method)
        self._groups = (RegionGroup([(r.dev, r.host) for r in regions if r.dense]),
                        RegionGroup([(r.dev, r.host) for r in regions if not r.dense]))

    def _pick_method(self, method: CudaCopyMethod | None,
                     ) -> tuple[BatchMemcpy | None, CudaCopyMethod]:
        if method is CudaCopyMethod.INDEXED:
            return None, method
        batch = load_batch_memcpy(self.device.index or 0)
        if batch is not None:
            return batch, CudaCopyMethod.BATCH
        if method is CudaCopyMethod.BATCH:
            raise ConfigError("CudaCopyMethod.BATCH needs cuMemcpyBatchAsync (a CUDA >= 12.8 "
                              "driver); use CudaCopyMethod.INDEXED")
        return None, CudaCopyMethod.INDEXED

    def submit(self, job: CopyJob, after: Fence | None = None) -> None:
        """Enqueue the job's copies on its direction's stream after ``after``; never raises."""
        seq = self._tracker.add(job.job_id, job.direction)
        if self._closed:
            self._tracker.count_rejected_closed()
            closed = Done(job.job_id, self.rank, False, "CopyError: engine closed")
            self._tracker.finish(seq, closed)
            return
        try:
            if self._gate is not None and not self._gate():
                raise CopyError(f"job {job.job_id}: gate closed (worker revoked)")
            if after is not None and not isinstance(after, CudaFence):
                raise CopyError(f"job {job.job_id}: the CUDA engine orders copies after a "
                                f"CudaFence, got {type(after).__name__}")
            src_rows, dst_rows = self._rows[job.direction]
            src_ids, dst_ids = check_ids(job, src_rows, dst_rows)
        except Exception as exc:  # noqa: BLE001 - nothing enqueued: fail at once
            self._tracker.finish(seq, Done(job.job_id, self.rank, False, describe_error(exc)))
            return
        stream = self._streams[job.direction]
        error = ""
        keep: object = None
        try:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after.event)
                try:
                    keep = self._enqueue(job.direction is Direction.STORE, src_ids, dst_ids,
                                         stream)
                except Exception as exc:  # noqa: BLE001 - report once enqueued work is done
                    error = describe_error(exc)
                event = _new_event()
                event.record(stream)
        except Exception as exc:  # noqa: BLE001 - the stream itself is broken
            self._tracker.finish(seq, Done(job.job_id, self.rank, False, describe_error(exc)))
            return
        self._pending[job.direction].append(
            _Pending(seq, job.job_id, event, len(src_ids) * self._block_bytes, len(src_ids), error,
                     keep))

    def _enqueue(self, store: bool, src_ids: list[int], dst_ids: list[int],
                 stream: Any) -> object:
        """Enqueue the job's pieces on ``stream`` (current); returns what must stay alive
        until they are done."""
        runs, singles = pieces(src_ids, dst_ids)
        if self._batch is not None:
            try:
                return self._enqueue_batch(self._batch, store, runs, singles, stream)
            except CopyError:
                self._batch, self.method = None, CudaCopyMethod.INDEXED
                self._fallbacks += 1
        self._enqueue_indexed(store, runs, singles)
        return None

    def _enqueue_batch(self, batch: BatchMemcpy, store: bool, runs: list[tuple[int, int, int]],
                       singles: list[tuple[int, int, int]], stream: Any) -> object:
        parts = [group.descriptors(store, torch.tensor(plist, dtype=torch.int64))
                 for group, plist in zip(self._groups, (runs, singles))
                 if group.row_bytes.numel() and plist]
        if not parts:
            return None
        dsts, srcs, sizes = (torch.cat(col) if len(parts) > 1 else col[0]
                             for col in zip(*parts))
        batch(store, dsts, srcs, sizes, int(stream.cuda_stream))
        return dsts, srcs, sizes

    def _enqueue_indexed(self, store: bool, runs: list[tuple[int, int, int]],
                         singles: list[tuple[int, int, int]]) -> None:
        for r in self._regions:
            src, dst = (r.dev, r.host) if store else (r.host, r.dev)
            for s, d, k in (runs if r.dense else singles):
                dst[d:d + k].copy_(src[s:s + k], non_blocking=True)

    def _reap(self) -> None:
        """Mark finished every job whose event has completed, FIFO per stream."""
        for lane in self._pending.values():
            while lane:
                head = lane[0]
                try:
                    if not head.event.query():
                        break
                    error = head.error
                except Exception as exc:  # noqa: BLE001 - a CUDA error surfaced here
                    error = describe_error(exc)
                lane.popleft()
                if error:
                    done = Done(head.job_id, self.rank, False, error)
                else:
                    done = Done(head.job_id, self.rank, True)
                self._tracker.finish(head.seq, done, nbytes=head.nbytes, pairs=head.pairs)

    def poll(self) -> list[Done]:
        """Finished jobs not yet reported, FIFO per direction; never waits."""
        self._reap()
        return self._tracker.take_ready()

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until exactly ``job_ids`` have finished (or ``timeout``); their ``Done``s.

        Waits on those jobs' events only (never the device or a whole stream).
        """
        ids = frozenset(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._reap()
            waiting = set(self._tracker.unfinished(ids))
            targets = [p.event for lane in self._pending.values() for p in lane if p.seq in waiting]
            if not targets:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                if not _wait_event(targets[-1], left):
                    self._tracker.count_wait_timeout()
                    break
            except Exception:  # noqa: BLE001 - _reap turns it into a failed Done
                # ... once it heads its lane: until an older event there completes the
                # failed one is raised again at once, so nap (no spin) and keep the
                # deadline (the loop spun, past any timeout, while the head ran)
                if deadline is not None and time.monotonic() >= deadline:
                    self._tracker.count_wait_timeout()
                    break
                time.sleep(_MAX_NAP_S)
        return self._tracker.take(ids)

    def stats(self) -> dict[str, int]:
        """Counters (see :class:`~workers.copy_engine.CopyStats`) plus ``jobs_outstanding``
        and ``batch_fallbacks`` (batches the driver refused; see the module docstring)."""
        d = self._tracker.snapshot()
        d["batch_fallbacks"] = self._fallbacks
        return d

    def set_gate(self, gate: Callable[[], bool] | None) -> None:
        """See CopyEngine.set_gate: asked at submit, the last moment this engine can
        decline a job (its copies go on the stream there)."""
        self._gate = gate

    def cancel_queued(self) -> None:
        """Nothing to cancel: a job's copies are on its stream from ``submit`` on, and a
        stream cannot be emptied; the scheduler's fence covers them (see CopyEngine)."""

    def close(self) -> None:
        """Refuse new jobs, wait for this engine's two streams, reap (idempotent).

        Every job submitted is still reported once by poll/wait afterwards.
        """
        if self._closed:
            return
        self._closed = True
        for stream in self._streams.values():
            try:
                stream.synchronize()
            except Exception:  # noqa: BLE001 - _reap reports the failures
                pass
        self._reap()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
