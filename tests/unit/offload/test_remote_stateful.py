"""Hypothesis stateful test of the manager with a remote tier (``kvshm.offload.remote``).

Random interleavings of stores (write-through PUTs), P/D prefills (with or without their
partial last block) and their decoders' lookups and loads, lookups that query the held
index, answers, steps, per-rank acks of jobs in any order (ok or failed), requests
finishing, evictions on the server, ``reset`` and a rank's death and fence. After every
rule the manager's own cross-check runs (every CPU pin recorded exactly once, a block
being fetched carries no hash). Invariants of the remote tier checked here:

* a readiness key is published only for blocks whose PUT every rank acked ok;
* a block another engine published (never stored here) is indexed in the CPU tier only
  after a GET of it that every rank acked ok;
* a P/D manifest is written only after every block it names (the partial last block
  included) had its PUT acked ok by every rank; a decoder's hit never covers the last
  prompt token;
* once every job is acked and every request finished, nothing is pinned.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from manager_rig import BS, REMOTE, Req
from requests_model import Requests
from test_remote_book import WORLD, HeldIndex, remote_rig, rkey

from kvshm.hashing import chain_tail
from kvshm.ipc.protocol import Remote, RemoteOp, Transfer
from kvshm.offload.pd.manifest import Manifest
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import RequestView

PROMPTS = [Req(f"p{i}", 4 * (1 + i % 3) + 1, base=100 * i) for i in range(6)]
#: Prompts another engine published (on the server from the start; never stored here).
FOREIGN = [Req(f"x{i}", 4 * (1 + i % 3) + 1, base=5000 + 100 * i) for i in range(3)]
FOREIGN_KEYS = {remote_hash(h): h for r in FOREIGN for h in r.h}


class RemoteMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = HeldIndex()
        self.index.ready.update(rkey(h) for h in FOREIGN_KEYS.values())
        self.rig = remote_rig(self.index, cpu=10, max_job=2)  # long hits: several GETs
        self.out: list[tuple[Remote | Transfer, dict[int, bool]]] = []  # posted, acks so far
        self.put_ok: set[str] = set()  # readiness keys whose PUT every rank acked ok
        self.get_ok: set[bytes] = set()  # foreign keys a GET fetched, every rank ok
        self.reqs = Requests(self.rig)  # lookups' and decoders' hits and GPU tables
        self.handoffs: dict[str, tuple[Req, dict[str, Any]]] = {}  # published, params
        self.failed = False
        self.n = 0

    def _plan(self) -> None:
        plan = self.rig.step()
        self.out.extend((t, {}) for t in (plan.store, plan.load) if t is not None)
        self.out.extend((msg, {}) for msg in plan.remote)

    @rule(i=st.integers(0, len(PROMPTS) - 1))
    def store(self, i: int) -> None:
        req = PROMPTS[i]
        if self.failed or self.rig.gpu.num_free < len(req.h):
            return
        self.n += 1
        rid = f"s{self.n}"
        g = self.rig.alloc(len(req.h), req.h)
        r = Req(rid, len(req.toks), base=req.toks[0])
        plan = self.rig.step(r.sched(g, confirmed=len(r.toks), new=True))
        if plan.store is not None:
            self.rig.ack(plan.store, ranks=range(WORLD))
        self.out.extend((m, {}) for m in plan.remote)
        self.rig.m.finished(rid, len(r.toks), [g])
        self.rig.gpu.free(reversed(g))
        self.rig.m.check_invariants()

    @rule(i=st.integers(0, len(PROMPTS) - 1), tail=st.booleans())
    def prefill(self, i: int, tail: bool) -> None:
        """A P/D prefill of PROMPTS[i]'s full blocks and a 3-token tail (``tail``: with
        its key); its store and PUTs are acked by the ``ack`` rule, in any order."""
        req = PROMPTS[i]
        n_tok = BS * len(req.h) + 3
        if self.failed or self.rig.gpu.num_free < len(req.h) + 1:
            return
        self.n += 1
        rid = f"pd{self.n}"
        r = Req(rid, n_tok, base=req.toks[0], params=REMOTE)
        g = self.rig.alloc(len(r.h) + 1, r.h)
        plan = self.rig.step(r.sched(g, confirmed=n_tok, new=True))
        self.out.extend((t, {}) for t in (plan.store, plan.load) if t is not None)
        self.out.extend((m, {}) for m in plan.remote)
        self.rig.m.finished(rid, n_tok, [g],
                            tail_hash=chain_tail(r.toks, BS, r.h) if tail else None)
        params = self.rig.m.transfer_params(rid)
        if params is not None:
            self.handoffs[rid] = (r, params)
        self.rig.gpu.free(reversed(g))
        self.rig.m.check_invariants()

    @precondition(lambda self: self.handoffs)
    @rule(data=st.data(), tail=st.booleans())
    def decode(self, data: st.DataObject, tail: bool) -> None:
        """A decoder looks a hand-off up (with or without the tail key)."""
        rid = data.draw(st.sampled_from(sorted(self.handoffs)))
        r, params = self.handoffs[rid]
        cid = f"d{rid}"
        if cid in self.reqs.tables:
            return
        view = RequestView(cid, r.h, len(r.toks), {"do_remote_prefill": True, **params},
                           chain_tail(r.toks, BS, r.h) if tail else None)
        hit = self.rig.m.lookup(view, 0)
        self.rig.m.check_invariants()
        assert hit is None or 0 <= hit <= len(r.toks) - 1
        self.reqs.looked_up(cid, hit)

    @precondition(lambda self: self.reqs.hits)
    @rule(data=st.data())
    def accept(self, data: st.DataObject) -> None:
        """Phase B of a decoder's last hit: a GPU table, the load planned next step."""
        self.reqs.accept(data.draw(st.sampled_from(sorted(self.reqs.hits))))

    @rule(i=st.integers(0, len(PROMPTS) + len(FOREIGN) - 1), n=st.integers(0, 3))
    def lookup(self, i: int, n: int) -> None:
        req = (PROMPTS + FOREIGN)[i]
        rid = f"l{i}.{n}"
        self.reqs.live.add(rid)
        self.rig.m.lookup(Req(rid, len(req.toks), base=req.toks[0]).view(), 0)
        self.rig.m.check_invariants()

    @rule()
    def answer(self) -> None:
        self.index.answer_all()

    @rule()
    def step(self) -> None:
        self._plan()

    @rule()
    def settle(self) -> None:
        """Every rank acks every job ok, then the next steps' jobs, a few rounds."""
        for _ in range(4):
            self.index.answer_all()
            self._plan()
            for msg, acks in self.out:
                for rank in range(WORLD):
                    if rank not in acks:
                        acks[rank] = True
                        self.rig.m.on_done(msg.job_id, rank, True)
                if all(acks.values()) and not self.failed:
                    self._completed_ok(msg)
            self.out = []
            self.rig.m.check_invariants()

    @precondition(lambda self: self.out)
    @rule(data=st.data(), ok=st.booleans())
    def ack(self, data: st.DataObject, ok: bool) -> None:
        k = data.draw(st.integers(0, len(self.out) - 1))
        msg, acks = self.out[k]
        rank = data.draw(st.sampled_from([r for r in range(WORLD) if r not in acks]))
        acks[rank] = ok
        self.rig.m.on_done(msg.job_id, rank, ok)
        if len(acks) == WORLD:
            del self.out[k]
            if all(acks.values()) and not self.failed:
                self._completed_ok(msg)
        self.rig.m.check_invariants()

    def _completed_ok(self, msg: Remote | Transfer) -> None:
        if not isinstance(msg, Remote):
            return
        hashes = [msg.hashes[i:i + msg.hash_len] for i in range(0, len(msg.hashes),
                                                                 msg.hash_len)]
        if msg.op is RemoteOp.PUT:
            self.put_ok.update(f"ready:{h.hex()}" for h in hashes)
        else:
            self.get_ok.update(FOREIGN_KEYS[h] for h in hashes if h in FOREIGN_KEYS)

    @precondition(lambda self: self.reqs.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.reqs.finish(data.draw(st.sampled_from(sorted(self.reqs.live))))

    @rule(i=st.integers(0, 20))
    def evict_on_server(self, i: int) -> None:
        ready = sorted(self.index.ready)
        if ready:
            self.index.ready.discard(ready[i % len(ready)])

    @rule()
    def reset(self) -> None:
        self.rig.m.reset()
        self.rig.m.check_invariants()

    @precondition(lambda self: not self.failed)
    @rule()
    def rank_dies_and_is_fenced(self) -> None:
        self.failed = True
        self.rig.m.rank_fenced(1)
        for _msg, acks in self.out:
            acks[1] = False
        self.out = [(m, a) for m, a in self.out if len(a) < WORLD]
        self.rig.m.check_invariants()

    @invariant()
    def published_only_after_every_rank_stored(self) -> None:
        assert set(self.index.published) <= self.put_ok

    @invariant()
    def a_manifest_follows_every_put_of_its_blocks(self) -> None:
        for key, raw in self.index.kv.items():
            if key.startswith("kvshm:v1:pd:"):
                m = msgspec.json.decode(raw, type=Manifest)
                assert {f"ready:{h}" for h in m.hashes} <= self.put_ok, key
                assert 0 <= m.tail <= 1 and m.tail < len(m.hashes)

    @invariant()
    def foreign_blocks_are_indexed_only_after_every_rank_fetched_them(self) -> None:
        foreign = set(FOREIGN_KEYS.values())
        indexed = {k for c in range(self.rig.cpu.num_blocks)
                   for k in self.rig.cpu.block_hashes(c)}
        assert indexed & foreign <= self.get_ok

    def teardown(self) -> None:
        for msg, acks in list(self.out):
            for rank in range(WORLD):
                if rank not in acks:
                    self.rig.m.on_done(msg.job_id, rank, True)
        self.reqs.finish_all()
        if not self.rig.m.has_pending_work():
            assert self.rig.m.pins_held() == 0


RemoteMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                           deadline=None)
TestRemote = RemoteMachine.TestCase


def test_remote_hash_and_ready_key_agree() -> None:
    """The test's published key for a stored block is the book's readiness key."""
    h = PROMPTS[0].h[0]
    assert rkey(h) == f"ready:{remote_hash(h).hex()}" and BS == 4
