"""Hypothesis state machine: invalid calls interleaved with valid traffic.

A toy engine drives the OffloadManager with valid traffic (admissions with CPU hits and
partial acceptance, steps that grow requests, finishes, resets, acks now or later) and,
between its calls, makes invalid ones: wrong types, None, unhashable ids and hashes,
hashes that are not bytes or too short, block ids out of range, negative, ``bool`` or
repeated, the wrong number of tables, negative or fractional token counts, and steps
that list good requests next to a bad one. Every invalid call must raise
``InvalidRequest`` and change nothing (:func:`manager_state` before == after, but for
``invalid_calls`` + 1). After every rule ``check_invariants()`` holds and a canary makes
the whole round trip -- store a prefix, ack, look it up, load it, ack, finish -- so a
refusal that left a stray mark, pin or cursor behind would show as a canary that is not
stored or not loaded.

The model stays away from what kvshm.offload.validate leaves unchecked on purpose: fields of an
*unchanged* listed request that the step does not read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from manager_rig import manager_state

from kvshm.errors import InvalidRequest
from kvshm.hashing import chain_hashes, hash_block
from kvshm.ipc.protocol import Transfer
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.types import (
    KVGroup,
    LoadResult,
    RequestView,
    ScheduledRequest,
    StepInput,
    StepPlan,
)

BS = 2
GPU = 32
BASES = [list(range(b * 100, b * 100 + 8)) for b in range(2)]
CANARY_BLOCKS = 2


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimReq:
    """The toy engine's request."""

    def __init__(self, rid: str, tokens: list[int], ngroups: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.hashes = chain_hashes(tokens, BS)
        self.status = "running"
        self.tables: list[list[int]] = [[] for _ in range(ngroups)]
        self.new_ids: list[list[int]] = [[] for _ in range(ngroups)]
        self.computed = 0
        self.listed = False
        self.max_len = len(tokens) + 4

    def grow(self, t: int) -> None:
        self.tokens.append(t)
        if len(self.tokens) % BS == 0:
            self.hashes.append(hash_block(self.hashes[-1] if self.hashes else None,
                                          self.tokens[-BS:]))

    def listing(self) -> ScheduledRequest:
        return ScheduledRequest(self.rid, self.hashes, len(self.tokens),
                                tuple(tuple(x) for x in self.new_ids), not self.listed,
                                self.computed)


BAD_HASHES: list[Any] = [None, 7, "ab", [[1, 2]], [None], ["xy"], [b"short"], [b""]]
BAD_IDS: list[Any] = [GPU, GPU + 5, -1, True, "3", None, 2.0]
BAD_COUNTS: list[Any] = [-BS, -1, True, None, 2.5, "4"]
BAD_RIDS: list[Any] = [None, 5, ["r"], b"r"]


class InvalidTrafficMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(hybrid=st.booleans())
    def setup(self, hybrid: bool) -> None:
        groups = (KVGroup.full(), KVGroup.sliding_window(2 * BS)) if hybrid else (KVGroup.full(),)
        self.ng = len(groups)
        self.cpu = BlockPool(16)
        self.gpu = BlockPool(GPU)
        self.m = OffloadManager(self.cpu, self.gpu, block_size=BS, groups=groups, world_size=2)
        self.reqs: dict[str, SimReq] = {}
        self.out: dict[int, set[int]] = {}
        self.n = 0
        self.n_step = 0
        self.unique = 10_000
        self.canaries = 0

    # ---- the toy engine ------------------------------------------------------------------

    def _fresh(self, base: int, keep: int, extra: int) -> SimReq:
        tokens = BASES[base][:keep] + list(range(self.unique, self.unique + extra))
        self.unique += extra
        self.n += 1
        return SimReq(f"r{self.n}", tokens, self.ng)

    def _room(self, blocks: int) -> bool:
        """``blocks`` more GPU blocks fit and leave the canary its tables."""
        return self.gpu.num_free >= blocks + (CANARY_BLOCKS + 1) * self.ng

    def _tables_for(self, r: SimReq) -> list[list[int]] | None:
        need = cdiv(len(r.tokens), BS)
        if not self._room(need * self.ng):
            return None
        return [self.gpu.allocate(need) for _ in range(self.ng)]

    def _admit(self, r: SimReq, ext: int | None, accept: int) -> None:
        """Phase B after a lookup that answered ``ext``."""
        tables = self._tables_for(r) if ext is not None else None
        if tables is None:
            if ext:
                self.m.allocated(r.rid, [[] for _ in range(self.ng)], 0)
            return
        acc = min(accept, (ext or 0) // BS) * BS
        self.m.allocated(r.rid, tables, acc)
        r.tables, r.new_ids = tables, [list(t) for t in tables]
        r.status = "loading" if acc else "running"
        self.reqs[r.rid] = r

    def _take(self, plan: StepPlan) -> list[LoadResult]:
        """Record the plan's jobs and apply the load outcomes drained since the last step."""
        for t in (plan.store, plan.load):
            if t is not None:
                self.out[t.job_id] = {0, 1}
        results = self.m.take_load_results()
        for res in results:
            r = self.reqs.get(res.req_id)
            if r is not None and r.status == "loading":
                r.status = "running"
                r.computed = res.num_tokens if res.ok else 0
        return results

    def _ack_all(self) -> None:
        for job, ranks in list(self.out.items()):
            for rank in sorted(ranks):
                self.m.on_done(job, rank, True)
        self.out.clear()

    def _listing(self) -> list[ScheduledRequest]:
        """This step's valid listing, from the model as it is (nothing changed)."""
        return [r.listing() for r in sorted(self.reqs.values(), key=lambda r: r.rid)
                if r.status == "running" and r.computed < len(r.tokens)]

    def _step(self) -> None:
        self.n_step += 1
        listed = []
        for r in sorted(self.reqs.values(), key=lambda r: r.rid):
            if r.status != "running" or r.computed >= len(r.tokens):
                continue
            if cdiv(len(r.tokens), BS) > len(r.tables[0]):
                if not self._room(self.ng):
                    continue
                for g in range(self.ng):
                    [b] = self.gpu.allocate(1)
                    r.tables[g].append(b)
                    r.new_ids[g].append(b)
            listed.append(r)
        plan = self.m.build_step(StepInput(self.n_step, [r.listing() for r in listed]))
        self._take(plan)
        for r in listed:
            r.listed, r.new_ids = True, [[] for _ in range(self.ng)]
            r.computed = len(r.tokens)
            for p in range(len(r.hashes)):
                for g in range(self.ng):
                    self.gpu.add_hashes(r.tables[g][p], [r.hashes[p]])
            if len(r.tokens) < r.max_len:
                r.grow(self.unique)
                self.unique += 1

    def _finish(self, r: SimReq) -> None:
        confirmed = r.computed if r.status == "running" else 0
        self.m.finished(r.rid, confirmed, r.tables)
        for t in r.tables:
            self.gpu.free(reversed(t))
        del self.reqs[r.rid]

    def _pick(self, i: int) -> SimReq | None:
        reqs = sorted(self.reqs.values(), key=lambda r: r.rid)
        return reqs[i % len(reqs)] if reqs else None

    # ---- valid traffic -------------------------------------------------------------------

    @rule(base=st.integers(0, 1), keep=st.integers(0, 8), extra=st.integers(1, 3),
          accept=st.integers(0, 4))
    def add(self, base: int, keep: int, extra: int, accept: int) -> None:
        r = self._fresh(base, keep, extra)
        ext = self.m.lookup(RequestView(r.rid, r.hashes, len(r.tokens)), 0)
        self._admit(r, ext, accept)

    @rule(ack=st.booleans())
    def step(self, ack: bool) -> None:
        self._step()
        if ack:
            self._ack_all()

    @rule(i=st.integers(0, 20))
    def finish(self, i: int) -> None:
        r = self._pick(i)
        if r is not None:
            self._finish(r)

    @rule()
    def reset(self) -> None:
        self.m.reset()

    # ---- invalid calls -------------------------------------------------------------------

    def _refused(self, call: Callable[[], object]) -> None:
        before = manager_state(self.m)
        n_invalid = self.m.counters.invalid_calls
        try:
            call()
        except InvalidRequest:
            pass
        else:
            raise AssertionError("an invalid call was accepted")
        assert manager_state(self.m) == before, "a refused call changed the manager"
        assert self.m.counters.invalid_calls == n_invalid + 1

    @rule(data=st.data())
    def bad_lookup(self, data: st.DataObject) -> None:
        """A lookup whose request or count is bad, for a new or a known request."""
        r = self._pick(data.draw(st.integers(0, 20), "i")) or self._fresh(0, 4, 1)
        kind = data.draw(st.sampled_from(["hashes", "rid", "local", "tokens", "params"]))
        rid: Any = r.rid
        hashes: Any = r.hashes
        ntok: Any = len(r.tokens)
        local: Any = 0
        params: Any = None
        if kind == "hashes":
            hashes = data.draw(st.sampled_from(BAD_HASHES))
            if isinstance(hashes, list):
                hashes = hashes[:1] * max(1, min(len(r.tokens) // BS, 3))
                ntok = max(ntok, len(hashes) * BS + 1)
        elif kind == "rid":
            rid = data.draw(st.sampled_from(BAD_RIDS))
        elif kind == "local":
            local = data.draw(st.sampled_from([*BAD_COUNTS, ntok + BS]))
        elif kind == "tokens":
            ntok = data.draw(st.sampled_from([-1, None, 1.5, len(r.hashes) * BS - 1]))
        else:
            params = data.draw(st.sampled_from(["x", ["do_remote_decode"], 3]))
        self._refused(lambda: self.m.lookup(RequestView(rid, hashes, ntok, params), local))

    def _bad_tables(self, data: st.DataObject, good: list[list[int]]) -> Any:
        kind = data.draw(st.sampled_from(["count", "id", "repeat", "not_a_table"]))
        if kind == "count":
            return data.draw(st.sampled_from([[], [*good, [0]], [good[0]] * (self.ng + 1)]))
        if kind == "not_a_table":
            return data.draw(st.sampled_from([None, "ab", [None] * self.ng, 5]))
        tables = [list(t) for t in good]
        g = data.draw(st.integers(0, self.ng - 1))
        if kind == "repeat":
            tables[g] = tables[g] + [tables[g][0]] if tables[g] else [3, 3]
        else:
            pos = data.draw(st.integers(0, len(tables[g])))
            tables[g].insert(pos, data.draw(st.sampled_from(BAD_IDS)))
        return tables

    @rule(data=st.data(), base=st.integers(0, 1), accept=st.integers(0, 4))
    def bad_allocated(self, data: st.DataObject, base: int, accept: int) -> None:
        """A fresh request looks up its prefix (maybe pinning a hit); its phase B is
        first sent with a bad table, id or count (refused), then correctly."""
        r = self._fresh(base, 8, 1)
        ext = self.m.lookup(RequestView(r.rid, r.hashes, len(r.tokens)), 0)
        good = [list(range(cdiv(len(r.tokens), BS))) for _ in range(self.ng)]
        kind = data.draw(st.sampled_from(["tables", "tokens", "rid", "too_many"]))
        rid: Any = r.rid
        tables: Any = good
        tokens: Any = (ext or 0)
        if kind == "tables":
            tables = self._bad_tables(data, good)
        elif kind == "tokens":
            tokens = data.draw(st.sampled_from(BAD_COUNTS))
        elif kind == "rid":
            rid = data.draw(st.sampled_from(BAD_RIDS))
        elif ext:
            tokens = ext + BS                                  # more than offered
        else:
            tables = [[GPU]] * self.ng
        self._refused(lambda: self.m.allocated(rid, tables, tokens))
        self._admit(r, ext, accept)

    @rule(data=st.data(), i=st.integers(0, 20))
    def bad_finished(self, data: st.DataObject, i: int) -> None:
        r = self._pick(i)
        if r is None:
            return
        kind = data.draw(st.sampled_from(["tables", "confirmed", "hashes", "rid"]))
        rid: Any = r.rid
        tables: Any = r.tables
        confirmed: Any = r.computed if r.status == "running" else 0
        kw: dict[str, Any] = {}
        if kind == "tables":
            tables = self._bad_tables(data, r.tables)
        elif kind == "confirmed":
            confirmed = data.draw(st.sampled_from(BAD_COUNTS))
        elif kind == "rid":
            rid = data.draw(st.sampled_from(BAD_RIDS))
        else:
            bad = data.draw(st.sampled_from(BAD_HASHES[1:]))   # None: no explicit hashes
            kw["block_hashes"] = (r.hashes + bad) if isinstance(bad, list) else bad
        self._refused(lambda: self.m.finished(rid, confirmed, tables, **kw))

    def _bad_known(self, data: st.DataObject) -> ScheduledRequest:
        """A listed request whose change is bad: a bad appended id, a negative
        confirmed count."""
        known = sorted((r for r in self.reqs.values() if r.listed), key=lambda r: r.rid)
        r = known[data.draw(st.integers(0, len(known) - 1))]
        if data.draw(st.booleans(), "append"):
            bad = data.draw(st.sampled_from(BAD_IDS[:5]))
            nb = tuple((bad,) if g == 0 else () for g in range(self.ng))
            return ScheduledRequest(r.rid, r.hashes, len(r.tokens), nb, False, r.computed)
        return ScheduledRequest(r.rid, r.hashes, len(r.tokens), r.listing().new_block_ids,
                                False, data.draw(st.sampled_from([-BS, -1])))

    def _bad_new(self, data: st.DataObject) -> ScheduledRequest:
        """A new request with one bad field."""
        c = self._fresh(data.draw(st.integers(0, 1)), 4, 1)
        table = tuple(range(GPU - 3, GPU))
        fields: dict[str, Any] = {
            "req_id": c.rid, "block_hashes": c.hashes, "num_tokens": len(c.tokens),
            "new_block_ids": (table,) * self.ng, "new_or_resumed": True,
            "num_confirmed_tokens": 4, "preempted": False, "kv_transfer_params": None}
        kind = data.draw(st.sampled_from(sorted(fields)))
        fields[kind] = data.draw(st.sampled_from({
            "req_id": BAD_RIDS,
            "block_hashes": [None, 7, "ab", [[1]] * 2, [None] * 2, [b"x"] * 2],
            "num_tokens": [-1, None, 3],
            "new_block_ids": [(), (table,) * (self.ng + 1), ((GPU,),) * self.ng,
                              ((1, 1, 2),) * self.ng, ((True, 0, 1),) * self.ng],
            "new_or_resumed": [None, 1],
            "num_confirmed_tokens": BAD_COUNTS,
            "preempted": [None, 0],
            "kv_transfer_params": ["x", 3],
        }[kind]))
        return ScheduledRequest(**fields)

    def _bad_listing(self, data: st.DataObject, bad: ScheduledRequest) -> None:
        """This step's valid listing with ``bad`` at any position: refused whole."""
        listing: list[Any] = self._listing()
        listing.insert(data.draw(st.integers(0, len(listing))), bad)
        self._refused(lambda: self.m.build_step(StepInput(self.n_step + 1, listing)))

    @rule(data=st.data())
    def bad_step_new_request(self, data: st.DataObject) -> None:
        self._bad_listing(data, self._bad_new(data))

    @precondition(lambda self: any(r.listed for r in self.reqs.values()))
    @rule(data=st.data())
    def bad_step_known_request(self, data: st.DataObject) -> None:
        self._bad_listing(data, self._bad_known(data))

    @rule(data=st.data())
    def bad_step_input(self, data: st.DataObject) -> None:
        """A good listing in a StepInput whose step number, finished ids or allocated
        ids are bad, or a new request listed twice."""
        listing: list[Any] = self._listing()
        step: Any = self.n_step + 1
        finished: Any = ()
        alloc: Any = ()
        which = data.draw(st.sampled_from(["twice", "step", "finished", "alloc"]))
        if which == "twice":
            c = self._fresh(0, 4, 1)
            new = ScheduledRequest(c.rid, c.hashes, len(c.tokens), ((0, 1, 2),) * self.ng,
                                   True, 0)
            listing += [new, new]
        elif which == "step":
            step = data.draw(st.sampled_from([-1, None, True, 1.0]))
        elif which == "finished":
            finished = data.draw(st.sampled_from(["r1", [None], [["r1"]], 4]))
        else:
            alloc = data.draw(st.sampled_from([[GPU], [-1], "ab", [None]]))
        self._refused(lambda: self.m.build_step(StepInput(step, listing, finished, alloc)))

    # ---- after every rule ----------------------------------------------------------------

    @invariant()
    def consistent_and_canary_round_trip(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        self._canary()
        self.m.check_invariants()

    def _ack(self, t: Transfer | None) -> None:
        if t is not None and t.job_id in self.out:
            for rank in sorted(self.out.pop(t.job_id)):
                self.m.on_done(t.job_id, rank, True)

    def _canary(self) -> None:
        """Store a fresh 2-block prefix, ack, look it up as another request, load it,
        ack, finish both: the CPU tier must serve it. Only the canary's own jobs are
        acked, so the model's stay in flight; everything is drained only where nothing
        could be planned otherwise (jobs abandoned by a reset, a full CPU tier)."""
        self.canaries += 1
        if self.m.outcomes.abandoned:
            self._ack_all()
        base = 50_000 + 10 * self.canaries
        toks = list(range(base, base + CANARY_BLOCKS * BS + 1))
        hashes = chain_hashes(toks, BS)
        rid = f"canary{self.canaries}"
        tables = [self.gpu.allocate(CANARY_BLOCKS + 1) for _ in range(self.ng)]
        for g in range(self.ng):
            for b, h in zip(tables[g], hashes):
                self.gpu.add_hashes(b, [h])
        keys = [self.m._gs.key(h, g) for h in hashes for g in range(self.ng)]
        listing = ScheduledRequest(rid, hashes, len(toks), tuple(tuple(t) for t in tables),
                                   True, CANARY_BLOCKS * BS)
        for _ in range(3):
            self.n_step += 1
            plan = self.m.build_step(StepInput(self.n_step, [listing]))
            self._take(plan)
            self._ack(plan.store)
            if all(self.cpu.is_cached(k) for k in keys):
                break
            self._ack_all()                                    # a full CPU tier: drain, retry
            listing = ScheduledRequest(rid, hashes, len(toks), ((),) * self.ng, False,
                                       CANARY_BLOCKS * BS)
        else:
            raise AssertionError("the canary's prefix was never stored")
        self.m.finished(rid, CANARY_BLOCKS * BS, tables)
        for t in tables:
            self.gpu.free(reversed(t))
        self._canary_load(hashes, len(toks))

    def _canary_load(self, hashes: list[bytes], ntok: int) -> None:
        rid = f"canary{self.canaries}b"
        assert self.m.lookup(RequestView(rid, hashes, ntok), 0) == CANARY_BLOCKS * BS
        tables = [self.gpu.allocate(CANARY_BLOCKS + 1) for _ in range(self.ng)]
        self.m.allocated(rid, tables, CANARY_BLOCKS * BS)
        self.n_step += 1
        plan = self.m.build_step(StepInput(self.n_step, []))
        assert plan.load is not None and plan.load_jobs[plan.load.job_id] == (rid,)
        self._take(plan)
        self._ack(plan.load)
        self.n_step += 1
        results = self._take(self.m.build_step(StepInput(self.n_step, [])))
        assert any(res.req_id == rid and res.ok and res.num_tokens == CANARY_BLOCKS * BS
                   for res in results), results
        self.m.finished(rid, 0, tables)
        for t in tables:
            self.gpu.free(reversed(t))

    # ---- teardown ------------------------------------------------------------------------

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for _ in range(10):
            self._ack_all()
            self._step()
            if not any(r.status == "loading" for r in self.reqs.values()):
                break
        for r in list(self.reqs.values()):
            self._finish(r)
        for _ in range(10):
            self._ack_all()
            if not self.m.has_pending_work():
                break
            self.n_step += 1
            self._take(self.m.build_step(StepInput(self.n_step, [])))
        self.m.check_invariants()
        assert self.m.pins_held() == 0 and self.cpu.num_pinned == 0 and self.gpu.num_pinned == 0


InvalidTrafficMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_invalid_calls_change_nothing = InvalidTrafficMachine.TestCase
