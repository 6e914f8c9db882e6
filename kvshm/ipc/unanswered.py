"""What a rank has been sent and not yet answered, as the hang clock counts it.

The scheduler channel re-checks its ``done`` ring on a timer while this count is above
zero, and :mod:`kvshm.engine.supervision` reads it to tell a stuck rank from an idle one.
Only copies count: a :class:`~kvshm.ipc.protocol.Transfer` is the rank's own work on
memory it owns, answered in milliseconds. A tier job (``Remote`` or ``Disk``) waits on a
network server or on the rank's slab I/O threads, with deadlines of its own (the
scheduler's read timeout and write cap); its id is kept only so that its Done is not
taken for a Transfer's answer.

Every Done must answer a job this side sent to this rank and has not seen answered:
one that answers nothing (a job never sent, another rank's, one answered already, or a
Done naming another rank) is a *stray*, a protocol fault (:meth:`Unanswered.answered`
returns them; the channel fails the rank). Counting them as answers let one stray Done
zero the count while a load was still unanswered, and the hang check, which reads an
idle rank from a zero count, never judged the stuck rank: the request's wait never
ended (hazard "a stray Done blinds the hang check", docs/design.md).

Invariants: an id is in exactly one of the two sets from its post (or its refused
post's undo) until its Done; ``count`` is the Transfer set's size.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshm.ipc import protocol

__all__ = ["Unanswered"]


class Unanswered:
    """The ids of the Transfers and of the tier jobs sent to one rank and unanswered."""

    __slots__ = ("_tier_ids", "_transfer_ids")

    def __init__(self) -> None:
        #: Transfers posted (in the ring or queued behind it) and not yet answered
        self._transfer_ids: set[int] = set()
        self._tier_ids: set[int] = set()

    @property
    def count(self) -> int:
        """Transfers posted and not yet answered (what the hang clock waits on)."""
        return len(self._transfer_ids)

    def sent(self, msg: protocol.CmdMsg) -> None:
        """``msg`` was posted (into the ring or its overflow queue)."""
        if isinstance(msg, (protocol.Remote, protocol.Disk)):
            self._tier_ids.add(msg.job_id)
        elif isinstance(msg, protocol.Transfer):
            self._transfer_ids.add(msg.job_id)

    def unsent(self, msg: protocol.CmdMsg) -> None:
        """Undo :meth:`sent` for a message the ring refused after it was counted."""
        if isinstance(msg, (protocol.Remote, protocol.Disk)):
            self._tier_ids.discard(msg.job_id)
        elif isinstance(msg, protocol.Transfer):
            self._transfer_ids.discard(msg.job_id)

    def answered(self, dones: Sequence[protocol.Done], rank: int) -> list[protocol.Done]:
        """``dones`` arrived from ``rank``, in order: each that answers an unanswered job
        of this rank marks it answered; returns the strays (module docstring), usually
        ``[]``, which mark nothing."""
        xfer, tier = self._transfer_ids, self._tier_ids
        stray: list[protocol.Done] = []
        for d in dones:
            j = d.job_id
            if d.rank != rank:
                stray.append(d)
            elif j in xfer:
                xfer.remove(j)
            elif j in tier:
                tier.remove(j)
            else:
                stray.append(d)
        return stray

    @property
    def tier_jobs(self) -> int:
        """Tier jobs posted and not yet answered (they do not count)."""
        return len(self._tier_ids)
