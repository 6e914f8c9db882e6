"""The P/D hand-off's partial last block (``kvshm.offload.pd``), narrated with exact
block ids and ref counts on real managers: a prefill manager P and a decode manager D
share one held readiness index (:class:`HeldIndex`, the test answers its queries).

BS = 4. R has 11 tokens: full blocks 0 and 1 (hashes ``h0``, ``h1``) and a 3-token tail
(``tail_hash(h1, tokens 8..10)``). A decoder that derives the same tail key loads all
three blocks and computes only token 10; one without it loads the two full blocks.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from manager_rig import BS, REMOTE, Req, Rig, manager_state, refs
from test_remote_book import WORLD, HeldIndex, ack_remote, remote_rig, rkey, settle

from kvshm.errors import InvalidRequest
from kvshm.hashing import tail_hash
from kvshm.ipc.protocol import RemoteOp, unpack_ids
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest, manifest_key
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import RequestView

MANIFEST = manifest_key("fp", WORLD, "r")


def tail_of(r: Req) -> bytes:
    n = len(r.toks) // BS
    return tail_hash(r.h[n - 1], r.toks[n * BS:])


def publish(index: HeldIndex, n_tokens: int = 11, *, tail: bool = True,
            req: Req | None = None) -> tuple[Rig, Req, dict[str, Any]]:
    """P computes R (GPU blocks 0, 1, 2), stores its full blocks, finishes it with the
    tail key, stores the tail and puts everything; every job acked by both ranks.
    ``req``: another request than R (its id names the manifest)."""
    rig = remote_rig(index)
    r = req if req is not None else Req("r", n_tokens, params=REMOTE)
    n_tokens = len(r.toks)
    g = rig.alloc(-(-n_tokens // BS), r.h)
    plan = rig.step(r.sched(g, confirmed=n_tokens, new=True))
    rig.m.finished(r.rid, n_tokens, [g], tail_hash=tail_of(r) if tail else None)
    if tail and n_tokens % BS > 1:   # the partial block: the engine's ref and the store's
        assert refs(rig.gpu, g) == [2, 2, 2]
    params = rig.m.transfer_params(r.rid)
    assert params is not None and params[MANIFEST_PARAM].endswith(f":{r.rid}")
    rig.ack(plan.store, ranks=range(WORLD))
    settle(rig)
    rig.gpu.free(reversed(g))
    return rig, r, params


def manifest(index: HeldIndex) -> Manifest:
    return msgspec.json.decode(index.kv[MANIFEST], type=Manifest)


def consume(index: HeldIndex, r: Req, params: dict[str, Any], tail: bytes | None
            ) -> tuple[Rig, RequestView, int]:
    """D looks R up as a P/D proxy sends it: manifest, readiness query (answered), GET
    (acked by both ranks), then the CPU hit; returns D's rig, the view and the hit."""
    rig = remote_rig(index)
    view = RequestView("r", r.h, len(r.toks), {"do_remote_prefill": True, **params}, tail)
    for _ in range(6):
        hit = rig.m.lookup(view, 0)
        rig.m.check_invariants()
        if hit is not None:
            return rig, view, hit
        index.answer_all()
        for msg in rig.step().remote:
            assert msg.op is RemoteOp.GET
            ack_remote(rig, msg)
    raise AssertionError("the decoder never answered")


def test_the_partial_last_block_is_published_last_and_loaded_so_only_the_last_token_is_computed(
        ) -> None:
    """P: the first step stores GPU 0, 1 (the full blocks) into CPU 0, 1; ``finished``
    with the tail key pins GPU 2 (the partial block: ref 2, the engine's and the
    finish-time store's) and the next step stores it into CPU 2 under the tail key;
    once both ranks acked every PUT the server holds the three readiness keys, then the
    manifest (written last) naming h0, h1, tail with ``tail == 1``. GPU 2 is back to
    the engine's ref alone before the engine frees it.

    D (fresh CPU tier) derives the same tail key from R's tokens: its lookup reads the
    manifest, asks the three readiness keys, fetches CPU 0, 1, 2 and answers 10 tokens
    (11 - 1: only token 10 is computed). Phase B loads all three blocks into GPU
    5, 6, 7; D's store cursor starts at position 2 (the tail position is stored once
    its block fills), and the manifest is collected."""
    index = HeldIndex()
    p, r, params = publish(index)
    tail = tail_of(r)
    assert p.cpu.get_cached(r.h[0]) == 0 and p.cpu.get_cached(r.h[1]) == 1
    assert p.cpu.get_cached(tail) == 2 and refs(p.gpu, [0, 1, 2]) == [0, 0, 0]
    assert index.log == [rkey(r.h[0]), rkey(r.h[1]), rkey(tail), MANIFEST]
    # the manifest vouches for its own readiness keys only: written unless one of
    # those is refused (another block's refusal does not hold it back)
    assert index.after[MANIFEST] == [rkey(r.h[0]), rkey(r.h[1]), rkey(tail)]
    m = manifest(index)
    assert m.hashes == [remote_hash(k).hex() for k in (r.h[0], r.h[1], tail)]
    assert (m.tail, m.num_tokens) == (1, 11)

    d, view, hit = consume(index, r, params, tail)
    assert hit == 10
    assert [d.cpu.get_cached(k) for k in (r.h[0], r.h[1], tail)] == [0, 1, 2]
    assert refs(d.cpu, [0, 1, 2]) == [1, 1, 1]                    # the hit's pins
    g = d.gpu.allocate(8)[5:]                                      # GPU 5, 6, 7
    d.m.allocated("r", [g], hit)
    d.m.check_invariants()
    assert d.m._track.reqs["r"].start == 2
    plan = d.step()
    assert plan.load is not None
    assert unpack_ids(plan.load.src_ids) == [0, 1, 2] and unpack_ids(plan.load.dst_ids) == g
    assert MANIFEST not in index.kv                                # collected
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.collected == 1


def test_a_decoder_without_the_tail_key_loads_the_full_blocks_only() -> None:
    """The same hand-off; D's request carries no tail key (an API user that did not
    compute it): the manifest is still trusted (its tail is not compared), only h0, h1
    are asked and fetched, and the hit is 8 tokens (tokens 8..10 computed)."""
    index = HeldIndex()
    _, r, params = publish(index)
    d, _, hit = consume(index, r, params, None)
    assert hit == 8
    assert d.cpu.get_cached(tail_of(r)) is None
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.consumed == 1


def test_a_wrong_tail_key_is_simply_not_found() -> None:
    """D computes a tail key over other tokens: the full blocks load (8 tokens); the
    server has no readiness key for D's tail, so nothing else is fetched."""
    index = HeldIndex()
    _, r, params = publish(index)
    _, _, hit = consume(index, r, params, tail_hash(r.h[1], [7, 7, 7]))
    assert hit == 8


def test_a_one_token_tail_is_not_handed_off() -> None:
    """R has 9 tokens (a 1-token tail): the decoder computes token 8 in any case, so P
    neither stores nor publishes the tail; D's hit is 8 tokens."""
    index = HeldIndex()
    p, r, params = publish(index, 9)
    assert p.cpu.get_cached(tail_of(r)) is None and manifest(index).tail == 0
    _, _, hit = consume(index, r, params, tail_of(r))
    assert hit == 8


def test_a_handoff_ending_on_a_block_boundary_loads_every_block() -> None:
    """R has 12 tokens (3 full blocks, no tail): an ordinary lookup stops at 8 tokens
    (the last full block holds the last token), but a hand-off decoder loads all three
    blocks and answers 11: it computes token 11 only (vLLM's P/D convention)."""
    index = HeldIndex()
    _, r, params = publish(index, 12, tail=False)
    d, _, hit = consume(index, r, params, None)
    assert hit == 11
    g = d.gpu.allocate(3)
    d.m.allocated("r", [g], hit)
    plan = d.step()
    assert plan.load is not None and unpack_ids(plan.load.dst_ids) == g
    assert d.m._track.reqs["r"].start == 2


@pytest.mark.parametrize(("tail", "n", "problem"), [
    (b"x" * 3, 11, "a block hash must be 8..64 bytes, got 3"),
    ("not-bytes", 11, "a block hash must be bytes"),
    (b"x" * 16, 12, "12 tokens end on a block boundary"),
])
def test_a_bad_tail_key_is_refused_whole(tail: Any, n: int, problem: str) -> None:
    """``finished`` and ``lookup`` refuse a tail key of the wrong type or length, or one
    for a count that ends on a block boundary: InvalidRequest naming ``tail_hash``,
    the manager exactly as before but for its ``invalid_calls`` counter."""
    index = HeldIndex()
    rig = remote_rig(index)
    r = Req("r", n, params=REMOTE)
    g = rig.alloc(3, r.h)
    rig.step(r.sched(g, confirmed=n, new=True))
    before, n_invalid = manager_state(rig.m), rig.m.counters.invalid_calls
    with pytest.raises(InvalidRequest, match=problem) as exc:
        rig.m.finished("r", n, [g], tail_hash=tail)
    assert exc.value.field == "tail_hash" and exc.value.call == "finished"
    with pytest.raises(InvalidRequest, match=problem):
        rig.m.lookup(RequestView("r", r.h, n, None, tail), 0)
    assert manager_state(rig.m) == before and rig.m.counters.invalid_calls == n_invalid + 2


def test_a_tail_block_the_steps_did_not_list_there_is_refused() -> None:
    """A P/D prefill request r (11 tokens: 2 full blocks and a 3-token tail) was listed
    with GPU 0, 1, 2 -- 2 holds its tail. Its ``finished`` names GPU 3 (another
    request's partial block) at the tail's position: the finish check covered the full
    blocks only, and the hand-off's tail store pinned 3 and published its bytes under
    r's tail key (found by a review). Refused now; the manager unchanged."""
    index = HeldIndex()
    rig = remote_rig(index)
    r = Req("r", 11, params=REMOTE)
    g = rig.alloc(3, r.h)                                      # [0, 1, 2]
    other = rig.alloc(1)                                       # [3]
    rig.step(r.sched(g, confirmed=11, new=True))
    before, n_invalid = manager_state(rig.m), rig.m.counters.invalid_calls
    with pytest.raises(InvalidRequest, match="block 3 where the steps listed 2") as exc:
        rig.m.finished("r", 11, [[g[0], g[1], other[0]]], tail_hash=tail_of(r))
    assert exc.value.field == "gpu_block_ids[0][2]"
    assert manager_state(rig.m) == before and rig.m.counters.invalid_calls == n_invalid + 1
    assert refs(rig.gpu, other) == [1]
