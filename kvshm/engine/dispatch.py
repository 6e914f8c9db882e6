"""Job traffic between the manager and the ranks: Transfers out, Dones back.

:class:`Dispatcher` posts each planned Transfer to every live rank and applies the
batches of ``Done`` that come back to :meth:`OffloadManager.on_done
<kvshm.offload.manager.OffloadManager.on_done>`. Rules kept here:

* A plan's transfers are posted in plan order (store, then load), each to every live
  rank in rank order, so every rank sees jobs in job-id order. A full ring queues
  (``SchedulerChannel.post``), never blocks.
* A batch of Dones is applied in arrival order. An exception while applying one fails
  that job only (counted in ``done_errors``, logged once per exception type); every
  other Done of the batch is still applied. The load outcomes stay in the manager's
  queue (nothing here copies them).
* A Remote or Disk job goes out through :meth:`post_remote`, in the order the runtime
  posts it (a step's Disk jobs before its transfers and its Remote jobs:
  ``Runtime.step``).
* Each Done is progress for its rank's hang clock (:meth:`RankWatch.acked
  <kvshm.engine.supervision.RankWatch.acked>`) and carries its job's ack latency while
  acks are still owed: a job's post time is kept for as many Dones as ranks it went to,
  or until :meth:`forget_posted` (a verdict: the owed acks will not all come).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Mapping
from typing import Final

from kvshm.engine.snapshot import CoreCounters
from kvshm.engine.supervision import RankWatch
from kvshm.errors import ConfigError
from kvshm.ipc.protocol import Direction, Disk, Done, Remote, Transfer
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.offload.manager import OffloadManager
from kvshm.ratelog import RateLimitedLog

__all__ = ["Dispatcher"]

#: What a rank's failed disk job names when the disk is full or over quota: the
#: strerror of the ENOSPC / EDQUOT its write got (lowercase, as matched).
_NO_SPACE: Final = (os.strerror(errno.ENOSPC).lower(), os.strerror(errno.EDQUOT).lower())

_log = logging.getLogger("kvshm.engine.runtime")  # one logger name for the whole runtime
_rlog = RateLimitedLog(_log)  # per-job errors: one line per kind per interval


class Dispatcher:
    """See the module docstring. ``channels`` and ``watch`` are the runtime's own maps
    (read, never changed here: channels appear at READY and are closed by the runtime)."""

    def __init__(self, name: str, channels: Mapping[int, SchedulerChannel],
                 watch: Mapping[int, RankWatch], counters: CoreCounters) -> None:
        self._name = name
        self._channels = channels
        self._watch = watch
        self._counters = counters
        self._posted: dict[int, tuple[float, int]] = {}  # job id -> (post time, acks owed)
        self._remote: dict[int, int] = {}  # remote or disk job id -> Dones still due
        self._disk: set[int] = set()  # the disk jobs among them
        self._logged: set[str] = set()

    def post(self, t: Transfer) -> None:
        """Post ``t`` to every live rank (queued where a ring is full)."""
        live = [r for r, c in self._channels.items() if not c.closed]
        now = time.monotonic()
        self._posted[t.job_id] = (now, len(live))
        for rank in live:
            self._channels[rank].post(t)
            self._watch[rank].posted(now)
        if t.direction is Direction.STORE:
            self._counters.store_jobs += 1
        else:
            self._counters.load_jobs += 1

    def post_remote(self, msg: Remote | Disk) -> list[int]:
        """Post a remote-tier or disk-tier job to every live rank; the ranks that refused
        it (a record the ring can never hold: the caller fails the job for them, nothing
        raises). Not on the hang clock and not in the ack-latency histogram: it waits on
        a network server (or the rank's slab I/O) with its own deadlines, not on the
        rank's copy engine; its Done is no progress for the rank's stall clock either
        (:meth:`apply`)."""
        refused: list[int] = []
        for rank, chan in self._channels.items():
            if chan.closed:
                continue
            try:
                chan.post(msg)
            except ConfigError as exc:
                refused.append(rank)
                self._counters.remote_post_refused += 1
                _rlog.error("remote_post", "kvshm %s: remote job %d refused by rank %d's "
                            "ring: %s; the job fails (a miss)", self._name, msg.job_id,
                            rank, exc)
        posted = sum(1 for c in self._channels.values() if not c.closed) - len(refused)
        if posted > 0:
            self._remote[msg.job_id] = posted
        if isinstance(msg, Disk):
            self._counters.disk_jobs += 1
            if posted > 0:
                self._disk.add(msg.job_id)
        else:
            self._counters.remote_jobs += 1
        return refused

    def forget_posted(self) -> None:
        """Drop every post time (a verdict: the remaining acks will not all come)."""
        self._posted.clear()
        self._remote.clear()
        self._disk.clear()

    def apply(self, rank: int, dones: list[Done], manager: OffloadManager | None) -> None:
        """Apply a batch of Dones from ``rank`` (to ``manager`` once there is one), then
        move the rank's queued Transfers into the room the batch made."""
        now = time.monotonic()
        watch = self._watch[rank]
        remote = self._remote
        for d in dones:
            try:
                due = remote.get(d.job_id) if remote else None
                if due is not None:  # no progress of the rank's copies (hang clock)
                    self._counters.remote_acks += 1
                    if not d.ok and d.job_id in self._disk:
                        self._disk_failed(d)
                    if due <= 1:
                        del remote[d.job_id]
                        self._disk.discard(d.job_id)
                    else:
                        remote[d.job_id] = due - 1
                else:
                    watch.acked(now, d.ok, self._ack_latency(d.job_id, now))
                if manager is not None:
                    manager.on_done(d.job_id, rank, d.ok)
            except Exception as exc:  # noqa: BLE001 - one bad Done must not lose the rest
                self._done_failed(rank, d, exc, manager)
        chan = self._channels.get(rank)
        if chan is not None and not chan.closed and chan.overflow_depth:
            chan.flush_overflow()

    def _disk_failed(self, done: Done) -> None:
        """Count a disk job a rank failed, by what its error names (the worker's slot
        outcome: a checksum mismatch, a bad header, a full disk -- the strerror of ENOSPC
        or EDQUOT the worker's write got --, or anything else: that one also logged, one
        line per interval, since it may be a rank whose slab could not be opened at all)."""
        why = done.error.lower()
        if "crc" in why or "checksum" in why:
            self._counters.disk_read_bad_crc += 1
        elif "header" in why:
            self._counters.disk_read_bad_header += 1
        elif _NO_SPACE[0] in why or _NO_SPACE[1] in why:
            self._counters.disk_failed_no_space += 1
        else:
            self._counters.disk_failed_other += 1
            _rlog.warning("disk_failed_other", "kvshm %s: rank %d failed disk job %d: %s "
                          "(a miss; counted in disk_failed_other)", self._name, done.rank,
                          done.job_id, done.error)

    def _done_failed(self, rank: int, done: Done, exc: Exception,
                     manager: OffloadManager | None) -> None:
        """Applying ``done`` raised: count and log it, and fail its job (best effort:
        a second failure is only counted)."""
        self._counters.done_errors += 1
        key = type(exc).__name__
        if key not in self._logged:
            self._logged.add(key)
            _log.error("kvshm %s: applying Done(job %d) from rank %d failed; that job is "
                       "failed, the rest of the batch goes on", self._name,
                       done.job_id, rank, exc_info=exc)
        if manager is not None and done.ok:
            try:
                manager.on_done(done.job_id, rank, False)
            except Exception:  # noqa: BLE001 - counted above; the job may be gone
                self._counters.done_errors += 1

    def _ack_latency(self, job_id: int, now: float) -> float | None:
        entry = self._posted.get(job_id)
        if entry is None:
            return None
        posted, left = entry
        if left <= 1:
            del self._posted[job_id]
        else:
            self._posted[job_id] = (posted, left - 1)
        return now - posted
