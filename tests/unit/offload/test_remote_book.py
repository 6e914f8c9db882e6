"""The remote tier's scheduler side (``kvshm.offload.remote``), narrated with exact block
ids and ref counts, on the real manager and pools.

The readiness index is the one seam a test must control in time (when an answer
arrives); :class:`HeldIndex` implements :class:`~kvshm.remote.tier.ReadyIndex` and holds
every query until the test answers it. The real Valkey index is tested against a real
server in ``tests/remote``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from manager_rig import BS, REMOTE, Req, Rig, refs

from kvshm.config import RemoteMode
from kvshm.ipc.protocol import Remote, RemoteOp, unpack_ids
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import MANIFEST_PARAM, manifest_key
from kvshm.offload.remote import RemoteBook
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import LoadFailure

WORLD = 2


class HeldIndex:
    """A ReadyIndex whose queries wait until the test answers them."""

    def __init__(self) -> None:
        self.ready: set[str] = set()  # what "the server" holds
        self.published: list[str] = []
        self.queries: list[tuple[int, list[str]]] = []
        self._answers: list[tuple[int, int]] = []
        self.up = True
        self.log: list[str] = []  # every write, in order
        self.kept: set[str] = set()  # readiness keys published with the hold TTL
        self.refuse: list[str] = []  # readiness writes the "server" refused (to report)
        self.kv: dict[str, bytes] = {}
        self._values: list[tuple[int, bytes | None]] = []
        self.lost = 0  # times "the server" lost its data (restarts())
        self.after: dict[str, list[str]] = {}  # a value's ``after`` readiness keys

    def publish(self, keys: Sequence[str], *, keep: bool = False) -> None:
        self.kept.update(keys if keep else ())
        self.published.extend(keys)
        self.ready.update(keys)
        self.log.extend(keys)

    def put_value(self, key: str, value: bytes, ttl_s: int, *,
                  after: Sequence[str] = ()) -> None:
        self.kv[key] = value
        self.after[key] = list(after)
        self.log.append(key)

    def get_value(self, token: int, key: str) -> None:
        self._values.append((token, self.kv.get(key)))

    def delete_if_same(self, key: str, value: bytes) -> None:
        if self.kv.get(key) == value:
            del self.kv[key]

    def expire(self, keys: Sequence[str]) -> None:
        self.log.extend(f"expire {k}" for k in keys)

    def values(self) -> list[tuple[int, bytes | None]]:
        out, self._values = self._values, []
        return out

    def refused(self) -> list[str]:
        out, self.refuse = self.refuse, []
        return out

    def restarts(self) -> int:
        return self.lost

    def query(self, token: int, keys: Sequence[str]) -> None:
        self.queries.append((token, list(keys)))

    def answer_all(self) -> None:
        """Answer every held query with the longest present prefix."""
        for token, keys in self.queries:
            n = 0
            while n < len(keys) and keys[n] in self.ready:
                n += 1
            self._answers.append((token, n))
        self.queries = []

    def answers(self) -> list[tuple[int, int]]:
        out, self._answers = self._answers, []
        return out

    def healthy(self) -> bool:
        return self.up

    def statistics(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


def key(h: bytes) -> str:
    """The readiness key the book asks for (it passes remote hashes)."""
    return f"ready:{h.hex()}"


def rkey(h: bytes) -> str:
    """The readiness key of a block whose CPU index key is ``h``."""
    return key(remote_hash(h))


def remote_rig(index: HeldIndex, *, cpu: int = 16, mode: RemoteMode = RemoteMode.WRITE_THROUGH,
               timeout: float = 2.0, clock: list[float] | None = None,
               max_job: int = 128, ttl_s: float | None = None,
               hold_ttl_s: float | None = None) -> Rig:
    rig = Rig(cpu=cpu, gpu=16, world_size=WORLD)
    now = clock if clock is not None else [0.0]

    def make(cpu_pool: Any, gs: Any, jobs: Any) -> RemoteBook:
        pd = Handoffs(index, "fp", WORLD, BS, remote_hash, key, clock=lambda: now[0])
        return RemoteBook(cpu_pool, gs, jobs, index, key, mode=mode, answer_timeout_s=timeout,
                          clock=lambda: now[0], handoffs=pd, max_job_blocks=max_job,
                          ttl_s=ttl_s, hold_ttl_s=hold_ttl_s)
    rig.m = OffloadManager(rig.cpu, rig.gpu, block_size=BS, world_size=WORLD, remote=make)
    return rig


def ack_remote(rig: Rig, msg: Remote, oks: Sequence[bool] = (True, True)) -> None:
    for rank, ok in enumerate(oks):
        rig.m.on_done(msg.job_id, rank, ok)
        rig.m.check_invariants()


def settle(rig: Rig) -> None:
    """Run steps, acking every remote job and store on both ranks, until none is left."""
    for _ in range(4):
        plan = rig.step()
        for msg in plan.remote:
            ack_remote(rig, msg)
        if plan.store is not None:
            rig.ack(plan.store, ranks=range(WORLD))


def store(rig: Rig, req: Req, msgs: list[Remote] | None = None) -> list[int]:
    """``req`` computed all its full blocks and finished; its store acked by both ranks.
    Returns the CPU ids it was stored in; the step's remote jobs go to ``msgs``."""
    n = len(req.h)
    g = rig.alloc(n, req.h)
    p = rig.step(req.sched(g, confirmed=len(req.toks), new=True))
    if msgs is not None:
        msgs.extend(p.remote)
    assert p.store is not None
    rig.ack(p.store, ranks=range(WORLD))
    rig.m.finished(req.rid, len(req.toks), [g])
    rig.gpu.free(reversed(g))
    return unpack_ids(p.store.dst_ids)


def test_write_through_publishes_only_after_every_rank_acked_the_put() -> None:
    """A stores 2 blocks into CPU 0, 1; the completed store queues them for write-through
    (pinned: ref 1); the next step's PUT job carries both. Rank 0's ack publishes
    nothing -- a reader must never see a block rank 1 has not stored; rank 1's ack
    publishes both readiness keys and unpins them (ref 0, still cached). Storing the same
    content again puts nothing (deduplicated by key)."""
    index = HeldIndex()
    rig = remote_rig(index)
    a = Req("a", 9)
    cpu = store(rig, a)
    assert cpu == [0, 1] and refs(rig.cpu, cpu) == [1, 1]      # queued for the PUT
    plan = rig.step()
    (put,) = plan.remote
    assert put.op is RemoteOp.PUT and unpack_ids(put.cpu_ids) == [0, 1]
    assert put.hashes == remote_hash(a.h[0]) + remote_hash(a.h[1]) and put.hash_len == 32
    rig.m.on_done(put.job_id, 0, True)
    rig.m.check_invariants()
    assert index.published == [] and refs(rig.cpu, cpu) == [1, 1]
    rig.m.on_done(put.job_id, 1, True)
    rig.m.check_invariants()
    assert index.published == [rkey(a.h[0]), rkey(a.h[1])]
    assert refs(rig.cpu, cpu) == [0, 0] and rig.cpu.get_cached(a.h[0]) == 0
    book = rig.m.remote
    assert book is not None and book.counters.published_blocks == 2
    rig.cpu.drop_all_hashes()                                     # the CPU copy is gone
    b = Req("b", 9)                                               # same tokens as A
    store(rig, b)
    assert rig.step().remote == () and book.counters.put_skipped_duplicate == 2


def test_a_put_and_a_get_a_reset_abandoned_count_as_abandoned_not_failed() -> None:
    """A reset abandons a PUT and a GET that then succeed on both ranks: they were
    counted as failed blocks and jobs (``put_failed_blocks`` 2, ``get_failed_jobs`` 1)
    while the manager's ``jobs_failed`` said 0 (found by a hostile review). Now they are
    ``put_abandoned_blocks`` and ``get_abandoned_jobs``; nothing is published or
    indexed."""
    index, rig, r = fetch_setup()
    store(rig, Req("a", 9, base=50))
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    msgs = rig.step().remote
    assert sorted(m.op.name for m in msgs) == ["GET", "PUT"]
    assert rig.m.reset() is False
    for msg in msgs:
        ack_remote(rig, msg)
    assert rig.m.reset_done() and index.published == [] and rig.cpu.num_hashes == 0
    book = rig.m.remote
    assert book is not None
    c = book.counters
    assert (c.put_abandoned_blocks, c.get_abandoned_jobs) == (2, 1)
    assert (c.put_failed_blocks, c.get_failed_jobs, c.get_failed_blocks) == (0, 0, 0)
    assert rig.m.counters.jobs_failed == 0 and rig.m.counters.jobs_abandoned == 2


def test_a_failed_put_publishes_nothing() -> None:
    """Rank 1 fails the PUT: no readiness key, the pins go, the failure is counted."""
    index = HeldIndex()
    rig = remote_rig(index)
    cpu = store(rig, Req("a", 9))
    (put,) = rig.step().remote
    ack_remote(rig, put, (True, False))
    assert index.published == [] and refs(rig.cpu, cpu) == [0, 0]
    assert rig.m.remote is not None and rig.m.remote.counters.put_failed_blocks == 2


def fetch_setup(blocks: int = 2) -> tuple[HeldIndex, Rig, Req]:
    """A remote tier that holds ``blocks`` blocks of R's prompt (9 tokens: 2 full blocks)."""
    index = HeldIndex()
    r = Req("r", 4 * blocks + 1)
    index.ready.update(rkey(h) for h in r.h)
    return index, remote_rig(index), r


def test_get_blocks_are_indexed_only_after_every_rank_acked() -> None:
    """R misses the CPU tier: its lookup queries the index and says "ask again" (None);
    after the answer (2 blocks present) the next step plans a GET into fresh CPU blocks
    0, 1 (ref 1, no hash). Rank 0's ack indexes nothing (rank 1 may still be writing);
    rank 1's ack indexes both, still pinned for R (ref 1). R's next lookup is an ordinary
    CPU hit of 8 tokens: its own pin (ref 2), then the fetch pin goes (ref 1)."""
    index, rig, r = fetch_setup()
    assert rig.m.lookup(r.view(), 0) is None
    assert len(index.queries) == 1 and index.queries[0][1] == [rkey(h) for h in r.h]
    assert rig.m.lookup(r.view(), 0) is None                      # still unanswered
    index.answer_all()
    assert rig.m.lookup(r.view(), 0) is None                      # answered, not fetched
    (get,) = rig.step().remote
    assert get.op is RemoteOp.GET and unpack_ids(get.cpu_ids) == [0, 1]
    assert refs(rig.cpu, [0, 1]) == [1, 1] and rig.cpu.block_hashes(0) == ()
    rig.m.on_done(get.job_id, 0, True)
    rig.m.check_invariants()
    assert rig.cpu.block_hashes(0) == () and rig.m.lookup(r.view(), 0) is None
    rig.m.on_done(get.job_id, 1, True)
    rig.m.check_invariants()
    assert rig.cpu.get_cached(r.h[0]) == 0 and rig.cpu.get_cached(r.h[1]) == 1
    assert refs(rig.cpu, [0, 1]) == [1, 1]
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # the hit's pin only
    assert len(index.queries) == 0 and rig.m.remote is not None
    assert rig.m.remote.counters.hit_blocks == 2


def test_a_preempted_request_asks_the_server_again_when_readmitted() -> None:
    """R is served its 2 blocks from the server (GET into CPU 0, 1, then a CPU hit),
    loaded and preempted; the CPU tier then loses them. R's re-admission lookup answered
    0 without asking the server -- its fetch record (FETCHED) stayed until R ended --
    and R recomputed what the server held (found by a hostile review). An accepted
    phase B now ends R's remote lookup: the re-admission queries again (None, one new
    query for both blocks) and is fetched like a first lookup."""
    index, rig, r = fetch_setup()
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    (get,) = rig.step().remote
    ack_remote(rig, get)
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    g = rig.alloc(3)
    rig.m.allocated(r.rid, [g], 2 * BS)
    plan = rig.step(r.sched(g, confirmed=0, new=True))
    rig.ack(plan.load, ranks=range(WORLD))
    rig.step(r.sched((), confirmed=0, preempted=True))
    rig.gpu.free(reversed(g))
    assert refs(rig.cpu, [0, 1]) == [0, 0]
    rig.cpu.drop_all_hashes()                                     # evicted meanwhile
    assert rig.m.lookup(r.view(), 0) is None                      # asks the server again
    assert [q for _, q in index.queries] == [[rkey(h) for h in r.h]]
    index.answer_all()
    (get,) = rig.step().remote
    assert get.op is RemoteOp.GET
    ack_remote(rig, get)
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    rig.m.check_invariants()


def test_a_failed_get_frees_its_blocks_unindexed_and_recomputes() -> None:
    """Rank 1's GET misses (evicted, corrupt, server down): the job fails, CPU blocks
    0, 1 go back unindexed (ref 0, no hash) only once both ranks acked; R's lookup says
    0 (recompute) and the index is not asked again."""
    index, rig, r = fetch_setup()
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    (get,) = rig.step().remote
    rig.m.on_done(get.job_id, 1, False)
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # rank 0 may still write
    rig.m.on_done(get.job_id, 0, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.num_hashes == 0
    assert rig.m.lookup(r.view(), 0) == 0 and index.queries == []
    assert rig.m.remote is not None and rig.m.remote.counters.get_failed_jobs == 1


def test_a_rank_declared_dead_during_a_get_quarantines_its_blocks() -> None:
    """Rank 1 is declared dead while the GET into CPU 0, 1 runs: the job fails at once,
    but rank 1 may still be writing those rows, so they stay pinned (quarantined) after
    rank 0's ack, until rank 1 is fenced; then they go back unindexed."""
    index, rig, r = fetch_setup()
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    (get,) = rig.step().remote
    rig.m.rank_failed(1)
    rig.m.on_done(get.job_id, 0, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [1, 1] and rig.m.quarantined_blocks() == (0, 2)
    rig.m.rank_fenced(1)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.num_hashes == 0


def test_reset_during_a_get_indexes_nothing() -> None:
    """reset() while the GET runs abandons it: its completion frees CPU 0, 1 unindexed."""
    index, rig, r = fetch_setup()
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    (get,) = rig.step().remote
    assert rig.m.reset() is False
    ack_remote(rig, get)
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.num_hashes == 0
    assert rig.m.reset() is True


def test_the_same_prefix_is_never_fetched_twice_at_once() -> None:
    """S shares R's prefix while R's GET runs: S asks again without a query; after R's
    GET, S's lookup is a plain CPU hit."""
    index, rig, r = fetch_setup()
    s = Req("s", 9)
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    (get,) = rig.step().remote
    assert rig.m.lookup(s.view(), 0) is None and index.queries == []
    ack_remote(rig, get)
    assert rig.m.lookup(s.view(), 0) == 2 * BS
    assert rig.m.remote is not None and rig.m.remote.counters.queries == 1


def test_an_unanswered_query_times_out_and_an_unhealthy_index_is_not_asked() -> None:
    """No answer within the answer timeout: the lookup gives up (0) and counts it. While
    the index is unhealthy (breaker open) a lookup answers 0 at once, without a query."""
    index, _, r = fetch_setup()
    now = [100.0]
    rig = remote_rig(index, timeout=2.0, clock=now)
    assert rig.m.lookup(r.view(), 0) is None
    now[0] += 2.5
    assert rig.m.lookup(r.view(), 0) == 0
    book = rig.m.remote
    assert book is not None and book.counters.query_timeouts == 1
    index.up = False
    t = Req("t", 9, base=50)
    assert rig.m.lookup(t.view(), 0) == 0 and book.counters.skipped_unhealthy == 1
    assert len(index.queries) == 1                                # R's only


def test_a_request_gone_before_its_get_completes_leaves_the_blocks_cached() -> None:
    """R finishes while its GET runs: the GET still completes (rows written on both
    ranks), indexes CPU 0, 1 and leaves them cached at ref 0 for the next request."""
    index, rig, r = fetch_setup()
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    (get,) = rig.step().remote
    rig.m.finished("r", 0, [[]])
    ack_remote(rig, get)
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.get_cached(r.h[1]) == 1


def test_a_full_cpu_tier_declines_the_get() -> None:
    """Every CPU block pinned by a lookup: the answered GET cannot get a block; R ends
    with 0 (recompute), counted."""
    index = HeldIndex()
    rig = remote_rig(index, cpu=2)
    held = Req("h", 9, base=100)
    rig.seed_cpu(*held.h)
    assert rig.m.lookup(held.view(), 0) == 2 * BS                 # pins CPU 0, 1
    r = Req("r", 9)
    index.ready.update(rkey(h) for h in r.h)
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    assert rig.step().remote == ()
    assert rig.m.lookup(r.view(), 0) == 0
    assert rig.m.remote is not None and rig.m.remote.counters.get_declined_cpu_full == 1


def test_on_evict_puts_each_block_once_just_before_it_would_be_reused() -> None:
    """ON_EVICT, a 16-block LRU tier, window 8: A's blocks land in CPU 0, 1 (freed tail
    first: 1 is reused before 0), each Fi's in the next two. Nothing is put while the
    next 8 blocks the tier would hand out are empty ones; F3's step takes CPU 8, 9 and
    leaves A's 1, 0 among the next 8 (after 10..15): they are put (PUT [1, 0]), F4's
    step puts F0's and F1's, and so on, one batch in flight at a time. A put block goes
    back as recently used (a second chance); published, it is never put again."""
    index = HeldIndex()
    rig = remote_rig(index, mode=RemoteMode.ON_EVICT)
    puts: list[list[int]] = []
    for i, req in enumerate([Req("a", 9)] + [Req(f"f{i}", 9, base=1000 + 100 * i)
                                             for i in range(8)]):
        msgs: list[Remote] = []
        assert store(rig, req, msgs) == [(2 * i) % 16, (2 * i + 1) % 16]
        puts.extend(unpack_ids(m.cpu_ids) for m in msgs)
        for m in msgs:
            ack_remote(rig, m)
        if i == 3:
            assert puts == []
        if i == 4:
            assert puts == [[1, 0]]
        if i == 5:
            assert puts == [[1, 0], [3, 2, 5, 4]]
    flat = [c for p in puts for c in p]
    assert len(flat) == len(set(flat)) and len(index.published) == len(flat)
    assert rig.m.remote is not None
    assert rig.m.remote.counters.put_skipped_duplicate == 0


def test_group_qualified_keys_travel_as_fixed_length_remote_hashes() -> None:
    """A key longer than 32 bytes (a second KV group's) is sent as its BLAKE2b digest."""
    long_key = b"h" * 32 + b"\x00kvshm.g\x01\x00"
    assert len(remote_hash(long_key)) == 32 and remote_hash(long_key) != long_key[:32]
    assert remote_hash(b"x" * 32) == b"x" * 32


def test_failed_load_result_after_a_remote_hit_is_recomputed() -> None:
    """After a remote fetch, R's CPU hit is loaded; a failed load reports the cause and
    the pins all go (the remote part changes nothing about load failure)."""
    index, rig, r = fetch_setup()
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    (get,) = rig.step().remote
    ack_remote(rig, get)
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    g = rig.alloc(3)
    rig.m.allocated("r", [g], 2 * BS)
    p = rig.step(r.sched(g, confirmed=0, new=True))
    rig.ack(p.load, ranks=(0, 1), ok=False)
    (res,) = rig.m.take_load_results()
    assert not res.ok and res.cause is LoadFailure.WORKER_FAILED
    assert refs(rig.cpu, [0, 1]) == [0, 0]


def test_a_handoff_manifest_is_written_after_every_block_and_readiness_key() -> None:
    """P/D: P's request (``do_remote_decode``) finishes with its 2 blocks stored; its
    transfer params name the manifest at once, but the manifest is written only after
    both ranks acked the blocks' PUT, after their readiness keys (the server's write
    order: ready, ready, manifest). A failed PUT would leave no manifest at all."""
    index = HeldIndex()
    rig = remote_rig(index, mode=RemoteMode.ON_EVICT)    # P/D blocks are put anyway
    p = Req("p", 9, params={"do_remote_decode": True})
    g = rig.alloc(3, p.h)
    plan = rig.step(p.sched(g, confirmed=9, new=True))
    rig.m.finished("p", 9, [g])
    params = rig.m.transfer_params("p")
    assert params is not None and params[MANIFEST_PARAM] == manifest_key("fp", WORLD, "p")
    assert params["do_remote_prefill"] is True and index.log == []
    rig.ack(plan.store, ranks=(0, 1))
    (put,) = rig.step().remote
    rig.m.on_done(put.job_id, 0, True)
    assert index.log == []
    rig.m.on_done(put.job_id, 1, True)
    rig.m.check_invariants()
    assert index.log == [rkey(p.h[0]), rkey(p.h[1]), manifest_key("fp", WORLD, "p")]
    assert put.keep and index.kept == {rkey(p.h[0]), rkey(p.h[1])}   # hold TTL until loaded


def test_a_failed_handoff_put_writes_no_manifest_and_demotes_its_blocks() -> None:
    """Rank 1 fails the hand-off's PUT: no manifest ever; the blocks (kept: hold TTL) and
    their readiness keys get the ordinary TTL back, every rank's shard named."""
    index = HeldIndex()
    rig = remote_rig(index)
    p = Req("p", 5, params={"do_remote_decode": True})
    g = rig.alloc(2, p.h)
    plan = rig.step(p.sched(g, confirmed=5, new=True))
    rig.m.finished("p", 5, [g])
    rig.ack(plan.store, ranks=(0, 1))
    (put,) = rig.step().remote
    ack_remote(rig, put, (True, False))
    h = remote_hash(p.h[0]).hex()
    assert index.log == [f"expire kvshm:v1:fp:0/2:{h}", f"expire kvshm:v1:fp:1/2:{h}",
                         f"expire {rkey(p.h[0])}"]
    assert rig.m.remote is not None and rig.m.remote.pd is not None
    assert rig.m.remote.pd.counters.publish_failed == 1


def _a_get_only_rank_0_acked() -> tuple[HeldIndex, Rig, Req, Remote, list[float]]:
    """R's 2 blocks are on the server; its GET into CPU 0, 1 is planned at time 0 and
    acked by rank 0 only. Returns the index, rig, R, the GET and the test's clock."""
    index, _, r = fetch_setup()
    now = [0.0]
    rig = remote_rig(index, clock=now)
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    (get,) = rig.step().remote
    assert unpack_ids(get.cpu_ids) == [0, 1]
    rig.m.on_done(get.job_id, 0, True)
    return index, rig, r, get, now


def test_a_get_stuck_on_a_rank_times_out_the_request_but_keeps_its_pins() -> None:
    """Rank 1 never acks R's GET (stuck on the server): after the fetch timeout R's
    lookup gives up (0, counted) so the request recomputes; CPU 0, 1 stay pinned by the
    job (rank 1 may still write them) and go back only when it ends."""
    index, rig, r, get, now = _a_get_only_rank_0_acked()
    now[0] += 10.0
    assert rig.m.lookup(r.view(), 0) is None                      # still within 15 s
    now[0] += 6.0
    assert rig.m.lookup(r.view(), 0) == 0
    assert rig.m.remote is not None and rig.m.remote.counters.fetch_timeouts == 1
    assert refs(rig.cpu, [0, 1]) == [1, 1]
    rig.m.on_done(get.job_id, 1, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [0, 0] and rig.cpu.get_cached(r.h[0]) == 0


def test_a_get_overdue_on_a_stuck_rank_starts_no_new_remote_read_until_it_ends() -> None:
    """Hazard "a stopped rank holding only tier jobs": rank 1 never acks R's GET (CPU 0,
    1). After the fetch timeout R recomputes (counted), and so does Q -- another request
    whose blocks the server holds -- at once: its lookup answers 0 without a query
    (``lookups_tier_overdue``), where it used to query, plan a GET that rank 1 would
    not serve either and wait another whole timeout. A hit on the CPU tier still
    answers. Once rank 1 acks (the job ends, CPU 0, 1 go back to the pool) Q's next
    lookup queries the server again."""
    index, rig, r, get, now = _a_get_only_rank_0_acked()
    now[0] += 16.0
    assert rig.m.lookup(r.view(), 0) == 0                         # R: past the timeout
    assert rig.m.remote is not None and rig.m.remote.counters.fetch_timeouts == 1
    q = Req("q", 9, base=300)
    index.ready.update(rkey(h) for h in q.h)
    queries = rig.m.remote.counters.queries
    assert rig.m.lookup(q.view(), 0) == 0                         # at once, no query
    assert index.queries == [] and rig.m.remote.counters.queries == queries
    assert rig.m.counters.lookups_tier_overdue == 1
    assert rig.step().remote == ()
    c = Req("c", 9, base=600)
    rig.seed_cpu(*c.h)                                            # CPU 2, 3
    assert rig.m.lookup(c.view(), 0) == 2 * BS                   # a CPU hit answers
    assert rig.m.counters.lookups_tier_overdue == 1
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # the job's pins
    rig.m.on_done(get.job_id, 1, True)
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [0, 0]
    assert rig.m.lookup(q.view(), 0) is None                      # queries again
    assert len(index.queries) == 1 and rig.m.remote.counters.queries == queries + 1
    assert rig.m.counters.lookups_tier_overdue == 1


def test_a_lookup_the_overdue_gate_answers_releases_what_its_fetch_pinned() -> None:
    """R's GET completed: CPU 2, 3 are pinned for R (FETCHED, ref 1) until its next
    lookup. Meanwhile Q's GET (CPU 0, 1) is stuck on rank 1 past the fetch timeout. R's
    next lookup comes with the engine's own hit covering both blocks: a miss past them,
    which the gate answers 0 -- and, as the remote tier's own lookup would, it drops R's
    fetch pins (CPU 2, 3 back to ref 0, cached), or they would stay unevictable until R
    finished."""
    index, rig, q, get, now = _a_get_only_rank_0_acked()           # Q's: CPU 0, 1
    r = Req("r2", 9, base=300)
    index.ready.update(rkey(h) for h in r.h)
    now[0] += 1.0
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    (get_r,) = rig.step().remote
    assert unpack_ids(get_r.cpu_ids) == [2, 3]
    ack_remote(rig, get_r)
    assert refs(rig.cpu, [2, 3]) == [1, 1]                        # pinned for R
    now[0] += 15.0                                                # Q's GET: overdue
    assert rig.m.lookup(r.view(), 2 * BS) == 0
    assert rig.m.counters.lookups_tier_overdue == 1
    assert refs(rig.cpu, [2, 3]) == [0, 0] and rig.cpu.get_cached(r.h[0]) == 2
    rig.m.check_invariants()
    assert refs(rig.cpu, [0, 1]) == [1, 1]                        # Q's job keeps its own
    rig.m.on_done(get.job_id, 1, True)                            # the gate lifts
    assert rig.m.remote is not None and not rig.m.remote.fetches.overdue()
    assert rig.m.lookup(q.view(), 0) == 2 * BS                    # Q: its blocks, a hit


def test_an_answer_that_comes_once_a_get_is_overdue_is_not_fetched() -> None:
    """P queries the server 14 s into R's GET (stuck on rank 1): not overdue yet, so the
    query goes out. Its answer (2 blocks present) comes at 16 s, when R's GET is past the
    fetch timeout: the step plans no GET for P -- it would wait on rank 1 too -- and P's
    fetch ends (``get_declined_overdue``); P's next lookup recomputes (0) at once."""
    index, rig, _, _, now = _a_get_only_rank_0_acked()
    p = Req("p", 9, base=700)
    index.ready.update(rkey(h) for h in p.h)
    now[0] += 14.0
    assert rig.m.lookup(p.view(), 0) is None and len(index.queries) == 1
    now[0] += 2.0
    index.answer_all()
    assert rig.step().remote == ()
    assert rig.m.remote is not None and rig.m.remote.counters.get_declined_overdue == 1
    assert rig.m.remote.counters.get_jobs == 1                    # R's only
    assert rig.m.lookup(p.view(), 0) == 0 and index.queries == []
    assert rig.m.counters.lookups_tier_overdue == 1
    rig.m.check_invariants()


def test_remote_jobs_never_exceed_what_one_ring_record_holds() -> None:
    """With room for 2 blocks a command, A's 3 stored blocks go out as PUTs of 2 and 1,
    and R's 3-block remote prefix is fetched whole by GETs of 2 and 1 -- no command a
    ring could refuse. (A hit longer than one command was cut to its first, the rest
    recomputed: a 50,000-block prompt got 14,561 blocks back from the remote tier and
    128 from the disk, a hostile probe at production scale.) R waits until both are in;
    a GET of it that fails leaves the other's blocks indexed: R hits up to the gap."""
    index = HeldIndex()
    rig = remote_rig(index, max_job=2)
    store(rig, Req("a", 13))
    puts = rig.step().remote
    assert [len(unpack_ids(m.cpu_ids)) for m in puts] == [2, 1]
    for m in puts:
        ack_remote(rig, m)
    r = Req("r", 13, base=500)
    index.ready.update(rkey(h) for h in r.h)
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    first, second = rig.step().remote
    assert [len(unpack_ids(g.cpu_ids)) for g in (first, second)] == [2, 1]
    ack_remote(rig, first)
    # the first's 2 blocks are a CPU hit now; taking it would end the fetch and the
    # second would complete for nobody (a review): R waits for the second
    assert rig.m.lookup(r.view(), 0) is None
    ack_remote(rig, second)
    assert rig.m.lookup(r.view(), 0) == 3 * BS
    assert rig.m.remote is not None and rig.m.remote.counters.get_capped == 0
    assert rig.m.remote.counters.get_jobs == 2
    rig.m.finished("r", 3 * BS, [rig.alloc(3)])
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()


def test_a_cpu_hit_ends_the_requests_remote_lookup() -> None:
    """R's remote query is answered, but before the GET is planned R's next lookup finds
    a CPU hit (another request stored the blocks meanwhile): no GET is planned for R,
    nothing is fetched twice."""
    index, rig, r = fetch_setup()
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    rig.seed_cpu(*r.h)                                            # CPU 0, 1
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    assert rig.step().remote == ()
    assert rig.m.remote is not None and rig.m.remote.counters.get_jobs == 0


def test_a_request_behind_a_stuck_get_waits_no_longer_than_the_get_would() -> None:
    """S shares R's prefix while R's GET is stuck on a rank: S asks again only until the
    fetch timeout (15 s), then recomputes without a read of its own (it used to query and
    post a GET that the stuck rank would not serve either: see
    :func:`test_a_get_overdue_on_a_stuck_rank_starts_no_new_remote_read_until_it_ends`)."""
    index, _, r = fetch_setup()
    now = [0.0]
    rig = remote_rig(index, clock=now)
    s = Req("s", 9)
    rig.m.lookup(r.view(), 0)
    index.answer_all()
    rig.step()
    assert rig.m.lookup(s.view(), 0) is None and index.queries == []
    now[0] += 16.0
    assert rig.m.lookup(s.view(), 0) == 0 and index.queries == []
    assert rig.m.counters.lookups_tier_overdue == 1


def test_puts_in_flight_are_capped_at_a_quarter_of_the_cpu_tier() -> None:
    """A 16-block tier with 2-block commands: once 4 or more blocks are being put, no
    more PUTs go out (counted); the queue waits, pinned, until PUTs complete. A's 3
    blocks go as [2, 1] (3 in flight), B's first 2 follow (5 in flight), B's last waits
    until A's first PUT is acked (3 in flight again)."""
    index = HeldIndex()
    rig = remote_rig(index, max_job=2)
    store(rig, Req("a", 13))
    msgs: list[Remote] = []
    store(rig, Req("b", 13, base=100), msgs)
    assert [len(unpack_ids(m.cpu_ids)) for m in msgs] == [2, 1]
    (b01,) = rig.step().remote
    assert len(unpack_ids(b01.cpu_ids)) == 2
    assert rig.step().remote == ()
    assert rig.m.remote is not None and rig.m.remote.counters.put_backpressure >= 1
    ack_remote(rig, msgs[0])
    assert [len(unpack_ids(m.cpu_ids)) for m in rig.step().remote] == [1]


def test_a_manifest_of_another_deployment_or_oversized_is_refused_unread() -> None:
    """A decode request naming a manifest outside this deployment's namespace is refused
    without a read; one whose value is far larger than the request could need is
    refused unparsed. Both recompute, counted."""
    index = HeldIndex()
    rig = remote_rig(index)
    r = Req("r", 9, params={"do_remote_prefill": True,
                            MANIFEST_PARAM: "kvshm:v1:pd:other:2:r"})
    assert rig.m.lookup(r.view(), 0) == 0 and index._values == []
    key = "kvshm:v1:pd:fp:2:s"
    index.kv[key] = b"[" + b"0," * 100_000 + b"0]"
    s = Req("s", 9, params={"do_remote_prefill": True, MANIFEST_PARAM: key})
    assert rig.m.lookup(s.view(), 0) is None
    assert rig.m.lookup(s.view(), 0) == 0
    assert rig.m.remote is not None and rig.m.remote.pd is not None
    assert rig.m.remote.pd.counters.manifest_refused == 2
    # a name of this deployment's with a lone surrogate (a JSON body may carry one):
    # its read, in the index's shared batch, failed that batch's every command, and
    # glide's encoding error was taken for the server's, opening the breaker (a
    # hostile probe: other requests' manifests went unwritten); refused unread now
    t = Req("t", 9, params={"do_remote_prefill": True,
                            MANIFEST_PARAM: "kvshm:v1:pd:fp:2:t\ud800"})
    assert rig.m.lookup(t.view(), 0) == 0 and index._values == []
    assert rig.m.remote.pd.counters.manifest_refused == 3


def test_a_block_is_put_again_once_the_server_may_have_dropped_it() -> None:
    """TTL 100 s: A's blocks, published at t=0, count as on the server until t=50 (half
    the TTL); storing the same content again then puts nothing. At t=60 it is put
    again (the server may have expired it)."""
    index = HeldIndex()
    now = [0.0]
    rig = remote_rig(index, clock=now, ttl_s=100)
    store(rig, Req("a", 9))
    (put,) = rig.step().remote
    ack_remote(rig, put)
    rig.cpu.drop_all_hashes()
    now[0] = 40.0
    store(rig, Req("b", 9))
    assert rig.step().remote == ()
    rig.cpu.drop_all_hashes()
    now[0] = 60.0
    store(rig, Req("c", 9))
    assert len(rig.step().remote) == 1


@pytest.mark.parametrize("ttl_s", [None, 7200.0])
def test_a_handoffs_blocks_count_as_there_for_half_the_hold_ttl_only(
        ttl_s: float | None) -> None:
    """The hazard: a hand-off's blocks go with the hold TTL (900 s here) but were
    remembered as on the server for half the server's TTL -- for ever with none. P's
    blocks, put (kept) at t=0, expire at t=900 unless collected; at t=1000 Q hands off
    the same prompt: its manifest was written at once with no PUT, naming blocks the
    server had dropped (its decoder recomputed), and write-through never put them
    again. Now they count as there until t=450: Q's hand-off puts them again, then
    writes its manifest."""
    index = HeldIndex()
    now = [0.0]
    rig = remote_rig(index, mode=RemoteMode.ON_EVICT, clock=now, ttl_s=ttl_s,
                     hold_ttl_s=900)
    p = Req("p", 9, params=REMOTE)
    g = rig.alloc(3, p.h)
    plan = rig.step(p.sched(g, confirmed=9, new=True))
    rig.m.finished("p", 9, [g])
    assert rig.m.transfer_params("p") is not None
    rig.ack(plan.store, ranks=range(WORLD))
    (put,) = rig.step().remote
    assert put.keep
    ack_remote(rig, put)
    rig.gpu.free(reversed(g))
    now[0] = 1000.0                                     # past the hold TTL: dropped
    index.ready.clear()
    q = Req("q", 9, params=REMOTE)
    g2 = rig.alloc(3, q.h)
    plan = rig.step(q.sched(g2, confirmed=9, new=True))
    rig.m.finished("q", 9, [g2])
    params = rig.m.transfer_params("q")
    assert params is not None and params[MANIFEST_PARAM] not in index.kv
    assert plan.store is None                           # still in the CPU tier
    (again,) = rig.step().remote
    assert again.op is RemoteOp.PUT and again.keep
    assert len(unpack_ids(again.cpu_ids)) == 2
    ack_remote(rig, again)
    rig.step()
    assert params[MANIFEST_PARAM] in index.kv           # after the PUT, not before
    assert {rkey(h) for h in q.h[:2]} <= index.ready
    rig.gpu.free(reversed(g2))
    rig.m.check_invariants()


def test_a_server_that_lost_its_data_has_every_block_put_again() -> None:
    """TTL 3600 s: A's blocks are published at t=0 and would count as on the server
    until t=1800. At t=10 the index reports that the server lost its data (a restart:
    a new run_id). The next store of that content puts it again at once (counted
    server_restarts 1) rather than skipping it as a duplicate for half an hour; a
    second store after that PUT skips it again (the memory is rebuilt)."""
    index = HeldIndex()
    now = [0.0]
    rig = remote_rig(index, clock=now, ttl_s=3600)
    store(rig, Req("a", 9))
    (put,) = rig.step().remote
    ack_remote(rig, put)
    rig.cpu.drop_all_hashes()
    now[0] = 5.0
    store(rig, Req("b", 9))
    assert rig.step().remote == ()                      # a duplicate: skipped
    rig.cpu.drop_all_hashes()
    now[0] = 10.0
    index.lost += 1
    store(rig, Req("c", 9))
    (again,) = rig.step().remote
    assert again.op is RemoteOp.PUT and len(unpack_ids(again.cpu_ids)) == 2
    assert rig.m.remote is not None and rig.m.remote.counters.server_restarts == 1
    ack_remote(rig, again)
    rig.cpu.drop_all_hashes()
    store(rig, Req("d", 9))
    assert rig.step().remote == ()
    assert rig.m.remote.counters.server_restarts == 1
    rig.m.check_invariants()


def test_a_readiness_write_the_server_refused_is_not_remembered() -> None:
    """The server refused A's readiness writes (OOM): the blocks count as unpublished
    (counted) and the next store of that content puts and publishes them again."""
    index = HeldIndex()
    rig = remote_rig(index)
    a = Req("a", 9)
    store(rig, a)
    (put,) = rig.step().remote
    ack_remote(rig, put)
    index.refuse = [rkey(a.h[0]), rkey(a.h[1])]
    rig.cpu.drop_all_hashes()
    store(rig, Req("b", 9))
    (again,) = rig.step().remote
    assert again.op is RemoteOp.PUT and len(unpack_ids(again.cpu_ids)) == 2
    assert rig.m.remote is not None and rig.m.remote.counters.publish_refused == 2


def test_a_prefix_reached_from_another_start_is_not_fetched_twice() -> None:
    """R holds block 0 on its GPU (a local hit of one block) and fetches block 1; S asks
    from block 0: block 0 is not being fetched but block 1 is, so S asks again (no
    query) instead of fetching block 1 a second time."""
    index, rig, r = fetch_setup()
    s = Req("s", 9)
    assert rig.m.lookup(r.view(), BS) is None
    index.answer_all()
    (get,) = rig.step().remote
    assert len(unpack_ids(get.cpu_ids)) == 1
    assert rig.m.lookup(s.view(), 0) is None and index.queries == []


def test_transfer_params_of_an_id_that_is_no_str_is_refused() -> None:
    """``transfer_params(["r"])`` raised TypeError (unhashable) out of the hand-off's
    books (a review): every other call checks its request id. Now InvalidRequest,
    counted, nothing changed."""
    from kvshm.errors import InvalidRequest

    rig = remote_rig(HeldIndex())
    before = rig.m.counters.invalid_calls
    with pytest.raises(InvalidRequest, match=r"transfer_params: input: req_id: must be a str"):
        rig.m.transfer_params(["r"])  # type: ignore[arg-type]
    assert rig.m.counters.invalid_calls == before + 1
    assert rig.m.transfer_params("r") is None


def test_a_long_remote_hit_whose_second_get_fails_hits_up_to_the_gap() -> None:
    """R's 3-block remote prefix comes in GETs of 2 and 1 (``max_job=2``); the second
    fails on one rank: R waits no more, and its next lookup hits the 2 blocks the first
    read (indexed, pinned for it) -- the third is recomputed. No pin is left."""
    index, _, r = fetch_setup(3)
    rig = remote_rig(index, max_job=2)
    assert rig.m.lookup(r.view(), 0) is None
    index.answer_all()
    first, second = rig.step().remote
    ack_remote(rig, first)
    ack_remote(rig, second, (True, False))
    assert rig.m.lookup(r.view(), 0) == 2 * BS
    assert rig.m.remote is not None and rig.m.remote.counters.get_failed_jobs == 1
    rig.m.finished("r", 3 * BS, [rig.alloc(3)])
    assert rig.m.pins_held() == 0
    rig.m.check_invariants()
