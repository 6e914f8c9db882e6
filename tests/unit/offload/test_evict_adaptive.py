"""The ``adaptive`` eviction order (kvshm/offload/evict_adaptive.py) in a BlockPool.

Behaviour: a burst of one-off long prompts does not flush a hot set of shared templates
(LRU loses all of them), and a tier that learned to keep chain heads hands over to
recency once the traffic turns to conversations whose tails come back (``deepest``
keeps the heads and loses the tails). Mechanics: the miniature simulations score the
compute a hit saves and admit, evict and remember ghosts as the tier does; a hand-over
re-keys every free block; bad parameters are refused. A Hypothesis state machine runs
the pool's operations with forced hand-overs in between and checks the pool's and the
order's invariants after each one.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule
from manager_rig import Req, Rig
from test_evict import PoolMachine

from kvshm.config import Eviction
from kvshm.errors import ConfigError
from kvshm.offload.evict_adaptive import EXPERTS, Adaptive
from kvshm.offload.evict_cost import block_cost
from kvshm.offload.evict_panel import MAX_PENDING, MIN_LEAD, SHADOW_BLOCKS, Expert, Shadow
from kvshm.offload.pool import BlockPool


def _key(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()[:16]


def _request(pool: BlockPool, keys: list[bytes]) -> int:
    """What the manager does for one request over the chain ``keys``: pin and free the
    cached prefix (a hit), then store the rest (allocate, index with depths, free tail
    first). Returns the hit blocks."""
    hits = pool.cached_run(keys, 0, len(keys))
    if hits:
        pool.touch(hits)
        pool.free(hits[::-1])
    new = [k for k in range(len(hits), len(keys)) if not pool.is_cached(keys[k])]
    if new:
        ids = pool.allocate(len(new))
        pool.add_keys(ids, [keys[k] for k in new], new)
        pool.free(ids[::-1])
    return len(hits)


def _fs(pool: BlockPool) -> Adaptive:
    fs = pool._queue
    assert isinstance(fs, Adaptive)
    return fs


TEMPLATES = [[_key("t", t, i) for i in range(12)] for t in range(8)]


def _templates_and_scans(pool: BlockPool, rounds: int = 30) -> int:
    """Few-shot traffic on 8 templates of 12 blocks (96 blocks, a 256-block pool), each
    request a template and a 2-block one-off query; after every 40 requests a burst of
    4 one-off prompts of 80 blocks (320: more than the pool). Returns the template
    blocks still cached after the last burst."""
    rng = random.Random(0)
    q = 0
    for _ in range(rounds):
        for _ in range(40):
            q += 1
            _request(pool, TEMPLATES[rng.randrange(8)] + [_key("q", q, i) for i in range(2)])
        for _ in range(4):
            q += 1
            _request(pool, [_key("scan", q, i) for i in range(80)])
    pool.check_invariants()
    return sum(pool.is_cached(k) for t in TEMPLATES for k in t)


@pytest.mark.parametrize(("eviction", "at_least", "at_most"),
                         [(Eviction.ADAPTIVE, 77, 96), (Eviction.LRU, 0, 0)])
def test_a_scan_does_not_flush_the_hot_set(eviction: Eviction, at_least: int,
                                           at_most: int) -> None:
    """After 30 bursts the adaptive order still holds at least 80 % of the templates
    (it hands the tier to an expert that takes the deep one-off blocks first); LRU
    holds none of them."""
    pool = BlockPool(256, eviction=eviction)
    assert at_least <= _templates_and_scans(pool) <= at_most


def _conversations(pool: BlockPool, *, n: int = 60, skip: int = 20) -> float:
    """Conversations on one shared 8-block system prompt, three open at a time in turn,
    6 turns each adding 6 blocks; a finished one never comes back. Returns the share of
    the history beyond the shared head (the tails) that hits, over the conversations
    from ``skip`` on."""
    head = [_key("sys", i) for i in range(8)]
    history: dict[int, list[bytes]] = {}
    live: list[tuple[int, int]] = []
    nxt = asked = hit = 0
    while nxt < n or live:
        while len(live) < 3 and nxt < n:
            history[nxt] = list(head)
            live.append((nxt, 0))
            nxt += 1
        c, t = live.pop(0)
        chain = history[c] + [_key("c", c, t, i) for i in range(6)]
        got = _request(pool, chain)
        if t and c >= skip:
            asked += len(history[c]) - len(head)
            hit += max(0, got - len(head))
        history[c] = chain
        if t + 1 < 6:
            live.append((c, t + 1))
    pool.check_invariants()
    return hit / asked


def test_a_shared_head_is_not_kept_at_the_price_of_every_tail() -> None:
    """The scan traffic above leaves the adaptive tier keeping heads; once the traffic
    is conversations, it hands over to an expert that keeps the live tails: nearly
    every tail hits, where ``deepest`` (heads first, no learning) keeps the shared
    head and the finished conversations' heads and loses most tails."""
    pool = BlockPool(256, eviction=Eviction.ADAPTIVE)
    _templates_and_scans(pool)
    assert _fs(pool).expert.name.startswith("heads")
    switches = _fs(pool).switches
    assert _conversations(pool) >= 0.95
    assert not _fs(pool).expert.name.startswith("heads")
    assert _fs(pool).switches > switches
    deepest = BlockPool(256, eviction=Eviction.DEEPEST)
    _templates_and_scans(deepest)
    assert _conversations(deepest) < 0.5


def test_a_hand_over_rekeys_every_free_block() -> None:
    """Under ``recency`` the victims go least recently placed first; handed to
    ``heads``, the same free blocks go deepest first."""
    pool = BlockPool(8, eviction=Eviction.ADAPTIVE)
    ids = pool.allocate(4)
    for b, d in zip(ids, [3, 0, 2, 1]):
        pool.add_keys([b], [_key(b)], [d])
        pool.free([b])
    fs = _fs(pool)
    assert fs.expert.name == "recency"
    assert [b.block_id for b in fs][-4:] == ids  # after the 4 uncached blocks
    fs._adopt(1)
    fs._rekey()
    pool.check_invariants()
    assert fs.expert.name == "heads"
    pool.allocate(4)  # the uncached ones
    assert pool.allocate(4) == [ids[0], ids[2], ids[3], ids[1]]  # depth 3, 2, 1, 0


def test_a_shadow_scores_saved_compute_admits_after_evicting_and_remembers_ghosts() -> None:
    sh = Shadow(Expert("p", 0.0, 0.1, False), num_blocks=4, capacity=2)
    sh.use(b"a", 0, 1, 1.0)
    sh.use(b"b", 3, 2, 1.0)
    assert sh.score == 0.0
    sh.use(b"a", 0, 3, block_cost(0, 16))  # a hit scores its block's compute, to main
    assert sh.score == block_cost(0, 16) and sh.sizes == [1, 1]
    sh.use(b"c", 5, 4, 1.0)  # full: probation (b) goes first, c is admitted
    assert set(sh.held) == {b"a", b"c"} and b"b" in sh.ghost
    sh.use(b"b", 3, 5, 1.0)  # a ghost comes back to main
    assert sh.held[b"b"] & 1 == 1 and b"b" not in sh.ghost
    sh.check()
    sh.decay(0.5)
    assert sh.score == block_cost(0, 16) / 2


def test_a_shadow_counts_gpu_hits_only_for_an_expert_that_does() -> None:
    for refresh in (True, False):
        sh = Shadow(Expert("r", 0.0, None, refresh), num_blocks=2, capacity=2)
        sh.use(b"a", 0, 1, 1.0)
        sh.use(b"b", 0, 2, 1.0)
        sh.touch(b"a", 0, 3)  # a GPU hit on a
        sh.use(b"c", 0, 4, 1.0)  # the least recent goes
        assert (b"a" in sh.held) is refresh


def test_the_simulations_are_sampled_to_a_bounded_size() -> None:
    small = Adaptive(64)
    assert small.panel.sample_below == 65536 and small.panel.tiers[0][0].capacity == 64
    big = Adaptive(64 * SHADOW_BLOCKS)
    assert big.panel.sample_below == 65536 // 64
    assert [t[0].capacity for t in big.panel.tiers] == [SHADOW_BLOCKS, SHADOW_BLOCKS * 3 // 4,
                                                  SHADOW_BLOCKS // 2]
    assert len(big.panel.shadows) == 3 * len(EXPERTS)


@pytest.mark.parametrize("kw", [{"num_blocks": 0}, {"num_blocks": 4, "block_tokens": 0},
                                {"num_blocks": 4, "half": 0.0},
                                {"num_blocks": 4, "experts": ()},
                                {"num_blocks": 4, "start": len(EXPERTS)},
                                {"num_blocks": 4, "max_pending": -1}])
def test_bad_parameters_are_refused(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="bad Adaptive parameters"):
        Adaptive(**kw)  # type: ignore[arg-type]


# scores per tier (full, 0.75, 0.5 of the capacity) for recency, heads, heads_probation,
# probation; the tier runs recency (values recorded from bench_evict's runs).
LEANS_THEN_SETTLED = [[1856, 1941, 1941, 1856], [831, 1870, 1817, 831], [135, 1148, 825, 135]]
DISAGREES = [[2000, 1941, 1941, 1856], [831, 1870, 1817, 831], [135, 1148, 825, 135]]
A_FEW_HITS = [[289, 289, 289, 289], [289, 289, 289, 289], [161, 207, 207, 0]]
CLEAR = [[2409, 3143, 3143, 2409], [1199, 2789, 2633, 1319], [668, 1815, 1376, 752]]


@pytest.mark.parametrize(("tiers", "want"), [
    (LEANS_THEN_SETTLED, 1), (DISAGREES, None), (A_FEW_HITS, None), (CLEAR, 1)])
def test_a_hand_over_needs_a_clear_lead_no_larger_simulation_contradicts(
        tiers: list[list[float]], want: int | None) -> None:
    """The full-capacity simulation leaning to ``heads`` by 4.6 % (under the 5 %
    hysteresis) is settled by the 0.75 one (2.25x): hand over (chat_sync at a quarter
    capacity, seed 0, one period earlier than reading the first tier with any spread
    did: 0.377 -> 0.413 of the unbounded tier's saved compute). Where the full one
    prefers the current expert, no smaller one overrules it; a lead of three sampled
    hits (under ``MIN_LEAD``) is noise; a clear lead in the full one hands over."""
    fs = Adaptive(4096, block_tokens=16)
    assert fs.expert.name == "recency" and 207 - 161 < MIN_LEAD * block_cost(0, 16)
    assert fs.panel.challenger(tiers, fs.cur) == want


def _deferred_vs_immediate(pool: BlockPool, rng: random.Random, *, settle: int | None
                           ) -> list[tuple[object, ...]]:
    """Scan-heavy few-shot traffic, then conversations on a shared head (the two
    workloads above, shortened), with GPU hits on a random prefix of each chain before
    its request (``pool.refresh``, as the manager's lookup does) and, unless ``settle``
    is None, a host's ``settle(settle)`` at random points (0: the whole log; k: the
    oldest k events, as the vLLM side's pump does). Returns, after every request, the
    free set's victim order, the expert in charge and the periods ended."""
    out: list[tuple[object, ...]] = []
    fs = _fs(pool)
    when = random.Random(rng.random())  # the host's settles: apart from the traffic's

    def request(chain: list[bytes]) -> None:
        gpu = rng.randrange(len(chain) + 1)
        ids = [pool.get_cached(k) for k in chain[:gpu]]
        pool.refresh([b for b in reversed(ids) if b is not None])
        _request(pool, chain)
        if settle is not None and when.random() < 0.3:
            pool.settle(settle)
        out.append((tuple(b.block_id for b in fs), fs.cur, fs.panel.decisions))

    q = 0
    for _ in range(6):
        for _ in range(30):
            q += 1
            request(TEMPLATES[rng.randrange(8)] + [_key("q", q, i) for i in range(2)])
        for _ in range(3):
            q += 1
            request([_key("scan", q, i) for i in range(80)])
    head = [_key("sys", i) for i in range(8)]
    history = {c: list(head) for c in range(40)}
    for t in range(6):
        for c in range(40):
            history[c] = history[c] + [_key("c", c, t, i) for i in range(6)]
            request(history[c])
    pool.check_invariants()
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_deferred_simulations_evict_exactly_as_immediate_ones(seed: int) -> None:
    """The simulations' log (settled by the host at random points -- all of it, or its
    oldest 3 events at a time --, by the order before each decision, and whenever it
    outgrows ``max_pending``) leaves every decision and every victim as applying each
    event at once does (``max_pending=0``): the same victim order after every request,
    the same hand-overs, the same scores. A limited settle that took other events than
    the oldest, or reordered them, would change a score and fail here."""
    runs = []
    for max_pending, settle in ((0, None), (MAX_PENDING, None), (MAX_PENDING, 0),
                                (MAX_PENDING, 3), (5, None)):
        pool = BlockPool(256, eviction=Eviction.ADAPTIVE)
        _fs(pool).panel.max_pending = max_pending
        seq = _deferred_vs_immediate(pool, random.Random(seed), settle=settle)
        fs = _fs(pool)
        assert fs.panel.pending == 0  # check_invariants settled
        runs.append((seq, fs.switches, [s.score for s in fs.panel.shadows],
                     [sorted(s.held.items()) for s in fs.panel.shadows]))
    immediate = runs[0]
    assert immediate[1] >= 2  # the traffic hands the tier over: the decisions matter
    for run in runs[1:]:
        assert run == immediate


def test_a_lookup_logs_the_simulations_work_and_a_settle_applies_it() -> None:
    """A GPU hit and a pin only log their simulation events (the hooks' path); the
    scores move at ``settle``."""
    pool = BlockPool(64, eviction=Eviction.ADAPTIVE)
    keys = [_key("k", i) for i in range(8)]
    _request(pool, keys)
    pool.settle()
    fs = _fs(pool)
    before = [s.score for s in fs.panel.shadows]
    ids = [pool.get_cached(k) for k in reversed(keys[:4])]
    pool.refresh([b for b in ids if b is not None])
    _request(pool, keys)  # a hit on every block
    assert fs.panel.pending == 4 + 8  # 4 GPU hits, 8 pinned
    assert [s.score for s in fs.panel.shadows] == before
    assert pool.settle(5) is True  # a host's bounded settle: the oldest 5, 7 left
    assert fs.panel.pending == 7 and fs.panel.settled == 8 + 5
    assert pool.settle() is False
    assert fs.panel.pending == 0 and fs.panel.settled == 8 + 12  # the stores, then these
    assert all(s.score > b for s, b in zip(fs.panel.shadows, before))
    assert pool.settle(5) is False and fs.panel.settled == 8 + 12  # nothing left: a no-op


class AdaptiveMachine(PoolMachine):
    """The pool state machine of test_evict (a model of refs, hashes and the
    take-first blocks) on the adaptive order, plus hand-overs at any point."""

    eviction = Eviction.ADAPTIVE

    @rule(i=st.integers(0, len(EXPERTS) - 1))
    def hand_over(self, i: int) -> None:
        fs = _fs(self.pool)
        fs._adopt(i)
        fs._rekey()

    @rule()
    def end_period(self) -> None:
        _fs(self.pool)._choose()

    @rule()
    def settle(self) -> None:
        self.pool.settle()
        assert _fs(self.pool).panel.pending == 0


AdaptiveMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_adaptive_machine = AdaptiveMachine.TestCase


@pytest.mark.parametrize("eviction", [Eviction.ADAPTIVE, Eviction.SLRU, Eviction.S3FIFO])
def test_a_request_waiting_for_admission_is_one_use_of_its_hit_not_one_per_step(
        eviction: Eviction) -> None:
    """The hazard: vLLM looks a waiting request up every step until its KV fits. Each
    lookup freed the previous hit's pins first -- the blocks went back to the free set
    (a placement: the order's clock and the panel's period advanced) -- and then pinned
    them again, which the order took for a hit (a scored use for every simulation, a
    frequency step). One 6-block hit asked 50 times counted as 300 hits and ended 18
    periods. Now the new hit is pinned before the old one is released: 50 asks leave
    the order exactly as one ask does."""
    def after(asks: int) -> tuple[object, ...]:
        rig = Rig(cpu=16, gpu=64, eviction=eviction)
        b = Req("b", 4 * 6 + 1)
        rig.seed_cpu(*b.h[:6])
        for _ in range(asks):
            assert rig.m.lookup(b.view(), 0) == 24
        rig.m.allocated("b", [rig.alloc(7)], 24)
        rig.m.check_invariants()
        rig.cpu.settle()
        fs = rig.cpu._queue
        order = (fs.clock, fs.panel.settled, fs.panel.decisions,
                 [round(s.score, 6) for s in fs.panel.shadows]) \
            if isinstance(fs, Adaptive) else ()
        return (order, [rig.cpu._blocks[i].freq for i in range(16)],
                tuple(rig.cpu.iter_free_from_lru()), rig.m.counters.hit_tokens)

    assert after(50) == after(1)


@pytest.mark.parametrize("expert", range(len(EXPERTS)))
@pytest.mark.parametrize("seed", range(4))
def test_the_free_walk_is_the_order_allocate_takes(expert: int, seed: int) -> None:
    """The hazard: ``iter_free_from_lru()`` is "the blocks allocate takes next", which
    disk write-back and on-evict PUTs read to pick the tier's next victims; the
    adaptive order yielded all of probation, then all of main, while its victim is the
    lower key of the two (or the probation share's pick): an old block in main that
    goes first came last, so those writers pinned blocks that were not about to go.
    After a random history under each expert, the walk equals what allocating every
    free block one by one takes."""
    rng = random.Random(seed)
    pool = BlockPool(48, eviction=Eviction.ADAPTIVE)
    fs = pool._queue
    assert isinstance(fs, Adaptive)
    fs._adopt(expert)
    fs._rekey()
    for step in range(300):
        n = rng.randint(1, 4)
        if pool.num_free < n:
            continue
        ids = pool.allocate(n)
        pool.add_keys(ids, [b"k%d-%d" % (step, i) for i in range(n)],
                      [rng.randint(0, 30) for _ in range(n)])
        pool.free(ids[::-1], evict_first=rng.random() < 0.1)
        cached = [b for b in range(48) if pool.ref_cnt(b) == 0 and pool.block_hashes(b)]
        if cached and rng.random() < 0.3:
            hit = rng.sample(cached, min(len(cached), rng.randint(1, 3)))
            pool.touch(hit)
            pool.free(hit)
    walk = list(pool.iter_free_from_lru())
    taken = [pool.allocate(1)[0] for _ in range(pool.num_free)]
    assert walk == taken


@pytest.mark.parametrize("eviction", [Eviction.ADAPTIVE, Eviction.SLRU, Eviction.S3FIFO])
def test_a_pin_for_io_is_no_hit(eviction: Eviction) -> None:
    """The hazard: disk write-back pins the tier's next victims while it writes them,
    and a remote PUT pins the block it reads; both pinned with the hit path, so the
    order counted each as a use (a frequency step, which moved a never-hit block to
    main / protected; a scored hit for every simulation of the panel: 8 write-back
    pins took a simulation's score from 0 to 128). ``touch(use=False)`` withdraws the
    block and counts nothing: its frequency and the panel stay as they were."""
    def history(use: bool) -> tuple[list[int], list[int], Any]:
        pool = BlockPool(16, eviction=eviction, enable_events=False)
        ids = pool.allocate(8)
        pool.add_keys(ids, [hashlib.sha256(b"%d" % i).digest() for i in range(8)],
                      list(range(8)))
        pool.free(ids[::-1])
        fs = pool._queue
        before = [pool._blocks[b].freq for b in ids]
        pool.touch(ids, use=use)
        freqs = [pool._blocks[b].freq for b in ids]
        pool.free(ids[::-1], evict_first=True)
        pool.check_invariants()
        pool.settle()
        panel = (fs.panel.settled, [s.score for s in fs.panel.shadows]) \
            if isinstance(fs, Adaptive) else ()
        return before, freqs, panel

    before, freqs, panel = history(use=False)
    assert freqs == before
    assert panel == (() if eviction is not Eviction.ADAPTIVE
                     else (panel[0], [0.0] * len(panel[1])))
    _, hit_freqs, _ = history(use=True)
    assert hit_freqs != before  # the hit path does count
