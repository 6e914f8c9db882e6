"""The hang clock's count of unanswered commands (:mod:`kvshm.ipc.unanswered`)."""

from __future__ import annotations

from kvshm.ipc import protocol as p
from kvshm.ipc.unanswered import Unanswered


def transfer(job: int) -> p.Transfer:
    return p.Transfer(1, job, p.Direction.STORE, p.pack_ids([1]), p.pack_ids([2]))


def remote(job: int) -> p.Remote:
    return p.Remote(job, p.RemoteOp.GET, b"\0" * 4, b"\0" * 32, 32)


def test_only_transfers_count_and_a_tier_jobs_done_is_not_taken_for_a_transfers() -> None:
    """Transfers 1 and 2 and remote job 7 go out: the count is 2 (the remote job waits
    on a server, with its own deadlines). Job 7's Done arrives first: it answers the
    remote job, not a Transfer, so the count stays 2 until 1 and 2 are answered."""
    u = Unanswered()
    for msg in (transfer(1), remote(7), transfer(2)):
        u.sent(msg)
    assert (u.count, u.tier_jobs) == (2, 1)
    u.answered([p.Done(7, 0, True)])
    assert (u.count, u.tier_jobs) == (2, 0)
    u.answered([p.Done(2, 0, True), p.Done(1, 0, True)])
    assert (u.count, u.tier_jobs) == (0, 0)


def test_a_refused_post_leaves_nothing_behind() -> None:
    """A message the ring refused after it was counted (:meth:`Unanswered.unsent`):
    neither the Transfer's count nor the tier job's id stays."""
    u = Unanswered()
    u.sent(transfer(1))
    u.sent(remote(9))
    u.unsent(remote(9))
    u.unsent(transfer(1))
    assert (u.count, u.tier_jobs) == (0, 0)


def test_a_done_for_a_job_never_sent_floors_the_count_at_zero() -> None:
    """A rank that answers job 5, never sent (a protocol fault reported elsewhere),
    cannot drive the count below zero: the timer would stop re-checking a ring that
    still owes Transfer 6's answer only after 6 is answered anyway."""
    u = Unanswered()
    u.answered([p.Done(5, 0, True)])
    assert u.count == 0
    u.sent(transfer(6))
    assert u.count == 1
