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
    assert u.answered([p.Done(7, 0, True)], 0) == []
    assert (u.count, u.tier_jobs) == (2, 0)
    assert u.answered([p.Done(2, 0, True), p.Done(1, 0, True)], 0) == []
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


def test_a_stray_done_answers_nothing_and_is_returned() -> None:
    """Hazard "a stray Done blinds the hang check": Transfers 5 (a store, answered) and
    6 (a load, never answered) went to rank 1. Before, every Done that was not a tier
    job's lowered the count, floored at zero: a second Done for 5 (or one for job 99,
    never sent, or one naming rank 0) took the count from 1 to 0, so the hang check
    read rank 1 as idle while load 6 was stuck. Now each such Done is a stray: returned,
    and the count stays 1 until 6 itself is answered."""
    u = Unanswered()
    u.sent(transfer(5))
    assert u.answered([p.Done(5, 1, True)], 1) == []
    u.sent(transfer(6))
    assert u.count == 1
    twice, never, other_rank = p.Done(5, 1, True), p.Done(99, 1, True), p.Done(6, 0, True)
    stray = u.answered([twice, never, other_rank], 1)
    assert [d is x for d, x in zip(stray, (twice, never, other_rank), strict=True)] == \
        [True] * 3
    assert u.count == 1
    assert u.answered([p.Done(6, 1, False, "CopyError")], 1) == []  # a failure answers
    assert u.count == 0
