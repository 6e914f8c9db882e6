"""A P/D decoder that already holds part of a hand-off locally, narrated with exact
block ids and ref counts on real managers (``kvshm.offload.manager.lookup`` and
``kvshm.offload.pd``): a prefill manager P and a decode manager D share one held
readiness index (:class:`HeldIndex`, the test answers its queries).

BS = 4, two ranks. R has 11 tokens: full blocks h0, h1 and a 3-token tail. P publishes
all three and the manifest. Hazard: *a hand-off short-cut by a local CPU hit* -- D's CPU
tier already holds h0 (an earlier request with the same first block, e.g. a shared
system prompt), and a CPU hit used to end the lookup there: D recomputed tokens 4..9
that the server held for it, and never read or collected the manifest. Now a hand-off
whose CPU hit ends short of its extent asks the remote tier for the rest (the manifest
said the server holds it) and waits, holding its hit meanwhile.

Second hazard: *a manifest trusted but never collected* -- D's GPU already holds every
full block of R (nothing to fetch): the manifest was read and trusted, but only a GET's
completion collected it, so it stayed on the server until its TTL. Now the request's end
collects it.
"""

from __future__ import annotations

from typing import Any

from manager_rig import Req, Rig, refs
from test_handoff_tail import MANIFEST, publish, tail_of
from test_remote_book import HeldIndex, ack_remote, remote_rig, rkey, settle, store

from kvshm.ipc.protocol import RemoteOp, unpack_ids
from kvshm.types import RequestView


def handoff_view(r: Req, params: dict[str, Any], tail: bytes | None) -> RequestView:
    return RequestView("r", r.h, len(r.toks), {"do_remote_prefill": True, **params}, tail)


def q_decoder(*, tail: bool = True, cpu: int = 16
              ) -> tuple[HeldIndex, Rig, Req, RequestView]:
    """P hands R off (with its tail or not); D (``cpu`` CPU blocks) stored Q, whose one
    full block is R's h0, into CPU 0 (ref 0, its PUT acked). Returns the index, D, R
    and R's hand-off view (with the tail key when ``tail``)."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=tail)
    d = remote_rig(index, cpu=cpu)
    assert store(d, Req("q", 5)) == [0]
    settle(d)
    return index, d, r, handoff_view(r, params, tail_of(r) if tail else None)


def test_a_handoff_short_cut_by_a_local_cpu_hit_fetches_the_rest() -> None:
    """D first computes Q (tokens 0..4: its one full block is h0, R's first) and stores
    it into CPU 0 (ref 0 once its write-through PUT is acked). R's first lookup finds
    the CPU hit on CPU 0 (4 tokens) short of R's extent (positions 0..2, tail included),
    so it answers None holding CPU 0 (ref 1) and the manifest is asked. The manifest
    arrives and is trusted; the readiness keys of positions 1 and 2 (h1, the tail) --
    not h0's, which D holds -- are asked and answered; the GET fetches them into CPU 1,
    2. The next lookup is an ordinary CPU hit over CPU 0, 1, 2 (refs 1, 1, 1): 10
    tokens, only token 10 computed. Phase B loads CPU 0, 1, 2 into GPU 5, 6, 7 and the
    manifest is collected."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    q = Req("q", 5)
    assert q.h[0] == r.h[0]
    assert store(d, q) == [0]
    settle(d)
    assert d.cpu.get_cached(r.h[0]) == 0 and refs(d.cpu, [0]) == [0]

    view = handoff_view(r, params, tail_of(r))
    assert d.m.lookup(view, 0) is None                  # not the 4-token CPU hit
    assert refs(d.cpu, [0]) == [1]                      # held while it waits
    d.m.check_invariants()
    asked: list[list[str]] = []
    hit = None
    for _ in range(6):
        asked.extend(keys for _, keys in index.queries)
        index.answer_all()
        for msg in d.step().remote:
            assert msg.op is RemoteOp.GET
            assert unpack_ids(msg.cpu_ids) == [1, 2]
            ack_remote(d, msg)
        hit = d.m.lookup(view, 0)
        d.m.check_invariants()
        if hit is not None:
            break
    assert asked == [[rkey(r.h[1]), rkey(tail_of(r))]]
    assert hit == 10
    assert [d.cpu.get_cached(k) for k in (r.h[0], r.h[1], tail_of(r))] == [0, 1, 2]
    assert refs(d.cpu, [0, 1, 2]) == [1, 1, 1]
    g = d.gpu.allocate(8)[5:]
    d.m.allocated("r", [g], hit)
    plan = d.step()
    assert plan.load is not None
    assert unpack_ids(plan.load.src_ids) == [0, 1, 2] and unpack_ids(plan.load.dst_ids) == g
    assert MANIFEST not in index.kv
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert (d.m.remote.pd.counters.consumed, d.m.remote.pd.counters.collected) == (1, 1)


def test_a_handoff_whose_cpu_hit_covers_its_extent_does_not_wait() -> None:
    """D holds every block of R in its CPU tier already (CPU 0, 1, 2: it stored a
    request with R's tokens and the tail): R's lookup is the CPU hit at once (10
    tokens), nothing is asked of the server."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    view = handoff_view(r, params, tail_of(r))
    for _ in range(6):                         # the first hand-off fetches all three
        hit = d.m.lookup(view, 0)
        if hit is not None:
            break
        index.answer_all()
        for msg in d.step().remote:
            ack_remote(d, msg)
    assert hit == 10
    d.m.allocated("r", [d.gpu.allocate(3)], 0)  # accepted none: the pins go
    d.m.finished("r", 11, [[]])
    assert refs(d.cpu, [0, 1, 2]) == [0, 0, 0]
    index.queries.clear()
    again = RequestView("r2", r.h, 11, view.kv_transfer_params, view.tail_hash)
    assert d.m.lookup(again, 0) == 10
    assert refs(d.cpu, [0, 1, 2]) == [1, 1, 1] and index.queries == []


def test_a_manifest_trusted_but_never_collected_is_collected_when_the_request_ends(
        ) -> None:
    """R (11 tokens, handed off without its tail: full blocks h0, h1) reaches D, whose
    GPU holds both full blocks (8 local tokens): the extent after them is empty, so the
    lookup answers 0 at once (nothing to wait for) and the manifest is read in the
    background: the next step judges and trusts it (consumed 1); no GET runs. When R
    finishes on D, the manifest is deleted and its blocks get the ordinary TTL
    (collected 1)."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    view = handoff_view(r, params, None)
    assert d.m.lookup(view, 8) == 0
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    d.step()
    assert (pd.counters.consumed, pd.counters.collected) == (1, 0)
    assert MANIFEST in index.kv
    d.m.finished("r", 12, [[]])
    assert MANIFEST not in index.kv
    assert pd.counters.collected == 1
    assert f"expire {rkey(r.h[1])}" in index.log


def test_a_decoder_holding_the_whole_extent_never_waits_for_a_manifest_gone() -> None:
    """Hazard: *a wait for a manifest it does not need*. R's manifest is already gone
    from the server (a sibling of R -- vLLM's parallel sampling shares one hand-off --
    finished and collected it). R reaches D, whose GPU holds h0 and h1 (8 local tokens,
    the whole extent): the lookup used to wait for the manifest ("ask again") and, the
    manifest missing, go on asking for ``wait_s`` (5 s) before answering 0. Now it
    answers 0 at once; the background read ends missing (counted) and nothing is
    collected or pinned."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    del index.kv[MANIFEST]
    clock = [0.0]
    d = remote_rig(index, clock=clock)
    assert d.m.lookup(handoff_view(r, params, None), 8) == 0
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    for t in (1.0, 6.0, 7.0):
        clock[0] = t
        d.step()
    assert (pd.counters.consumed, pd.counters.manifest_missing) == (0, 1)
    d.m.finished("r", 12, [[]])
    assert pd.counters.collected == 0 and d.m.pins_held() == 0


def wait_for_hit(d: Rig, index: HeldIndex, view: RequestView, local: int = 0) -> int:
    """Look ``view`` up, answering the server's queries and acking its GETs, until the
    lookup answers; returns what it answered."""
    for _ in range(8):
        hit = d.m.lookup(view, local)
        d.m.check_invariants()
        if hit is not None:
            return hit
        index.answer_all()
        for msg in d.step().remote:
            ack_remote(d, msg)
    raise AssertionError("the lookup never answered")


def test_the_get_for_the_rest_does_not_evict_the_prefix_it_extends() -> None:
    """Hazard: *the wait evicts its own prefix*. D's CPU tier has two blocks; CPU 0
    holds h0 (Q's), ref 0. R's lookup waits for h1 and the tail. Had the wait left CPU 0
    unpinned, the GET's allocation of two blocks would have taken CPU 1 and evicted CPU
    0 (the LRU one) for the tail: the next lookup found no CPU hit at all and answered 0
    -- worse than the 4-token hit it waited on. Held, CPU 0 stays ref 1: only one block
    is free, the GET fetches h1 alone into CPU 1 (the tail is recomputed), and R's hit
    is CPU 0, 1 (8 tokens, refs 1, 1). The held pin went with the hit: no double pin."""
    index, d, r, view = q_decoder(cpu=2)
    assert d.m.lookup(view, 0) is None
    assert refs(d.cpu, [0]) == [1] and d.cpu.num_free == 1
    gets: list[list[int]] = []
    hit = None
    for _ in range(6):
        index.answer_all()
        for msg in d.step().remote:
            gets.append(unpack_ids(msg.cpu_ids))
            ack_remote(d, msg)
        hit = d.m.lookup(view, 0)
        d.m.check_invariants()
        if hit is not None:
            break
    assert gets == [[1]]
    assert hit == 8
    assert [d.cpu.get_cached(k) for k in (r.h[0], r.h[1])] == [0, 1]
    assert refs(d.cpu, [0, 1]) == [1, 1]
    d.m.allocated("r", [[]], 0)
    assert refs(d.cpu, [0, 1]) == [0, 0]


def test_a_reset_does_not_collect_a_manifest_whose_request_goes_on() -> None:
    """Hazard: *a reset collects a hand-off in flight*. R's manifest is read and trusted
    (consumed 1) and its readiness query is out when the engine resets: the remote book
    forgets its lookups and unpins CPU 0 (held, ref 1 -> 0), but R goes on -- the manifest
    stays on the server (collected 0) and R's verdict is kept. Once the reset is over,
    R's next lookup asks the server again without re-reading the manifest and loads all
    three blocks; only then is the manifest collected. (The readiness query sent with
    the manifest read is still unanswered when it is trusted: a second, ordinary query
    goes out.)"""
    index, d, r, view = q_decoder()
    assert d.m.lookup(view, 0) is None and len(index.queries) == 1  # asked ahead
    d.step()                                   # the manifest arrives: a query goes out
    assert d.m.lookup(view, 0) is None and len(index.queries) == 2
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    assert pd.counters.consumed == 1 and refs(d.cpu, [0]) == [1]
    assert d.m.reset() is True
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [0] and d.m.pins_held() == 0
    assert MANIFEST in index.kv and pd.counters.collected == 0
    index.queries.clear()
    index.answer_all()                         # the old answer is stale now
    d.step()
    assert wait_for_hit(d, index, view) == 10
    assert pd.counters.consumed == 1           # not read twice
    assert MANIFEST not in index.kv and pd.counters.collected == 1


def test_a_decoder_without_the_tail_key_holding_every_full_block_does_not_wait() -> None:
    """Hazard: *a wait for blocks it can never hit*. R (11 tokens) is handed off with
    its tail, but D has no tail key (``tail_hash`` None): its extent is h0, h1 (positions
    0..1; the 3 tail tokens are computed). D's CPU tier holds both (CPU 0, 1, Q's). The
    lookup used to compare the hit's end (2) with the token extent (3 blocks) and wait
    for a block it has no key for; now it answers 8 at once (refs 1, 1) and asks the
    server no readiness key."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    assert store(d, Req("q", 9)) == [0, 1]
    settle(d)
    index.queries.clear()
    assert d.m.lookup(handoff_view(r, params, None), 0) == 8
    assert refs(d.cpu, [0, 1]) == [1, 1] and index.queries == []


def test_a_handoff_served_wholly_from_the_cpu_tier_collects_its_manifest() -> None:
    """Hazard: *a manifest nobody reads*. R (11 tokens, handed off without its tail:
    h0, h1) reaches D, whose CPU tier holds both (CPU 0, 1). The hit covers the extent
    (8 tokens at once, no wait), and the manifest is read in the background; the next
    step judges it (consumed 1). R loads CPU 0, 1 and finishes: the manifest is deleted
    and its blocks get the ordinary TTL (collected 1). Before, it was never read and
    stayed on the server, its blocks held, until its TTL."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    assert store(d, Req("q", 9)) == [0, 1]
    settle(d)
    assert d.m.lookup(handoff_view(r, params, None), 0) == 8
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    d.m.allocated("r", [d.gpu.allocate(2)], 8)
    plan = d.step()
    assert plan.load is not None and unpack_ids(plan.load.src_ids) == [0, 1]
    assert pd.counters.consumed == 1 and MANIFEST in index.kv
    d.m.finished("r", 12, [[]])
    assert MANIFEST not in index.kv and pd.counters.collected == 1
    assert f"expire {rkey(r.h[1])}" in index.log
