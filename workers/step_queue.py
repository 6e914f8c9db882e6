"""Transfers waiting for their step to begin, and the Flush lists of coming steps.

Commands from the ``cmd`` ring come in through :meth:`StepQueue.intake` (Transfers and
Flushes are queued; a Shutdown is reported to the caller, which owns the phase).
Invariants: a Transfer leaves the queue exactly once (``take``, ``take_ids`` or
``take_all``), and within one direction in arrival order (the scheduler posts in job-id
order); a Transfer is only handed out for a step bound the caller has begun.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable

from kvshm.errors import ProtocolError
from kvshm.ipc.protocol import Direction, Disk, Flush, Remote, Shutdown, Transfer, unpack_ids

__all__ = ["StepQueue"]


class StepQueue:
    """Per-direction FIFO of Transfers, and job ids to flush per step."""

    def __init__(self) -> None:
        self._q: dict[Direction, list[Transfer]] = {d: [] for d in Direction}
        self._flush: dict[int, set[int]] = {}
        #: Remote jobs, in arrival order: they run on arrival (no step; a GET asks the
        #: disk mover's row fence: the link hands the Disk jobs over first).
        self.remote: list[Remote] = []
        #: Disk jobs, in arrival order: they run on arrival too.
        self.disk: list[Disk] = []

    def __len__(self) -> int:
        return sum(map(len, self._q.values()))

    def intake(self, msgs: Iterable[object], counts: Counter[str]) -> bool:
        """Queue the Transfers, Flushes, Remote and Disk jobs of ``msgs``, in order,
        counting each kind (``transfers``, ``flushes``, ``remote_jobs``, ``disk_jobs``,
        ``shutdowns``, ``ignored_messages``); True if a Shutdown was among them. A Flush
        whose id list does not unpack raises its ProtocolError only after every other
        message of ``msgs`` is queued (the caller then fails the queued jobs locally:
        none is dropped because a neighbour was bad)."""
        shutdown = False
        bad: ProtocolError | None = None
        for msg in msgs:
            if isinstance(msg, Transfer):
                counts["transfers"] += 1
                self.add(msg)
            elif isinstance(msg, Flush):
                counts["flushes"] += 1
                try:
                    self.add_flush(msg.step, unpack_ids(msg.job_ids))
                except ProtocolError as exc:
                    bad = bad or exc
            elif isinstance(msg, Remote):
                counts["remote_jobs"] += 1
                self.remote.append(msg)
            elif isinstance(msg, Disk):
                counts["disk_jobs"] += 1
                self.disk.append(msg)
            elif isinstance(msg, Shutdown):
                counts["shutdowns"] += 1
                shutdown = True
            else:
                counts["ignored_messages"] += 1
        if bad is not None:
            raise bad
        return shutdown

    def add(self, t: Transfer) -> None:
        self._q[Direction(t.direction)].append(t)

    def add_flush(self, step: int, job_ids: Collection[int]) -> None:
        self._flush.setdefault(step, set()).update(job_ids)

    def steps(self) -> list[int]:
        """Distinct steps of the queued Transfers, ascending."""
        return sorted({t.step for q in self._q.values() for t in q})

    def any_upto(self, limit: int) -> bool:
        """True if some queued Transfer has ``step <= limit``."""
        return any(t.step <= limit for q in self._q.values() for t in q)

    def take(self, direction: Direction, limit: int) -> list[Transfer]:
        """Remove and return ``direction``'s Transfers with ``step <= limit``, in order."""
        queue = self._q[direction]
        if not any(t.step <= limit for t in queue):
            return []
        self._q[direction] = [t for t in queue if t.step > limit]
        return [t for t in queue if t.step <= limit]

    def take_ids(self, job_ids: Collection[int], limit: int) -> list[Transfer]:
        """Remove and return the Transfers of ``job_ids`` with ``step <= limit``."""
        out: list[Transfer] = []
        for direction, queue in self._q.items():
            hit = [t for t in queue if t.job_id in job_ids and t.step <= limit]
            if hit:
                self._q[direction] = [t for t in queue if t not in hit]
                out += hit
        return out

    def take_flush(self, limit: int) -> set[int]:
        """Remove and return the job ids Flush'ed for every step ``<= limit``."""
        ids: set[int] = set()
        for step in [s for s in self._flush if s <= limit]:
            ids |= self._flush.pop(step)
        return ids

    def take_all(self) -> list[Transfer]:
        """Empty the queue (and the flush lists); every queued Transfer, by direction."""
        out = [t for q in self._q.values() for t in q]
        self._q = {d: [] for d in Direction}
        self._flush.clear()
        return out

    def take_remote(self) -> list[Remote]:
        """Remove and return the queued Remote jobs, in arrival order."""
        out, self.remote = self.remote, []
        return out

    def take_disk(self) -> list[Disk]:
        """Remove and return the queued Disk jobs, in arrival order."""
        out, self.disk = self.disk, []
        return out
