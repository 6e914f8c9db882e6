"""Bad input to the scheduler-side calls: refused whole, before anything changes.

Each hazard test replays a call an attacker made through the public API that used to
be *half applied* -- the manager changed some of its state, then raised (or raised
nothing and failed later) -- and shows that the call is now refused with one
``InvalidRequest`` while the manager stays exactly as it was: every pool's ref counts,
free-queue (LRU) order and hashes, the hits, the load queue, the in-flight marks, the
jobs, the tracker's tables and cursors, and every counter but ``invalid_calls``
(:func:`manager_state`). Then the same request, sent correctly, goes through and ends
with no pin left. Same rig as test_manager_hazards.py: real pools, tiny sizes, exact
block ids and ref counts (:mod:`manager_rig`, which also holds the snapshot).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from engine_rig import BS as ENGINE_BS
from engine_rig import Client, embedded_engine, tokens
from manager_rig import BS, Req, Rig, manager_state, pairs, refs

from kvshm.config import Eviction
from kvshm.engine import EngineState
from kvshm.errors import ConfigError, InvalidRequest
from kvshm.hashing import chain_hashes
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.types import (
    KVGroup,
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
    no_new_blocks,
)

# ---- refusals ------------------------------------------------------------------------


def refused(m: OffloadManager, call: Callable[..., object], *args: Any,
            **kw: Any) -> InvalidRequest:
    """``call(*args, **kw)`` raises InvalidRequest and changes nothing but
    ``invalid_calls`` (+1); the manager's invariants still hold."""
    before = manager_state(m)
    n_invalid = m.counters.invalid_calls
    with pytest.raises(InvalidRequest) as info:
        call(*args, **kw)
    assert manager_state(m) == before
    assert m.counters.invalid_calls == n_invalid + 1
    m.check_invariants()
    return info.value


def sched(rid: str, hashes: Sequence[Any], n_tokens: int, *tables: Sequence[Any],
          confirmed: int, new: bool = True) -> ScheduledRequest:
    return ScheduledRequest(rid, hashes, n_tokens, tuple(tuple(t) for t in tables), new,
                            confirmed)


# ---- one test per reported hazard ----------------------------------------------------------


def test_bad_call_half_applied_step_non_bytes_hashes() -> None:
    """L's 2-block prefix (CPU 0, 1) is being loaded into GPU 0, 1 (job 1 in flight)
    when a step lists A (9 tokens, GPU 3, 4, 5 not hashed yet) with str "hashes". The
    step used to plan a store of GPU 3, 4 under the str keys; its completion then
    raised inside the done callback after the job had left the table: 2 CPU and 2 GPU
    pins with no record (pins_held 0, check_invariants failing). Now the step is
    refused and names A and the entry; job 1 still completes, and A listed with its
    real hashes is stored."""
    rig = Rig()
    lo, a = Req("l", 9, base=100), Req("a", 9)
    assert rig.seed_cpu(lo.h[0], lo.h[1]) == [0, 1]
    assert rig.m.lookup(lo.view(), 0) == 8
    gl = rig.alloc(3)                                          # [0, 1, 2]
    rig.m.allocated("l", [gl], 8)
    p1 = rig.step(lo.sched(gl, confirmed=0, new=True))
    assert pairs(p1.load) == ([0, 1], [0, 1]) and p1.load is not None
    ga = rig.alloc(3)                                          # [3, 4, 5], unhashed
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, [0, 1, 2, 3, 4, 5]) == [2, 2, 1, 1, 1, 1]

    bad = sched("a", ["h0", "h1"], 9, ga, confirmed=9)
    err = refused(rig.m, rig.m.build_step, StepInput(2, [lo.sched((), confirmed=0), bad]))
    assert (err.req_id, err.field) == ("a", "block_hashes[0]") and "bytes" in str(err)
    assert refs(rig.cpu, [0, 1]) == [1, 1] and refs(rig.gpu, [0, 1, 2, 3, 4, 5]) == [2, 2, 1, 1, 1, 1]
    assert rig.m.pins_held() == 4 and rig.m.num_jobs_in_flight == 1

    rig.ack(p1.load)
    p2 = rig.step(lo.sched((), confirmed=8), a.sched(ga, confirmed=9, new=True))
    assert tuple(rig.m.take_load_results()) == (LoadResult("l", True, (), None, 8),)
    assert pairs(p2.store) == ([3, 4], [2, 3])
    rig.ack(p2.store)
    assert rig.cpu.get_cached(a.h[0]) == 2 and rig.cpu.get_cached(a.h[1]) == 3
    assert rig.m.pins_held() == 0 and refs(rig.gpu, [0, 1, 2, 3, 4, 5]) == [1] * 6


def test_bad_call_half_applied_allocated_out_of_range_gpu_id() -> None:
    """R's 7 blocks are all in the CPU tier (CPU 0-6); its lookup pins them. Phase B
    names GPU id 16 in a 16-block pool. That used to raise after the hit was removed
    and the CPU blocks touched: 7 CPU blocks pinned for good with no record. Now it is
    refused with the hit and its 7 pins as they were; the right table then loads them
    and every pin goes."""
    rig = Rig(cpu=8, gpu=16)
    r = Req("r", 29)
    assert rig.seed_cpu(*r.h) == [0, 1, 2, 3, 4, 5, 6]
    assert rig.m.lookup(r.view(), 0) == 28
    assert refs(rig.cpu, range(7)) == [1] * 7
    table = rig.alloc(8)                                       # [0 .. 7]
    bad = table[:6] + [16] + table[7:]
    err = refused(rig.m, rig.m.allocated, "r", [bad], 28)
    assert (err.req_id, err.field) == ("r", "gpu_block_ids[0][6]") and "16 blocks" in str(err)
    assert refs(rig.cpu, range(7)) == [1] * 7 and rig.m.pins_held() == 7

    rig.m.allocated("r", [table], 28)
    p = rig.step()
    assert pairs(p.load) == ([0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6])
    rig.ack(p.load)
    rig.step()
    assert rig.m.take_load_results() == [LoadResult("r", True, (), None, 28)]
    assert refs(rig.cpu, range(7)) == [0] * 7 and rig.m.pins_held() == 0


def test_bad_call_half_applied_finished_out_of_range_id() -> None:
    """A (13 tokens, GPU 0-3, blocks 0-2 hashed) is tracked with nothing stored yet.
    Its ``finished`` names GPU id 8 (pool of 8) at position 1. The finish-time store
    used to mark GPU 0 in flight and then raise: A forgotten, block 0 marked for a
    store that never comes, so it was never stored again. Now it is refused; the right
    call then stores blocks 0, 1, 2."""
    rig = Rig(cpu=8, gpu=8)
    a = Req("a", 13)
    ga = rig.alloc(4, a.h)                                     # [0, 1, 2, 3]
    rig.step(a.sched(ga, confirmed=0, new=True))
    err = refused(rig.m, rig.m.finished, "a", 13, [[0, 8, 2, 3]])
    assert (err.req_id, err.field) == ("a", "gpu_block_ids[0][1]")
    assert rig.m._stores.marks.gpu == set() and "a" in rig.m._track.reqs

    assert rig.m.finished("a", 13, [ga]) is False
    rig.m.check_invariants()
    assert refs(rig.gpu, ga) == [2, 2, 2, 1]
    p = rig.step()
    assert pairs(p.store) == ([0, 1, 2], [0, 1, 2])
    rig.ack(p.store)
    assert [rig.cpu.get_cached(h) for h in a.h] == [0, 1, 2]
    assert refs(rig.gpu, ga) == [1, 1, 1, 1] and rig.m.pins_held() == 0


def test_bad_call_finished_with_a_table_the_steps_never_listed() -> None:
    """A (13 tokens) was listed with GPU 0-3, nothing stored yet. Its ``finished``
    names GPU 4-7 instead -- another request's blocks. The finish-time store used to
    take them: GPU 4, 5, 6 stored under A's hashes, their bytes served to every later
    hit of A's prefix (found by a hostile probe: a wrong block loaded ``ok``). Now the
    call is refused at the first position the steps listed otherwise, nothing pinned or
    forgotten; the right call stores GPU 0, 1, 2."""
    rig = Rig(cpu=8, gpu=8)
    a = Req("a", 13)
    ga = rig.alloc(4, a.h)                                     # [0, 1, 2, 3]
    other = rig.alloc(4)                                       # [4, 5, 6, 7]
    rig.step(a.sched(ga, confirmed=0, new=True))
    before = manager_state(rig.m)
    err = refused(rig.m, rig.m.finished, "a", 13, [other])
    assert (err.req_id, err.field) == ("a", "gpu_block_ids[0][0]")
    assert "block 4 where the steps listed 0" in str(err)
    assert manager_state(rig.m) == before and "a" in rig.m._track.reqs
    assert refs(rig.gpu, ga + other) == [1] * 8

    assert rig.m.finished("a", 13, [ga]) is False
    p = rig.step()
    assert pairs(p.store) == ([0, 1, 2], [0, 1, 2])
    rig.ack(p.store)
    assert [rig.cpu.get_cached(h) for h in a.h] == [0, 1, 2] and rig.m.pins_held() == 0


def test_bad_call_finished_with_hashes_that_rename_the_listed_ones() -> None:
    """A (13 tokens, GPU 0-3) was listed with only its first two hashes (the engine's
    sequence lacked the third), nothing stored yet. Its ``finished`` passes
    ``block_hashes`` whose position 1 is B's hash instead of A's. The finish-time store
    used to take them: GPU 1 (A's bytes) stored under B's hash, served to every later
    hit of B's prefix. Now refused at position 1, nothing changed; the finish that only
    adds the third hash stores GPU 0, 1, 2 under A's three."""
    rig = Rig(cpu=8, gpu=8)
    a, b = Req("a", 13), Req("b", 13, base=100)
    ga = rig.alloc(4, a.h)                                     # [0, 1, 2, 3]
    rig.step(ScheduledRequest("a", a.h[:2], 13, (tuple(ga),), True, 0))
    before = manager_state(rig.m)
    renamed = [a.h[0], b.h[1], a.h[2]]
    err = refused(rig.m, rig.m.finished, "a", 13, [ga], block_hashes=renamed)
    assert (err.req_id, err.field) == ("a", "block_hashes[1]")
    assert "a finish may add hashes, not change them" in str(err)
    assert manager_state(rig.m) == before and "a" in rig.m._track.reqs

    assert rig.m.finished("a", 13, [ga], block_hashes=list(a.h)) is False
    p = rig.step()
    assert pairs(p.store) == ([0, 1, 2], [0, 1, 2])
    rig.ack(p.store)
    assert [rig.cpu.get_cached(h) for h in a.h] == [0, 1, 2]
    assert rig.cpu.get_cached(b.h[1]) is None and rig.m.pins_held() == 0


def test_bad_call_step_lists_a_request_it_reports_ended() -> None:
    """X ran (GPU 0-2, listed), then ended without ``finished()``: its end was due in
    the next step's ``finished``. Before that step a new request reused the id "x":
    its lookup pinned CPU 0-1 (8 tokens) and its phase B queued a load into GPU 3-4.
    The step then listed the new "x" *and* reported "x" ended: the end, applied after
    the listing's check, dropped the new request's queued load -- no load planned, no
    failed result, its waiter told "no load pending" (found by a fuzzer). Now that step
    is refused, nothing changed: the load is still queued. Reporting the end first, as
    the contract asks, is the caller's fix."""
    rig = Rig(cpu=8, gpu=16)
    x_old, x_new = Req("x", 9, base=100), Req("x", 9)
    assert rig.seed_cpu(*x_new.h[:2]) == [0, 1]
    g_old = rig.alloc(3)                                       # [0, 1, 2]
    rig.step(x_old.sched(g_old, confirmed=0, new=True))
    rig.gpu.free(reversed(g_old))                              # x ended: not reported yet
    assert rig.m.lookup(x_new.view(), 0) == 8
    g_new = rig.alloc(3)
    rig.m.allocated("x", [g_new], 8)
    before = manager_state(rig.m)
    assert list(before["load_queue"]) == ["x"]
    err = refused(rig.m, rig.m.build_step,
                  StepInput(rig.n + 1, [x_new.sched(g_new, confirmed=0, new=True)], ["x"]))
    assert (err.req_id, err.field) == ("x", "finished")
    assert "listed in the step that reports its end" in str(err)
    assert manager_state(rig.m) == before and refs(rig.cpu, [0, 1]) == [1, 1]

    p = rig.step(x_new.sched(g_new, confirmed=0, new=True))    # without the stale end
    assert pairs(p.load) == ([0, 1], g_new[:2])


def test_finished_hashes_may_fill_a_listed_entry_that_was_no_hash() -> None:
    """A listing's hashes are checked up to its confirmed blocks only: A (13 tokens)
    was listed with ``[h0, h1, None]`` and nothing confirmed. Its finish with the three
    real hashes used to compare position 2 against the None and raise AttributeError
    (an untyped error, found by a review); a listed entry that is no hash is one the
    sequence still lacked: the finish's is stored."""
    rig = Rig(cpu=8, gpu=8)
    a = Req("a", 13)
    ga = rig.alloc(4, a.h)                                     # [0, 1, 2, 3]
    junk: list[Any] = [a.h[0], a.h[1], None]
    rig.step(ScheduledRequest("a", junk, 13, (tuple(ga),), True, 0))
    assert rig.m.finished("a", 13, [ga], block_hashes=list(a.h)) is False
    p = rig.step()
    assert pairs(p.store) == ([0, 1, 2], [0, 1, 2])


def test_bad_call_finished_after_a_stray_phase_b_is_still_checked() -> None:
    """A (17 tokens) runs, listed with GPU 0-3, nothing stored yet; a stray phase B (0
    tokens, its own tables) is accepted mid-run. A first mend turned the finish check
    off after any phase B until an admission listing -- which a running request never
    gets -- so a later ``finished`` naming another request's blocks at positions 2-3
    was stored (found by a review). The check now compares against that phase B's
    tables: refused, nothing changed."""
    rig = Rig(cpu=8, gpu=16)
    a = Req("a", 17)
    ga = rig.alloc(4, a.h)                                     # [0, 1, 2, 3]
    rig.step(a.sched(ga, confirmed=0, new=True))
    other = rig.alloc(2)                                       # [4, 5]
    rig.m.allocated("a", [ga], 0)
    err = refused(rig.m, rig.m.finished, "a", 16, [ga[:2] + other])
    assert (err.req_id, err.field) == ("a", "gpu_block_ids[0][2]")
    assert "block 4 where its last phase B listed 2" in str(err)


def test_bad_call_half_applied_step_good_and_bad_request() -> None:
    """One step lists G (9 tokens, GPU 0-2, 2 blocks confirmed) and then B, whose table
    names GPU id 9 (pool of 8) at a confirmed position. The step used to admit both,
    mark G's GPU 0, 1 and B's 3 in flight, then raise before any job existed: those
    blocks were never stored. Now the step is refused (naming B) and neither request is
    tracked, nor is its step number taken as the latest (the disk reads planned
    between steps are stamped with it); G alone then stores GPU 0, 1."""
    rig = Rig(cpu=8, gpu=8)
    g, b = Req("g", 9), Req("b", 9, base=50)
    gg = rig.alloc(3, g.h)                                     # [0, 1, 2]
    gb = rig.alloc(3, b.h)                                     # [3, 4, 5]
    bad = sched("b", b.h, 9, (gb[0], 9, gb[2]), confirmed=8)
    last = rig.m._last_step
    err = refused(rig.m, rig.m.build_step, StepInput(99, [g.sched(gg, confirmed=8, new=True),
                                                          bad]))
    assert (err.req_id, err.field) == ("b", "new_block_ids[0][1]")
    assert rig.m._track.reqs == {} and rig.m._stores.marks.gpu == set()
    assert rig.m._last_step == last

    p = rig.step(g.sched(gg, confirmed=8, new=True))
    assert pairs(p.store) == ([0, 1], [0, 1])
    rig.ack(p.store)
    assert rig.cpu.get_cached(g.h[0]) == 0 and rig.m.pins_held() == 0


@pytest.mark.parametrize(("hashes", "field"), [
    (None, "block_hashes"),
    ([[1, 2]], "block_hashes[0]"),          # unhashable
    ([None, None], "block_hashes[0]"),
    ("ab", "block_hashes"),                 # a str is no sequence of hashes
    ([b"short"], "block_hashes[0]"),        # 5 bytes
], ids=["none", "unhashable", "none-entries", "str", "short"])
def test_bad_call_lookup_unhashable_or_none_hashes(hashes: Any, field: str) -> None:
    """R holds a phase-A pin on CPU 0 (its first block). A repeated lookup with hashes
    that are None, unhashable, not bytes or too short used to drop that pin and then
    raise a bare TypeError (or, for a short hash, answer 0). Now it is refused and the
    pin stays."""
    rig = Rig()
    r = Req("r", 9)
    assert rig.seed_cpu(r.h[0]) == [0]
    assert rig.m.lookup(r.view(), 0) == 4
    err = refused(rig.m, rig.m.lookup, RequestView("r", hashes, 9), 0)
    assert (err.req_id, err.field) == ("r", field)
    assert f"lookup: request 'r': {field}:" in str(err)
    assert refs(rig.cpu, [0]) == [1] and rig.m._hits["r"].pinned == [0]
    assert rig.m.lookup(r.view(), 0) == 4                      # the repeat drops the older pin
    assert refs(rig.cpu, [0]) == [1]
    rig.m.allocated("r", [rig.alloc(3)], 0)
    assert refs(rig.cpu, [0]) == [0] and rig.m.pins_held() == 0


def test_bad_call_lookup_refresh_reads_hashes_it_checked() -> None:
    """With a refreshing order (``adaptive``, the default): A's lookup with 8 local
    tokens refreshed and checked hashes 0-1 and pinned its CPU hit (CPU 2-3). A second
    lookup with 12 local tokens and a view whose hash 0 is a list was checked for hash
    2 only (the first lookup had checked "the first two"), yet the refresh read hash 0:
    a bare TypeError after the call had dropped the pins and moved the request's start.
    The hashes are those of this view, not the earlier one's: refused whole now."""
    rig = Rig(eviction=Eviction.ADAPTIVE)
    a = Req("a", 17)
    rig.seed_cpu(*a.h)                                         # CPU 0-3
    assert rig.m.lookup(a.view(), 8) == 8
    assert refs(rig.cpu, [2, 3]) == [1, 1]
    bad = [["not", "a", "hash"], *a.h[1:]]
    err = refused(rig.m, rig.m.lookup, RequestView("a", bad, 17), 12)  # type: ignore[arg-type]
    assert err.field == "block_hashes[0]"
    assert refs(rig.cpu, [2, 3]) == [1, 1]
    assert rig.m.lookup(a.view(), 12) == 4                     # CPU 3 now; 2 released
    rig.m.allocated("a", [rig.alloc(5)], 0)
    assert rig.m.pins_held() == 0


def test_bad_call_allocated_twice_for_one_lookup() -> None:
    """R's lookup pinned CPU 0-1 and its phase B queued their load into GPU 0-1. A
    second phase B with no lookup between used to be taken as "phase B without a pin":
    it reported R's load failed naming GPU 0-2 -- the engine would recompute into the
    blocks the first load was writing -- while that load still went out and later
    reported ok. Refused now, queued or in flight; after a new lookup it is fine."""
    rig = Rig()
    r = Req("r", 9)
    rig.seed_cpu(*r.h)
    assert rig.m.lookup(r.view(), 0) == 8
    g = rig.alloc(3)
    rig.m.allocated("r", [g], 8)
    err = refused(rig.m, rig.m.allocated, "r", [g], 8)
    assert (err.req_id, err.field) == ("r", "req_id")
    p = rig.step()
    assert pairs(p.load) == ([0, 1], g[:2])
    refused(rig.m, rig.m.allocated, "r", [g], 8)               # in flight: still refused
    rig.ack(p.load)
    assert rig.m.take_load_results() == [LoadResult("r", True, (), None, 8)]
    assert rig.step().failed_loads == {}
    rig.m.finished("r", 8, [g])
    rig.gpu.free(reversed(g))
    assert rig.m.pins_held() == 0


async def test_bad_call_engine_step_non_bytes_hashes_with_a_load_in_flight() -> None:
    """The reported path end to end (Engine, two embedded ranks): prefix P is in the
    CPU tier and being loaded for L when the serving engine lists request A with str
    hashes. ``step`` used to accept it; the store's completion then failed inside the
    done callback, L's load never completed, GPU pins leaked while ``statistics()``
    said 0 and the engine stayed READY. Now ``step`` raises InvalidRequest, L's load
    completes, and the engine ends with no pin and consistent records."""
    async with embedded_engine() as (eng, gpu, _, _):
        c = Client(eng, gpu)
        toks = tokens(3 * ENGINE_BS + 1, seed=7)
        await c.store_only("p", toks)
        hit, table_l, plan = c.load("l", toks)
        assert hit == 3 * ENGINE_BS and plan.load is not None
        table_a = gpu.allocate(3)
        bad = ScheduledRequest("a", ["x", "y", "z"],  # type: ignore[list-item]
                               3 * ENGINE_BS, (tuple(table_a),), True,
                               3 * ENGINE_BS)
        with pytest.raises(InvalidRequest, match="request 'a': block_hashes"):
            c.step(bad)
        res = await c.loaded("l")
        assert res.ok and res.num_tokens == 3 * ENGINE_BS
        c.finish("l", table_l, 3 * ENGINE_BS)
        gpu.free(reversed(table_a))
        await c.settle()
        st = eng.statistics()
        assert eng.state is EngineState.READY
        assert st.pins_held == 0 and st.jobs_in_flight == 0 and gpu.num_pinned == 0
        assert st.counters["invalid_calls"] == 1 and st.counters["done_errors"] == 0
        assert eng._core.manager is not None
        eng._core.manager.check_invariants()
    await asyncio.sleep(0)


def test_store_completion_that_cannot_index_still_releases_pins() -> None:
    """Records and pools never disagree: a store whose completion cannot index a block
    (the GPU pool answers a hash the CPU index refuses) has already left the job table,
    so its pins go anyway -- the error still reaches the caller, and pins_held (0)
    matches both pools."""

    class OddPool(BlockPool):
        odd = False

        def block_hashes(self, block_id: int) -> tuple[bytes, ...]:
            return ("not bytes",) if self.odd else super().block_hashes(block_id)  # type: ignore[return-value]

    rig = Rig()
    rig.gpu = OddPool(16)
    rig.m = OffloadManager(rig.cpu, rig.gpu, block_size=BS)
    a = Req("a", 9)
    ga = rig.alloc(3)                                          # unhashed: stored under a.h
    p = rig.step(a.sched(ga, confirmed=9, new=True))
    assert pairs(p.store) == ([0, 1], [0, 1]) and p.store is not None
    rig.gpu.odd = True
    with pytest.raises(ConfigError, match="must be bytes"):
        rig.m.on_done(p.store.job_id, 0, True)
    rig.gpu.odd = False
    rig.m.check_invariants()
    assert rig.m.pins_held() == 0 and rig.cpu.num_pinned == 0
    assert refs(rig.gpu, ga) == [1, 1, 1]


# ---- the rules, call by call ---------------------------------------------------------------

Case = tuple[str, Callable[[Rig], object], str, str]


def _reqs(n: int = 9, rid: str = "r") -> Req:
    return Req(rid, n)


def _cases() -> Iterator[Case]:
    """(name, bad call on a rig with request "r" known, req id or "", field)."""
    r = _reqs()
    h = r.h
    nn = no_new_blocks(1)

    def step(*reqs: Any, step_no: Any = 9, finished: Any = (), alloc: Any = ()) -> Callable[[Rig], object]:
        return lambda rig: rig.m.build_step(StepInput(step_no, list(reqs), finished, alloc))

    def alloc(*args: Any) -> Callable[[Rig], object]:
        return lambda rig: rig.m.allocated(*args)

    def fin(*args: Any, **kw: Any) -> Callable[[Rig], object]:
        return lambda rig: rig.m.finished(*args, **kw)

    def look(view: Any, local: Any = 0) -> Callable[[Rig], object]:
        return lambda rig: rig.m.lookup(view, local)

    yield "lookup req id not str", look(RequestView(7, h, 9)), "", "req_id"  # type: ignore[arg-type]
    yield "lookup negative local", look(r.view(), -4), "r", "num_local_tokens"
    yield "lookup bool local", look(r.view(), True), "r", "num_local_tokens"
    yield "lookup float local", look(r.view(), 4.0), "r", "num_local_tokens"
    yield "lookup local beyond tokens", look(r.view(), 12), "r", "num_local_tokens"
    yield "lookup negative tokens", look(RequestView("r", [], -1)), "r", "num_tokens"
    yield "lookup more hashes than blocks", look(RequestView("r", h, 7)), "r", "block_hashes"
    yield "lookup params not a mapping", look(RequestView("r", h, 9, ["x"])), "r", "kv_transfer_params"  # type: ignore[arg-type]
    yield "lookup not a view", look(None), "", "req"
    yield "allocated no table", alloc("r", [], 4), "r", "gpu_block_ids"
    yield "allocated two tables", alloc("r", [[0], [1]], 4), "r", "gpu_block_ids"
    yield "allocated bool id", alloc("r", [[0, True, 2]], 4), "r", "gpu_block_ids[0][1]"
    yield "allocated negative id", alloc("r", [[0, -1, 2]], 4), "r", "gpu_block_ids[0][1]"
    yield "allocated str id", alloc("r", [[0, "1", 2]], 4), "r", "gpu_block_ids[0][1]"
    yield "allocated repeated id", alloc("r", [[0, 1, 0]], 4), "r", "gpu_block_ids[0]"
    yield "allocated table a str", alloc("r", ["012"], 4), "r", "gpu_block_ids[0]"
    # a set's order is not a table's: it was taken in hash order (a hostile probe)
    yield "allocated table a set", alloc("r", [{2, 0, 1}], 4), "r", "gpu_block_ids[0]"
    yield "allocated table a dict", alloc("r", [{0: 0, 1: 1, 2: 2}], 4), "r", \
        "gpu_block_ids[0]"
    yield "allocated negative tokens", alloc("r", [[0, 1, 2]], -4), "r", "num_external_tokens"
    yield "allocated None tokens", alloc("r", [[0, 1, 2]], None), "r", "num_external_tokens"
    yield "allocated more than offered", alloc("r", [[0, 1, 2]], 8), "r", "num_external_tokens"
    yield "allocated table too short", alloc("r", [[]], 4), "r", "gpu_block_ids[0]"
    yield "allocated unhashable id", alloc(["r"], [[0]], 4), "", "req_id"
    yield "finished negative tokens", fin("r", -1, [[0]]), "r", "num_confirmed_tokens"
    yield "finished wrong table count", fin("r", 4, [[0], [1]]), "r", "gpu_block_ids"
    yield "finished bad explicit hash", fin("r", 8, [[0, 1, 2]], block_hashes=[h[0], 3]), "r", "block_hashes[1]"
    yield "finished hashes a str", fin("r", 8, [[0, 1, 2]], block_hashes="ab"), "r", "block_hashes"
    yield "finished id out of range", fin("r", 8, [[0, 1, 99]]), "r", "gpu_block_ids[0][2]"
    yield "step number None", step(step_no=None), "", "step"
    yield "step number bool", step(step_no=True), "", "step"
    yield "step number negative", step(step_no=-1), "", "step"
    # 2**64 was planned, then failed to post to the ranks (msgpack: 64-bit ints) with
    # its store's pins held for good
    yield "step number 2**64", step(step_no=2**64), "", "step"
    yield "lookup tokens 2**63", look(RequestView("r", h, 2**63)), "r", "num_tokens"
    # a listing's plain fast path took 2**64 (hashes a list) that every other path
    # refused: the documented range is [0, 2**63) (a hostile probe)
    yield "step tokens 2**64", step(sched("n", h, 2**64, [0], confirmed=0)), "n", "num_tokens"
    yield "step confirmed 2**64", step(sched("r", h, 9, [], confirmed=2**64, new=False)), \
        "r", "num_confirmed_tokens"
    yield "step finished a str", step(finished="r"), "", "finished"
    yield "step finished not str", step(finished=[3]), "", "req_id"
    yield "step allocated out of range", step(alloc=[99]), "", "allocated_block_ids[0]"
    yield "step allocated a str", step(alloc="ab"), "", "allocated_block_ids"
    yield "step request None", step(None), "", "requests[0]"
    yield "step unhashable id", step(sched(["x"], h, 9, [0], confirmed=0)), "", "requests[0]"  # type: ignore[arg-type]
    yield "step no tables", step(ScheduledRequest("n", h, 9, (), True, 0)), "n", "new_block_ids"
    yield "step two tables", step(sched("n", h, 9, [0], [1], confirmed=0)), "n", "new_block_ids"
    yield "step negative confirmed", step(sched("n", h, 9, [0], confirmed=-4)), "n", "num_confirmed_tokens"
    yield "step float confirmed", step(sched("n", h, 9, [0], confirmed=4.0)), "n", "num_confirmed_tokens"  # type: ignore[arg-type]
    yield "step flag None", step(ScheduledRequest("n", h, 9, ((0,),), None, 0)), "n", "new_or_resumed"  # type: ignore[arg-type]
    yield "step preempted int", step(ScheduledRequest("r", h, 9, nn, False, 0, 1)), "r", "preempted"  # type: ignore[arg-type]
    yield "step params a str", step(ScheduledRequest("n", h, 9, ((0,),), True, 0, False, "x")), "n", "kv_transfer_params"  # type: ignore[arg-type]
    yield "step more hashes than blocks", step(sched("n", h, 5, [0], confirmed=0)), "n", "block_hashes"
    yield "step known request bad appended id", step(sched("r", h, 9, [99], confirmed=0, new=False)), "r", "new_block_ids[0][0]"
    yield "step known request confirmed negative", step(sched("r", h, 9, [], confirmed=-8, new=False)), "r", "num_confirmed_tokens"
    yield "step known request hash None", step(sched("r", [h[0], None], 9, [], confirmed=8, new=False)), "r", "block_hashes[1]"
    yield "step listed twice", step(sched("n", h, 9, [5], confirmed=0), sched("n", h, 9, [5], confirmed=0)), "n", "requests"
    # a lone surrogate (a JSON body may carry one): UnicodeEncodeError, no
    # InvalidRequest, from the first call that encoded the id -- a P/D prefill's
    # finished() after it had changed state (a hostile probe)
    bad_id = "x\udfff"
    yield "lookup id with a lone surrogate", look(RequestView(bad_id, h, 9)), "", "req_id"
    yield "allocated id with a lone surrogate", alloc(bad_id, [[0, 1, 2]], 0), "", "req_id"
    yield "finished id with a lone surrogate", fin(bad_id, 0, [[0]]), "", "req_id"
    yield "step id with a lone surrogate", step(sched(bad_id, h, 9, [5], confirmed=0)), "", "req_id"


@pytest.mark.parametrize("case", list(_cases()), ids=lambda c: c[0])
def test_bad_input_is_refused_whole(case: Case) -> None:
    """Request r (9 tokens, block 0 in the CPU tier) holds a phase-A pin on CPU 0 and
    is listed (GPU 0, 1, 2; block 0 confirmed, stored and acked). Each bad call is
    refused with InvalidRequest naming the request and the field, and changes
    nothing."""
    _name, call, rid, field = case
    rig = Rig()
    r = _reqs()
    rig.seed_cpu(r.h[0])
    table = rig.alloc(3, r.h)
    p = rig.step(r.sched(table, confirmed=4, new=True))
    assert p.store is None                                     # block 0 is already cached
    assert rig.m.lookup(r.view(), 0) == 4                      # pins CPU 0 (a re-lookup)
    err = refused(rig.m, call, rig)
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert err.req_id == (rid or None) and err.field == field, str(err)


def test_null_block_may_repeat_in_one_table() -> None:
    """vLLM puts its null block (id 0) wherever a sliding-window position holds no
    block, so one table may name it several times; any other repeat is refused."""

    class VllmLike(BlockPool):
        null_block_id = 0

    groups = (KVGroup.full(), KVGroup.sliding_window(4))
    gpu = VllmLike(16)
    m = OffloadManager(BlockPool(8), gpu, block_size=BS, groups=groups)
    h = chain_hashes(list(range(17)), BS)
    m.build_step(StepInput(1, [ScheduledRequest("a", h, 17, ((1, 2, 3, 4), (0, 0, 5, 6)),
                                                True, 0)]))
    assert m._track.reqs["a"].tables == [[1, 2, 3, 4], [0, 0, 5, 6]]
    err = refused(m, m.finished, "a", 0, [[1, 2, 3, 4], [5, 0, 5, 6]])
    assert err.field == "gpu_block_ids[1]" and "block id 5 appears 2 times" in str(err)


def test_the_null_block_in_a_full_attention_table_is_refused() -> None:
    """The hazard: the null block (vLLM's placeholder for a sliding-window position)
    was accepted anywhere. In a full-attention table ``(0, 5, 0)`` the store walk
    stored GPU block 0's bytes under the request's first prefix hash -- a later request
    with that prefix loaded them as its KV (a poisoned CPU cache) -- and a load wrote
    two CPU blocks into block 0. Now every call refuses it in a full-attention group's
    ids (a whole table, or one id a decode step appends), naming the position, and
    changes nothing; a sliding-window group still takes it (the test above)."""

    class VllmLike(BlockPool):
        null_block_id = 0

    groups = (KVGroup.full(), KVGroup.sliding_window(4))
    h = chain_hashes(list(range(17)), BS)
    m = OffloadManager(BlockPool(8), VllmLike(16), block_size=BS, groups=groups)
    step = StepInput(1, [ScheduledRequest("a", h, 17, ((0, 5, 6, 7), (0, 0, 1, 2)),
                                          True, 12)])
    err = refused(m, m.build_step, step)
    assert err.field == "new_block_ids[0][0]" and "null block 0" in str(err)
    m.build_step(StepInput(1, [ScheduledRequest("a", h, 17, ((4, 5, 6, 7), (0, 0, 1, 2)),
                                                True, 0)]))
    for tables in ([[4, 5, 0, 7], [0, 0, 1, 2]], [[0], [0]]):
        err = refused(m, m.finished, "a", 12, tables)
        assert err.field.startswith("gpu_block_ids[0]") and "null block" in str(err)
    # one group, one id appended: the decode step's fast path
    one = OffloadManager(BlockPool(8), VllmLike(16), block_size=BS)
    one.build_step(StepInput(1, [ScheduledRequest("b", h[:1], 5, ((3,),), True, 0)]))
    err = refused(one, one.build_step,
                  StepInput(2, [ScheduledRequest("b", h[:2], 9, ((0,),), False, 4)]))
    assert err.field == "new_block_ids[0][0]"
    assert refused(one, one.allocated, "c", [[0, 1]], 0).field == "gpu_block_ids[0][0]"


@pytest.mark.parametrize("kw", [{"world_size": 2.5}, {"block_size": 4.0},
                                {"mode": "lazy"}, {"lazy_window": 0.5},
                                {"groups": [None]}])
def test_a_manager_built_with_a_wrong_type_is_refused_at_once(kw: dict[str, Any]) -> None:
    """The hazards: ``world_size=2.5`` was accepted and the first store raised a
    TypeError after ``cpu.allocate`` -- a CPU pin no record held; ``block_size=4.0``
    was accepted, then failed the first step; ``mode="lazy"`` (a str, not the enum)
    stored nothing, silently. Each is a ConfigError at construction now."""
    args: dict[str, Any] = {"block_size": BS, **kw}
    with pytest.raises(ConfigError, match="must be"):
        OffloadManager(BlockPool(8), BlockPool(16), **args)


@pytest.mark.parametrize("window", [2.5, 8.0, None, 0])
def test_a_sliding_window_that_is_no_int_is_refused(window: Any) -> None:
    """``KVGroup.sliding_window(2.5)`` passed the group, the config and the manager, and
    the first lookup that hit raised a TypeError (``[None] * 2.5``)."""
    with pytest.raises(ConfigError, match="window_tokens, an int >= 1"):
        KVGroup.sliding_window(window)


def test_an_ack_of_the_wrong_type_is_refused_and_changes_nothing() -> None:
    """``on_done(job, 0.0, "failed")`` acked rank 0 and counted the failed store as
    done (a truthy str): its blocks were indexed. An unhashable job id or rank raised a
    bare TypeError. Each is a ConfigError now, the job still waiting for its ack."""
    rig = Rig()
    a = Req("a", 9)
    p = rig.step(a.sched(rig.alloc(3), confirmed=8, new=True))
    assert p.store is not None
    job = p.store.job_id
    for bad in ((job, 0.0, False), (job, 0, "failed"), ([job], 0, True),
                (job, [0], True), (job, True, True), (float(job), 0, True)):
        with pytest.raises(ConfigError, match="on_done: job_id and rank must be ints"):
            rig.m.on_done(*bad)
    assert rig.m.num_jobs_in_flight == 1 and rig.cpu.get_cached(a.h[0]) is None
    rig.m.on_done(job, 0, False)
    assert rig.m.num_jobs_in_flight == 0 and rig.cpu.get_cached(a.h[0]) is None
    rig.m.check_invariants()


def test_hash_length_is_exact_when_the_engine_names_it() -> None:
    """Without ``hash_bytes`` any length in 8..64 passes (kvshm's hashes are 16 bytes,
    vLLM's 32 or 16); with ``hash_bytes=16`` (or a GPU pool's ``hash_bytes``) a 24-byte
    hash is refused."""
    h24 = [bytes(24), bytes([1]) * 24]
    loose = OffloadManager(BlockPool(4), BlockPool(4), block_size=BS)
    assert loose.lookup(RequestView("a", h24, 9), 0) == 0

    class Sized(BlockPool):
        hash_bytes = 16

    for m in (OffloadManager(BlockPool(4), BlockPool(4), block_size=BS, hash_bytes=16),
              OffloadManager(BlockPool(4), Sized(4), block_size=BS)):
        err = refused(m, m.lookup, RequestView("a", h24, 9), 0)
        assert err.field == "block_hashes[0]" and "must be 16 bytes, got 24" in str(err)
        assert m.lookup(RequestView("a", chain_hashes(list(range(9)), BS), 9), 0) == 0
    with pytest.raises(ConfigError, match="hash_bytes"):
        OffloadManager(BlockPool(4), BlockPool(4), block_size=BS, hash_bytes=0)


# ---- the vLLM adapter's paths into the manager ---------------------------------------------


class ManagerClient:
    """SyncClient's scheduler calls straight onto a manager (no rendezvous, no ranks)."""

    state = EngineState.READY

    def __init__(self, m: OffloadManager) -> None:
        self.m = m
        self.steps: list[list[str]] = []

    def lookup(self, req: RequestView, n: int) -> int | None:
        return self.m.lookup(req, n)

    def allocated(self, rid: str, ids: Sequence[Sequence[int]], n: int) -> None:
        self.m.allocated(rid, ids, n)

    def step(self, inp: StepInput, *, service: bool = True) -> Any:
        self.steps.append([r.req_id for r in inp.requests])
        return self.m.build_step(inp)

    def finished(self, rid: str, n: int, ids: Sequence[Sequence[int]], *,
                 tail_hash: bytes | None = None) -> bool:
        return self.m.finished(rid, n, ids, tail_hash=tail_hash)

    def transfer_params(self, rid: str) -> dict[str, Any] | None:
        return self.m.transfer_params(rid)

    def poll(self) -> list[LoadResult]:
        return self.m.take_load_results()

    def reset(self) -> bool:
        return self.m.reset()

    def reset_done(self) -> bool:
        return self.m.reset_done()


def bound_side(client: ManagerClient, cpu_blocks: int, load_timeout_s: float = 30.0) -> Any:
    """A vLLM ``SchedulerSide`` (one rank, one full-attention group, eager stores) whose
    hooks call ``client`` (a manager in this process) instead of a running engine."""
    from kvshm.integrations.vllm.config import ConnectorConfig
    from kvshm.integrations.vllm.scheduler import SchedulerSide
    from kvshm.types import StoreMode

    side = SchedulerSide(ConnectorConfig("unit", 1, 1, BS, (KVGroup.full(),), StoreMode.EAGER,
                                         None, cpu_blocks, None, load_timeout_s, 5.0, 0))
    side.life.bound_client = client  # type: ignore[assignment]
    return side


def test_vllm_reset_cache_retried_polls_the_reset_instead_of_starting_another() -> None:
    """vLLM's callers retry ``reset_prefix_cache`` until True. Each retry was a new
    reset: once the first one's abandoned store was done, a step planned another, and
    the retry abandoned that one too -- under traffic it might never answer True. A
    retry while a reset drains now polls it: the store planned after the drain is not
    abandoned, and the retry answers True."""

    rig = Rig(cpu=8)
    side = bound_side(ManagerClient(rig.m), 8, 10.0)
    a, b = Req("a", 8), Req("b", 8, base=50)
    first = rig.step(a.sched(rig.alloc(2, a.h), confirmed=8, new=True))
    assert side.reset() is False                              # abandons a's store
    rig.ack(first.store)
    second = rig.step(b.sched(rig.alloc(2, b.h), confirmed=8, new=True))
    assert second.store is not None                           # planned after the drain
    assert side.reset() is True                               # polled: b's not abandoned
    assert rig.m.counters.jobs_abandoned == 1
    rig.ack(second.store)
    assert rig.cpu.get_cached(b.h[0]) is not None


def test_vllm_adapter_maps_refusals_to_no_offload() -> None:
    """The vLLM scheduler side never lets a refusal reach vLLM where a safe answer
    exists: X's lookup with a None hash is a miss (X is not offered a hit again), its
    phase B with nothing to load is refused for a repeated id and releases nothing it
    did not hold; a step listing good G next to bad B (GPU id 99 in a 16-block pool) is
    retried with B listed as preempted (its table forgotten), B is never listed again,
    and its finish only forgets it. G's
    blocks are stored as usual; the manager ends with no pin and no trace of B or X."""
    from types import SimpleNamespace as NS


    cpu, gpu = BlockPool(8), BlockPool(16)
    m = OffloadManager(cpu, gpu, block_size=BS)
    client = ManagerClient(m)
    side = bound_side(client, 8)

    def request(rid: str, hashes: list[Any], computed: int) -> Any:
        r = NS(request_id=rid, block_hashes=hashes, num_tokens=9, num_computed_tokens=computed,
               num_output_placeholders=0, kv_transfer_params=None)
        side.on_new_request(r)
        return r

    x = request("x", [None, None], 0)
    assert side.lookup(x, 0) == (0, False) and side.lookup(x, 0) == (0, False)
    assert side.counters.lookups_after_refusal == 1          # the second: counted
    side.allocated(x, [[1, 1, 2]], 0)                          # repeated id: refused, no pin held
    assert side.counters.requests_refused == 2 and m.counters.invalid_calls == 2

    g = request("g", chain_hashes(list(range(9)), BS), 8)
    b = request("b", chain_hashes(list(range(50, 59)), BS), 8)
    gg = gpu.allocate(3)
    so = NS(scheduled_new_reqs=[NS(req_id="g", block_ids=([*gg],), num_computed_tokens=8),
                                NS(req_id="b", block_ids=([3, 99, 5],), num_computed_tokens=8)],
            scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                     num_computed_tokens=[]),
            preempted_req_ids=set(), finished_req_ids=set())
    side.build(so)
    assert client.steps == [["g", "b"], ["g", "b"]]      # refused, b retried as preempted
    # b was never tracked (its first listing was the refused one): no record is made
    assert side.counters.requests_refused == 3 and "b" not in m._track.reqs
    so2 = NS(scheduled_new_reqs=[],
             scheduled_cached_reqs=NS(req_ids=["g", "b"], resumed_req_ids=set(),
                                      new_block_ids=[None, ([6],)], num_computed_tokens=[8, 8]),
             preempted_req_ids=set(), finished_req_ids=set())
    side.build(so2)
    assert client.steps[-1] == []              # b (new ids) is not listed again; g unchanged
    assert side.counters.requests_unchanged == 1
    assert m.num_jobs_in_flight == 1
    job = next(iter(m._jobs.jobs))
    m.on_done(job, 0, True)
    assert cpu.get_cached(g.block_hashes[0]) is not None

    side.finished(b, [[3, 99, 5]])                             # refused: only forgotten
    side.finished(x, [[]])
    side.finished(g, [gg])
    assert side.counters.requests_refused == 3
    gpu.free(reversed(gg))
    m.check_invariants()
    assert m.pins_held() == 0 and m._track.reqs == {} and m._hits == {}


def test_vllm_adapter_refused_listing_stops_the_stalled_walk_over_blocks_vllm_reuses(
        ) -> None:
    """R (13 tokens, GPU 0-3) was listed with 3 blocks confirmed; a 1-block CPU tier
    took GPU 0 and R's walk stalled at position 1. A later listing of R names GPU id 99
    (a 16-block pool): refused, and R left out of every listing -- its preemption's too.
    The manager went on walking R's last table, so after vLLM preempted R and gave GPU
    1-2 to S, the store that followed read GPU 1 (S's bytes) under R's second hash,
    served to every later hit of R's prefix. The retry now lists R as preempted (its
    table forgotten, a queued load untouched): nothing of R is stored again."""
    from types import SimpleNamespace as NS


    class PlanClient(ManagerClient):
        plans: list[Any] = []

        def step(self, inp: StepInput, *, service: bool = True) -> Any:
            plan = super().step(inp, service=service)
            self.plans.append(plan)
            return plan

    cpu, gpu = BlockPool(1), BlockPool(16)
    m = OffloadManager(cpu, gpu, block_size=BS)
    client = PlanClient(m)
    side = bound_side(client, 1)
    hashes = chain_hashes(list(range(13)), BS)
    r = NS(request_id="r", block_hashes=hashes, num_tokens=13, num_computed_tokens=12,
           num_output_placeholders=0, kv_transfer_params=None)
    side.on_new_request(r)
    table = gpu.allocate(4)                                    # [0, 1, 2, 3]

    def so(new: list[Any], cached: list[tuple[str, Any]], preempted: set[str]) -> Any:
        return NS(scheduled_new_reqs=new, preempted_req_ids=preempted,
                  finished_req_ids=set(),
                  scheduled_cached_reqs=NS(req_ids=[c[0] for c in cached],
                                           resumed_req_ids=set(),
                                           new_block_ids=[c[1] for c in cached],
                                           num_computed_tokens=[12 for _ in cached]))

    side.build(so([NS(req_id="r", block_ids=(table,), num_computed_tokens=12)], [], set()))
    first = client.plans[-1].store
    assert pairs(first) == ([0], [0])                          # stalled at position 1
    side.build(so([], [("r", ([99],))], set()))                # refused, retried without r
    assert side.counters.requests_refused == 1
    gpu.free(reversed(table))                                  # vLLM preempts r ...
    assert 1 in gpu.allocate(3)                                # ... and gives GPU 1 to s
    m.on_done(first.job_id, 0, True)                           # CPU 0 free again
    side.build(so([], [], {"r"}))
    side.build(so([], [], set()))
    stores = [p.store for p in client.plans[2:] if p.store is not None]
    assert stores == [], [pairs(t) for t in stores]            # was: GPU 1 under hashes[1]
    assert cpu.get_cached(hashes[1]) is None
    side.finished(r, [[]])
    m.check_invariants()
    assert m.pins_held() == 0 and m._track.reqs == {}


def test_vllm_adapter_refused_phase_b_with_tokens_becomes_a_failed_load() -> None:
    """vLLM says 8 tokens of R come from kvshm but hands a table with a repeated id: the
    manager refuses it (nothing changed). Raising would kill vLLM's scheduler, which
    then waits for those tokens; instead the lookup's pin is released and R travels in
    the next metadata's failed_loads with the blocks vLLM expected filled (recomputed)."""
    from types import SimpleNamespace as NS


    cpu, gpu = BlockPool(8), BlockPool(16)
    m = OffloadManager(cpu, gpu, block_size=BS)
    side = bound_side(ManagerClient(m), 8, 10.0)
    hashes = chain_hashes(list(range(9)), BS)
    r = NS(request_id="r", block_hashes=hashes, num_tokens=9, num_computed_tokens=0,
           num_output_placeholders=0, kv_transfer_params=None)
    side.on_new_request(r)
    side.lookup(r, 0)
    side.allocated(r, [[4, 4, 6]], 8)                          # repeated id 4: refused
    assert side.counters.requests_refused == 1 and m.pins_held() == 0
    so = NS(scheduled_new_reqs=[], preempted_req_ids=set(), finished_req_ids=set(),
            scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                     num_computed_tokens=[]))
    meta = side.build(so)
    assert meta.failed_loads == {"r": (4,)}                    # blocks 0-1 of the table
    assert side.build(so).failed_loads == {}                  # reported once
    m.check_invariants()


class LateDoneClient(ManagerClient):
    """A client whose ``poll`` first applies Dones that "arrived on the ring" since the
    last pump (``late``: job ids, rank 0, ok): a worker that published them between two
    of the scheduler's hooks."""

    def __init__(self, m: OffloadManager) -> None:
        super().__init__(m)
        self.late: list[int] = []
        self.polls = 0

    def poll(self) -> list[LoadResult]:
        self.polls += 1
        for job in self.late:
            self.m.on_done(job, 0, True)
        self.late = []
        return super().poll()


def test_vllm_lookup_pumps_before_asking_again() -> None:
    """R's lookup finds its prefix pinned by A's load still in flight, which would answer
    "ask again" (vLLM then skips R for this whole step). The load's Done is already in
    the ring (the worker published it after the step's last pump): the side pumps once
    and asks again, so R gets its hit in this schedule, not the next step's (the same
    path a disk read's Done takes: issue 32's disk hit cost an extra step per pump)."""
    from types import SimpleNamespace as NS


    cpu, gpu = BlockPool(8), BlockPool(16)
    m = OffloadManager(cpu, gpu, block_size=BS)
    client = LateDoneClient(m)
    side = bound_side(client, 8)
    hashes = chain_hashes(list(range(9)), BS)

    def request(rid: str, computed: int) -> Any:
        r = NS(request_id=rid, block_hashes=hashes, num_tokens=9, num_computed_tokens=computed,
               num_output_placeholders=0, kv_transfer_params=None)
        side.on_new_request(r)
        return r

    def step(new: list[Any]) -> None:
        side.build(NS(scheduled_new_reqs=new, preempted_req_ids=set(), finished_req_ids=set(),
                      scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(),
                                               new_block_ids=[], num_computed_tokens=[])))

    g, gg = request("g", 8), gpu.allocate(3)
    step([NS(req_id="g", block_ids=([*gg],), num_computed_tokens=8)])
    m.on_done(next(iter(m._jobs.jobs)), 0, True)              # g's blocks stored
    side.finished(g, [gg])
    a, ga = request("a", 0), gpu.allocate(3)
    assert side.lookup(a, 0) == (8, True)
    side.allocated(a, [ga], 8)
    step([NS(req_id="a", block_ids=([*ga],), num_computed_tokens=0)])
    load = next(iter(m._jobs.jobs))                            # A's load, in flight
    r = request("r", 0)
    polls = client.polls
    client.late = [load]                                       # its Done is in the ring
    assert side.lookup(r, 0) == (8, True)
    assert client.polls == polls + 1 and side.counters.lookups_answered_after_pump == 1


class ReadClient:
    """The scheduler side's client at the process seam: its lookup answers None ("a
    disk read in flight") until ``polls_to_answer`` pumps have run, then ``hit``."""

    def __init__(self, polls_to_answer: int, hit: int = 8) -> None:
        from kvshm.engine import EngineState

        self.state = EngineState.READY
        self.disk_warming = False  # the disk tier's start scan was applied
        self.polls = 0
        self.answer_after = polls_to_answer
        self.hit = hit

    def lookup(self, view: Any, num_computed_tokens: int) -> int | None:
        return self.hit if self.polls >= self.answer_after else None

    def poll(self) -> list[LoadResult]:
        self.polls += 1
        return []

    def fetch_to_plan(self) -> bool:
        return False  # no fetch answered that only a step can start

    def step(self, step_input: Any, *, service: bool = True) -> Any:
        from kvshm.types import StepPlan

        return StepPlan(step_input.step)


def _read_side(client: ReadClient, disk: bool, remote: bool = False) -> Any:
    from kvshm.integrations.vllm.config import ConnectorConfig
    from kvshm.integrations.vllm.scheduler import SchedulerSide
    from kvshm.types import StoreMode

    cfg = ConnectorConfig("unit", 1, 1, BS, (KVGroup.full(),), StoreMode.EAGER, None, 8,
                          None, 30.0, 5.0, 0, disk_path="/nonexistent" if disk else None,
                          remote_url="valkey://unused:1" if remote else None)
    side = SchedulerSide(cfg)
    side.life.bound_client = client  # type: ignore[assignment]
    return side


def _read_request(side: Any, rid: str) -> Any:
    from types import SimpleNamespace as NS

    r = NS(request_id=rid, block_hashes=chain_hashes(list(range(9)), BS), num_tokens=9,
           num_computed_tokens=0, num_output_placeholders=0, kv_transfer_params=None)
    side.on_new_request(r)
    return r


def _empty_step(side: Any) -> Any:
    """``build_connector_meta`` of a step that schedules nothing new; its metadata."""
    from types import SimpleNamespace as NS

    return side.build(NS(scheduled_new_reqs=[], preempted_req_ids=set(), finished_req_ids=set(),
                  scheduled_cached_reqs=NS(req_ids=[], resumed_req_ids=set(),
                                           new_block_ids=[], num_computed_tokens=[])))


def test_vllm_lookup_waits_for_its_disk_read_from_the_first_lookup_when_idle() -> None:
    """A disk hit: the first lookup posts the READ (``SyncClient.lookup``) and, with
    nothing else to run, sleeps and pumps until the read's Done arrives and answers the
    hit in the same call -- no "ask again", no empty step."""
    client = ReadClient(polls_to_answer=5)
    side = _read_side(client, disk=True)
    a = _read_request(side, "a")
    assert side.lookup(a, 0) == (8, True)
    assert client.polls == 5
    c = side.counters
    assert (c.lookups_waited, c.lookups_answered_after_wait, c.lookup_waits_timed_out,
            c.lookups_asked_again) == (1, 1, 0, 0)


def test_vllm_lookup_never_waits_while_another_request_could_run() -> None:
    """The same read, but another live request is not waiting on a lower tier: its step
    must not be delayed, so the lookup asks again at once."""
    client = ReadClient(polls_to_answer=50)
    side = _read_side(client, disk=True)
    a = _read_request(side, "a")
    _read_request(side, "b")  # live, not asked again
    assert side.lookup(a, 0) == (None, False)
    _empty_step(side)
    polls = client.polls
    assert side.lookup(a, 0) == (None, False)
    assert client.polls == polls + 1 and side.counters.lookups_waited == 0


class TimedReadClient(ReadClient):
    """A :class:`ReadClient` whose read ends ``after_s`` seconds after its first lookup
    (timing control at the process seam)."""

    def __init__(self, after_s: float, hit: int = 8) -> None:
        super().__init__(10**9, hit)
        self.after_s = after_s
        self.t0: float | None = None

    def lookup(self, view: Any, num_computed_tokens: int) -> int | None:
        import time

        if self.t0 is None:
            self.t0 = time.monotonic()
        return self.hit if time.monotonic() - self.t0 >= self.after_s else None


def test_vllm_lookup_wait_grows_with_the_blocks_it_may_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait's bound is READ_WAIT_S plus READ_WAIT_PER_BLOCK_S per block the request
    could still hit, at most READ_WAIT_MAX_S: the request's 2 full blocks, with 20 ms a
    block allowed (bound min(50, 10 + 2 x 20) = 50 ms; 30 ms past a 1-block local hit),
    and a read that ends 25 ms after the lookup: answered within the first lookup's wait
    -- at a fixed READ_WAIT_S (10 ms) it timed out and the request was asked again (an
    engine step, then a second wait)."""
    import time

    from kvshm.integrations.vllm import read_wait

    monkeypatch.setattr(read_wait, "READ_WAIT_PER_BLOCK_S", 0.020)
    client = TimedReadClient(after_s=0.025)
    side = _read_side(client, disk=True)
    a = _read_request(side, "a")
    assert side._reads.bound(_view(a), 0) == read_wait.READ_WAIT_MAX_S == 0.050
    assert side._reads.bound(_view(a), BS) == pytest.approx(0.010 + 0.020)
    t0 = time.monotonic()
    assert side.lookup(a, 0) == (8, True)
    assert 0.025 <= time.monotonic() - t0
    c = side.counters
    assert (c.lookups_waited, c.lookups_answered_after_wait, c.lookup_waits_timed_out,
            c.lookups_asked_again) == (1, 1, 0, 0)


class StepWorkClient(ReadClient):
    """A :class:`ReadClient` that never answers but, from its ``work_after``-th pump on,
    holds a fetch answered that only the next step can start."""

    def __init__(self, work_after: int) -> None:
        super().__init__(10**9)
        self.work_after = work_after

    def fetch_to_plan(self) -> bool:
        return self.polls >= self.work_after


def test_vllm_lookup_waits_for_a_remote_answer_and_ends_when_a_step_has_work() -> None:
    """With a remote tier alone, a lookup that asks again waits as with a disk tier (the
    manifest read or the readiness answer lands within the wait: on a spinning engine
    loop a hand-off's index round trip took 100-600 ms, 0.6 ms with the caller asleep).
    The wait ends at once when the client holds a fetch answered that only the next
    step can start (``fetch_to_plan``; here after 3 pumps; counted
    ``lookup_waits_ended_for_step``): waiting on would only delay that step. A
    lookup that starts with such a fetch held does not sleep at all (the first version
    ended only on *new* pending work, and slept its whole bound when any was pending at
    its start -- another request's GET in flight, a PUT queue: a review)."""
    import time

    client = StepWorkClient(work_after=3)
    side = _read_side(client, disk=False, remote=True)
    a = _read_request(side, "a")
    t0 = time.monotonic()
    assert side.lookup(a, 0) == (None, False)
    assert time.monotonic() - t0 < side._reads.bound(_view(a), 0)
    c = side.counters
    assert (c.lookups_waited, c.lookup_waits_ended_for_step, c.lookup_waits_timed_out) == \
        (1, 1, 0)
    assert client.polls == 3
    client = StepWorkClient(work_after=0)  # answered before the lookup
    side = _read_side(client, disk=False, remote=True)
    a = _read_request(side, "a")
    t0 = time.monotonic()
    assert side.lookup(a, 0) == (None, False)
    assert time.monotonic() - t0 < 0.005 and client.polls == 1  # the lookup's own pump
    assert side.counters.lookup_waits_ended_for_step == 1


def _view(r: Any) -> Any:
    from kvshm.types import RequestView

    return RequestView(r.request_id, r.block_hashes, r.num_tokens, None, None)


def test_vllm_lookup_wait_is_bounded_and_absent_without_a_disk_tier() -> None:
    """A read that does not end within the wait's bound (READ_WAIT_S plus 1 ms for each
    of the request's 2 full blocks: 12 ms): the lookup asks again after the wait (counted);
    without a lower tier (disk or remote) the lookup never waits at all."""
    import time

    client = ReadClient(polls_to_answer=10**9)
    side = _read_side(client, disk=True)
    a = _read_request(side, "a")
    bound = side._reads.bound(_view(a), 0)
    assert bound == pytest.approx(0.012)
    for waits in (1, 2):  # the first lookup and the next step's each wait, bounded
        t0 = time.monotonic()
        assert side.lookup(a, 0) == (None, False)
        assert bound <= time.monotonic() - t0 < bound + 1.0
        assert side.counters.lookup_waits_timed_out == waits
        _empty_step(side)

    client = ReadClient(polls_to_answer=10**9)
    side = _read_side(client, disk=False)
    a = _read_request(side, "a")
    side.lookup(a, 0)
    _empty_step(side)
    polls = client.polls
    assert side.lookup(a, 0) == (None, False)
    assert client.polls == polls + 1 and side.counters.lookups_waited == 0


class UnplannedClient(ReadClient):
    """A client whose hit is accepted in phase B but whose step plans no load for it
    (what a failed engine's ``build_step`` does): the process seam's answer."""

    def __init__(self) -> None:
        super().__init__(polls_to_answer=0)

    def allocated(self, req_id: str, block_ids: Any, num_external_tokens: int) -> None:
        return None


def _sync_side(hit: int) -> Any:
    """A scheduler side with synchronous loads whose client answers ``hit`` tokens and
    plans no load for them (:class:`UnplannedClient`)."""
    import dataclasses

    client = UnplannedClient()
    client.hit = hit
    side = _read_side(client, disk=False)
    side.cfg = dataclasses.replace(side.cfg, sync_loads=True)
    return side


def test_vllm_sync_load_left_unplanned_is_failed_with_the_blocks_vllm_expects() -> None:
    """A synchronous load (``ConnectorConfig.sync_loads``): vLLM computes the request in
    the step that loads it, so a load the step did not plan must never be left for the
    forward to read. The lookup answers ``(8, False)``; phase B gets tables [[10, 11,
    12]] for 8 tokens (2 blocks of 4); the step plans no load: the metadata lists the
    request in ``sync_reqs`` and fails it with blocks (10, 11) -- the worker reports
    them as load errors and vLLM recomputes -- counted ``sync_loads_unplanned``."""
    side = _sync_side(8)
    a = _read_request(side, "a")
    assert side.lookup(a, 0) == (8, False)
    side.allocated(a, [[10, 11, 12]], 8)
    meta = _empty_step(side)
    assert meta.sync_reqs == ("a",)
    assert meta.failed_loads == {"a": (10, 11)}
    assert side.counters.sync_loads_unplanned == 1 and side.counters.lookups_sync == 1


def test_vllm_failed_sync_load_names_the_blocks_after_the_local_hit() -> None:
    """Hazard: a failed load reported with the local hit's blocks. vLLM calls
    ``update_state_after_alloc`` before it sets the request's ``num_computed_tokens``
    (it reads 0 there), so counting the local hit from the request named the prefix
    cache's own block: request a has a 4-token local hit (block 9, maybe shared with a
    running request) and a 4-token kvshm hit (block 10); its load is left unplanned.
    Reporting (9,) would make vLLM recompute whoever shares block 9 and count block 10,
    never loaded, as computed; the metadata must fail (10,): the blocks after the local
    hit the lookup was given."""
    side = _sync_side(4)
    a = _read_request(side, "a")
    assert side.lookup(a, 4) == (4, False)
    assert a.num_computed_tokens == 0  # as vLLM leaves it until after the allocation
    side.allocated(a, [[9, 10, 11]], 4)
    meta = _empty_step(side)
    assert meta.sync_reqs == ("a",)
    assert meta.failed_loads == {"a": (10,)}
    assert side.counters.sync_loads_unplanned == 1
