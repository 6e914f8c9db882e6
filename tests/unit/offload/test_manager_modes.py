"""Lazy store mode, ack bookkeeping, counters and edge cases of the OffloadManager.

Same rig as test_manager_hazards.py (:mod:`manager_rig`): real pools, tiny sizes, exact
ids and refs.
"""

from __future__ import annotations

import pytest
from manager_rig import Req, Rig, hashes, manager_state, pairs, refs

from kvshm.errors import ConfigError
from kvshm.offload.counters import DeclineReason
from kvshm.types import (
    KVGroup,
    LoadFailure,
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
    StoreMode,
)

# ---- lazy mode ---------------------------------------------------------------------------


def test_lazy_offloads_blocks_nearing_eviction_and_returns_them_evict_first() -> None:
    """A finished request left blocks 0-4 cached on the GPU (5 is a partial block,
    uncached, reused first). With a 3-block window the lazy scan looks at 5, 4, 3 and
    offloads 4 and 3; being pinned they leave the free queue, so the next step's window
    is 5, 2, 1. After each copy the blocks go back at the LRU end, in order, so the
    engine evicts them (already offloaded) before block 0, which the scan then finds."""
    rig = Rig(gpu=6, mode=StoreMode.LAZY, lazy_window=3)
    m, cpu, gpu = rig.m, rig.cpu, rig.gpu
    h = hashes(20)
    ids = gpu.allocate(6)
    for b, hh in zip(ids, h):
        gpu.add_hashes(b, [hh])
    gpu.free(reversed(ids))
    assert list(gpu.iter_free_from_lru()) == [5, 4, 3, 2, 1, 0]
    p1 = rig.step()
    assert pairs(p1.store) == ([4, 3], [0, 1])
    assert gpu.ref_cnt(4) == 1 and list(gpu.iter_free_from_lru()) == [5, 2, 1, 0]
    p2 = rig.step()
    assert pairs(p2.store) == ([2, 1], [2, 3])
    rig.ack(p1.store)
    rig.ack(p2.store)
    assert list(gpu.iter_free_from_lru()) == [2, 1, 4, 3, 5, 0]
    assert [cpu.get_cached(x) for x in h[:5]] == [None, 3, 2, 1, 0]
    assert rig.step().store is None                           # window 2, 1, 4: all cached
    assert gpu.allocate(5) == [2, 1, 4, 3, 5]
    p4 = rig.step()
    assert pairs(p4.store) == ([0], [4])
    rig.ack(p4.store)
    assert m.counters.stored_blocks == 5 and m.pins_held() == 0


def test_lazy_mode_stores_remote_decode_requests_eagerly() -> None:
    """In lazy mode ordinary running requests are not tracked, but a do_remote_decode
    request must still publish its KV, so it is stored as its blocks are confirmed."""
    rig = Rig(gpu=8, mode=StoreMode.LAZY, lazy_window=3)
    gpu = rig.gpu
    h = hashes(9)
    ids = gpu.allocate(3)
    for b, hh in zip(ids, h):
        gpu.add_hashes(b, [hh])
    plain = ScheduledRequest("p", h, 9, (tuple(ids),), True, 8)
    assert rig.step(plain).store is None
    ids2 = gpu.allocate(3)
    for b, hh in zip(ids2, hashes(9, base=100)):
        gpu.add_hashes(b, [hh])
    remote = ScheduledRequest("r", hashes(9, base=100), 9, (tuple(ids2),), True, 8, False,
                              {"do_remote_decode": True})
    p = rig.step(remote)
    assert pairs(p.store) == (ids2[:2], [0, 1])
    rig.ack(p.store)


def test_lazy_scan_never_picks_a_block_the_eager_walk_picked_under_another_hash() -> None:
    """The hazard: a remote-decode request lists free GPU block 5, which carries two
    hashes -- another prefix's first, then the request's block 0. The eager walk picks
    5 under the request's hash; the lazy scan, run before the walk's picks are touched,
    picked 5 again under its first hash: the store job read block 5 twice, the pool's
    invariants broke and the ack raised AssertionError. Now the scan skips blocks in
    flight: the job is ``[5] -> [0]``, acked cleanly."""
    rig = Rig(gpu=16, cpu=8, mode=StoreMode.LAZY, lazy_window=16)
    r = Req("r", 5, params={"do_remote_decode": True})
    g = rig.gpu.allocate(6)
    rig.gpu.add_hashes(5, [b"\x07" * 16, r.h[0]])
    rig.gpu.free(reversed(g))
    p = rig.step(ScheduledRequest("r", r.h, 5, ((5,),), True, 4, False, r.params))
    assert p.store is not None and pairs(p.store) == ([5], [0])
    rig.m.check_invariants()
    rig.ack(p.store)
    rig.m.check_invariants()


def test_lazy_mode_needs_a_single_group() -> None:
    with pytest.raises(ConfigError, match="single KV group"):
        Rig(gpu=8, mode=StoreMode.LAZY, lazy_window=3,
            groups=(KVGroup.full(), KVGroup.sliding_window(8)))
    with pytest.raises(ConfigError):
        Rig(gpu=8, mode=StoreMode.LAZY, lazy_window=0)


# ---- acks and job ids --------------------------------------------------------------------


def test_unknown_and_duplicate_acks_are_counted_and_ignored() -> None:
    """Acks for a job that does not exist, twice from one rank, or from a rank out of
    range change nothing but counters; job ids keep increasing across a reset."""
    rig = Rig(gpu=8, world_size=2)
    m, cpu, gpu = rig.m, rig.cpu, rig.gpu
    h = hashes(4)
    [b] = gpu.allocate(1)
    gpu.add_hashes(b, h)
    p1 = rig.step(ScheduledRequest("a", h, 4, ((b,),), True, 4))
    assert p1.store is not None and p1.store.job_id == 1
    m.on_done(99, 0, True)
    m.on_done(1, 0, True)
    m.on_done(1, 0, True)
    m.on_done(1, 7, True)
    m.check_invariants()
    assert (m.counters.acks_unknown, m.counters.acks_duplicate) == (1, 2)
    assert m.num_jobs_in_flight == 1 and m.has_pending_work()
    m.on_done(1, 1, True)
    assert m.num_jobs_in_flight == 0 and cpu.is_cached(h[0])
    assert m.reset() is True
    [b2] = gpu.allocate(1)
    h2 = hashes(4, base=9)
    gpu.add_hashes(b2, h2)
    p2 = rig.step(ScheduledRequest("b", h2, 4, ((b2,),), True, 4))
    assert p2.store is not None and p2.store.job_id == 2


def test_rank_failed_rejects_unknown_rank_and_is_idempotent() -> None:
    m = Rig(gpu=8, world_size=2).m
    with pytest.raises(ConfigError):
        m.rank_failed(2)
    m.rank_failed(1)
    m.rank_failed(1)
    assert m.failed and m.reset() is True
    m.check_invariants()


def test_a_bad_rank_changes_nothing_and_the_real_death_still_cleans_up() -> None:
    """The hazard: ``rank_failed(5)`` (or -1, or "0") on a two-rank manager set
    ``failed`` and only then checked the rank. The ConfigError left a manager marked
    failed whose first failure never ran: R's pinned hit on CPU 0-1 was not tombstoned
    and the index not dropped, and the real ``rank_failed(0)`` that followed skipped
    that cleanup too (it was no longer the first) -- R's phase B then queued a load no
    step ever sent, and the pins leaked. Now the rank is checked first: nothing
    changes, and the real death fails R's load and frees the pins."""
    for bad in (5, -1, "0", True):
        rig = Rig(cpu=8, gpu=16, world_size=2)
        r = Req("r", 9)
        rig.seed_cpu(*r.h)                                   # CPU 0, 1
        assert rig.m.lookup(r.view(), 0) == 8
        before = manager_state(rig.m)
        with pytest.raises(ConfigError, match="a rank is an int in \\[0, 2\\)"):
            rig.m.rank_failed(bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError):
            rig.m.rank_fenced(bad)  # type: ignore[arg-type]
        assert manager_state(rig.m) == before and not rig.m.failed
        rig.m.rank_failed(0)
        assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.num_hashes == 0
        g = rig.alloc(3)
        rig.m.allocated("r", [g], 8)
        assert rig.step().failed_loads == {"r": (g[0], g[1])}
        assert rig.m.take_load_results() == [
            LoadResult("r", False, (g[0], g[1]), LoadFailure.RANK_DIED, 0)]
        assert not rig.m.has_pending_work() and rig.m.pins_held() == 0
        rig.m.check_invariants()


def test_counters_flatten_for_stats() -> None:
    m = Rig(gpu=8).m
    flat = m.counters.as_dict()
    assert flat["lookups"] == 0 and flat["declined_cpu_full"] == 0
    assert all(isinstance(v, int) for v in flat.values())
    assert {f"declined_{r.value}" for r in DeclineReason} <= set(flat)


# ---- lookups -----------------------------------------------------------------------------


def test_unaligned_local_hit_gets_no_cpu_hit() -> None:
    rig = Rig(gpu=8)
    m, cpu = rig.m, rig.cpu
    h = hashes(12)
    for hh in h:
        [c] = cpu.allocate(1)
        cpu.add_hashes(c, [hh])
        cpu.free([c])
    view = RequestView("a", h, 13)
    assert m.lookup(view, 3) == 0 and m.counters.lookups_unaligned == 1
    assert m.lookup(view, 4) == 8
    m.finished("a", 0, [[]])
    assert m.pins_held() == 0


def test_sliding_window_partial_acceptance_fills_the_window_or_fails_it() -> None:
    """Hybrid (full + 8-token window = 2 blocks). Phase A offers 4 blocks and pins the
    window blocks 2-3. The engine accepts 2 blocks: the window now needs positions 0-1;
    position 1 is looked up again and pinned, position 0's window copy is gone, so its
    destination is reported failed (recompute) while the rest loads."""
    groups = (KVGroup.full(), KVGroup.sliding_window(8))
    rig = Rig(cpu=16, gpu=16, groups=groups)
    m, cpu, gpu = rig.m, rig.cpu, rig.gpu
    h = hashes(17)
    key = m._gs.key
    keys = [key(x, 0) for x in h] + [key(x, 1) for x in h[1:]]   # window copy of 0 missing
    for k in keys:
        [c] = cpu.allocate(1)
        cpu.add_hashes(c, [k])
        cpu.free([c])
    assert m.lookup(RequestView("a", h, 17), 0) == 16
    assert sum(cpu.ref_cnt(b) for b in range(16)) == 6       # 4 full + 2 window
    full, win = gpu.allocate(4), gpu.allocate(4)
    m.allocated("a", [full, win], 8)
    m.check_invariants()
    assert sum(cpu.ref_cnt(b) for b in range(16)) == 3       # full 0, 1 + window 1
    p = rig.step()
    src, dst = pairs(p.load)
    assert src == [cpu.get_cached(key(h[0], 0)), cpu.get_cached(key(h[1], 0)),
                   cpu.get_cached(key(h[1], 1))]
    assert dst == [full[0], full[1], win[1]]
    rig.ack(p.load)
    rig.step()
    assert m.take_load_results() == [
        LoadResult("a", False, (win[0],), LoadFailure.WINDOW_MISSING, 0)]
    assert m.counters.loaded_blocks == 3
    # a failed outcome like any other (it was not counted when decided at completion)
    assert m.counters.loads_failed == 1


def test_finish_stores_dropped_when_cpu_cannot_ever_supply() -> None:
    """Every CPU block is pinned by lookups and no job is in flight, so no completion
    will ever free one: finish-time stores are dropped (CPU_FULL) and their GPU pins
    released instead of being held forever."""
    rig = Rig(cpu=2, gpu=8)
    m, cpu, gpu = rig.m, rig.cpu, rig.gpu
    h = hashes(9, base=70)
    for hh in h:
        [c] = cpu.allocate(1)
        cpu.add_hashes(c, [hh])
        cpu.free([c])
    assert m.lookup(RequestView("w", h, 9), 0) == 8
    a = hashes(5)
    ids = gpu.allocate(2)
    gpu.add_hashes(ids[0], a)
    rig.step(ScheduledRequest("a", a, 5, (tuple(ids),), True, 0))
    m.finished("a", 5, [ids])
    assert gpu.ref_cnt(ids[0]) == 2
    p = rig.step()
    assert p.store is None and m.counters.declined[DeclineReason.CPU_FULL] == 1
    assert gpu.ref_cnt(ids[0]) == 1
    m.finished("w", 0, [[]])
    assert m.pins_held() == 0


def test_step_input_finished_releases_like_finished_without_final_stores() -> None:
    """A request named in StepInput.finished (its finished() never called) loses its
    phase-A pin, its queued load and its tracking; with no final count known, nothing
    more is stored for it."""
    rig = Rig(gpu=8)
    m, cpu, gpu = rig.m, rig.cpu, rig.gpu
    h = hashes(9)
    for hh in h:
        [c] = cpu.allocate(1)
        cpu.add_hashes(c, [hh])
        cpu.free([c])
    assert m.lookup(RequestView("a", h, 9), 0) == 8
    assert m.lookup(RequestView("b", h[:1], 5), 0) == 4
    gb = gpu.allocate(2)
    m.allocated("b", [gb], 4)
    assert m.pins_held() == 2 + 1 + 1
    plan = m.build_step(StepInput(1, (), ("a", "b", "unknown")))
    m.check_invariants()
    assert plan.load is None and plan.store is None and m.pins_held() == 0
    assert gpu.ref_cnt(gb[0]) == 1 and not m.has_pending_work()
