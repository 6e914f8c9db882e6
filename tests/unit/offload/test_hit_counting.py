"""The manager's hit counters (issue 28, point 5): ``hit_tokens`` counts what a request
was granted, once, at its first phase B; a lookup asked again while the request waits
for the serving engine's KV space is only a lookup (``lookups``, and the per-answer
``lookup_hit_tokens``); a re-admission after a preemption counts apart
(``hit_tokens_readmitted``). Real ``OffloadManager`` and pools (:mod:`manager_rig`)."""

from __future__ import annotations

from manager_rig import Req, Rig


def test_a_waiting_request_asked_five_times_is_one_hit() -> None:
    """vLLM looks a waiting request up every step until its KV fits: five answers of 8
    tokens, then one phase B that accepts them -- 8 hit tokens, not 40."""
    rig = Rig()
    b = Req("b", 9)
    rig.seed_cpu(b.h[0], b.h[1])
    for _ in range(5):
        assert rig.m.lookup(b.view(), 0) == 8
    rig.m.allocated("b", [rig.alloc(3)], 8)
    rig.m.check_invariants()
    c = rig.m.counters
    assert (c.lookups, c.lookup_hit_tokens) == (5, 40)
    assert (c.hit_tokens, c.hit_tokens_readmitted) == (8, 0)


def test_a_partly_accepted_hit_counts_what_was_accepted() -> None:
    """vLLM may take fewer tokens than offered (a block-aligned local hit, its own
    rules): the count is what phase B accepted."""
    rig = Rig()
    b = Req("b", 9)
    rig.seed_cpu(b.h[0], b.h[1])
    assert rig.m.lookup(b.view(), 0) == 8
    rig.m.allocated("b", [rig.alloc(3)], 4)
    rig.m.check_invariants()
    assert rig.m.counters.hit_tokens == 4


def test_a_preempted_request_readmitted_counts_apart_and_a_new_one_counts_again() -> None:
    """A second phase B of the same live request (vLLM re-admits a preempted request:
    lookup and phase B again) goes to ``hit_tokens_readmitted`` -- vLLM counts it as a
    preempted hit, not in ``external_prefix_cache_hits``; a miss at the first phase B
    still makes the request admitted. Once finished, the id is a new request."""
    rig = Rig()
    b = Req("b", 9)
    rig.seed_cpu(b.h[0], b.h[1])
    assert rig.m.lookup(b.view(), 0) == 8
    first = rig.alloc(3)
    rig.m.allocated("b", [first], 8)
    plan = rig.step(b.sched(first, confirmed=0, new=True))
    rig.ack(plan.load)
    rig.m.take_load_results()
    assert rig.m.lookup(b.view(), 0) == 8  # preempted: its blocks freed, asked again
    rig.m.allocated("b", [rig.alloc(3)], 8)
    rig.m.check_invariants()
    c = rig.m.counters
    assert (c.hit_tokens, c.hit_tokens_readmitted) == (8, 8)

    d = Req("d", 9, base=50)
    assert rig.m.lookup(d.view(), 0) == 0
    rig.m.allocated("d", [rig.alloc(3)], 0)  # admitted without a hit
    rig.seed_cpu(d.h[0], d.h[1])
    assert rig.m.lookup(d.view(), 0) == 8  # re-admitted with one
    second = rig.alloc(3)
    rig.m.allocated("d", [second], 8)
    assert (c.hit_tokens, c.hit_tokens_readmitted) == (8, 16)

    rig.m.finished("d", 0, [second])
    rig.m.check_invariants()
    assert rig.m.lookup(d.view(), 0) == 8  # the id again, after its finish: new
    rig.m.allocated("d", [rig.alloc(3)], 8)
    assert (c.hit_tokens, c.hit_tokens_readmitted) == (16, 16)
