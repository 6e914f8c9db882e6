"""A P/D decoder's readiness query sent with its manifest read
(``kvshm.offload.remote_ahead`` through ``kvshm.offload.remote.RemoteBook``), narrated
on real managers: a prefill manager P and a decode manager D share one held readiness
index (:class:`HeldIndex`: the test answers its queries; a manifest read answers at
once).

BS = 4, two ranks. R has 11 tokens: full blocks h0, h1 and a 3-token tail; P publishes
all three and the manifest. Before, D read the manifest and only then asked the
readiness keys: two rounds of the index's thread and an engine step more before the
GET, each wake-up a wait for the GIL on a busy engine."""

from __future__ import annotations

from test_handoff_local_prefix import handoff_view
from test_handoff_tail import MANIFEST, publish, tail_of
from test_remote_book import HeldIndex, ack_remote, remote_rig, rkey

from kvshm.ipc.protocol import RemoteOp, unpack_ids
from kvshm.offload.fetches import FetchState


def test_the_answer_that_came_with_the_manifest_plans_the_get_without_a_second_query(
        ) -> None:
    """R's first lookup asks the manifest and, beside it, the readiness keys of h0, h1
    and the tail (one query). Both are answered; the next lookup trusts the manifest
    and takes that answer: R's fetch is ANSWERED at once, no second query goes out, and
    the very next step plans the GET of all three blocks into CPU 0, 1, 2. The lookup
    after the acks is the CPU hit (10 tokens) and the manifest is collected."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    view = handoff_view(r, params, tail_of(r))
    assert d.m.lookup(view, 0) is None
    assert [keys for _, keys in index.queries] == [[rkey(h) for h in (*r.h, tail_of(r))]]
    index.answer_all()
    assert d.m.lookup(view, 0) is None and index.queries == []
    book = d.m.remote
    assert book is not None and book.pd is not None
    st = book.fetches.get("r")
    assert st is not None and st.state is FetchState.ANSWERED and st.present == 3
    gets = [m for m in d.step().remote if m.op is RemoteOp.GET]
    assert [unpack_ids(m.cpu_ids) for m in gets] == [[0, 1, 2]]
    ack_remote(d, gets[0])
    assert d.m.lookup(view, 0) == 10
    c = book.counters
    assert (c.queries_ahead, c.ahead_used, c.queries, c.query_hits) == (1, 1, 0, 1)
    assert MANIFEST not in index.kv and book.pd.counters.collected == 1
    d.m.check_invariants()


def test_a_short_answer_beside_the_manifest_is_thrown_away_and_asked_again() -> None:
    """What the rule guards: the readiness query beside the manifest read is
    answered while R's readiness keys are not there (0 present: an answer read before
    the manifest existed, or keys evicted; here they are taken from the "server" for
    that answer only). When the manifest is trusted that short
    answer is not used -- R does not give up its hand-off for a stale 0 -- the ordinary
    query goes out, finds all three, and the GET fetches them: 10 tokens hit."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    view = handoff_view(r, params, tail_of(r))
    assert d.m.lookup(view, 0) is None and len(index.queries) == 1
    ready, index.ready = index.ready, set()
    index.answer_all()  # 0 present
    index.ready = ready
    assert d.m.lookup(view, 0) is None
    assert [keys for _, keys in index.queries] == [[rkey(h) for h in (*r.h, tail_of(r))]]
    hit = None
    for _ in range(6):
        index.answer_all()
        for msg in d.step().remote:
            ack_remote(d, msg)
        hit = d.m.lookup(view, 0)
        if hit is not None:
            break
    assert hit == 10
    book = d.m.remote
    assert book is not None
    c = book.counters
    assert (c.queries_ahead, c.ahead_used, c.queries, c.query_hits) == (1, 0, 1, 1)
    d.m.check_invariants()
