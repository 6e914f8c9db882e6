"""A store the CPU pool could not take is retried by the manager itself, listed or not
(``RequestTracker.stalled``, issue 15 part 2): an engine that lists only the requests
that changed still gets a deferred block stored as soon as the pool has room; a
preemption or a finish drops the retry."""

from __future__ import annotations

from manager_rig import BS, Req, Rig, declined, pairs

from kvshm.offload.counters import DeclineReason


def _stalled_after_a_full_pool() -> tuple[Rig, Req]:
    """A's 4 confirmed blocks meet a 2-block CPU pool: 2 stored, A stalled."""
    rig = Rig(cpu=2)
    a = Req("a", 4 * BS + 1)
    ga = rig.alloc(5, a.h)
    p1 = rig.step(a.sched(ga, confirmed=4 * BS, new=True))
    assert pairs(p1.store)[0] == ga[:2] and declined(rig.m, DeclineReason.CPU_FULL) == 1
    assert set(rig.m._track.stalled) == {"a"}
    rig.ack(p1.store)  # stored: cached at ref 0, evictable
    return rig, a


def test_a_stalled_store_is_retried_without_a_listing() -> None:
    rig, a = _stalled_after_a_full_pool()
    p2 = rig.step()  # A is not listed
    assert p2.store is not None and pairs(p2.store)[0] == rig.m._track.reqs["a"].tables[0][2:4]
    assert rig.m._track.stalled == {}
    rig.ack(p2.store)
    assert rig.step().store is None  # caught up: nothing more
    rig.m.check_invariants()


def test_a_preempted_or_finished_request_is_not_retried() -> None:
    rig, a = _stalled_after_a_full_pool()
    rig.step(a.sched((), confirmed=0, preempted=True))
    assert rig.m._track.stalled == {} and rig.step().store is None
    rig2, _ = _stalled_after_a_full_pool()
    rig2.m.finished("a", 0, [[]])
    assert rig2.m._track.stalled == {} and rig2.step().store is None
    rig.m.check_invariants()
    rig2.m.check_invariants()
