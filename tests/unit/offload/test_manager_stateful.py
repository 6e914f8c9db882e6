"""Hypothesis state machine: a toy engine drives the OffloadManager at random.

The engine admits requests (GPU prefix hit, ``lookup``, allocation, partial acceptance,
``allocated``), runs steps (prefill, then one token per step), preempts and finishes
requests, resets, and plays 1-4 worker ranks that ack jobs out of order, fail acks and
die, over a CPU tier of every eviction order (``kvshm.config.Eviction``). After every
rule ``check_invariants()`` runs, and an independent oracle -- every
(job, rank) copy not yet acked -- checks that no GPU block the engine allocates and no
CPU block a new job uses is still under copy by any rank. At teardown (everything
acked, every request finished) both pools hold zero pins, and no request was ever left
waiting for a load result.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvshm.config import Eviction
from kvshm.hashing import chain_hashes, hash_block
from kvshm.ipc.protocol import Direction, Transfer, unpack_ids
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.types import KVGroup, RequestView, ScheduledRequest, StepInput, StepPlan, StoreMode

BS = 2
BASES = [list(range(b * 100, b * 100 + 10)) for b in range(3)]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SimReq:
    """The engine's view of one request."""

    def __init__(self, rid: str, tokens: list[int], remote: bool) -> None:
        self.rid = rid
        self.tokens = tokens
        self.hashes = chain_hashes(tokens, BS)
        self.params = {"do_remote_decode": True} if remote else None
        self.status = "waiting"
        self.tables: list[list[int]] = []
        self.new_ids: list[list[int]] = []
        self.computed = 0
        self.local = 0
        self.after_load = 0
        self.listed = False
        self.preempted = False
        self.max_len = len(tokens) + 6

    def append_token(self, t: int) -> None:
        self.tokens.append(t)
        if len(self.tokens) % BS == 0:
            parent = self.hashes[-1] if self.hashes else None
            self.hashes.append(hash_block(parent, self.tokens[-BS:]))


class ManagerMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(ws=st.integers(1, 4), hybrid=st.booleans(), lazy=st.booleans(),
                eviction=st.sampled_from(list(Eviction)))
    def setup(self, ws: int, hybrid: bool, lazy: bool, eviction: Eviction) -> None:
        hybrid = hybrid and not lazy
        groups = (KVGroup.full(), KVGroup.sliding_window(2 * BS)) if hybrid else (KVGroup.full(),)
        self.ng = len(groups)
        self.gpu = BlockPool(24 if hybrid else 16)
        self.cpu = BlockPool(12, eviction=eviction)
        self.m = OffloadManager(self.cpu, self.gpu, block_size=BS, groups=groups,
                                world_size=ws, mode=StoreMode.LAZY if lazy else StoreMode.EAGER,
                                lazy_window=4)
        self.ws = ws
        self.revoked: set[int] = set()
        self.reqs: dict[str, SimReq] = {}
        self.n_req = 0
        self.n_step = 0
        self.unique = 10_000
        self.out: dict[int, tuple[Transfer, set[int]]] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        """Run one request per base prompt to completion and evict the GPU cache, so the
        CPU tier holds prefixes for the random requests to hit."""
        for base in range(len(BASES)):
            self.add_request(base, 10, 1, False)
            r = self.reqs[f"r{self.n_req}"]
            self.admit(10**6, 0)
            self.step_and_ack()
            self.step_and_ack()
            self._finish(r)
            self.step_and_ack()
        self.gpu_pressure()

    # ---- oracle ------------------------------------------------------------------------

    def _under_copy(self) -> tuple[set[int], set[int], set[int], set[int]]:
        """(GPU read by stores, GPU written by loads, CPU written by stores, CPU read by
        loads) over every copy some live rank has not acked."""
        gr, gw, cw, cr = set(), set(), set(), set()
        for t, _ranks in self.out.values():
            src, dst = unpack_ids(t.src_ids), unpack_ids(t.dst_ids)
            if t.direction is Direction.STORE:
                gr.update(src)
                cw.update(dst)
            else:
                cr.update(src)
                gw.update(dst)
        return gr, gw, cw, cr

    def _gpu_alloc(self, n: int) -> list[int]:
        ids = self.gpu.allocate(n)
        gr, gw, _, _ = self._under_copy()
        assert not (set(ids) & (gr | gw)), f"GPU blocks {ids} reused while under copy"
        return ids

    def _take_plan(self, plan: StepPlan) -> None:
        gr, gw, cw, cr = self._under_copy()
        live = set(range(self.ws)) - self.m._jobs.dead
        for t in (plan.store, plan.load):
            if t is None:
                continue
            src, dst = unpack_ids(t.src_ids), unpack_ids(t.dst_ids)
            assert len(src) == len(dst) and t.job_id not in self.out
            if t.direction is Direction.STORE:
                assert not set(dst) & (cw | cr), "CPU block reused while under copy"
                assert not set(src) & gw, "store reads a block a load is writing"
            else:
                assert not set(src) & cw, "load reads a CPU block being written"
                assert not set(dst) & (gr | gw), "load writes a GPU block under copy"
            self.out[t.job_id] = (t, set(live))
        for res in self.m.take_load_results():
            r = self.reqs.get(res.req_id)
            if r is None or r.status != "loading":
                continue
            r.status = "running"
            if res.ok:
                r.computed = r.after_load
                self._hash_loaded(r)
            else:
                r.computed = r.local * BS

    def _hash_loaded(self, r: SimReq) -> None:
        end = r.computed // BS
        nsw = cdiv(2 * BS - 1, BS)
        for p in range(r.local, end):
            self.gpu.add_hashes(r.tables[0][p], [r.hashes[p]])
            if self.ng > 1 and p >= end - nsw:
                self.gpu.add_hashes(r.tables[1][p], [r.hashes[p]])

    # ---- requests ----------------------------------------------------------------------

    @rule(base=st.integers(0, 2), keep=st.integers(0, 10), extra=st.integers(1, 3),
          remote=st.sampled_from([False, False, True]), accept=st.integers(0, 8),
          pressure=st.booleans())
    def add_and_admit(self, base: int, keep: int, extra: int, remote: bool, accept: int,
                      pressure: bool) -> None:
        """A new request sharing a prefix with earlier ones; maybe GPU pressure first
        (so its prefix is found in the CPU tier); admitted at once if it fits."""
        if pressure:
            self.gpu_pressure()
        self.add_request(base, keep, extra, remote)
        self._admit(self.reqs[f"r{self.n_req}"], accept)

    def add_request(self, base: int, keep: int, extra: int, remote: bool) -> None:
        tokens = BASES[base][:keep] + list(range(self.unique, self.unique + extra))
        self.unique += extra
        self.n_req += 1
        rid = f"r{self.n_req}"
        self.reqs[rid] = SimReq(rid, tokens, remote)

    def _pick(self, status: str, i: int) -> SimReq | None:
        cands = sorted((r for r in self.reqs.values() if r.status == status), key=lambda r: r.rid)
        return cands[i % len(cands)] if cands else None

    @rule(i=st.integers(0, 20), accept=st.integers(0, 8))
    def admit(self, i: int, accept: int) -> None:
        r = self._pick("waiting", i)
        if r is not None:
            self._admit(r, accept)

    def _admit(self, r: SimReq, accept: int) -> None:
        local: list[int] = []
        if self.ng == 1:
            for h in r.hashes[: (len(r.tokens) - 1) // BS]:
                b = self.gpu.get_cached(h)
                if b is None:
                    break
                local.append(b)
        self.gpu.touch(local)
        ext = self.m.lookup(RequestView(r.rid, r.hashes, len(r.tokens), r.params), len(local) * BS)
        need = cdiv(len(r.tokens), BS) - len(local)
        if ext is None or self.gpu.num_free < need * self.ng:
            self.gpu.free(reversed(local))
            return
        tables = [local + self._gpu_alloc(need)] + [self._gpu_alloc(need + len(local))
                                                    for _ in range(self.ng - 1)]
        acc = min(accept, ext // BS) * BS
        self.m.allocated(r.rid, tables, acc)
        r.tables, r.new_ids = tables, [list(t) for t in tables]
        r.local, r.listed = len(local), False
        if acc:
            r.status, r.after_load = "loading", len(local) * BS + acc
        else:
            r.status, r.computed = "running", len(local) * BS

    def gpu_pressure(self) -> None:
        """Other work takes every free GPU block and returns it: the GPU prefix cache is
        evicted (so later requests hit the CPU tier)."""
        ids = self._gpu_alloc(self.gpu.num_free)
        self.gpu.free(ids)

    @rule(i=st.integers(0, 20))
    def preempt(self, i: int) -> None:
        r = self._pick("running", i)
        if r is None:
            return
        for t in r.tables:
            self.gpu.free(reversed(t))
        r.status, r.tables, r.computed, r.preempted = "waiting", [], 0, True

    @rule(i=st.integers(0, 20), which=st.sampled_from(["done", "running", "waiting", "loading"]))
    def finish(self, i: int, which: str) -> None:
        """A request that has generated all its tokens ends, or one is aborted."""
        if which == "done":
            cands = sorted((r for r in self.reqs.values()
                            if r.status == "running" and r.computed >= r.max_len),
                           key=lambda r: r.rid)
            r = cands[i % len(cands)] if cands else None
        else:
            r = self._pick(which, i)
        if r is not None:
            self._finish(r)

    def _finish(self, r: SimReq) -> None:
        tables = r.tables if r.tables else [[] for _ in range(self.ng)]
        confirmed = r.computed if r.status == "running" else 0
        assert self.m.finished(r.rid, confirmed, tables, block_hashes=r.hashes) is False
        for t in r.tables:
            self.gpu.free(reversed(t))
        del self.reqs[r.rid]

    # ---- steps and workers -------------------------------------------------------------

    @rule(acks=st.sampled_from(["none", "all", "lagging_rank", "one_fails"]),
          fault=st.sampled_from(["none"] * 12 + ["reset", "kill_rank", "fence"]),
          rank=st.integers(0, 3))
    def step(self, acks: str, fault: str, rank: int) -> None:
        """One engine step; then the workers ack nothing, everything, everything but the
        last live rank (a slow rank keeps jobs in flight), or everything with the first
        ack failing -- after, maybe, a reset or a rank's death with the step's jobs in
        flight."""
        self._step()
        if fault == "reset":
            self._reset()
        elif fault == "kill_rank" and self.n_step >= 6:
            self._kill_rank(rank % self.ws)
        elif fault == "fence":
            self._fence_revoked()
        if acks != "none":
            self._ack_pending(lag=acks == "lagging_rank", fail_first=acks == "one_fails")

    def step_and_ack(self) -> None:
        self._step()
        self._ack_pending()

    def _ack_pending(self, *, lag: bool = False, fail_first: bool = False) -> None:
        ok = not fail_first
        for job, (_, ranks) in list(self.out.items()):
            for rank in sorted(ranks - self.revoked)[: -1 if lag else None]:
                self.m.on_done(job, rank, ok)
                self._acked(job, rank)
                ok = True

    def _step(self) -> None:
        self.n_step += 1
        listed: list[ScheduledRequest] = []
        allocated: list[int] = []
        scheduled: list[SimReq] = []
        for r in sorted(self.reqs.values(), key=lambda r: r.rid):
            if r.status != "running" or r.computed >= len(r.tokens):
                continue
            if cdiv(len(r.tokens), BS) > len(r.tables[0]):
                if self.gpu.num_free < self.ng:
                    continue
                for g in range(self.ng):
                    [b] = self._gpu_alloc(1)
                    r.tables[g].append(b)
                    r.new_ids[g].append(b)
                    allocated.append(b)
            listed.append(ScheduledRequest(
                r.rid, r.hashes, len(r.tokens), tuple(tuple(x) for x in r.new_ids),
                not r.listed, r.computed, r.preempted and not r.listed, r.params))
            r.listed, r.preempted = True, False
            r.new_ids = [[] for _ in range(self.ng)]
            scheduled.append(r)
        plan = self.m.build_step(StepInput(self.n_step, listed, (), allocated))
        assert plan.flush == ()
        self._take_plan(plan)
        for r in scheduled:
            r.computed = len(r.tokens)
            for p in range(min(r.computed // BS, len(r.hashes))):
                for g in range(self.ng):
                    self.gpu.add_hashes(r.tables[g][p], [r.hashes[p]])
            if len(r.tokens) < r.max_len:
                r.append_token(self.unique)
                self.unique += 1

    @precondition(lambda self: bool(self.out))
    @rule(i=st.integers(0, 50), ok=st.booleans())
    def ack(self, i: int, ok: bool) -> None:
        pairs = sorted((j, k) for j, (_, ranks) in self.out.items() for k in ranks)
        job, rank = pairs[i % len(pairs)]
        self.m.on_done(job, rank, ok)
        self._acked(job, rank)

    def _acked(self, job: int, rank: int) -> None:
        ranks = self.out[job][1]
        ranks.discard(rank)
        if not ranks:
            del self.out[job]

    @rule(job=st.integers(0, 200), rank=st.integers(-1, 5))
    def stray_ack(self, job: int, rank: int) -> None:
        """An ack nobody is waiting for: counted and ignored."""
        if job in self.out and rank in self.out[job][1]:
            return
        before = self.m.counters.acks_unknown + self.m.counters.acks_duplicate
        self.m.on_done(job, rank, True)
        assert self.m.counters.acks_unknown + self.m.counters.acks_duplicate == before + 1

    def _kill_rank(self, rank: int) -> None:
        """Declared dead, not fenced: its outstanding copies may still run, so the model
        keeps them under copy (and it acks nothing more) until :meth:`_fence_revoked`."""
        if rank in self.m._jobs.dead or rank in self.revoked:
            return
        self.m.rank_failed(rank)
        self.revoked.add(rank)
        assert self.m.lookup(RequestView("probe", chain_hashes(BASES[0], BS), 10), 0) == 0
        self.m.finished("probe", 0, [[] for _ in range(self.ng)])

    def _fence_revoked(self) -> None:
        """Every revoked rank's process is gone: its unacked jobs count as acked."""
        for rank in sorted(self.revoked):
            self.m.rank_fenced(rank)
            for job in list(self.out):
                if rank in self.out[job][1]:
                    self._acked(job, rank)
        self.revoked.clear()

    def _reset(self) -> None:
        done = self.m.reset()  # jobs waiting only for revoked ranks do not hold it up
        assert done == all(ranks <= self.revoked for _, ranks in self.out.values())

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "m"):
            return
        self.m.check_invariants()
        gr, gw, cw, cr = self._under_copy()
        for b in gr | gw:
            assert self.gpu.ref_cnt(b) > 0, f"GPU block {b} is under copy but unpinned"
        for b in cw | cr:
            assert self.cpu.ref_cnt(b) > 0, f"CPU block {b} is under copy but unpinned"
        for b in cw:
            assert not self.cpu.block_hashes(b), f"CPU block {b} hits while being written"

    # ---- teardown ----------------------------------------------------------------------

    def _ack_all(self) -> None:
        self._fence_revoked()
        for job, (_, ranks) in list(self.out.items()):
            for rank in sorted(ranks):
                self.m.on_done(job, rank, True)
        self.out.clear()

    def teardown(self) -> None:
        if not hasattr(self, "m"):
            return
        for _ in range(30):
            self._ack_all()
            self._step()
            if not any(r.status == "loading" for r in self.reqs.values()):
                break
        assert not any(r.status == "loading" for r in self.reqs.values()), "load never resolved"
        for r in list(self.reqs.values()):
            self._finish(r)
        for _ in range(30):
            self._ack_all()
            if not self.m.has_pending_work():
                break
            self._take_plan(self.m.build_step(StepInput(self.n_step, ())))
        assert not self.m.has_pending_work() and not self.out
        self.m.check_invariants()
        assert self.m.pins_held() == 0
        assert self.cpu.num_pinned == 0 and self.gpu.num_pinned == 0


def _settings() -> settings:
    return settings(max_examples=200, stateful_step_count=60, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


ManagerMachine.TestCase.settings = _settings()
test_manager_state_machine = ManagerMachine.TestCase
