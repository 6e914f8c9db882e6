"""The decode side's memory of collected manifests and the empty-extent short cut, on
real managers: a prefill rig P and a decode rig D share one :class:`HeldIndex` (BS = 4,
two ranks). R has 11 tokens: full blocks h0, h1 and a 3-token tail; its manifest is
``manifest_key("fp", 2, "r")`` (MANIFEST).

The first three were found by a hostile review and failed on 24c6819: a memory that kept
a *new* publication under a reused name from being collected, an expired memory that
shut a fresh publication out, and a request served by the engine that ended before its
background read arrived (the manifest was never collected). The others are edge cases
that held.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from manager_rig import BS, REMOTE, Req, Rig, refs
from test_handoff_local_prefix import handoff_view, wait_for_hit
from test_handoff_tail import MANIFEST, publish, tail_of
from test_remote_book import WORLD, HeldIndex, remote_rig, rkey

from kvshm.offload.pd.collected import entry_size
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest
from kvshm.types import RequestView


def publish_as(index: HeldIndex, req: Req) -> dict[str, Any]:
    """P (a fresh prefill rig) hands ``req`` off (its rid names the manifest) with its
    tail; returns its transfer params."""
    return publish(index, req=req)[2]


def pd_of(d: Rig) -> Handoffs:
    assert d.m.remote is not None and d.m.remote.pd is not None
    return d.m.remote.pd


def load_and_finish(d: Rig, rid: str, hit: int, n_tokens: int = 11) -> None:
    d.m.allocated(rid, [d.gpu.allocate(-(-hit // BS))], hit)
    plan = d.step()
    assert plan.load is not None
    d.ack(plan.load, ranks=range(WORLD))
    d.m.finished(rid, n_tokens, [[]])


def collect_r(index: HeldIndex, clock: list[float] | None = None
              ) -> tuple[Rig, Req, RequestView]:
    """R is handed off and D's request "r" fetches h0, h1, tail into CPU 0, 1, 2,
    loads them and collects the manifest (collected 1, remembered in D's ``_done``);
    D's CPU tier is then reset (CPU 0, 1, 2 unindexed, ref 0)."""
    _, r, params = publish(index)
    d = remote_rig(index, clock=clock)
    view = handoff_view(r, params, tail_of(r))
    assert wait_for_hit(d, index, view) == 10
    load_and_finish(d, "r", 10)
    assert MANIFEST not in index.kv and pd_of(d).counters.collected == 1
    assert d.m.reset() is True
    assert refs(d.cpu, [0, 1, 2]) == [0, 0, 0] and d.cpu.get_cached(r.h[0]) is None
    return d, r, view


# ---- bugs ------------------------------------------------------------------------------


def test_a_second_publication_under_a_remembered_name_is_collected_too() -> None:
    """D loads and collects R's manifest M1 (``manifest_key("fp", 2, "r")``; collected
    1; M1 in D's ``_done``). The prefill then reuses request id "r" for another prompt X
    (11 tokens from 100): P publishes X's h0', h1', tail' (hold TTL) and M2 under the
    same name. D's request for X (under "r" again: the proxy sends one request id to
    both engines, so it is M2's owner) names M2: the memory does not match X's prefix,
    so it asks
    the server (manifest_reused 0), trusts M2 (consumed 2), fetches X's three blocks
    into CPU 3, 4, 5 and loads them. M2 is collected -- deleted from the server, X's
    blocks demoted to the ordinary TTL, collected 2: the memory skips a collection only
    for the very bytes it holds (it used to skip any name it held, leaving M2 on the
    server and X's blocks under the hold TTL)."""
    index = HeldIndex()
    d, _, _ = collect_r(index)
    pd = pd_of(d)
    x = Req("r", 11, base=100, params=REMOTE)       # the reused prefill request id
    params = publish_as(index, x)
    assert params[MANIFEST_PARAM] == MANIFEST and MANIFEST in index.kv
    xv = RequestView("r", x.h, 11, {"do_remote_prefill": True, **params}, tail_of(x))
    index.log.clear()
    assert wait_for_hit(d, index, xv) == 10
    assert [d.cpu.get_cached(k) for k in (x.h[0], x.h[1], tail_of(x))] == [3, 4, 5]
    assert (pd.counters.manifest_reused, pd.counters.consumed) == (0, 2)
    load_and_finish(d, "r", 10)
    assert f"expire {rkey(x.h[1])}" in index.log      # X's blocks demoted
    assert MANIFEST not in index.kv                   # M2 deleted
    assert pd.counters.collected == 2


def test_an_expired_remembered_manifest_does_not_shut_out_a_fresh_publication() -> None:
    """D loads and collects R's manifest M1 (expires_at = publish time + 600 s); its CPU
    tier is reset. 601 s later (D's wall clock) the prefill reuses request id "r" for the
    same prompt (a retried request) and writes a fresh M2 (expires 600 s after its own
    publication) under the same name; the server holds h0, h1, tail. D's request "r2"
    names M2: the remembered M1 has expired, so it is forgotten and M2 is read from the
    server and trusted; the three blocks are loaded (hit 10 tokens, as with no memory).
    It used to be judged from memory -- expired, refused -- and R2 recomputed all 10
    tokens while the fresh manifest sat on the server."""
    index = HeldIndex()
    d, r, view = collect_r(index)
    pd = pd_of(d)
    later = time.time() + 601.0
    pd.consumers._wall = lambda: later
    r_again = Req("r", 11, params=REMOTE)
    params = publish_as(index, r_again)
    # P writes M2 at D's "now" minus 1 s: it expires 599 s from now
    m2 = msgspec.structs.replace(msgspec.json.decode(index.kv[MANIFEST], type=Manifest),
                                 expires_at=later + 599.0)
    index.kv[MANIFEST] = msgspec.json.encode(m2)
    r2 = RequestView("r2", r.h, 11, {"do_remote_prefill": True, **params}, view.tail_hash)
    assert wait_for_hit(d, index, r2) == 10
    assert pd.counters.manifest_expired == 0


def test_a_short_request_served_by_the_engine_still_collects_its_manifest() -> None:
    """R (11 tokens, handed off without its tail: h0, h1) reaches D, whose GPU holds h0
    and h1 (8 local tokens, the whole extent): since 6032cfc the lookup answers 0 at
    once and the manifest is read in the background. The server's answer is not in yet
    when D's plan runs (a real index answers from another thread; modelled by
    withholding ``values()`` for one step), and R (max_tokens 1: one decode step) ends in
    that step. Its read becomes an orphan: when the answer arrives it is checked and
    collected -- the manifest deleted, h0, h1 demoted (collected 1), as for every other
    request that trusted its manifest. It used to be discarded as stale, leaving the
    manifest and the blocks' hold TTL on the server."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    pd = pd_of(d)
    assert d.m.lookup(handoff_view(r, params, None), 8) == 0
    held = index.values()                   # in flight: not answered yet
    d.step()                                # R's one decode step
    d.m.finished("r", 12, [[]])             # R ends
    index._values.extend(held)              # the answer arrives
    d.step()
    assert MANIFEST not in index.kv
    assert pd.counters.collected == 1


def test_an_orphan_read_that_is_never_answered_or_finds_nothing_is_dropped_counted(
        ) -> None:
    """Two requests served by the engine end while their manifest reads are out (as
    above). R's answer never comes: once D's clock passes ``2 * wait_s`` (10 s) from
    its lookup the orphan is dropped (orphans_dropped 1) and an answer arriving after
    that is ignored -- nothing is deleted, nothing collected. X's read answers
    "missing" (its manifest was never written): read again, as a live request's would
    be (its prefill may still publish), until ``wait_s`` (5 s) after X's lookup, then
    dropped (orphans_dropped 2). No orphan is left and no pin is held."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    clock = [0.0]
    d = remote_rig(index, clock=clock)
    pd = pd_of(d)
    assert d.m.lookup(handoff_view(r, params, None), 8) == 0
    late = index.values()                   # R's answer: held back for ever
    d.m.finished("r", 12, [[]])
    clock[0] = 10.5
    d.step()
    assert pd.counters.orphans_dropped == 1 and pd.consumers._orphans == {}
    index._values.extend(late)
    d.step()
    assert MANIFEST in index.kv and pd.counters.collected == 0
    x = Req("x", 11, base=100)
    xv = RequestView("x", x.h, 11, {"do_remote_prefill": True,
                                    MANIFEST_PARAM: "kvshm:v1:pd:fp:2:x"}, None)
    assert d.m.lookup(xv, 8) == 0           # the engine holds X's extent
    d.m.finished("x", 12, [[]])
    d.step()                                # "missing" arrives for the orphan
    assert pd.counters.orphans_dropped == 1 and pd.consumers._orphans_due != {}
    while clock[0] < 16.0:                  # read again every 10 ms at most ...
        clock[0] += 0.25
        d.step()
    assert pd.counters.orphans_dropped == 2  # ... until 5 s after X's lookup
    assert pd.consumers._orphans == {} and pd.consumers._orphans_due == {}
    assert pd.counters.collected == 0 and d.m.pins_held() == 0
    d.m.check_invariants()


# ---- edge cases that held ------------------------------------------------------------


def test_a_memory_judged_sibling_with_the_engine_holding_the_full_blocks_loads_the_tail(
        ) -> None:
    """After "r" collected M1 and a reset, sibling "r-1" (tail key, GPU holds h0, h1: 8
    local tokens, n_max 1) needs only the tail: judged from memory (manifest_reused 1),
    the tail's readiness key is asked and fetched into CPU 3; hit 2 tokens (8..9), ref 1.
    Nothing collected twice (collected 1), no manifest asked."""
    index = HeldIndex()
    d, r, view = collect_r(index)
    pd = pd_of(d)
    sib = RequestView("r-1", r.h, 11, view.kv_transfer_params, view.tail_hash)
    assert wait_for_hit(d, index, sib, local=8) == 2
    assert d.cpu.get_cached(tail_of(r)) == 3 and refs(d.cpu, [3]) == [1]
    assert (pd.counters.manifest_reused, pd.counters.manifest_missing) == (1, 0)
    d.m.allocated("r-1", [d.gpu.allocate(3)], 2)
    d.m.finished("r-1", 11, [[]])
    assert pd.counters.collected == 1 and d.m.pins_held() == 0
    d.m.check_invariants()


def test_a_sibling_served_by_the_engine_is_judged_from_memory_without_the_server(
        ) -> None:
    """Sibling "r-1" whose GPU holds the whole extent (11 tokens, no tail key: h0, h1;
    8 local) answers 0 at once and is judged from memory at once (no manifest read,
    consumed 2, manifest_reused 1); its end collects nothing twice; nothing pinned."""
    index = HeldIndex()
    d, r, view = collect_r(index)
    pd = pd_of(d)
    sib = RequestView("r-1", r.h, 11, view.kv_transfer_params, None)
    assert d.m.lookup(sib, 8) == 0
    assert index.values() == []
    assert (pd.counters.consumed, pd.counters.manifest_reused) == (2, 1)
    d.m.finished("r-1", 12, [[]])
    assert pd.counters.collected == 1 and d.m.pins_held() == 0
    assert pd.consumers._tokens == {} and "r-1" not in pd.consumers._reqs


def test_memory_path_with_an_unhealthy_index_recomputes_without_a_query() -> None:
    """Index down after the collection: sibling "r-1" is judged from memory (GO,
    consumed 2) but the remote book skips the query (skipped_unhealthy 1): 0, nothing
    pinned; its end collects nothing twice. The pd ``unhealthy`` counter is not bumped
    (the manifest was not needed)."""
    index = HeldIndex()
    d, r, view = collect_r(index)
    pd = pd_of(d)
    index.up = False
    sib = RequestView("r-1", r.h, 11, view.kv_transfer_params, view.tail_hash)
    assert d.m.lookup(sib, 0) == 0
    assert d.m.remote is not None and d.m.remote.counters.skipped_unhealthy == 1
    assert (pd.counters.consumed, pd.counters.unhealthy) == (2, 0)
    d.m.finished("r-1", 11, [[]])
    assert pd.counters.collected == 1 and d.m.pins_held() == 0


def test_empty_extent_after_the_engine_failed_or_unaligned_reads_nothing() -> None:
    """Unaligned local tokens (7) answer 0 before the short cut: no manifest read."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    assert d.m.lookup(handoff_view(r, params, None), 7) == 0
    assert index.values() == [] and pd_of(d).consumers._reqs == {}


def test_empty_extent_of_a_non_handoff_is_not_served() -> None:
    """An ordinary request (no do_remote_prefill) naming a manifest with 8 local tokens
    answers 0 and reads nothing (served is only for hand-offs)."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    v = RequestView("r", r.h, 11, dict(params, do_remote_prefill=False), None)
    assert d.m.lookup(v, 8) == 0
    assert index.values() == [] and pd_of(d).consumers._reqs == {}


def test_done_bytes_matches_the_memory_after_eviction(monkeypatch: Any) -> None:
    """With the bound lowered to 1.5 manifests, collecting R then X evicts R's entry:
    ``nbytes`` equals the entries' sizes (X's alone)."""
    index = HeldIndex()
    d, _, _ = collect_r(index)
    pd = pd_of(d)
    one = pd.consumers._done.nbytes
    monkeypatch.setattr(pd.consumers._done, "limit", one + one // 2)
    x = Req("x", 11, base=100, params=REMOTE)
    params = publish_as(index, x)
    xv = RequestView("x", x.h, 11, {"do_remote_prefill": True, **params}, tail_of(x))
    assert wait_for_hit(d, index, xv) == 10
    load_and_finish(d, "x", 10)
    key = params[MANIFEST_PARAM]
    raw = pd.consumers._done.get(key)
    assert pd.consumers._done.keys() == [key] and raw is not None
    assert pd.consumers._done.nbytes == entry_size(key, raw)
