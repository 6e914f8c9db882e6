"""A run of one-position walks selected at once (``StorePlanner.pick_run``, used by
``RequestTracker.select`` for a decode step's requests) decides exactly what walking
them one by one decides.

Two levels: ``pick_run`` against ``walk`` per cursor, over drawn pool states (blocks and
keys repeated within the run, in flight, cached, being loaded, GPU hashes that differ,
too few CPU blocks), where a pick changes nothing unless every walk would pick; and
whole manager steps of a drawn decode trace (requests sharing prefix blocks, stores
acked late or never, a small CPU tier) with the run path and with it switched off,
which must plan the same transfers and end in the same state."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from manager_rig import BS, Req, Rig, manager_state

from kvshm.offload.counters import ManagerCounters
from kvshm.offload.groups import GroupSet
from kvshm.offload.jobs import Selection
from kvshm.offload.pool import BlockPool
from kvshm.offload.stores import StorePlanner
from kvshm.types import KVGroup

H = [bytes([i]) * 16 for i in range(12)]


@dataclass
class _Cur:
    """A request's store tracking as the planner reads it."""

    tables: list[list[int]]
    hashes: Sequence[bytes]
    cursor: int = 0


def _state(gpu_h: list[int | None], cached: set[int], inflight: set[int],
           keys_inflight: set[int], loading: set[int]) -> StorePlanner:
    """A one-group planner over a 12-block GPU pool hashed as ``gpu_h`` says (block
    ``b`` carries ``H[gpu_h[b]]``), a CPU tier holding ``cached``, those GPU ids and
    keys in flight and ``loading`` being loaded."""
    gpu, cpu = BlockPool(12), BlockPool(16)
    gpu.allocate(12)
    for b, h in enumerate(gpu_h):
        if h is not None:
            gpu.add_hashes(b, [H[h]])
    for c, h in zip(cpu.allocate(len(cached)), sorted(cached)):
        cpu.add_hashes(c, [H[h]])
    plan = StorePlanner(cpu, gpu, GroupSet((KVGroup.full(),), 16), 16, ManagerCounters(), 8,
                        loading)
    plan.inflight_gpu.update(inflight)
    plan.inflight_keys.update(H[k] for k in keys_inflight)
    return plan

# (block, key, position): blocks and keys from a few values so that runs repeat them; a
# key of None is the block's own hash (what the GPU block carries when it is hashed)
run_s = st.lists(st.tuples(st.integers(0, 5), st.one_of(st.none(), st.integers(0, 5)),
                           st.integers(0, 3)), min_size=1, max_size=6)
few_s = st.sets(st.integers(0, 5), max_size=2)
# a GPU block's hash: its own (H[b]), none, or another block's
gpu_s = st.lists(st.one_of(st.just("own"), st.none(), st.integers(0, 5)), min_size=12,
                 max_size=12).map(lambda hs: [b if h == "own" else h for b, h in enumerate(hs)])


def _outcome(plan: Any, curs: list[_Cur], sel: Selection, left: int) -> tuple[Any, ...]:
    return (left, [c.cursor for c in curs], sel.gpu_ids, sel.groups, sel.keys, sel.depths,
            sel.to_touch, sorted(plan.inflight_gpu), sorted(plan.inflight_keys),
            plan.counters.as_dict())


@settings(max_examples=400, deadline=None)
@given(gpu_h=gpu_s, run=run_s, cached=few_s, inflight=few_s, keys_inflight=few_s,
       loading=few_s, avail=st.integers(0, 8))
def test_pick_run_picks_what_walking_one_by_one_picks(
        gpu_h: list[int | None], run: list[tuple[int, int | None, int]], cached: set[int],
        inflight: set[int], keys_inflight: set[int], loading: set[int], avail: int) -> None:
    """Each run entry (block, key, position) is a cursor whose one position to walk
    holds that block and hash."""
    entries = [(b, b if k is None else k, p) for b, k, p in run]
    out = []
    picked = False
    for batch in (True, False):
        plan = _state(gpu_h, cached, inflight, keys_inflight, loading)
        curs = [_Cur([[0] * p + [b]], [H[0]] * p + [H[k]], p) for b, k, p in entries]
        sel = Selection()
        left = avail
        if batch and avail >= len(entries) and plan.pick_run(
                [b for b, _, _ in entries], [H[k] for _, k, _ in entries],
                [p for _, _, p in entries], sel):
            picked = True
            for c in curs:
                c.cursor += 1
            left -= len(entries)
        elif batch:  # refused: nothing changed
            assert (sel.gpu_ids, sorted(plan.inflight_gpu), sorted(plan.inflight_keys)) == \
                ([], sorted(inflight), sorted(H[k] for k in keys_inflight))
            for c in curs:
                left = plan.walk(c, c.cursor + 1, left, (), sel)
        else:
            for c in curs:
                left = plan.walk(c, c.cursor + 1, left, (), sel)
        out.append(_outcome(plan, curs, sel, left))
    assert out[0] == out[1]
    if picked:
        assert out[1][1] == [p + 1 for _, _, p in entries]  # every walk picked


def test_pick_run_takes_a_plain_decode_run() -> None:
    """Distinct hashed blocks, nothing in flight, cached or loading: taken at once (so
    the property test above is not only exercising refusals)."""
    plan = _state(list(range(12)), set(), set(), set(), set())
    sel = Selection()
    assert plan.pick_run([3, 5, 7], [H[3], H[5], H[7]], [2, 0, 4], sel)
    assert (sel.gpu_ids, sel.groups, sel.keys, sel.depths, sel.to_touch) == \
        ([3, 5, 7], [0, 0, 0], [H[3], H[5], H[7]], [2, 0, 4], [3, 5, 7])
    assert plan.inflight_gpu == {3, 5, 7} and plan.inflight_keys == {H[3], H[5], H[7]}


step_s = st.lists(st.tuples(st.integers(0, 4), st.booleans(), st.booleans()),
                  min_size=1, max_size=6)


def _drive(rig: Rig, reqs: list[Req], tables: list[list[int]], steps: list[Any],
           ack_every: int, batch: bool) -> list[Any]:
    """Run the drawn trace; the plans' store pairs and the manager's state per step."""
    if not batch:
        rig.m._stores.pick_run = lambda *a: False  # type: ignore[method-assign]
    confirmed = [2] * len(reqs)
    out: list[Any] = []
    pending: list[Any] = []
    first = rig.step(*[r.sched(t, confirmed=2 * BS, new=True) for r, t in zip(reqs, tables)])
    pending.append(first.store)
    for n, moves in enumerate(steps):
        listed: list[Any] = []
        for i, grow, confirm in moves:
            i %= len(reqs)
            r, t = reqs[i], tables[i]
            if any(x.req_id == r.rid for x in listed):
                continue
            nb: tuple[int, ...] = ()
            if grow and len(t) < len(r.h):
                nb = (rig.alloc(1)[0],)
                t.append(nb[0])
            if confirm and confirmed[i] < len(t):
                rig.hash([t[confirmed[i]]], [r.h[confirmed[i]]])
                confirmed[i] += 1
            listed.append(r.sched(nb, confirmed=confirmed[i] * BS))
        plan = rig.step(*listed)
        out.append((plan.store and (plan.store.src_ids, plan.store.dst_ids),
                    manager_state(rig.m)))
        pending.append(plan.store)
        if n % ack_every == 0:
            for t in pending:
                if t is not None:
                    rig.ack(t)
            pending.clear()
    return out


@settings(max_examples=150, deadline=None)
@given(n_reqs=st.integers(2, 4), shared=st.integers(0, 2), cpu=st.integers(3, 12),
       steps=st.lists(step_s, min_size=1, max_size=8), ack_every=st.integers(1, 3))
def test_select_with_runs_plans_what_select_without_them_plans(
        n_reqs: int, shared: int, cpu: int, steps: list[Any], ack_every: int) -> None:
    """Requests whose first ``shared`` blocks are the same GPU blocks (a shared
    prefix), growing and confirming a block at a time, stores acked every
    ``ack_every`` steps: the same plans and the same state either way."""
    results = []
    for batch in (True, False):
        rig = Rig(cpu=cpu, gpu=64)
        reqs = [Req(f"r{i}", 12 * BS, base=0 if i % 2 else 100) for i in range(n_reqs)]
        base = rig.alloc(shared, reqs[0].h)
        tables = []
        for r in reqs:
            own = rig.alloc(2 - min(shared, 2) + 1)
            t = (base[:2] if r.h[:shared] == reqs[0].h[:shared] else []) + own
            t = t[:3] if len(t) >= 3 else t + rig.alloc(3 - len(t))
            rig.hash(t[:2], r.h[:2])
            tables.append(t)
        results.append(_drive(rig, reqs, tables, steps, ack_every, batch))
    assert results[0] == results[1]


def test_pick_run_refuses_what_one_walk_would_decline() -> None:
    """Each refusal on its own, nothing changed by it: a block twice (its GPU copy
    unhashed, so both keys would pass the hash test), a key twice (on two unhashed
    blocks), a GPU block hashed
    for another key, a block being loaded into, a key in flight, a cached key."""
    gpu_h: list[int | None] = [0, 1, 2, 3, None, 5, None, 7, 8, 9, 10, 11]
    cases: list[tuple[list[int], list[int], set[int], set[int]]] = [
        ([4, 4], [1, 2], set(), set()),  # block 4 twice
        ([4, 6], [1, 1], set(), set()),  # key 1 twice
        ([1, 2], [1, 3], set(), set()),  # block 2 carries H[2], not H[3]
        ([1, 2], [1, 2], {2}, set()),  # block 2 is a load's destination
        ([1, 2], [1, 2], set(), {2}),  # H[2] cached
    ]
    for blocks, keys, loading, cached in cases:
        plan = _state(gpu_h, cached, set(), set(), loading)
        sel = Selection()
        assert not plan.pick_run(blocks, [H[k] for k in keys], [0] * len(blocks), sel)
        assert sel.gpu_ids == [] and not plan.inflight_gpu and not plan.inflight_keys
    plan = _state(gpu_h, set(), set(), {2}, set())
    assert not plan.pick_run([1, 2], [H[1], H[2]], [0, 0], Selection())  # H[2] in flight
