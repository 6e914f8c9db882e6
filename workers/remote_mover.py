"""A worker's remote-tier jobs: its CPU rows <-> the remote tier, on one thread.

A :class:`~kvshm.ipc.protocol.Remote` job names CPU rows and the block hash of each;
this rank's key for a block is :func:`kvshm.remote.tier.block_key` of the engine's
fingerprint, the rank and the hash, and every value carries a
:class:`~kvshm.remote.tier.BlockHeader` (checked on GET: a mismatch is BAD, never
loaded). A block's bytes on a rank are one row per region of the host pool; with one
region the row itself is the value (no copy: the store reads or fills the row in place),
with several the rows are gathered into (PUT) or scattered from (GET) a staging buffer of
one call's blocks (:func:`batch_blocks`: 32, or 16 MiB of smaller blocks). The store
moves a call's blocks in one round trip per part (see :mod:`kvshm.remote.valkey`).

Ordering and threads: jobs run in arrival order on one thread (the store spreads each
batch over its own client threads). ``submit`` never blocks and never raises: a job it
cannot take becomes a failed Done at once. A finished job's Done waits in the mover's
:class:`~workers.done_outbox.DoneOutbox` until :meth:`poll`; its eventfd
:meth:`notify_fd` turns readable when one is there (the worker's channel watches it, so
a parked standalone loop wakes). :meth:`close` stops taking jobs, fails
the queued ones, waits for the running one (every store call has a deadline) and closes
the store: after it returns, no thread of this mover touches a host row.

Publishing on finish: a hook set with :meth:`RemoteMover.on_finish` runs on the mover
thread right after each job's Done entered the outbox (an embedded worker publishes it
from there: :meth:`~workers.link.WorkerLink._publish_from_mover`). The thread holds the
GIL then anyway (it just judged the blocks), so the Done reaches the ``done`` ring
without waking another thread: on a process whose other thread keeps running Python
(vLLM stepping) each wake-up can wait up to the switch interval for the GIL. The hook
must never block (the host may be closing this mover, which joins the thread); a Done it
does not publish stays in the outbox for :meth:`poll` (its eventfd is readable).

Row fence: where the rank also has a disk tier, the scheduler may hand a GET CPU rows
whose old block a disk WRITE posted just before still reads (a victim written down
before its reuse: :mod:`kvshm.offload.disk_writes`). The session sets
:meth:`RemoteMover.fence_rows` to the disk mover's
:meth:`~workers.disk_mover.DiskMover.wait_rows`: a GET fills its rows only once no WRITE
received before it reads them (the disk mover counts the waits, ``copies_fenced``); a
wait past :data:`~workers.disk_mover.FENCE_TIMEOUT_S` fails the GET without touching a
row (``gets_fence_timed_out``: a miss, recomputed). The wait is one WRITE's I/O (its
queued runs move up), but it holds this mover's one thread: later PUTs and GETs of the
rank wait behind it.

Outcome rule (the remote tier's): failure = miss = recompute. A job is ok only if every
block was stored (PUT) or every block was a HIT (GET); otherwise its Done says how many of
each outcome, and the scheduler treats the whole job as failed.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from kvshm.ipc.protocol import Done, Remote, RemoteOp, RemoteSetup, ids_array
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, BlockStore, GetOutcome, block_key
from workers.done_outbox import DoneOutbox
from workers.host_pool import HostPool

__all__ = ["BATCH", "BATCH_BYTES", "RemoteMover", "batch_blocks"]

#: Fewest blocks one ``put_many``/``get_many_into`` call may move (see :func:`batch_blocks`).
BATCH: Final = 32
#: Smaller blocks go this many bytes to a call (the store cuts a call into one-round-trip
#: parts and runs them over its threads: more small blocks per call fill them all).
BATCH_BYTES: Final = 16 << 20


def batch_blocks(bytes_per_block: int) -> int:
    """Most blocks one store call moves: :data:`BATCH`, or more for blocks smaller than
    ``BATCH_BYTES / BATCH`` (bounds the staging buffer at ``max(BATCH x block,
    BATCH_BYTES)``)."""
    return max(BATCH, BATCH_BYTES // max(1, bytes_per_block))


class RemoteMover:
    """See the module docstring. ``store`` is owned from here on (closed by :meth:`close`)."""

    def __init__(self, rank: int, world: int, setup: RemoteSetup, host: HostPool,
                 store: BlockStore) -> None:
        self.rank, self.world = rank, world
        self._fingerprint = setup.fingerprint
        self._host = host
        self._store = store
        self._rows: list[torch.Tensor] = list(host.regions)  # [num_cpu_blocks, bytes] each
        self._bpb = host.bytes_per_block
        self._batch = batch_blocks(self._bpb)
        self._staging: torch.Tensor | None = None  # [_batch, bytes_per_block], several regions
        self._jobs: queue.SimpleQueue[Remote | None] = queue.SimpleQueue()
        self._outbox = DoneOutbox()
        self._closed = False
        self.counts: Counter[str] = Counter()
        self._on_finish: Callable[[], bool] | None = None
        self._fence: Callable[[Sequence[int]], bool] | None = None
        self._thread = threading.Thread(target=self._loop, name=f"kvshm-remote-r{rank}",
                                        daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ worker thread

    def submit(self, job: Remote) -> None:
        """Queue ``job`` (never blocks or raises; refused once closed: a failed Done)."""
        if self._closed:
            self._finish(Done(job.job_id, self.rank, False, "RemoteError: mover closed"))
            return
        self._jobs.put(job)

    def fence_rows(self, wait: Callable[[Sequence[int]], bool]) -> None:
        """Set the row fence (module docstring): ``wait(rows)`` blocks until no disk
        WRITE received so far reads ``rows``; False: it timed out. Set before the first
        job."""
        self._fence = wait

    def poll(self) -> list[Done]:
        """The Dones of the jobs finished since the last call, in finishing order. Called
        on every pump: with nothing finished it returns without a syscall (a Done added
        after this read leaves the eventfd readable, so the next wait wakes for it:
        :class:`DoneOutbox`)."""
        return self._outbox.take()

    def notify_fd(self) -> int:
        """Readable while a Done waits in :meth:`poll`."""
        return self._outbox.fd()

    def on_finish(self, hook: Callable[[], bool] | None) -> None:
        """Run ``hook`` on the mover thread after each job's Done entered the outbox
        (None: no hook). It returns whether it published the Done (counted
        ``published_on_mover`` / ``publish_deferred``); it must never block (see the
        module docstring); an exception is counted (``finish_hook_errors``), the Done
        stays in the outbox."""
        self._on_finish = hook

    def statistics(self) -> dict[str, Any]:
        return {"mover": dict(self.counts), "store": self._store.statistics()}

    def cancel_queued(self, why: str) -> int:
        """Fail every job not started yet (the running one finishes); how many."""
        n = 0
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return n
            if job is None:  # close()'s sentinel: put it back for the thread
                self._jobs.put(None)
                return n
            n += 1
            self.counts["jobs_cancelled"] += 1
            self._finish(Done(job.job_id, self.rank, False, f"RemoteError: {why}"))

    def close(self) -> None:
        """Stop (idempotent): queued jobs fail, the running one finishes, the store closes."""
        if self._closed:
            return
        self._closed = True
        self.cancel_queued("mover closed")
        self._jobs.put(None)
        self._thread.join()
        self.cancel_queued("mover closed")
        self._store.close()
        self._rows = []
        self._staging = None

    def release(self) -> None:
        """Close the notify fd (after :meth:`close` and a last :meth:`poll`)."""
        self._outbox.close()

    # ------------------------------------------------------------------ mover thread

    def _loop(self) -> None:
        warm = getattr(self._store, "warm", None)
        if callable(warm):  # connect before the first job (never blocks the rank)
            warm()
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                # the host rows may be inference tensors (vLLM's worker makes them under
                # inference_mode): an in-place copy into one outside the mode raises
                with torch.inference_mode():
                    done = self._run(job)
            except Exception as exc:  # noqa: BLE001 - a bug fails this job, not the rank
                self.counts["job_errors"] += 1
                done = Done(job.job_id, self.rank, False,
                            f"RemoteError: {type(exc).__name__}: {exc}")
            self._finish(done)
            self._publish()

    def _publish(self) -> None:
        """The finish hook, if any, on this thread (see :meth:`on_finish`)."""
        hook = self._on_finish
        if hook is None:
            return
        try:
            published = hook()
        except Exception:  # noqa: BLE001 - counted; the Done waits in the outbox
            self.counts["finish_hook_errors"] += 1
            return
        self.counts["published_on_mover" if published else "publish_deferred"] += 1

    def _finish(self, done: Done) -> None:
        self.counts["jobs_ok" if done.ok else "jobs_failed"] += 1
        self._outbox.put(done)

    def _run(self, job: Remote) -> Done:
        ids = ids_array(job.cpu_ids)
        n, hl = len(ids), job.hash_len
        if hl <= 0 or len(job.hashes) != n * hl:
            self.counts["bad_jobs"] += 1
            return Done(job.job_id, self.rank, False,
                        f"RemoteError: {n} rows but {len(job.hashes)} hash bytes "
                        f"(hash_len {hl})")
        if any(not 0 <= i < self._host.num_cpu_blocks for i in ids):
            self.counts["bad_jobs"] += 1
            return Done(job.job_id, self.rank, False,
                        f"RemoteError: CPU row out of range [0, {self._host.num_cpu_blocks})")
        if job.op is RemoteOp.GET and self._fence is not None \
                and not self._fence(ids.tolist()):
            self.counts["gets_fence_timed_out"] += 1
            return Done(job.job_id, self.rank, False,
                        f"RemoteError: rank {self.rank}: a disk WRITE still reads the GET's "
                        f"CPU rows after the fence's timeout")
        hashes = [job.hashes[k * hl:(k + 1) * hl] for k in range(n)]
        tally: Counter[str] = Counter()
        for start in range(0, n, self._batch):
            part = slice(start, start + self._batch)
            if job.op is RemoteOp.PUT:
                self._put(list(ids[part]), hashes[part], tally, job.keep)
            else:
                self._get(list(ids[part]), hashes[part], tally)
        good = tally["stored"] if job.op is RemoteOp.PUT else tally[GetOutcome.HIT.value]
        self.counts.update({f"{job.op.name.lower()}_{k}": v for k, v in tally.items()})
        if good == n:
            return Done(job.job_id, self.rank, True)
        what = ", ".join(f"{v} {k}" for k, v in sorted(tally.items()))
        return Done(job.job_id, self.rank, False,
                    f"RemoteError: {job.op.name} of {n} block(s): {what}")

    def _headers(self, hashes: Sequence[bytes]) -> list[BlockHeader]:
        return [BlockHeader(self._fingerprint, h, self.rank, self.world, self._bpb)
                for h in hashes]

    def _keys(self, hashes: Sequence[bytes]) -> list[str]:
        return [block_key(KEY_PREFIX, self._fingerprint, self.rank, self.world, h)
                for h in hashes]

    def _views(self, ids: Sequence[int]) -> list[memoryview]:
        """One value view per block: the row itself (one region) or a staging slot --
        slices of one byte view of the region (of the staging buffer): no tensor is
        indexed per block."""
        bpb = self._bpb
        if len(self._rows) == 1:
            region = _view(self._rows[0])
            return [region[i * bpb:(i + 1) * bpb] for i in ids]
        if self._staging is None:
            self._staging = torch.empty((self._batch, bpb), dtype=torch.uint8)
        staging = _view(self._staging)
        return [staging[k * bpb:(k + 1) * bpb] for k in range(len(ids))]

    def _regions(self) -> list[tuple[memoryview, int]]:
        """Each region's byte view and row width (several regions: the staging path)."""
        return [(_view(r), r.shape[1]) for r in self._rows]

    def _put(self, ids: list[int], hashes: list[bytes], tally: Counter[str],
             keep: bool) -> None:
        views = self._views(ids)
        if len(self._rows) > 1:  # gather each block's rows into its staging slot: plain
            regions = self._regions()  # memcpy under the GIL, no torch call (each one
            for k, i in enumerate(ids):  # releases the GIL: a wait in a busy process)
                slot, at = views[k], 0
                for region, width in regions:
                    slot[at:at + width] = region[i * width:(i + 1) * width]
                    at += width
        ok = self._store.put_many(self._keys(hashes), views, self._headers(hashes), keep=keep)
        tally["stored"] += sum(ok)
        tally["not_stored"] += len(ok) - sum(ok)

    def _get(self, ids: list[int], hashes: list[bytes], tally: Counter[str]) -> None:
        views = self._views(ids)
        got = self._store.get_many_into(self._keys(hashes), views, self._headers(hashes))
        tally.update(g.value for g in got)
        if len(self._rows) > 1:  # scatter each HIT's slot into its rows (as in _put)
            regions = self._regions()
            for k, i in enumerate(ids):
                if got[k] is GetOutcome.HIT:
                    slot, at = views[k], 0
                    for region, width in regions:
                        region[i * width:(i + 1) * width] = slot[at:at + width]
                        at += width


def _view(row: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 tensor (a row, a region), without numpy
    (torch's CPU build does not require it). The caller keeps ``row``'s storage alive
    while the view is used (the mover holds the host pool's region tensors and its
    staging buffer)."""
    assert row.dtype is torch.uint8 and row.is_contiguous()
    buf = (ctypes.c_char * row.numel()).from_address(row.data_ptr())
    return memoryview(buf).cast("B")
