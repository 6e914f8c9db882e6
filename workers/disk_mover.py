"""A worker's disk-tier jobs: its CPU rows <-> slots of its slab file, on a few threads.

A :class:`~kvshm.ipc.protocol.Disk` job names CPU rows, slots of this rank's slab file
(:class:`~kvshm.disk.SlabFile`, opened from ``Ready.disk`` when the mover is made) and
the block hash of each. A block's bytes on a rank are one row per region of the host
pool; each slot's I/O is one vectored read or write straight between those rows and the
file (O_DIRECT where the rows are page-aligned: :mod:`kvshm.disk.slab`).

Ordering and threads: a job's slots are spread over a pool of ``threads`` threads, in
runs of consecutive entries (at most :data:`RUN`, except that a READ keeps a stretch of
neighbouring slots in one run: :func:`read_runs`; runs of several jobs interleave; a
queued READ run goes before every queued WRITE run: :class:`_Runs`); a
thread hands its run to the slab in one call, which moves neighbouring slots (slot
numbers k, k + 1, ...) in one vectored read or write.
``submit`` never blocks and never raises: a job it cannot take (closed, malformed)
becomes a failed Done at once. A job's Done is made by the thread that finishes its
last slot and waits in the mover's :class:`~workers.done_outbox.DoneOutbox` until
:meth:`poll`; its eventfd :meth:`notify_fd` turns readable when one is there. Before
each run a thread asks the gate (:meth:`set_gate`: the rank's revocation word): a revoked
rank starts no more slot I/O (a run already started finishes, as a single slot's I/O
did). :meth:`close` stops taking jobs, fails the queued slots, waits for the running
ones and closes the slab: after it returns, no thread of this mover touches a host row.

Row fence: the scheduler may hand a CPU block to a store or a READ while a WRITE it
posted just before still reads the block's old bytes down to the slab (a victim
written before its reuse: :mod:`kvshm.offload.disk`). On each rank, a job that writes a
CPU row runs only after every WRITE received before it that reads the row: a READ
whose rows a WRITE still reads waits (its runs are queued once those WRITEs end, whose
queued runs move up with the READs meanwhile; counted ``reads_fenced``), and the
worker's store copy and the remote mover's GET ask :meth:`wait_rows` first. Rows are
registered when a WRITE is submitted and released when its last slot is done (ok or
not), so the fence never outlives the job.

Outcome rule (the remote tier's): failure = miss = recompute. A job is ok only if every
slot succeeded (WRITE: written; READ: a HIT); otherwise its Done names how many of each
outcome (``crc`` and ``header`` for a READ whose slot is BAD, which is never loaded) and
the scheduler treats the whole job as failed.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TypeAlias

import torch

from kvshm.disk import MAX_HASH_BYTES, SlabFile, SlabSpec, SlotOutcome
from kvshm.ipc.protocol import Disk, DiskOp, DiskSetup, Done, ids_array
from workers.done_outbox import DoneOutbox
from workers.host_pool import HostPool
from workers.slab_opener import SlabOpener

__all__ = ["FENCE_TIMEOUT_S", "RUN", "RUN_BYTES", "THREADS", "WRITE_RUN", "DiskMover",
           "read_runs"]

#: Longest a store copy or a remote GET waits for the disk WRITEs that still read its CPU
#: rows (:meth:`DiskMover.wait_rows`); past it the job fails (a miss, recomputed).
FENCE_TIMEOUT_S: Final = 5.0

#: Slot I/O threads per rank by default.
THREADS: Final = 4
#: Most slots of a job one thread takes at a time, in order (a job of n slots is cut into
#: runs of ceil(n / threads), at most this many): neighbouring slots go to one thread as
#: one stream, the threads' streams run side by side.
RUN: Final = 8
#: Most slots of a WRITE job one thread takes at a time (a job is not spread over the
#: threads first: write-back waits for no one, and each run a thread takes costs the
#: host's Python thread a GIL hand-off, which on a busy host delays its forward).
WRITE_RUN: Final = 16
#: Most payload bytes in one run (at least one slot): large slots go one per run, so the
#: threads share a job's tail evenly instead of one thread finishing a long run alone.
RUN_BYTES: Final = 1 << 20

#: Counters :meth:`DiskMover.statistics` always reports (0 until they move).
_ALWAYS: Final = ("writes", "reads", "bytes_written", "bytes_read", "failures",
                  "crc_mismatch", "bad_header", "empty", "io_errors", "bounce", "jobs_ok",
                  "jobs_failed", "bad_jobs")

#: The outcome key of a slot that succeeded, per op.
_GOOD: Final = {DiskOp.WRITE: "written", DiskOp.READ: SlotOutcome.HIT.value}


@dataclass
class _Job:
    """One Disk job in flight: its slots' outcomes, counted as threads finish them."""

    msg: Disk
    ids: list[int]
    slots: list[int]
    hashes: list[bytes]
    remaining: int
    tally: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    rows: frozenset[int] = frozenset()  # a WRITE's CPU rows (the row fence)
    waits: set[int] = field(default_factory=set)  # a fenced READ: the WRITEs (by id) first
    runs: list[tuple[int, int]] = field(default_factory=list)  # a fenced READ's runs


class DiskMover:
    """See the module docstring. Raises ConfigError from the slab's open: the caller
    then fails every Disk job with the reason. A slab whose lock another process holds
    is opened later (:class:`~workers.slab_opener.SlabOpener`): until then each job
    fails with the reason (``jobs_refused_no_slab``)."""

    def __init__(self, rank: int, world: int, setup: DiskSetup, host: HostPool, *,
                 threads: int = THREADS) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.rank, self.world = rank, world
        self._host = host
        self._spec = SlabSpec(setup.fingerprint, rank, world, setup.slots, host.bytes_per_block)
        self._opener = SlabOpener(setup.path, self._spec, direct=setup.direct,
                                  keep=setup.keep)
        self._keep = setup.keep
        try:
            self._start(host, threads)
        except BaseException:  # no fd or lock of a mover that never ran is kept
            self._opener.close()
            if self._opener.slab is not None:
                self._opener.slab.close()
            raise

    @property
    def _slab(self) -> SlabFile:
        """The open slab (a pool thread runs only jobs accepted once it was open)."""
        slab = self._opener.slab
        assert slab is not None
        return slab

    def _start(self, host: HostPool, threads: int) -> None:
        """The state besides the slab, and the threads (started last)."""
        self._regions: list[torch.Tensor] = list(host.regions)
        self._bases = [_view(r) for r in self._regions]
        self._row_bytes = [r.shape[1] for r in self._regions]
        #: (job, first slot index, end): a run of a job's slots one thread does in order.
        self._tasks = _Runs()
        self._nthreads = threads
        self._outbox = DoneOutbox()
        self._lock = threading.Lock()  # the counters
        self._gate: Callable[[], bool] | None = None
        self._closed = False
        self.counts: Counter[str] = Counter()
        self._rows_cv = threading.Condition()  # the row fence: the two below
        self._writes: dict[int, _Job] = {}  # WRITEs not finished, by id(job)
        self._fenced: list[_Job] = []  # READs waiting for earlier WRITEs of their rows
        self._threads = [threading.Thread(target=self._loop, name=f"kvshm-disk-r{self.rank}-{i}",
                                          daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ worker thread

    def submit(self, job: Disk) -> None:
        """Queue ``job``'s slots (never blocks or raises: a job that cannot run is a
        failed Done at once)."""
        if not self._closed and self._opener.slab is None:
            self._count("jobs_refused_no_slab")
            self._finish(Done(job.job_id, self.rank, False,
                              f"DiskError: the slab is not open yet ({self._opener.waiting})"))
            return
        try:
            if self._closed:
                raise _Refused("mover closed")
            parsed = self._parse(job)
        except Exception as exc:  # noqa: BLE001 - a bad job fails, the rank goes on
            self._count("bad_jobs" if not self._closed else "jobs_refused")
            self._finish(Done(job.job_id, self.rank, False, f"DiskError: {exc}"))
            return
        if not parsed.slots:
            self._finish(Done(job.job_id, self.rank, True))
            return
        n = len(parsed.slots)
        most = RUN_BYTES // self._spec.row_bytes
        write = parsed.msg.op == DiskOp.WRITE
        if write:  # write-back: whole groups, fewest GIL hand-offs
            run = max(1, min(WRITE_RUN, most))
            runs = [(k, min(n, k + run)) for k in range(0, n, run)]
        else:  # a request waits: spread over the threads, neighbours kept together
            run = max(1, min(RUN, -(-n // self._nthreads), most))
            runs = read_runs(parsed.slots, run, max(1, most))
        with self._rows_cv:  # register or fence before any run can start
            if write:
                parsed.rows = frozenset(parsed.ids)
                self._writes[id(parsed)] = parsed
            else:
                ids = set(parsed.ids)
                first = [w for w in self._writes.values() if not w.rows.isdisjoint(ids)]
                if first:
                    parsed.waits, parsed.runs = {id(w) for w in first}, runs
                    self._fenced.append(parsed)
                    self._tasks.promote({id(w) for w in first})
                    self._count("reads_fenced")
                    return
        for start, end in runs:
            self._tasks.put((parsed, start, end))

    def wait_rows(self, ids: Collection[int], timeout: float) -> bool:
        """Block until no WRITE submitted so far still reads any of the CPU rows ``ids``
        (their queued runs move up meanwhile), or ``timeout`` s: False then. What a
        store copy into those rows asks first (module docstring)."""
        want = set(ids)
        deadline = time.monotonic() + timeout
        with self._rows_cv:
            waited = False
            while True:
                first = {id(w) for w in self._writes.values() if not w.rows.isdisjoint(want)}
                if not first:
                    if waited:
                        self._count("copies_fenced")
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    self._count("fence_timeouts")
                    return False
                if not waited:
                    self._tasks.promote(first)
                    waited = True
                self._rows_cv.wait(left)

    def _write_ended(self, job: _Job) -> None:
        """``job`` (a WRITE) finished: its rows are free; READs fenced on it only are
        queued (failed once the mover is closed)."""
        ready: list[_Job] = []
        with self._rows_cv:
            if self._writes.pop(id(job), None) is None:
                return
            key = id(job)
            keep: list[_Job] = []
            for r in self._fenced:
                r.waits.discard(key)
                (keep if r.waits else ready).append(r)
            self._fenced = keep
            self._rows_cv.notify_all()
        for r in ready:
            if self._closed:  # cancel_queued no longer sees it: count it here
                self._count("slots_cancelled", len(r.slots))
                self._slots_done(r, Counter(cancelled=len(r.slots)), "mover closed")
                continue
            for start, end in r.runs:
                self._tasks.put((r, start, end))

    def set_gate(self, gate: Callable[[], bool] | None) -> None:
        """Asked before each run's I/O (any pool thread): False = the rank was revoked,
        the run's slots are not touched and their job fails."""
        self._gate = gate

    def poll(self) -> list[Done]:
        """The Dones of the jobs finished since the last call, in finishing order; with
        nothing finished it returns without a syscall (:class:`DoneOutbox`)."""
        return self._outbox.take()

    def notify_fd(self) -> int:
        """Readable while a Done waits in :meth:`poll`."""
        return self._outbox.fd()

    def statistics(self) -> dict[str, Any]:
        """The mover's and the slab's counters in one flat dict, plus where the slab is:
        ``writes``, ``reads`` (HITs), ``bytes_written``, ``bytes_read``, ``failures``
        (slots that did not succeed), ``crc_mismatch``, ``bad_header``, ``empty``,
        ``io_errors``, ``bounce``, ``jobs_ok``, ``jobs_failed``, ``bad_jobs``..."""
        with self._lock:
            out: dict[str, Any] = dict.fromkeys(_ALWAYS, 0)
            out.update(self.counts)
        opener = self._opener
        out["open_retries"] = opener.retries
        slab = opener.slab
        if slab is None:
            out.update(path=opener.path, slots=self._spec.slots, waiting=opener.waiting)
            return out
        out.update(slab.counts)
        out.update(path=slab.path, slots=self._spec.slots, direct=slab.direct)
        return out

    def cancel_queued(self, why: str) -> int:
        """Fail every slot whose run has not started (running runs finish); how many."""
        n = 0
        for job, start, end in self._tasks.take_all():
            n += end - start
            self._count("slots_cancelled", end - start)
            self._slots_done(job, Counter(cancelled=end - start), why)
        with self._rows_cv:
            fenced, self._fenced = self._fenced, []
        for job in fenced:
            n += len(job.slots)
            self._count("slots_cancelled", len(job.slots))
            self._slots_done(job, Counter(cancelled=len(job.slots)), why)
        return n

    def close(self) -> None:
        """Stop (idempotent): queued slots fail, running ones finish, the slab closes
        (removed where its setup says it is not kept)."""
        if self._closed:
            return
        self._closed = True
        self.cancel_queued("mover closed")
        self._tasks.stop(len(self._threads))
        for t in self._threads:
            t.join()
        self.cancel_queued("mover closed")
        self._opener.close()  # its retries end first: then the slab no longer changes
        if self._opener.slab is not None:  # (one never opened is another process's)
            self._opener.slab.close(remove=not self._keep)
        self._bases = []
        self._regions = []

    def release(self) -> None:
        """Close the notify fd (after :meth:`close` and a last :meth:`poll`)."""
        self._outbox.close()

    # ------------------------------------------------------------------ pool threads

    def _parse(self, job: Disk) -> _Job:
        ids, slots = list(ids_array(job.cpu_ids)), list(ids_array(job.slots))
        n, hl = len(ids), job.hash_len
        if len(slots) != n:
            raise _Refused(f"{n} rows but {len(slots)} slots")
        if not 0 < hl <= MAX_HASH_BYTES or len(job.hashes) != n * hl:
            raise _Refused(f"{n} rows but {len(job.hashes)} hash bytes (hash_len {hl})")
        if any(i >= self._host.num_cpu_blocks for i in ids):
            raise _Refused(f"CPU row out of range [0, {self._host.num_cpu_blocks})")
        if any(s >= self._spec.slots for s in slots):
            raise _Refused(f"slot out of range [0, {self._spec.slots})")
        DiskOp(job.op)  # ValueError for an op this side does not know
        hashes = [job.hashes[k * hl:(k + 1) * hl] for k in range(n)]
        return _Job(job, ids, slots, hashes, n)

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            job, start, end = task
            gate = self._gate
            if gate is not None and not gate():
                self._count("slots_refused", end - start)
                self._slots_done(job, Counter(revoked=end - start), "rank revoked")
                continue
            try:
                keys = self._run(job, start, end)
            except Exception as exc:  # noqa: BLE001 - a bug fails these slots, not the rank
                self._count("slot_errors", end - start)
                keys = [f"error ({type(exc).__name__}: {exc})"] * (end - start)
            errors = sum(k.startswith("io_error") for k in keys)
            self._count("io_errors", errors)
            self._slots_done(job, Counter(keys), "")

    def _run(self, job: _Job, start: int, end: int) -> list[str]:
        """Slots ``start..end-1`` of ``job`` in one slab call (neighbouring slots share a
        vectored read or write): each slot's outcome key."""
        rows = [[base[i * n:(i + 1) * n] for base, n in zip(self._bases, self._row_bytes)]
                for i in job.ids[start:end]]
        slots, hashes = job.slots[start:end], job.hashes[start:end]
        if job.msg.op == DiskOp.WRITE:
            return ["written" if err is None else f"io_error ({err.strerror or err})"
                    for err in self._slab.write_many(slots, rows, hashes)]
        return [got.value if isinstance(got, SlotOutcome)
                else f"io_error ({got.strerror or got})"
                for got in self._slab.read_many(slots, rows, hashes)]

    def _slots_done(self, job: _Job, keys: Counter[str], why: str) -> None:
        with job.lock:
            job.tally.update(keys)
            if why:
                job.tally[f"why:{why}"] = 1
            job.remaining -= sum(keys.values())
            last = job.remaining == 0
        if last:
            if job.rows:
                self._write_ended(job)
            self._finish(self._done_of(job))

    def _done_of(self, job: _Job) -> Done:
        op = DiskOp(job.msg.op)
        n = len(job.slots)
        good = job.tally[_GOOD[op]]
        self._count("failures", n - good)
        if good == n:
            return Done(job.msg.job_id, self.rank, True)
        parts = [f"{v} {k}" for k, v in sorted(job.tally.items())
                 if k != _GOOD[op] and not k.startswith("why:")]
        why = [k[4:] for k in job.tally if k.startswith("why:")]
        tail = f" ({'; '.join(why)})" if why else ""
        return Done(job.msg.job_id, self.rank, False,
                    f"DiskError: {op.name} of {n} slot(s): {good} ok, "
                    f"{', '.join(parts)}{tail}")

    def _finish(self, done: Done) -> None:
        self._count("jobs_ok" if done.ok else "jobs_failed")
        self._outbox.put(done)

    def _count(self, key: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self.counts[key] += n


def read_runs(slots: Sequence[int], run: int, most: int) -> list[tuple[int, int]]:
    """A READ's runs ``(start, end)`` over its entries, in order: a run of scattered
    slots ends after ``run`` entries (the threads share them, each slot its own I/O), a
    stretch of neighbouring slots (k, k + 1, ... or k, k - 1, ...: write-back writes a
    chain deepest block first) stays in one run up to ``most`` entries
    (the slab reads it in one vectored read: one thread and one GIL hand-off instead of
    several threads each paying one, on a disk the stretch's bytes keep busy anyway).
    A run ends only where a stretch does, or at ``most``."""
    out: list[tuple[int, int]] = []
    a = 0
    for k in range(1, len(slots)):
        if k - a >= most or (k - a >= run and abs(slots[k] - slots[k - 1]) != 1):
            out.append((a, k))
            a = k
    if slots:
        out.append((a, len(slots)))
    return out


_Run: TypeAlias = tuple[_Job, int, int]
"""A run of a job's slots one thread does in order: (job, first slot index, end)."""


class _Runs:
    """The runs waiting for a pool thread: every READ run before any WRITE run, each kind
    in arrival order. A READ is a request waiting for its blocks (the scheduler answers
    "ask again" until it ends); a WRITE is write-back, which may wait: a read posted
    behind a burst of write-back starts at the next free thread, not after the burst.
    :meth:`stop` hands each of ``n`` threads a None (after every queued run)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._reads: deque[_Run] = deque()
        self._writes: deque[_Run] = deque()
        self._stops = 0

    def put(self, run: _Run) -> None:
        with self._cv:
            (self._reads if run[0].msg.op == DiskOp.READ else self._writes).append(run)
            self._cv.notify()

    def promote(self, jobs: Collection[int]) -> None:
        """Move the queued WRITE runs of ``jobs`` (by ``id``) behind the queued READ runs:
        a READ or a copy waits for them (the row fence)."""
        with self._cv:
            up = [r for r in self._writes if id(r[0]) in jobs]
            if up:
                self._writes = deque(r for r in self._writes if id(r[0]) not in jobs)
                self._reads.extend(up)

    def get(self) -> _Run | None:
        """The next run (blocks until there is one), or None once stopped."""
        with self._cv:
            while not (self._reads or self._writes or self._stops):
                self._cv.wait()
            if self._reads:
                return self._reads.popleft()
            if self._writes:
                return self._writes.popleft()
            self._stops -= 1
            return None

    def take_all(self) -> list[_Run]:
        """Every queued run, removed (reads first)."""
        with self._cv:
            out = [*self._reads, *self._writes]
            self._reads.clear()
            self._writes.clear()
            return out

    def stop(self, n: int) -> None:
        with self._cv:
            self._stops += n
            self._cv.notify_all()


class _Refused(Exception):
    """A Disk job that cannot run as given (its Done says why)."""


def _view(region: torch.Tensor) -> memoryview:
    """A writable flat byte view of a contiguous uint8 region tensor, without numpy. The
    mover keeps the tensor (hence the mapping) alive while the view is used."""
    assert region.dtype is torch.uint8 and region.is_contiguous()
    buf = (ctypes.c_char * region.numel()).from_address(region.data_ptr())
    return memoryview(buf).cast("B")
