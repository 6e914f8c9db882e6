"""One narrated regression test per scheduler-side hazard of docs/design.md ("Hazards").

Every test drives the real ``OffloadManager`` through the shared rig
(:mod:`manager_rig`: real pools, tiny sizes, exact block ids, ref counts and jobs). The
test plays the engine: it allocates GPU blocks, hashes a block once its KV is computed,
lists requests in ``StepInput``s and acks jobs. ``check_invariants()`` runs after every
manager call that changes state.
"""

from __future__ import annotations

from typing import Any

import pytest
from manager_rig import REMOTE, Req, Rig, declined, manager_state, pairs, refs

from kvshm.errors import ConfigError, InvalidRequest
from kvshm.ipc.protocol import Direction
from kvshm.offload.counters import DeclineReason
from kvshm.types import KVGroup, LoadFailure, LoadResult, ScheduledRequest, StepPlan

# ---- in-flight dedup -------------------------------------------------------------------


def test_in_flight_store_dedup_across_steps() -> None:
    """Step 1 stores A's two blocks; the job is still in flight in step 2, when B lists
    the same GPU blocks (a GPU prefix hit, B never looked up) and C holds the same
    content in other GPU blocks (recomputed). Nothing may be stored twice: C's blocks
    are skipped by hash, a block reached under another of its hashes by GPU id. After
    the ack the CPU index holds each hash once and a later duplicate is
    ALREADY_CACHED."""
    rig = Rig()
    a, b, c = Req("a", 9), Req("b", 9), Req("c", 9)
    ga = rig.alloc(3, a.h)                                  # [0, 1, 2]
    p1 = rig.step(a.sched(ga, confirmed=9, new=True))
    assert p1.store is not None and pairs(p1.store) == ([0, 1], [0, 1])
    assert refs(rig.gpu, [0, 1, 2]) == [2, 2, 1] and refs(rig.cpu, [0, 1]) == [1, 1]
    assert not rig.cpu.is_cached(a.h[0])                    # a block being written never hits
    assert rig.m.lookup(b.view(), 0) == 0

    rig.gpu.touch(ga[:2])                                   # B's GPU prefix hit
    gb = ga[:2] + rig.alloc(1)                              # [0, 1, 3]
    gc = rig.alloc(3, c.h)                                  # [4, 5, 6], same hashes as A
    # E reaches GPU block 0 under a secondary hash the block also carries: only the
    # GPU-id mark can tell it is the block already being stored.
    secondary = b"secondary hash of block 0"
    rig.gpu.add_hashes(0, [secondary])
    rig.gpu.touch([0])
    e = ScheduledRequest("e", [secondary], 5, ((0,),), True, 4)
    p2 = rig.step(a.sched((), confirmed=9), b.sched(gb, confirmed=8, new=True),
                  c.sched(gc, confirmed=8, new=True), e)
    assert p2.store is None
    assert declined(rig.m, DeclineReason.IN_FLIGHT) == 5
    assert rig.m.num_jobs_in_flight == 1

    rig.ack(p1.store)
    assert rig.cpu.get_cached(a.h[0]) == 0 and rig.cpu.get_cached(a.h[1]) == 1
    assert rig.cpu.get_cached(secondary) == 0                 # the GPU block's hashes at completion
    assert refs(rig.gpu, [0, 1]) == [3, 2] and refs(rig.cpu, [0, 1]) == [0, 0]
    d = Req("d", 9)
    gd = rig.alloc(3, d.h)
    p3 = rig.step(d.sched(gd, confirmed=8, new=True))
    assert p3.store is None and declined(rig.m, DeclineReason.ALREADY_CACHED) == 2
    assert rig.m.counters.stored_blocks == 2


# ---- TOCTOU ----------------------------------------------------------------------------


def test_toctou_pin_survives_eviction_between_phases() -> None:
    """Phase A finds B's prefix in CPU blocks 0 and 1 and pins them. Before phase B,
    request C's stores need every CPU block; 0 and 1 are the LRU-most evictable ones,
    but pinned, so C gets 2 and 3 and defers the rest. Phase B then loads exactly the
    pinned blocks (vLLM's old re-search here found 0 hit tokens and asserted)."""
    rig = Rig(cpu=4)
    b = Req("b", 9)
    assert rig.seed_cpu(b.h[0], b.h[1]) == [0, 1]
    assert rig.m.lookup(b.view(), 0) == 8
    assert refs(rig.cpu, [0, 1]) == [1, 1]

    c = Req("c", 16, base=100)
    gc = rig.alloc(4, c.h)                                  # [0, 1, 2, 3]
    p1 = rig.step(c.sched(gc, confirmed=16, new=True))
    assert pairs(p1.store) == ([0, 1], [2, 3])              # not 0 and 1: pinned
    assert declined(rig.m, DeclineReason.CPU_FULL) == 1
    assert rig.cpu.get_cached(b.h[0]) == 0 and rig.cpu.get_cached(b.h[1]) == 1

    gb = rig.alloc(3)                                        # [4, 5, 6]
    rig.m.allocated("b", [gb], 8)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, gb) == [2, 2, 1]
    p2 = rig.step(c.sched((), confirmed=16))
    assert pairs(p2.load) == ([0, 1], [4, 5]) and p2.load is not None
    assert p2.load.direction is Direction.LOAD and p2.load_jobs == {p2.load.job_id: ("b",)}
    rig.ack(p2.load)
    p3 = rig.step()  # c, stalled at CPU_FULL, is walked again although it is not listed
    assert tuple(rig.m.take_load_results()) == (LoadResult("b", True, (), None, 8),)
    gpu3, cpu3 = pairs(p3.store)
    assert gpu3 == [2, 3] and sorted(cpu3) == [0, 1] and p3.store is not None  # b's, unpinned
    rig.ack(p3.store)
    rig.step()
    assert rig.m._track.stalled == {}
    assert refs(rig.cpu, [0, 1]) == [0, 0] and refs(rig.gpu, gb) == [1, 1, 1]


# ---- sliding window --------------------------------------------------------------------


def _hybrid_a(gpu: int, cpu: int = 8) -> tuple[Rig, Req]:
    """Full attention + a 4-token sliding window (1 block before the hit point). A (17
    tokens) is listed with full ids 0-3 and window ids 4-7, nothing confirmed yet, and
    its forward has computed (hashed) all eight blocks."""
    rig = Rig(cpu=cpu, gpu=gpu, groups=(KVGroup.full(), KVGroup.sliding_window(4)))
    a = Req("a", 17)
    full, win = rig.alloc(4), rig.alloc(4)                   # [0..3], [4..7]
    rig.step(a.sched(full, win, confirmed=0, new=True))
    rig.hash(full, a.h)
    rig.hash(win, a.h)
    return rig, a


def test_stale_sliding_window_block_not_stored() -> None:
    """Hybrid model: full attention + a 4-token sliding window (1 block before the hit
    point). A prefills 16 tokens in step 1 (full ids 0-3, window ids 4-7) and is not
    scheduled in step 2. Its window blocks 4, 5, 6 fall out of the window and are freed;
    B takes 8 and 4 in step 2 and rehashes 4 for its own content; in step 3 C takes 5
    (listed in allocated_block_ids). When A's blocks are confirmed in step 3, window ids
    4 (hash changed) and 5 (reallocated this step) are stale and not stored; 6 was freed
    but not reused, still holds A's KV under A's hash, and is stored."""
    rig, a = _hybrid_a(9)
    rig.gpu.free([4, 5, 6])                                  # out of the window
    gb = rig.gpu.allocate(2)
    assert gb == [8, 4]
    rig.hash([4], [b"B's own block hash"])
    rig.step(allocated=gb)                                   # A not scheduled
    assert rig.gpu.allocate(1) == [5]
    p3 = rig.step(a.sched((), (), confirmed=16), allocated=[5])
    assert pairs(p3.store) == ([0, 1, 2, 6, 3, 7], [0, 1, 2, 3, 4, 5])
    assert declined(rig.m, DeclineReason.STALE_WINDOW) == 2
    rig.ack(p3.store)
    key = rig.m._gs.key
    assert rig.cpu.is_cached(key(a.h[2], 1)) and not rig.cpu.is_cached(key(a.h[0], 1))

    # Hybrid hit rule: all full blocks plus the window block before the hit point.
    d = Req("d", 17)
    assert rig.m.lookup(d.view(), 0) == 16
    e = Req("e", 9)                                    # hit point 2: window block 1 is missing
    assert rig.m.lookup(e.view(), 0) == 0


def test_stale_sliding_window_block_reused_in_an_earlier_step_under_the_same_hash() -> None:
    """Hybrid model as above. A prefills 16 tokens in step 1 (full ids 0-3, window ids
    4-7, confirmed 0) and is not listed in step 2. Its window block 4 (position 0)
    leaves the window and is freed; in step 2 B, sharing A's prefix but without a local
    hit, takes 4 (with 8-11) as its *full-attention* block of position 0 and hashes it
    with the same plain hash h[0]. In step 3 A's 16 tokens are confirmed. The walk
    compared block 4 only with step 3's allocations and with its hash, and both passed:
    B's full-attention bytes were stored as A's window block of position 0, and a later
    hit of the prefix loaded them ``ok`` (found by a fuzzer). Step 2's allocation of 4
    now marks A's position 0 stale: declined, the other six blocks stored."""
    rig, a = _hybrid_a(12)
    rig.gpu.free([4])                                        # out of A's window
    got = rig.gpu.allocate(5)
    assert sorted(got) == [4, 8, 9, 10, 11]
    rig.step(allocated=got)                                  # B's step; A not listed
    rig.gpu.free([x for x in got if x != 4])
    rig.hash([4], [a.h[0]])                                  # B's full block, same hash
    p3 = rig.step(a.sched((), (), confirmed=16))
    assert pairs(p3.store) == ([0, 1, 5, 2, 6, 3, 7], [0, 1, 2, 3, 4, 5, 6])
    assert declined(rig.m, DeclineReason.STALE_WINDOW) == 1
    assert rig.m._track.reqs["a"].stale == {(1, 0)}
    rig.ack(p3.store)
    key = rig.m._gs.key
    assert not rig.cpu.is_cached(key(a.h[0], 1)) and rig.cpu.is_cached(key(a.h[1], 1))


def test_a_stale_window_position_stays_stale_when_the_request_is_listed_again() -> None:
    """As in the earlier-step test, A's window block 4 (position 0) was taken by B in
    step 2 and hashed with h[0]. In step 3 A is listed again as new (a listing the
    engine repeats, e.g. one that reached kvshm before its workers were up), its table
    still naming 4 there. A re-admission cleared every stale mark, and the walk stored
    B's bytes as A's window block. A mark now stays wherever the new table names the
    same block; the rest of A's blocks are stored (found reading this change again)."""
    rig, a = _hybrid_a(12)
    rig.gpu.free([4])                                        # out of A's window
    got = rig.gpu.allocate(5)
    rig.step(allocated=got)                                  # B takes 4
    rig.gpu.free([x for x in got if x != 4])
    rig.hash([4], [a.h[0]])
    assert rig.m._track.reqs["a"].stale == {(1, 0)}
    p3 = rig.step(a.sched([0, 1, 2, 3], [4, 5, 6, 7], confirmed=16, new=True))
    assert pairs(p3.store)[0] == [0, 1, 5, 2, 6, 3, 7]
    assert rig.m._track.reqs["a"].stale == {(1, 0)}


def test_stale_sliding_window_block_that_became_a_load_destination() -> None:
    """As above, but B takes A's freed window block 4 as the *load destination* of its
    full-attention position 0 (a CPU hit of 8 tokens): vLLM allocates load
    destinations in a step that does not schedule B, and later reports only the blocks
    B computes, so no ``allocated_block_ids`` ever named 4. The load wrote h[0]'s
    full-attention bytes into 4 and A's late walk stored them as its window block (a
    review of the first fix). A phase B's destinations now count as allocated: A's
    position 0 is stale, its other window blocks stored."""
    rig, a = _hybrid_a(16, cpu=16)
    key = rig.m._gs.key
    for h, g in ((a.h[0], 0), (a.h[1], 0), (a.h[1], 1)):    # another request's copies
        c = rig.cpu.allocate(1)
        rig.cpu.add_hashes(c[0], [key(h, g)])
        rig.cpu.free(c)
    rig.gpu.free([4])                                        # out of A's window
    b = Req("b", 17)
    assert rig.m.lookup(b.view(), 0) == 8
    got = rig.gpu.allocate(9)
    rest = [x for x in got if x != 4]
    bf, bw = [4, rest[0]], rest[1:3]                         # 4: B's full block 0
    rig.gpu.free(rest[3:])
    rig.m.allocated("b", (bf, bw), 8)
    assert rig.m._track.reqs["a"].stale == {(1, 0)}
    p2 = rig.step()
    rig.ack(p2.load)
    rig.hash([4], [a.h[0]])                                  # the loaded block, cached
    rig.step(b.sched(bf, bw, confirmed=8, new=True))
    p4 = rig.step(a.sched((), (), confirmed=16))
    assert 4 not in pairs(p4.store)[0] and pairs(p4.store)[0] == [2, 6, 3, 7]
    rig.ack(p4.store)
    assert not rig.cpu.is_cached(key(a.h[0], 1))


def test_stale_sliding_window_block_shared_by_a_gpu_prefix_hit() -> None:
    """A's window block 4 (position 0, not stored yet) is also B's, through a GPU
    prefix hit. B's admission registered 4 at its own position 0 -- below B's cursor,
    never stored by B -- over A's entry; once both freed it and C took it (reported),
    only B's entry was looked at, and A's late walk stored C's full-attention bytes as
    its window block (a review of the first fix). Positions below a request's cursor
    are not registered, and one id keeps every request's entry: A's position 0 is
    stale."""
    rig, a = _hybrid_a(16, cpu=16)
    b = Req("b", 17)
    assert rig.m.lookup(b.view(), 4) == 0
    rig.gpu.touch([0, 4])                                    # B's GPU hit of position 0
    new_b = rig.gpu.allocate(2)
    tables_b = ([0, new_b[0]], [4, new_b[1]])
    rig.m.allocated("b", tables_b, 0)
    rig.step(b.sched(*tables_b, confirmed=4, new=True), allocated=new_b)
    rig.gpu.free([4])
    rig.gpu.free([4])                                        # out of both windows
    got = rig.gpu.allocate(rig.gpu.num_free)                 # C takes 4 (and the rest)
    rig.step(allocated=got)
    rig.gpu.free([x for x in got if x != 4])
    rig.hash([4], [a.h[0]])                                  # C's full block 0
    p = rig.step(a.sched((), (), confirmed=16))
    assert pairs(p.store)[0] == [0, 1, 5, 2, 6, 3, 7]
    assert rig.m._track.reqs["a"].stale == {(1, 0)}


# ---- do_remote_decode -------------------------------------------------------------------


def _remote_setup(params: dict[str, Any] | None) -> tuple[Rig, Req, list[int], StepPlan]:
    """R: 17 tokens; blocks 0-1 a GPU prefix hit (never stored), block 2 in the CPU
    tier (loaded), blocks 3 computed. Returns the plan of the step that lists R with
    12 confirmed tokens (after the load)."""
    rig = Rig()
    r = Req("r", 17, params=params)
    prefix = rig.alloc(2, r.h)                                # [0, 1] cached on the GPU
    [cpu2] = rig.seed_cpu(r.h[2])
    assert rig.m.lookup(r.view(), 8) == 4
    table = prefix + rig.alloc(3)                             # [0, 1, 2, 3, 4]
    rig.m.allocated("r", [table], 4)
    p1 = rig.step()
    assert pairs(p1.load) == ([cpu2], [2])
    rig.ack(p1.load)
    rig.hash([2], [r.h[2]])                                   # the engine caches the loaded block
    p2 = rig.step(r.sched(table, confirmed=12, new=True))
    assert tuple(rig.m.take_load_results()) == (LoadResult("r", True, (), None, 4),)
    return rig, r, table, p2


def test_do_remote_decode_stores_all_blocks() -> None:
    """A P/D prefill must publish its whole KV: with do_remote_decode the GPU prefix
    hits (blocks 0, 1) are stored too; the CPU-loaded block 2 is already in the tier.
    Control: the same request without the flag stores none of its prefix hits."""
    rig, r, table, p2 = _remote_setup(REMOTE)
    assert pairs(p2.store) == ([0, 1], [1, 2])
    rig.ack(p2.store)
    rig.hash([3], [r.h[3]])
    assert not rig.m.finished("r", 17, [table])
    p3 = rig.step()
    assert pairs(p3.store) == ([3], [3])
    rig.ack(p3.store)
    assert all(rig.cpu.is_cached(h) for h in r.h)

    ctl, rc, ctable, c2 = _remote_setup(None)
    assert c2.store is None                                   # cursor starts after the hits
    ctl.hash([3], [rc.h[3]])
    ctl.m.finished("r", 17, [ctable])
    assert pairs(ctl.step().store) == ([3], [1])
    assert not ctl.cpu.is_cached(rc.h[0])


# ---- exact-multiple prompt ---------------------------------------------------------------


def test_exact_multiple_prompt_recomputes_last_token() -> None:
    """An 8-token prompt is exactly two blocks, both in the CPU tier. The hit is capped
    at num_tokens - 1, i.e. one block: the last block is recomputed so the engine has a
    token to compute. Only the first block is pinned."""
    rig = Rig()
    a = Req("a", 8)
    assert rig.seed_cpu(*a.h) == [0, 1]
    assert rig.m.lookup(a.view(), 0) == 4
    assert refs(rig.cpu, [0, 1]) == [1, 0]
    assert rig.m.lookup(a.view(), 4) == 0                      # repeat drops the older pin
    assert refs(rig.cpu, [0, 1]) == [0, 0]
    rig.m.check_invariants()


# ---- preemption --------------------------------------------------------------------------


def test_preempted_request_restarts_cursor() -> None:
    """A (13 tokens, blocks 0-2 full) stores its three blocks in step 2; it is preempted
    in step 3 while the store is in flight, so its GPU blocks stay pinned by the job
    until the ack. The CPU tier then evicts h2 (the tail, first). A resumes with a new
    table [4, 5, 6, 7]: its cursor restarts at 0, so blocks 0 and 1 are found cached and
    block 2 is stored again from its new GPU id 6 -- never from the stale id 2."""
    rig = Rig(cpu=3)
    a = Req("a", 13)
    ga = rig.alloc(4)
    rig.step(a.sched(ga, confirmed=0, new=True))
    rig.hash(ga, a.h)
    p2 = rig.step(a.sched((), confirmed=13))
    assert pairs(p2.store) == ([0, 1, 2], [0, 1, 2])
    rig.step(a.sched((), confirmed=13, preempted=True))
    rig.gpu.free(reversed(ga))                                 # the engine takes them back
    assert refs(rig.gpu, ga) == [1, 1, 1, 0]                   # the job's pins
    rig.ack(p2.store)
    assert refs(rig.gpu, ga) == [0, 0, 0, 0]

    x = Req("x", 4, base=500)
    gx = rig.alloc(1, x.h)
    px = rig.step(x.sched(gx, confirmed=4, new=True))
    assert pairs(px.store) == ([gx[0]], [2])                  # h2's CPU block evicted first
    rig.ack(px.store)
    assert not rig.cpu.is_cached(a.h[2]) and rig.cpu.is_cached(a.h[0])

    ga2 = rig.gpu.allocate(4)
    assert ga2 == [4, 5, 6, 7]
    rig.step(a.sched(ga2, confirmed=0, new=True))
    rig.hash(ga2, a.h)
    cached_before = declined(rig.m, DeclineReason.ALREADY_CACHED)
    p = rig.step(a.sched((), confirmed=13))
    assert pairs(p.store) == ([6], [1])                        # LRU: h1's block is next
    assert declined(rig.m, DeclineReason.ALREADY_CACHED) - cached_before == 2


# ---- reset -------------------------------------------------------------------------------


def test_reset_with_transfers_in_flight() -> None:
    """A store (A) and a load (B) are in flight, C's load is queued and D holds a
    phase-A pin when reset() runs. C fails at once (RESET: no rank has it); D's later
    phase B fails too. B fails too, but its result comes only once every rank acked its
    job: reported at the reset, the host recomputed into B's GPU blocks while a live
    rank still copied the bytes from before the reset over them (a hostile probe). The
    jobs keep their pins until acked, the store's CPU blocks are released uncached,
    nothing new is planned meanwhile, and reset() reports False until both jobs are
    done."""
    rig = Rig(cpu=8)
    b, c, d = Req("b", 5, base=10), Req("c", 5, base=20), Req("d", 5, base=30)
    rig.seed_cpu(b.h[0], c.h[0], d.h[0])                      # CPU 0, 1, 2
    a = Req("a", 8)
    ga = rig.alloc(2, a.h)                                     # [0, 1]
    assert rig.m.lookup(b.view(), 0) == 4
    gb = rig.alloc(2)                                          # [2, 3]
    rig.m.allocated("b", [gb], 4)
    p1 = rig.step(a.sched(ga, confirmed=8, new=True))
    assert pairs(p1.store) == ([0, 1], [3, 4]) and pairs(p1.load) == ([0], [2])
    assert rig.m.lookup(c.view(), 0) == 4
    gc = rig.alloc(2)                                          # [4, 5]
    rig.m.allocated("c", [gc], 4)
    assert rig.m.lookup(d.view(), 0) == 4

    assert rig.m.reset() is False
    rig.m.check_invariants()
    assert not any(rig.cpu.is_cached(h) for h in (b.h[0], c.h[0], d.h[0]))
    assert refs(rig.cpu, [0, 1, 2, 3, 4]) == [1, 0, 0, 1, 1]   # only jobs pin now
    gd = rig.alloc(2)
    rig.m.allocated("d", [gd], 4)
    p2 = rig.step(a.sched((), confirmed=8))
    assert p2.store is None and p2.load is None
    assert set(rig.m.take_load_results()) == {
        LoadResult("c", False, (4,), LoadFailure.RESET, 0),
        LoadResult("d", False, (gd[0],), LoadFailure.RESET, 0)}   # not B: still copied
    assert dict(p2.failed_loads) == {"c": (4,), "d": (gd[0],)}
    assert rig.m.lookup(Req("e", 5, base=40).view(), 0) == 0    # while it drains: counted
    assert rig.m.counters.lookups_during_reset == 1
    rig.m.finished("e", 0, [[]])
    assert rig.m.reset() is False
    rig.ack(p1.store)
    assert rig.m.take_load_results() == [] and refs(rig.gpu, gb) == [2, 1]  # B's copy runs
    rig.ack(p1.load)
    assert rig.m.take_load_results() == [LoadResult("b", False, (2,), LoadFailure.RESET, 0)]
    assert not rig.cpu.is_cached(a.h[0]) and refs(rig.cpu, [0, 3, 4]) == [0, 0, 0]
    assert rig.m.reset() is True
    assert rig.m.counters.jobs_abandoned == 2 and rig.m.pins_held() == 0
    rig.step(a.sched((), confirmed=8))                          # planning resumes
    assert rig.m.take_load_results() == [] and not rig.m.has_pending_work()


# ---- rank failure ------------------------------------------------------------------------


def test_rank_failure_fails_job_but_keeps_pins_until_all_ranks_done() -> None:
    """Three ranks. R's load fails on rank 0: R learns it at once, but ranks 1 and 2
    may still be copying into its GPU blocks, so the pins stay. Rank 2 is declared dead
    (the job fails; the index is dropped, lookups get 0, nothing is planned). When rank 1
    acks, the pins still stay: rank 2 is declared dead but not fenced (a hung rank may
    resume and finish the copy), so its blocks are quarantined. They go when rank 2 is
    fenced (its process exited). A store in flight is never indexed."""
    rig = Rig(world_size=3)
    r = Req("r", 9)
    rig.seed_cpu(*r.h)                                          # CPU 0, 1
    assert rig.m.lookup(r.view(), 0) == 8
    gr = rig.alloc(3)
    rig.m.allocated("r", [gr], 8)
    a = Req("a", 4, base=50)
    ga = rig.alloc(1, a.h)
    p1 = rig.step(a.sched(ga, confirmed=4, new=True))
    assert p1.load is not None and p1.store is not None
    assert (p1.store.job_id, p1.load.job_id) == (1, 2)

    rig.ack(p1.load, ranks=[0], ok=False)
    p2 = rig.step(a.sched((), confirmed=4))
    assert rig.m.take_load_results() == [
        LoadResult("r", False, (0, 1), LoadFailure.WORKER_FAILED, 0)]
    assert p2.load_jobs == {2: ("r",)}
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, gr) == [2, 2, 1]

    rig.ack(p1.store, ranks=[0, 1])
    rig.m.rank_failed(2)
    rig.m.check_invariants()
    assert rig.m.failed and rig.m.counters.jobs_failed == 2
    assert refs(rig.gpu, gr) == [2, 2, 1]                       # rank 1 has not acked the load
    assert rig.cpu.ref_cnt(2) == 1 and not rig.cpu.is_cached(a.h[0])   # quarantined, not indexed
    assert rig.m.lookup(r.view(), 0) == 0
    assert rig.step(a.sched((), confirmed=4)).store is None

    rig.ack(p1.load, ranks=[1])
    # rank 2 was declared dead, not fenced: it may still be writing gr -> quarantined
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, gr) == [2, 2, 1]
    assert rig.m.quarantined_blocks() == (3, 3) and not rig.m.has_pending_work()
    assert rig.step().load_jobs == {}       # waits only for rank 2: no longer listed
    assert rig.m.reset() is True            # nothing will move a quarantined job
    rig.m.rank_fenced(2)                                        # its process is gone
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1, 2]) == [0, 0, 0] and refs(rig.gpu, gr) == [1, 1, 1]
    assert not rig.cpu.is_cached(a.h[0])                        # a failed store is not indexed
    assert rig.m.quarantined_blocks() == (0, 0)
    rig.m.on_done(2, 2, True)                                   # late ack from the dead rank
    assert rig.m.counters.acks_unknown == 1 and rig.m.pins_held() == 0


def test_load_result_waits_for_every_rank() -> None:
    """Two ranks: rank 0's successful ack alone completes nothing -- rank 1 may still be
    writing the destination blocks. The result and the unpinning come with rank 1."""
    rig = Rig(world_size=2)
    r = Req("r", 9)
    rig.seed_cpu(*r.h)
    assert rig.m.lookup(r.view(), 0) == 8
    gr = rig.alloc(3)
    rig.m.allocated("r", [gr], 8)
    p1 = rig.step()
    rig.ack(p1.load, ranks=[1])
    p2 = rig.step()
    assert rig.m.take_load_results() == [] and p1.load is not None
    assert p2.load_jobs == {p1.load.job_id: ("r",)}
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, gr) == [2, 2, 1]
    rig.ack(p1.load, ranks=[0])
    p3 = rig.step()
    assert rig.m.take_load_results() == [LoadResult("r", True, (), None, 8)]
    assert p3.load_jobs == {}
    assert rig.m.pins_held() == 0


# ---- LRU order ---------------------------------------------------------------------------


def test_prefix_tail_evicted_before_head() -> None:
    """A's four blocks are stored; completion frees their CPU blocks tail first, so the
    LRU order is h3, h2, h1, h0. When B needs one CPU block, h3's goes: A's prefix still
    hits three blocks. (Forward-order frees would evict h0 and make the rest useless.)
    A load's completion frees its sources tail first too."""
    rig = Rig(cpu=4)
    a = Req("a", 17)
    ga = rig.alloc(4, a.h)
    p1 = rig.step(a.sched(ga, confirmed=16, new=True))
    rig.ack(p1.store)
    assert list(rig.cpu.iter_free_from_lru()) == [3, 2, 1, 0]
    b = Req("b", 4, base=99)
    gb = rig.alloc(1, b.h)
    p2 = rig.step(b.sched(gb, confirmed=4, new=True))
    assert pairs(p2.store) == (gb, [3])
    rig.ack(p2.store)
    assert [rig.cpu.is_cached(h) for h in a.h] == [True, True, True, False]

    r = Req("r", 17)
    assert rig.m.lookup(r.view(), 0) == 12
    rig.m.allocated("r", [rig.alloc(5)], 12)
    p3 = rig.step()
    rig.ack(p3.load)
    assert list(rig.cpu.iter_free_from_lru()) == [3, 2, 1, 0]   # B's block, then A's tail first


# ---- concurrent loads --------------------------------------------------------------------


def test_concurrent_load_same_prefix_asks_again() -> None:
    """A and B share a prefix in the CPU tier. A's load is queued (phase B done), so B's
    lookup gets None and pins nothing: once A's blocks land, B will find them as a GPU
    hit instead of loading them a second time. A mere phase-A pin does not block B."""
    rig = Rig()
    a, b, c = Req("a", 9), Req("b", 9), Req("c", 9)
    rig.seed_cpu(*a.h)
    assert rig.m.lookup(a.view(), 0) == 8
    assert rig.m.lookup(c.view(), 0) == 8                       # only pinned: fine
    rig.m.finished("c", 0, [[]])
    rig.m.allocated("a", [rig.alloc(3)], 8)
    assert rig.m.lookup(b.view(), 0) is None
    assert refs(rig.cpu, [0, 1]) == [1, 1]                      # A's pins only
    assert rig.m.counters.lookups_asked_again == 1
    p = rig.step()
    assert rig.m.lookup(b.view(), 0) is None                    # still loading
    rig.ack(p.load)
    assert rig.m.lookup(b.view(), 0) == 8
    rig.m.check_invariants()


# ---- finish ------------------------------------------------------------------------------


def test_request_finished_frees_pins() -> None:
    """A finishes between phases A and B: its pin goes. B finishes with its load queued:
    the load is cancelled and every pin goes. C finishes while its load job runs: the
    job keeps its pins (a worker is copying) and releases them when acked."""
    rig = Rig()
    a, b, c = Req("a", 9), Req("b", 9), Req("c", 9)
    rig.seed_cpu(*a.h)
    assert rig.m.lookup(a.view(), 0) == 8
    assert refs(rig.cpu, [0, 1]) == [1, 1]
    assert rig.m.finished("a", 0, [[]]) is False
    assert refs(rig.cpu, [0, 1]) == [0, 0]

    assert rig.m.lookup(b.view(), 0) == 8
    gb = rig.alloc(3)
    rig.m.allocated("b", [gb], 8)
    assert refs(rig.gpu, gb) == [2, 2, 1]
    rig.m.finished("b", 0, [gb])
    rig.gpu.free(reversed(gb))
    assert refs(rig.cpu, [0, 1]) == [0, 0] and refs(rig.gpu, gb) == [0, 0, 0]
    rig.m.check_invariants()

    assert rig.m.lookup(c.view(), 0) == 8
    gc = rig.alloc(3)
    rig.m.allocated("c", [gc], 8)
    p = rig.step()
    rig.m.finished("c", 0, [gc])
    rig.gpu.free(reversed(gc))
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, gc) == [1, 1, 0]
    rig.ack(p.load)
    assert rig.m.pins_held() == 0 and refs(rig.gpu, gc) == [0, 0, 0]


def test_reused_request_id_never_gets_the_ended_requests_load_result() -> None:
    """The hazard: results name only a request id. A loads prefix P (CPU 0-1 -> GPU
    ga[0:2], job 1) and finishes while job 1 runs; a new request reuses id "a" for
    prompt Q (CPU 2-3, so its lookup is not asked to wait for job 1) and its load goes
    out as job 2 into gq[0:2]. Job 1 completes first: the manager reported
    ``LoadResult("a", ok)``, which the Engine handed to the new A's ``wait_loaded``
    while job 2 was still writing gq -- the forward would read KV not yet there. Now
    the ended request's outcome is superseded (counted, not reported) and the new A
    hears only of job 2."""
    rig = Rig(cpu=8, gpu=16)
    p_req, q_req = Req("a", 9), Req("a", 9, base=1000)
    rig.seed_cpu(*p_req.h)                                      # CPU 0, 1
    rig.seed_cpu(*q_req.h)                                      # CPU 2, 3
    assert rig.m.lookup(p_req.view(), 0) == 8
    ga = rig.alloc(3)
    rig.m.allocated("a", [ga], 8)
    p1 = rig.step(p_req.sched(ga, confirmed=0, new=True))
    assert pairs(p1.load) == ([0, 1], ga[:2]) and p1.load is not None
    rig.m.finished("a", 0, [ga])
    rig.gpu.free(reversed(ga))

    assert rig.m.lookup(q_req.view(), 0) == 8
    gq = rig.alloc(3)
    rig.m.allocated("a", [gq], 8)
    p2 = rig.step(q_req.sched(gq, confirmed=0, new=True))
    assert pairs(p2.load) == ([2, 3], gq[:2]) and p2.load is not None
    assert (p1.load.job_id, p2.load.job_id) == (1, 2)

    rig.ack(p1.load)
    assert rig.m.take_load_results() == []                     # job 2 still writing gq
    assert rig.m.counters.load_results_superseded == 1
    assert refs(rig.cpu, [0, 1]) == [0, 0] and refs(rig.gpu, ga[:2]) == [0, 0]
    rig.ack(p2.load)
    assert rig.m.take_load_results() == [LoadResult("a", True, (), None, 8)]
    rig.m.finished("a", 8, [gq])
    rig.gpu.free(reversed(gq))
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()


def test_readmitted_request_never_gets_its_earlier_loads_result() -> None:
    """The same hazard without an end: R's load (job 1: CPU 0-1 -> gr[0:2]) is in flight
    when the engine preempts R and admits it again with a longer local prefix, so its
    new hit (CPU 2, the third block) shares no block with job 1 and is not asked to
    wait; its load goes out as job 2. Job 1's ack must not tell R "loaded" while job 2
    writes: a new phase B supersedes the older load's outcome."""
    rig = Rig(cpu=8, gpu=16)
    r = Req("r", 13)
    rig.seed_cpu(*r.h)                                          # CPU 0, 1, 2
    assert rig.m.lookup(r.view(), 0) == 12
    gr = rig.alloc(4)
    rig.m.allocated("r", [gr], 8)                               # only 2 blocks accepted
    p1 = rig.step(r.sched(gr, confirmed=0, new=True))
    assert pairs(p1.load) == ([0, 1], gr[:2]) and p1.load is not None
    g2 = rig.alloc(4)                                           # preempted, re-admitted
    assert rig.m.lookup(r.view(), 8) == 4                       # local 8: CPU 2 only
    rig.m.allocated("r", [g2], 4)
    p2 = rig.step(r.sched(g2, confirmed=0, new=True, preempted=True))
    assert pairs(p2.load) == ([2], [g2[2]]) and p2.load is not None
    rig.ack(p1.load)
    assert rig.m.take_load_results() == []
    rig.ack(p2.load)
    assert rig.m.take_load_results() == [LoadResult("r", True, (), None, 4)]
    assert rig.m.counters.load_results_superseded == 1
    rig.m.check_invariants()


def test_vllms_zero_token_phase_b_after_an_async_load_keeps_its_result() -> None:
    """vLLM's own second phase B: a request whose asynchronous load finished on this
    rank is allocated again with 0 external tokens while the load's acks may still be
    on their way. That call is neither refused (as a second phase B with tokens is)
    nor does it supersede the load: its outcome is still reported."""
    rig = Rig()
    r = Req("r", 9)
    rig.seed_cpu(*r.h)
    assert rig.m.lookup(r.view(), 0) == 8
    g = rig.alloc(3)
    rig.m.allocated("r", [g], 8)
    p = rig.step(r.sched(g, confirmed=0, new=True))
    assert p.load is not None
    rig.m.allocated("r", [g], 0)                                # not refused
    assert rig.m.counters.invalid_calls == 0
    rig.ack(p.load)
    assert rig.m.take_load_results() == [LoadResult("r", True, (), None, 8)]
    assert rig.m.counters.load_results_superseded == 0
    rig.m.check_invariants()


def test_two_groups_naming_one_gpu_block_store_it_once() -> None:
    """The hazard: two full-attention groups whose tables name the same GPU blocks
    (0, 1) at the same positions (bad input the checks let through: repeats are
    refused within a table only). The store walk picked each block once per group, so
    job 1 listed GPU 0 and 1 twice; its completion failed an internal assertion before
    releasing anything: CPU 0-3 stayed pinned for good and the GPU blocks at ref 3
    while ``pins_held()`` said 0. Now a block a position already picked is declined
    (IN_FLIGHT) for the next group: the job stores each once and releases all."""
    rig = Rig(cpu=16, gpu=16, groups=(KVGroup.full(), KVGroup.full()))
    a = Req("a", 9)
    shared = rig.gpu.allocate(2)
    p = rig.step(a.sched(shared, shared, confirmed=9, new=True))
    assert p.store is not None
    src, dst = pairs(p.store)
    assert src == shared and len(dst) == 2                     # each block once (group 0)
    assert declined(rig.m, DeclineReason.IN_FLIGHT) == 2
    assert refs(rig.gpu, shared) == [2, 2]
    rig.ack(p.store)
    assert refs(rig.gpu, shared) == [1, 1] and refs(rig.cpu, dst) == [0, 0]
    rig.m.finished("a", 9, [shared, shared])
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()


def test_partial_acceptance_releases_unused_pins() -> None:
    """Three blocks are offered and pinned; the engine accepts 4 tokens (one block).
    Only CPU block 0 is loaded, into GPU block 0; blocks 1 and 2 are released at once."""
    rig = Rig()
    a = Req("a", 13)
    rig.seed_cpu(*a.h)
    assert rig.m.lookup(a.view(), 0) == 12
    assert refs(rig.cpu, [0, 1, 2]) == [1, 1, 1]
    ga = rig.alloc(4)
    rig.m.allocated("a", [ga], 4)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1, 2]) == [1, 0, 0] and refs(rig.gpu, ga) == [2, 1, 1, 1]
    p = rig.step()
    assert pairs(p.load) == ([0], [0])
    rig.m.finished("a", 0, [ga])
    rig.ack(p.load)
    assert rig.m.pins_held() == 0


def test_last_block_stored_when_request_finishes() -> None:
    """A decodes; the step that completes its third block is its last, and a finished
    request is never listed again. finished() pins that block (GPU ref 2, then 1 when
    the engine frees it) and the next build_step stores it; has_pending_work() keeps
    the engine stepping until the ack."""
    rig = Rig()
    a = Req("a", 12)
    ga = rig.alloc(3, a.h[:2])
    p1 = rig.step(a.sched(ga, confirmed=8, new=True))
    rig.ack(p1.store)
    rig.hash([ga[2]], [a.h[2]])
    assert rig.m.finished("a", 12, [ga]) is False
    assert refs(rig.gpu, ga) == [1, 1, 2]
    rig.gpu.free(reversed(ga))
    assert refs(rig.gpu, ga) == [0, 0, 1] and rig.m.has_pending_work()
    p2 = rig.step()
    assert pairs(p2.store) == ([2], [2])
    rig.ack(p2.store)
    assert rig.cpu.get_cached(a.h[2]) == 2 and rig.m.pins_held() == 0
    assert not rig.m.has_pending_work()


def test_prefill_only_remote_decode_request_stores_everything_at_finish() -> None:
    """A P/D prefill request is listed once (0 confirmed: its prefill runs in that step)
    and finishes right after, never listed again. finished() with its final count pins
    all four full blocks, GPU prefix hit included, and the next step stores them all."""
    rig = Rig()
    r = Req("r", 18, params=REMOTE)
    hit = rig.alloc(1, r.h)                                     # [0], a GPU prefix hit
    assert rig.m.lookup(r.view(), 4) == 0
    table = hit + rig.alloc(4)                                  # [0, 1, 2, 3, 4]
    rig.m.allocated("r", [table], 0)
    p1 = rig.step(r.sched(table, confirmed=4, new=True))
    assert p1.store is not None and pairs(p1.store) == ([0], [0])
    rig.hash(table[1:], r.h[1:])
    rig.m.finished("r", 18, [table])
    assert refs(rig.gpu, table) == [2, 2, 2, 2, 1]
    rig.gpu.free(reversed(table))
    p2 = rig.step()
    assert pairs(p2.store) == ([1, 2, 3], [1, 2, 3])
    rig.ack(p1.store)
    rig.ack(p2.store)
    assert all(rig.cpu.is_cached(h) for h in r.h) and rig.m.pins_held() == 0


def test_phase_b_without_pin_reports_failed_load() -> None:
    """The engine accepts external tokens the manager holds no pin for: a request never
    looked up (all its table ids fail: recompute from the start), and one whose pin a
    reset dropped between phases (exactly the hit's destinations fail). Each gets a
    failed LoadResult and a failed_loads entry at once -- never a request left waiting.
    The tokens "a" claimed were never offered: they are not a hit. ``hit_tokens`` (the
    headline metric) counted them -- any value a caller passed, 2**62 in a hostile
    probe; now only "b"'s 8, offered and accepted, count, and "a" is
    ``phase_b_unoffered``."""
    rig = Rig()
    b = Req("b", 9, base=40)
    rig.m.allocated("a", [[3, 4, 5]], 8)
    rig.seed_cpu(*b.h)
    assert rig.m.lookup(b.view(), 0) == 8
    assert rig.m.reset() is True
    gb = rig.alloc(3)
    rig.m.allocated("b", [gb], 8)
    rig.m.check_invariants()
    p = rig.step()
    assert p.load is None and tuple(rig.m.take_load_results()) == (
        LoadResult("a", False, (3, 4, 5), LoadFailure.NO_PIN, 0),
        LoadResult("b", False, tuple(gb[:2]), LoadFailure.RESET, 0))
    assert dict(p.failed_loads) == {"a": (3, 4, 5), "b": tuple(gb[:2])}
    assert rig.m.counters.loads_failed == 2 and rig.m.pins_held() == 0
    assert (rig.m.counters.hit_tokens, rig.m.counters.phase_b_unoffered) == (8, 1)


def test_a_kept_plan_does_not_change_when_a_later_load_fails() -> None:
    """An engine may keep a plan past the next call. A step with no failed loads used to
    hand out the manager's live (empty) dict, which the next failure then filled: step
    1's plan grew step 2's failure for "a" (destinations 3, 4, 5)."""
    rig = Rig()
    p1 = rig.step()
    rig.m.allocated("a", [[3, 4, 5]], 8)  # never looked up: no pin, fails at once
    p2 = rig.step()
    assert dict(p2.failed_loads) == {"a": (3, 4, 5)}
    assert dict(p1.failed_loads) == {}
    with pytest.raises(TypeError):  # read-only: nobody can write into the shared empty one
        p1.failed_loads["x"] = (1,)  # type: ignore[index]
    assert dict(rig.step().failed_loads) == {}
    assert rig.m.counters.loads_failed == 1 and rig.m.pins_held() == 0


def test_accepting_more_than_offered_is_a_config_error() -> None:
    """Phase B accepting more tokens than phase A offered is an engine bug: ConfigError,
    and the pin stays intact (the engine may still finish or retry the request)."""
    rig = Rig()
    a = Req("a", 9)
    rig.seed_cpu(*a.h)
    assert rig.m.lookup(a.view(), 4) == 4
    with pytest.raises(ConfigError, match="offered"):
        rig.m.allocated("a", [rig.alloc(3)], 8)
    assert refs(rig.cpu, [0, 1]) == [0, 1]
    rig.m.finished("a", 0, [[]])
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()


@pytest.mark.parametrize("drop", ["reset", "rank_failed"])
def test_accepting_more_than_offered_after_the_hit_was_dropped_is_refused(drop: str) -> None:
    """The hazard: ``lookup`` offered 8 tokens; ``reset()`` (or rank 0's death) dropped
    the hit's pins and left a tombstone; ``allocated("a", [[1, 2, 3]], 2**62)`` then
    skipped the "more than offered" check (it ran for live hits only) and walked the
    accepted range to name the failed blocks: it never returned (4 x 10**7 took 0.7
    s). The tombstone keeps the offer, the check runs first, and nothing changed; the
    offered 8 are still accepted and fail with the drop's cause, blocks 1 and 2. (10**6
    here: the old code accepted it in milliseconds instead of hanging the test.)"""
    rig = Rig()
    a = Req("a", 9)
    rig.seed_cpu(*a.h)
    assert rig.m.lookup(a.view(), 0) == 8
    rig.m.reset() if drop == "reset" else rig.m.rank_failed(0)
    with pytest.raises(ConfigError, match="1000000 accepted, 8 offered"):
        rig.m.allocated("a", [[1, 2, 3]], 10**6)
    assert rig.m.counters.invalid_calls == 1 and rig.m.take_load_results() == []
    rig.m.allocated("a", [[1, 2, 3]], 8)
    [res] = rig.m.take_load_results()
    assert not res.ok and res.failed_block_ids == (1, 2)
    assert res.cause is (LoadFailure.RESET if drop == "reset" else LoadFailure.RANK_DIED)
    assert rig.m.pins_held() == 0


def test_a_load_into_a_block_a_store_in_flight_reads_is_refused() -> None:
    """The hazard: request a's store job reads GPU 0 and 1 (pinned by kvshm, in
    flight); an engine that hands those blocks to request b anyway (a bug: they are
    pinned) had b's load planned into them, so on a GPU the load (H2D stream) could
    overwrite them while the store (D2H stream) still read them, and the CPU tier would
    cache b's bytes under a's hash. Phase B refuses such a destination, naming it, and
    changes nothing; once the store is acked the same call is accepted."""
    rig = Rig()
    a, b = Req("a", 9), Req("b", 9, base=500)
    rig.seed_cpu(b.h[0], b.h[1])
    g = rig.alloc(3)
    p1 = rig.step(a.sched(g, confirmed=8, new=True))
    assert p1.store is not None and pairs(p1.store) == ([0, 1], [2, 3])  # (GPU, CPU)
    assert rig.m.lookup(b.view(), 0) == 8
    with pytest.raises(ConfigError, match=r"gpu_block_ids\[0\]\[0\]: GPU block 0 is read"):
        rig.m.allocated("b", [[0, 1, 5]], 8)
    assert refs(rig.cpu, [0, 1]) == [1, 1]  # b's hit still pinned: nothing changed
    rig.m.on_done(p1.store.job_id, 0, True)
    rig.m.allocated("b", [[6, 7, 5]], 8)
    assert pairs(rig.step().load) == ([0, 1], [6, 7])  # (CPU, GPU)
    rig.m.check_invariants()


# ---- a listing that does not match what the manager tracks -----------------------------


def test_a_finished_request_listed_again_with_only_its_new_ids_is_refused() -> None:
    """Request x (4 blocks, hashes h0..h3) is listed new with GPU table [0, 1, 2] and
    ends before any token is confirmed; the engine frees its blocks and allocates GPU 3
    for someone else. A faulty engine then lists x once more as a decode step would:
    one id appended (3), 12 tokens confirmed, neither new nor preempted.

    The manager knew no table of x any more and took the appended id as x's whole table
    from position 0: it stored GPU 3 -- which never held x's block 0 -- under h0, and a
    later request sharing x's first block loaded those bytes as its prefix. The same
    stale listing also left a tracking record behind (watch 1) against which a new
    request under the id x had its end refused, so its pins were held for good.

    Now such a listing (an id the manager does not track, with only new ids) is refused:
    InvalidRequest, nothing changed, nothing stored; and a new request under the id
    then runs and ends with every pin released."""
    rig = Rig(cpu=8, gpu=16)
    x = Req("x", 16)
    gx = rig.alloc(3, x.h[:3])                                   # [0, 1, 2]
    assert rig.step(x.sched(gx, confirmed=0, new=True)).store is None
    rig.m.finished("x", 0, [gx])
    rig.gpu.free(gx)
    other = rig.alloc(1)                                        # GPU 3, someone else's
    assert other == [3]
    before = manager_state(rig.m)
    with pytest.raises(InvalidRequest, match="new_or_resumed: listed with only its new"):
        rig.step(ScheduledRequest("x", x.h, 16, ((3,),), False, 12, False))
    assert manager_state(rig.m) == before
    assert "x" not in rig.m._track.reqs and "x" not in rig.m._track.watch
    plan = rig.step()                                           # the next step: nothing
    assert plan.store is None and rig.cpu.get_cached(x.h[0]) is None

    # a new request under the id x: its hit is pinned, loaded and released at its end
    x2 = Req("x", 9, base=500)
    assert rig.seed_cpu(x2.h[1]) == [0]
    g2 = rig.alloc(1, x2.h[:1]) + rig.alloc(2)                  # its own GPU hit: [4, 5, 6]
    assert rig.m.lookup(x2.view(), 4) == 4 and rig.m.pins_held() == 1
    rig.m.allocated("x", [g2], 4)
    assert refs(rig.cpu, [0]) == [1]
    load = rig.step(x2.sched(g2, confirmed=4, new=True)).load
    assert load is not None and pairs(load) == ([0], [5])       # CPU 0 -> GPU 5
    rig.ack(load)
    rig.m.finished("x", 4, [g2], block_hashes=x2.h)             # accepted: its own hashes
    assert rig.m.pins_held() == 0 and refs(rig.cpu, [0]) == [0]


def test_a_failed_manager_takes_any_listing_of_a_request_it_never_tracked() -> None:
    """Once a rank died the manager plans nothing and tracks no request it admits: a
    request listed new then has no table kept, and its next decode-step listing (one id
    appended, neither new nor preempted) must still be taken -- refusing it would refuse
    every later step of an engine that only recomputes now (the stateful machine found
    this when the check above first refused it)."""
    rig = Rig(cpu=8, gpu=16)
    rig.m.rank_failed(0)
    a = Req("a", 12)
    ga = rig.alloc(2, a.h[:2])
    assert rig.step(a.sched(ga, confirmed=8, new=True)).store is None
    assert "a" not in rig.m._track.watch
    more = rig.alloc(1)
    plan = rig.step(ScheduledRequest("a", a.h, 12, ((more[0],),), False, 12, False))
    assert plan.store is None and plan.load is None
    rig.m.finished("a", 12, [ga + more])
    assert rig.m.pins_held() == 0


def test_a_preemption_listing_of_a_request_not_tracked_makes_no_record() -> None:
    """The sibling of the test above (a review): the ended request x is listed as
    preempted first. That listing made a record for x (an empty table, watched), so the
    decode-step listing that follows was taken -- its appended id as x's table from
    position 0 -- and the stale record refused the end of a new request under the id.
    Now a preemption of a request the manager does not track changes nothing: the
    decode-step listing after it is refused, and the new request ends cleanly."""
    rig = Rig(cpu=8, gpu=16)
    x = Req("x", 16)
    gx = rig.alloc(3, x.h[:3])
    rig.step(x.sched(gx, confirmed=0, new=True))
    rig.m.finished("x", 0, [gx])
    rig.gpu.free(gx)
    assert rig.alloc(1) == [3]
    before = manager_state(rig.m)
    rig.step(ScheduledRequest("x", (), 0, ((),), preempted=True))
    assert "x" not in rig.m._track.reqs and "x" not in rig.m._track.watch
    with pytest.raises(InvalidRequest, match="new_or_resumed: listed with only its new"):
        rig.step(ScheduledRequest("x", x.h, 16, ((3,),), False, 12, False))
    assert {k: v for k, v in manager_state(rig.m).items() if k != "last_step"} == \
        {k: v for k, v in before.items() if k != "last_step"}
    x2 = Req("x", 9, base=500)
    rig.m.finished("x", 8, [rig.alloc(3)], block_hashes=x2.h)   # accepted
    assert rig.m.pins_held() == 0
