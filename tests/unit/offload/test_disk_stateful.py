"""Hypothesis stateful test of the manager with a CPU tier and a disk tier
(``kvshm.offload.disk``).

Random interleavings of stores (a small CPU tier: they evict), lookups (CPU hits, disk
reads after a CPU miss or a partial CPU hit), phase B, steps (write-back of the CPU
tier's next victims), per-rank acks of every job in any order (ok or failed), requests
finishing, ``reset``, a rank declared dead and later fenced. The test keeps a model of
the bytes: each rank's CPU rows and slab slots hold the key last written there by a job
that rank acked ok (a failed ack leaves garbage), and a "worker" acks a READ ok only
when every slot it reads holds the block the READ names (a real worker's header and
CRC check). After every rule the manager's own cross-check runs (every CPU pin recorded
exactly once; the slot table's invariants; every slot pin a disk job's). Checked here:

* no slot is both indexed and being written, and no slot is read while a WRITE of it
  is in flight nor written while a READ of it is (the jobs as posted);
* the ranks keep the row fence (``workers.disk_mover``): a store or READ into a CPU
  row runs on a rank only after the WRITEs posted before it that read the row (the
  model runs those first), and the disk jobs of a step are posted before its store --
  the WRITE of a block the store's allocation evicted goes down with the old bytes;
* every indexed slot holds its block on every rank, and every indexed CPU block holds
  its block on every rank (no wrong byte through either tier);
* once every job is acked and every request finished, nothing is pinned.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from manager_rig import Req
from requests_model import Requests
from test_disk_book import WORLD, DiskRig

from kvshm.ipc.protocol import Direction, Disk, DiskOp, Transfer, unpack_ids
from kvshm.offload.disk import warm_table
from kvshm.offload.jobs import StoreJob
from kvshm.offload.remote_puts import remote_hash

PROMPTS = [Req(f"p{i}", 4 * (1 + i % 3) + 1, base=100 * i) for i in range(6)]
KEYS = {remote_hash(h): h for r in PROMPTS for h in r.h}


@dataclass
class Posted:
    """A job as the workers got it, and the acks so far (rank -> ok)."""

    msg: Transfer | Disk
    pairs: list[tuple[int, int, bytes]]  # (CPU id, slot or -1, key)
    acks: dict[int, bool] = field(default_factory=dict)


class DiskMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rig = DiskRig(cpu=6, slots=10, window=4, max_job=2)  # long hits: several READs
        self.out: list[Posted] = []
        self.cpu_bytes: list[dict[int, bytes | None]] = [{} for _ in range(WORLD)]
        self.slot_bytes: list[dict[int, bytes | None]] = [{} for _ in range(WORLD)]
        self.reqs = Requests(self.rig)
        self.failed = False
        self.revoked: set[int] = set()
        self.n = 0
        self.scan: dict[int, bytes] | None = None  # a warm start's scan, until it ends

    # ---- posting ---------------------------------------------------------------------

    def _post_plan(self, plan_store: Transfer | None, plan_load: Transfer | None,
                   disk: tuple[Disk, ...]) -> None:
        self._post_disk(disk)  # before the store, as the runtime posts them
        for t in (plan_store, plan_load):
            if t is None:
                continue
            pairs: list[tuple[int, int, bytes]] = []
            job = self.rig.m._jobs.jobs.get(t.job_id)
            if t.direction is Direction.STORE and isinstance(job, StoreJob):
                pairs = [(c, -1, k) for c, k in zip(job.cpu_ids, job.keys)]
            self.out.append(Posted(t, pairs))

    def _post_disk(self, disk: tuple[Disk, ...]) -> None:
        for msg in disk:
            hs = [msg.hashes[i:i + 32] for i in range(0, len(msg.hashes), 32)]
            pairs = list(zip(unpack_ids(msg.cpu_ids), unpack_ids(msg.slots), hs))
            slots = {s for _, s, _ in pairs}
            assert msg.op is DiskOp.READ or not self.rig.book.warming, "a WRITE while warming"
            for p in self.out:
                if isinstance(p.msg, Disk) and len(p.acks) < WORLD:
                    theirs = {s for _, s, _ in p.pairs}
                    if msg.op is DiskOp.READ and p.msg.op is DiskOp.WRITE:
                        assert not slots & theirs, "a READ of a slot being written"
                    if msg.op is DiskOp.WRITE:
                        assert not slots & theirs, "a WRITE into a slot in use"
            self.out.append(Posted(msg, pairs))

    def _step(self) -> None:
        plan = self.rig.step()
        self._post_plan(plan.store, plan.load, plan.disk)

    def _ack(self, p: Posted, rank: int, ok: bool) -> None:
        """Rank ``rank`` runs ``p`` (the model's bytes move) and acks it; a job that
        writes CPU rows runs the WRITEs posted before it that read them first (ok: the
        row fence lets them end before the copy)."""
        msg = p.msg
        if not (isinstance(msg, Disk) and msg.op is DiskOp.WRITE):
            rows = {c for c, _, _ in p.pairs}
            for q in self.out[:self.out.index(p)]:
                if (isinstance(q.msg, Disk) and q.msg.op is DiskOp.WRITE
                        and rank not in q.acks and rows & {c for c, _, _ in q.pairs}):
                    self._ack(q, rank, True)
        if isinstance(msg, Disk) and msg.op is DiskOp.READ and ok:
            ok = all(self.slot_bytes[rank].get(s) == KEYS.get(k, k) or
                     self.slot_bytes[rank].get(s) == k for _, s, k in p.pairs)
        for c, s, k in p.pairs:
            if isinstance(msg, Transfer):
                self.cpu_bytes[rank][c] = k if ok else None
            elif msg.op is DiskOp.WRITE:
                self.slot_bytes[rank][s] = self.cpu_bytes[rank].get(c) if ok else None
            else:
                self.cpu_bytes[rank][c] = self.slot_bytes[rank].get(s) if ok else None
        p.acks[rank] = ok
        self.rig.m.on_done(msg.job_id, rank, ok)

    # ---- rules -----------------------------------------------------------------------

    @initialize(warm=st.booleans(), prior=st.lists(
        st.tuples(st.integers(0, 9), st.sampled_from(sorted(KEYS))), max_size=6,
        unique_by=lambda t: t[0]))
    def start(self, warm: bool, prior: list[tuple[int, bytes]]) -> None:
        """A warm start: a previous run left ``prior``'s blocks in their slots on every
        rank, and the start's scan (a thread in the engine) runs until
        :meth:`warm_scan_ends`; meanwhile the book indexes and writes nothing."""
        if not warm:
            return
        for s, d in prior:
            for rank in range(WORLD):
                self.slot_bytes[rank][s] = KEYS[d]
        self.scan = dict(prior)
        self.rig.book.begin_warming()

    @precondition(lambda self: self.scan is not None)
    @rule()
    def warm_scan_ends(self) -> None:
        """The scan's result is applied (indexed unless a reset made it void)."""
        assert self.scan is not None
        slots = self.rig.slots
        voided = not self.rig.book.warming

        def index() -> list[tuple[bytes, ...]]:
            return [tuple(slots.block_hashes(s)) for s in range(slots.num_blocks)]
        before = index()
        self.rig.book.end_warming(warm_table(slots.num_blocks, self.scan))
        slots = self.rig.slots
        assert not self.rig.book.warming
        assert index() == before if voided else all(
            tuple(slots.block_hashes(s)) == (d,) for s, d in self.scan.items()), index()
        self.scan = None
        self.rig.m.check_invariants()

    @rule(i=st.integers(0, len(PROMPTS) - 1), acked=st.booleans())
    def store(self, i: int, acked: bool) -> None:
        """PROMPTS[i] computed and finished; ``acked``: its store is acked by every
        rank at once (else by the ``ack`` rule, in any order)."""
        req = PROMPTS[i]
        if self.failed or self.rig.gpu.num_free < len(req.h):
            return
        self.n += 1
        rid = f"s{self.n}"
        g = self.rig.alloc(len(req.h), req.h)
        r = Req(rid, len(req.toks), base=req.toks[0])
        plan = self.rig.step(r.sched(g, confirmed=len(r.toks), new=True))
        self._post_plan(plan.store, plan.load, plan.disk)
        if acked and plan.store is not None:
            p = next(p for p in self.out if p.msg is plan.store)
            for rank in range(WORLD):
                if rank not in self.revoked:
                    self._ack(p, rank, True)
            self.out = [q for q in self.out if len(q.acks) < WORLD]
        self.rig.m.finished(rid, len(r.toks), [g])
        self.rig.gpu.free(reversed(g))
        self.rig.m.check_invariants()

    @rule(i=st.integers(0, len(PROMPTS) - 1), n=st.integers(0, 3))
    def lookup_again(self, i: int, n: int) -> None:
        """The same as ``lookup`` (drawn twice as often: most lookups follow stores)."""
        self.lookup(i, n)

    @rule(i=st.integers(0, len(PROMPTS) - 1), n=st.integers(0, 3))
    def lookup(self, i: int, n: int) -> None:
        req = PROMPTS[i]
        rid = f"l{i}.{n}"
        if rid in self.reqs.tables:
            return
        hit = self.rig.m.lookup(Req(rid, len(req.toks), base=req.toks[0]).view(), 0)
        self.rig.m.check_invariants()
        self.reqs.looked_up(rid, hit or None)

    @precondition(lambda self: self.reqs.hits)
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        self.reqs.accept(data.draw(st.sampled_from(sorted(self.reqs.hits))))

    @rule()
    def step(self) -> None:
        self._step()

    @precondition(lambda self: self.out)
    @rule(data=st.data(), ok=st.booleans())
    def ack(self, data: st.DataObject, ok: bool) -> None:
        k = data.draw(st.integers(0, len(self.out) - 1))
        p = self.out[k]
        waiting = [r for r in range(WORLD) if r not in p.acks and r not in self.revoked]
        if not waiting:
            return
        self._ack(p, data.draw(st.sampled_from(waiting)), ok)
        self.out = [q for q in self.out if len(q.acks) < WORLD]
        self.rig.m.check_invariants()

    @rule()
    def settle(self) -> None:
        """Every live rank acks every job ok, then the next steps' jobs, a few rounds."""
        for _ in range(3):
            self._step()
            for p in self.out:
                for rank in range(WORLD):
                    if rank not in p.acks and rank not in self.revoked:
                        self._ack(p, rank, True)
            self.out = [p for p in self.out if len(p.acks) < WORLD]
            self.rig.m.check_invariants()

    @precondition(lambda self: self.reqs.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.reqs.finish(data.draw(st.sampled_from(sorted(self.reqs.live))))

    @rule(now=st.integers(0, 4))
    def reset(self, now: int) -> None:
        """A reset (one draw in five: it empties both tiers)."""
        if now:
            return
        self.rig.m.reset()
        self.rig.m.check_invariants()

    @precondition(lambda self: not self.revoked and not self.failed)
    @rule(now=st.integers(0, 9))
    def rank_declared_dead(self, now: int) -> None:
        """Rank 1 is declared dead (one draw in ten: the engine is done after it): its
        unacked jobs stay quarantined until the fence."""
        if now:
            return
        self.failed = True
        self.revoked.add(1)
        self.rig.m.rank_failed(1)
        self.rig.m.check_invariants()

    @precondition(lambda self: self.revoked)
    @rule(finish_copies=st.booleans())
    def rank_fenced(self, finish_copies: bool) -> None:
        """The dead rank's process is gone; it may have finished some copies first."""
        for p in self.out:
            if 1 not in p.acks and finish_copies:
                for c, s, _k in p.pairs:  # it wrote, but nobody counts its ack
                    if isinstance(p.msg, Disk) and p.msg.op is DiskOp.WRITE:
                        self.slot_bytes[1][s] = self.cpu_bytes[1].get(c)
            p.acks.setdefault(1, False)
        self.revoked.clear()
        self.rig.m.rank_fenced(1)
        self.out = [p for p in self.out if len(p.acks) < WORLD]
        self.rig.m.check_invariants()

    # ---- invariants ------------------------------------------------------------------

    @invariant()
    def indexed_slots_hold_their_block_on_every_rank(self) -> None:
        slots = self.rig.slots
        for s in range(slots.num_blocks):
            for h in slots.block_hashes(s):
                for rank in range(WORLD):
                    assert self.slot_bytes[rank].get(s) in (h, KEYS.get(h)), (s, rank)

    @invariant()
    def indexed_cpu_blocks_hold_their_block_on_every_rank(self) -> None:
        cpu = self.rig.cpu
        for c in range(cpu.num_blocks):
            for h in cpu.block_hashes(c):
                for rank in range(WORLD):
                    assert self.cpu_bytes[rank].get(c) == h, (c, rank)

    def teardown(self) -> None:
        for p in self.out:
            for rank in range(WORLD):
                if rank not in p.acks and rank not in self.revoked:
                    self.rig.m.on_done(p.msg.job_id, rank, True)
        if self.revoked:
            self.rig.m.rank_fenced(1)
        self.reqs.finish_all()
        self.rig.m.check_invariants()
        if not self.rig.m.has_pending_work():
            assert self.rig.m.pins_held() == 0 and self.rig.slots.num_pinned == 0


class WriteThroughMachine(DiskMachine):
    """The same with write-through: every stored block is written too."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = DiskRig(cpu=6, slots=10, window=4, write_through=True, max_job=2)
        self.reqs = Requests(self.rig)


DiskMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
WriteThroughMachine.TestCase.settings = settings(max_examples=75, stateful_step_count=40,
                                                 deadline=None)
TestDisk = DiskMachine.TestCase
TestDiskWriteThrough = WriteThroughMachine.TestCase
