"""What a rank has been sent and not yet answered, as the hang clock counts it.

The scheduler channel re-checks its ``done`` ring on a timer while this count is above
zero, and :mod:`kvshm.engine.supervision` reads it to tell a stuck rank from an idle one.
Only copies count: a :class:`~kvshm.ipc.protocol.Transfer` is the rank's own work on
memory it owns, answered in milliseconds. A tier job (``Remote`` or ``Disk``) waits on a
network server or on the rank's slab I/O threads, with deadlines of its own (the
scheduler's read timeout and write cap); its id is kept only so that its Done is not
taken for a Transfer's answer.

Invariants: ``count >= 0``; an id is in the tier set from its post until its Done (or a
refused post) and never counts. Dones of one rank arrive in no particular order, so the
count is approximate after a rank answers a job this side never sent (a protocol fault
the channel reports elsewhere): it is floored at zero rather than allowed negative.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshm.ipc import protocol

__all__ = ["Unanswered"]


class Unanswered:
    """The count of unanswered Transfers and the ids of unanswered tier jobs."""

    __slots__ = ("count", "_tier_ids")

    def __init__(self) -> None:
        #: Transfers posted (in the ring or queued behind it) and not yet answered
        self.count = 0
        self._tier_ids: set[int] = set()

    def sent(self, msg: protocol.CmdMsg) -> None:
        """``msg`` was posted (into the ring or its overflow queue)."""
        if isinstance(msg, (protocol.Remote, protocol.Disk)):
            self._tier_ids.add(msg.job_id)
        elif isinstance(msg, protocol.Transfer):
            self.count += 1

    def unsent(self, msg: protocol.CmdMsg) -> None:
        """Undo :meth:`sent` for a message the ring refused after it was counted."""
        if isinstance(msg, (protocol.Remote, protocol.Disk)):
            self._tier_ids.discard(msg.job_id)
        elif isinstance(msg, protocol.Transfer):
            self.count -= 1

    def answered(self, dones: Sequence[protocol.Done]) -> None:
        """``dones`` arrived: each answers a tier job whose id is kept, or a Transfer."""
        ids = self._tier_ids
        if not ids:
            n = len(dones)
        else:
            n = 0
            for d in dones:
                if d.job_id in ids:
                    ids.discard(d.job_id)
                else:
                    n += 1
        self.count = max(0, self.count - n)

    @property
    def tier_jobs(self) -> int:
        """Tier jobs posted and not yet answered (they do not count)."""
        return len(self._tier_ids)
