"""Hazards of the P/D hand-off's partial last block (:mod:`kvshm.offload.pd.handoffs`)
and of the hand-off lookup's input, each narrated with exact block ids and ref counts on
real managers (a prefill manager P and a decode manager D over one :class:`HeldIndex`;
BS = 4, two ranks). Each test failed before the fix it names:

1. A hand-off lookup reads hashes the lookup check never looked at: the manifest check
   reads every hash from position 0, and the hand-off extent reaches the last full
   block of a prompt ending on a block boundary. A malformed one there raised a bare
   TypeError mid-lookup (state already changed), or later inside another call's
   ``build_step`` -- losing the neighbours' manifest answers, so their lookups asked
   again for ever. Now ``InvalidRequest`` before any change; and a manifest answer
   that never comes no longer leaves a lookup waiting past twice ``wait_s``.
2. ``allocated`` compares the accepted tokens with the hit's whole blocks, not with the
   capped count ``lookup`` returned (``num_tokens - 1``): an engine accepting every
   prompt token is not refused. Now ``allocated`` compares with the lookup's answer
   (``Hit.offered``).
2b. A tail store dropped for want of CPU blocks (CPU_FULL) sank the whole hand-off: the
   publication waited for a key never put and timed out, though the full blocks were on
   the server. Now the publication drops its tail (the manager wires
   ``StorePlanner.on_dropped`` to ``RemoteBook.store_dropped``).
3. A tail key for a prompt shorter than one block (no full block, no parent) made P pin
   and store that block for a hand-off that publishes nothing.
4. Every manifest names ``tail`` (0 too), so a decoder of the previous release
   (``forbid_unknown_fields``) refused every hand-off of an upgraded prefill, even one
   without a tail; a manifest without a tail now reads as before.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from manager_rig import BS, REMOTE, Req, Rig, manager_state, refs
from test_handoff_tail import MANIFEST, consume, manifest, publish, tail_of
from test_remote_book import WORLD, HeldIndex, ack_remote, remote_rig

from kvshm.config import Eviction
from kvshm.errors import InvalidRequest
from kvshm.hashing import tail_hash
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest, handoff_extent
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import RequestView

HANDOFF = {"do_remote_prefill": True, MANIFEST_PARAM: MANIFEST}


# ---- 1. hashes a hand-off lookup reads are checked first ---------------------------------


def test_a_handoff_lookup_refuses_a_bad_last_full_hash_before_any_change() -> None:
    """D's CPU tier holds h0, h1 (CPU 0, 1). A hand-off request of 12 tokens (3 full
    blocks, no tail) whose third hash is not a hash (a list): its extent reaches block 2
    (the hit may cover 11 tokens), so the CPU search read it and raised TypeError after
    counting the lookup and creating the request's state. Now: InvalidRequest naming
    ``block_hashes[2]``, D exactly as before (but ``invalid_calls``), no pin taken."""
    index = HeldIndex()
    d = remote_rig(index)
    r = Req("r", 12)
    assert d.seed_cpu(r.h[0], r.h[1]) == [0, 1]
    bad: list[Any] = [r.h[0], r.h[1], [1, 2]]
    before, n_invalid = manager_state(d.m), d.m.counters.invalid_calls
    with pytest.raises(InvalidRequest, match="block_hashes\\[2\\]"):
        d.m.lookup(RequestView("r", bad, 12, HANDOFF), 0)
    assert manager_state(d.m) == before and d.m.counters.invalid_calls == n_invalid + 1
    assert refs(d.cpu, [0, 1]) == [0, 0]
    d.m.check_invariants()
    # the same request with its good hashes: its CPU hit (CPU 0, 1) ends before its
    # extent (block 2), so it first asks the server for the rest -- None, the hit held
    # meanwhile (a GET's allocation must not evict it)
    assert d.m.lookup(RequestView("r", r.h, 12, HANDOFF), 0) is None
    assert refs(d.cpu, [0, 1]) == [1, 1]
    d.m.check_invariants()


class SlowIndex(HeldIndex):
    """A HeldIndex whose values (manifests) arrive only when the test releases them, as
    a real server's answers do: two lookups' manifests can arrive in one poll."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[int, bytes | None]] = []

    def get_value(self, token: int, key: str) -> None:
        self.held.append((token, self.kv.get(key)))

    def release(self) -> None:
        self._values.extend(self.held)
        self.held = []


@pytest.mark.parametrize(("bad_at", "local"), [(2, 0), (0, 4)])
def test_a_bad_hash_the_manifest_check_reads_never_stalls_a_neighbour(
        bad_at: int, local: int) -> None:
    """P hands off R (12 tokens: h0, h1, h2, no tail). On D, request "x" asks for the
    same manifest with a malformed hash (7) the old check skipped (position 2, past the
    ordinary lookup cap; or position 0, under the engine's own 4-token hit), and the
    good request "r" asks too; both manifests arrive together. Before: both lookups
    said "ask again"; r's next lookup polled both manifests, hashed x's bad entry and
    raised TypeError out of r's own lookup (a plan would have raised it out of
    ``build_step``) -- and r's manifest answer, popped in the same poll, was lost: r's
    lookups said "ask again" for ever. Now x is refused at its
    lookup (InvalidRequest, D unchanged), and r goes on to its hit of 11 tokens (CPU 0,
    1, 2 fetched, pinned by the hit)."""
    index = SlowIndex()
    _, r, params = publish(index, 12, tail=False)
    d = remote_rig(index)
    kv = {"do_remote_prefill": True, **params}
    bad: list[Any] = list(r.h)
    bad[bad_at] = 7
    before = manager_state(d.m)
    with pytest.raises(InvalidRequest, match=f"block_hashes\\[{bad_at}\\]"):
        d.m.lookup(RequestView("x", bad, 12, kv), local)
    assert manager_state(d.m) == before
    view = RequestView("r", r.h, 12, kv)
    assert d.m.lookup(view, 0) is None
    index.release()
    assert ask(d, index, view) == 11
    assert [d.cpu.get_cached(h) for h in r.h] == [0, 1, 2]
    assert refs(d.cpu, [0, 1, 2]) == [1, 1, 1]


def test_a_manifest_answer_that_never_comes_ends_as_missing() -> None:
    """D asks for R's manifest and the answer never arrives (lost: the index never
    hands it over). Within ``wait_s`` (5 s) D asks again; past twice that it stops
    waiting: 0 (recompute), counted as a missing manifest -- before, "ask again" for
    ever, no pin taken meanwhile, and one readiness query only (the one sent with the
    first manifest read, never answered here: no second while it is in flight)."""
    index = SlowIndex()
    _, r, params = publish(index, 12, tail=False)
    now = [0.0]
    d = remote_rig(index, clock=now)
    view = RequestView("r", r.h, 12, {"do_remote_prefill": True, **params})
    assert d.m.lookup(view, 0) is None
    now[0] = 9.0
    assert d.m.lookup(view, 0) is None and len(index.queries) == 1
    now[0] = 10.5
    assert d.m.lookup(view, 0) == 0
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.manifest_missing == 1
    assert d.m.lookup(view, 0) == 0 and len(index.queries) == 1
    assert d.m.pins_held() == 0
    d.m.check_invariants()


def ask(d: Rig, index: HeldIndex, view: RequestView) -> int:
    """D's lookups of ``view`` until it answers: the index answers every query, every
    GET is acked by both ranks."""
    for _ in range(8):
        hit = d.m.lookup(view, 0)
        d.m.check_invariants()
        if hit is not None:
            return hit
        index.answer_all()
        if isinstance(index, SlowIndex):
            index.release()
        for msg in d.step().remote:
            ack_remote(d, msg)
    raise AssertionError(f"{view.req_id} never answered")


# ---- 2. allocated: at most what lookup returned ------------------------------------------


@pytest.mark.parametrize("accepted", [11, 12])
def test_allocated_refuses_more_tokens_than_the_capped_handoff_hit(accepted: int) -> None:
    """D's hit of R (11 tokens, tail handed off) is 10 tokens: CPU 0, 1, 2, the last one
    holding tokens 8..10. An engine accepting 11 (every prompt token: none left to
    compute for the first output) or 12 (more tokens than the prompt has) must be
    refused whole -- "more tokens than offered" -- and D left as it was, its pins
    (CPU 0, 1, 2 at ref 1) still the lookup's."""
    index = HeldIndex()
    _, r, params = publish(index)
    d, _, hit = consume(index, r, params, tail_of(r))
    assert hit == 10 and refs(d.cpu, [0, 1, 2]) == [1, 1, 1]
    g = d.gpu.allocate(3)
    before = manager_state(d.m)
    with pytest.raises(InvalidRequest, match="10 offered"):
        d.m.allocated("r", [g], accepted)
    assert manager_state(d.m) == before


# ---- 2b. a tail store dropped for want of CPU blocks ------------------------------------


def dropped_tail_publication(index: HeldIndex, *, wire: bool) -> Rig:
    """P's CPU tier has 2 blocks. R (11 tokens: GPU 0, 1 full, GPU 2 holding the 3-token
    tail) finishes without an earlier store: ``finished`` queues GPU 0, 1, 2 (ref 2
    each). The next step stores GPU 0, 1 into CPU 0, 1; GPU 2 does not fit and nothing
    is in flight, so its store is dropped (CPU_FULL; GPU 2 back to ref 1, the engine's).
    Both ranks ack the store and the PUT of h0, h1. ``wire``: the store planner tells
    the remote book of dropped stores (what the manager's patch does)."""
    p = remote_rig(index, cpu=2)
    if wire:
        assert p.m.remote is not None
        p.m._stores.finished.on_dropped = p.m.remote.store_dropped
    r = Req("r", 11, params=REMOTE)
    g = p.alloc(3, r.h)
    p.step(r.sched(g, confirmed=0, new=True))
    p.m.finished("r", 11, [g], tail_hash=tail_of(r))
    assert refs(p.gpu, g) == [2, 2, 2] and len(p.m._stores.finished.items) == 3
    plan = p.step()
    assert plan.store is not None and refs(p.gpu, g) == [2, 2, 1]
    p.ack(plan.store, ranks=range(WORLD))
    for _ in range(3):
        for msg in p.step().remote:
            ack_remote(p, msg)
    assert refs(p.gpu, g) == [1, 1, 1] and p.m.pins_held() == 0
    return p


def test_a_dropped_tail_store_leaves_the_full_block_handoff_intact() -> None:
    """Before: the publication waited for the tail key that would never be put, wrote
    no manifest and timed out after 30 s; D waited 5 s and recomputed all 11 tokens --
    the tail, an extra, sank the hand-off of the two full blocks that were on the server.
    Now the drop reaches the publication: it goes on without its tail (``tails_dropped``),
    the manifest names h0, h1 (``tail == 0``) and D, asking with the tail key, loads
    the two full blocks: 8 tokens."""
    index = HeldIndex()
    p = dropped_tail_publication(index, wire=True)
    r = Req("r", 11, params=REMOTE)
    assert p.m.remote is not None and p.m.remote.pd is not None
    assert p.m.remote.pd.counters.tails_dropped == 1
    m = manifest(index)
    assert (m.hashes, m.tail) == ([remote_hash(h).hex() for h in r.h], 0)
    _, _, hit = consume(index, r, {"do_remote_prefill": True, "do_remote_decode": False,
                                   MANIFEST_PARAM: MANIFEST}, tail_of(r))
    assert hit == 8


def test_the_manager_tells_the_remote_book_of_a_dropped_tail_store() -> None:
    """The same scenario without the test wiring the hook: the manager must."""
    index = HeldIndex()
    dropped_tail_publication(index, wire=False)
    assert MANIFEST in index.kv


# ---- 3. no tail without a full block before it -------------------------------------------


def test_a_tail_key_for_a_prompt_shorter_than_one_block_stores_nothing() -> None:
    """P's request has 3 tokens (no full block) and its engine passes a tail key anyway
    (there is no parent hash to derive it from). The hand-off publishes nothing (no
    full block), so the tail must not be pinned or stored either: GPU 0 stays at the
    engine's ref alone, nothing is queued, no store is planned, no CPU block is used."""
    index = HeldIndex()
    p = remote_rig(index)
    r = Req("r", 3, params=REMOTE)
    g = p.alloc(1)
    p.step(r.sched(g, confirmed=3, new=True))
    t = tail_hash(b"\x00" * 32, r.toks)
    p.m.finished("r", 3, [g], tail_hash=t)
    p.m.check_invariants()
    assert p.m.transfer_params("r") is None
    assert refs(p.gpu, g) == [1] and p.m._stores.finished.items == []
    assert p.step().store is None
    assert p.cpu.get_cached(t) is None and p.cpu.num_free == 16


def test_a_partial_last_block_not_handed_off_is_counted_by_why() -> None:
    """Two hand-offs whose partial last block (3 tokens) is left out: one finished
    without a tail key (vLLM gives none for multimodal inputs), one whose tail block the
    GPU pool says holds another hash (pin_tail refuses it). Both publish their full
    blocks only, as before -- but silently: the decoder then recomputed the last block
    and no counter said why. Now ``tails_unkeyed`` and ``tails_declined`` do."""
    index = HeldIndex()
    p = remote_rig(index)
    a, b = Req("a", 11, params=REMOTE), Req("b", 11, base=100, params=REMOTE)
    ga, gb = p.alloc(3, a.h), p.alloc(3, b.h)
    p.hash(gb[2:], [b"\xee" * 32])                                 # another hash on it
    p.step(a.sched(ga, confirmed=11, new=True), b.sched(gb, confirmed=11, new=True))
    p.m.finished("a", 11, [ga])                                     # no tail key
    p.m.finished("b", 11, [gb], tail_hash=tail_of(b))
    p.m.check_invariants()
    book = p.m.remote
    assert book is not None and book.pd is not None
    c = book.pd.counters
    assert (c.tails_unkeyed, c.tails_declined, c.published) == (1, 1, 2)
    assert refs(p.gpu, [ga[2], gb[2]]) == [1, 1]                    # no tail store queued


def test_the_handoff_extent_names_no_tail_without_a_full_block() -> None:
    """The decoder side of the same rule: a 3-token hand-off with a tail key looks
    nothing up (no full block: the tail has no parent), a 7-token one its full block and
    its tail (6 tokens: blocks 0, 1)."""
    t = b"t" * 32
    assert handoff_extent([], t, 3, BS, 0) == ([], 1)
    assert handoff_extent([b"h" * 32], t, 7, BS, 0) == ([b"h" * 32, t], 2)


# ---- 4. a manifest without a tail reads as before ----------------------------------------


class _ManifestV1(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The manifest as the release before the tail read it."""

    version: int
    fingerprint: str
    world: int
    block_size: int
    num_tokens: int
    hashes: list[str]
    expires_at: float


def test_a_manifest_without_a_tail_is_readable_by_the_previous_release() -> None:
    """P hands off a 12-token prompt (no tail): the manifest it writes decodes with the
    previous release's struct (a decoder not yet upgraded trusts it as before); one with
    a tail still decodes with today's struct (``tail == 1``) and is refused by the old
    one, which would otherwise compare the tail key as a full block's."""
    index = HeldIndex()
    _, r, _ = publish(index, 12, tail=False)
    raw = index.kv[MANIFEST]
    old = msgspec.json.decode(raw, type=_ManifestV1)
    assert old.hashes == [remote_hash(h).hex() for h in r.h] and old.num_tokens == 12
    assert manifest(index).tail == 0
    index2 = HeldIndex()
    publish(index2)
    assert manifest(index2).tail == 1
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(index2.kv[MANIFEST], type=_ManifestV1)
    m = Manifest(1, "fp", WORLD, BS, 12, ["ab"], time.time())
    assert b"tail" not in msgspec.json.encode(m)


# ---- 5. (pre-existing, found on the way) the GPU-hit refresh reads unchecked hashes ------


def test_the_gpu_hit_refresh_reads_no_unchecked_hash() -> None:
    """Not the tail's: an ``LRU_REFRESH`` CPU tier refreshes the CPU copies of the
    engine's own GPU hit, reading ``block_hashes[0:s)`` -- which the lookup check skips
    (it starts at the engine's hit). A malformed one there (an unhashable list at
    position 0 under a 4-token GPU hit) raised TypeError after the lookup was counted
    and its state created; it must be InvalidRequest with nothing changed."""
    rig = Rig(eviction=Eviction.LRU_REFRESH)
    r = Req("r", 12)
    bad: list[Any] = [[1], *r.h[1:]]
    before = manager_state(rig.m)
    with pytest.raises(InvalidRequest, match="block_hashes\\[0\\]"):
        rig.m.lookup(RequestView("r", bad, 12), 4)
    assert manager_state(rig.m) == before
