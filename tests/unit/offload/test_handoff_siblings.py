"""Sibling consumers of one P/D hand-off (vLLM's parallel sampling: the children of an
``n > 1`` request share its ``kv_transfer_params``), narrated with exact block ids and
ref counts on real managers: a prefill manager P and a decode manager D share one
:class:`HeldIndex` (BS = 4, two ranks). R has 11 tokens: full blocks h0, h1 and a
3-token tail.

Hazard: *a sibling finds its manifest collected*. The first child to load the blocks
collects the manifest (deletes it; the blocks keep the ordinary TTL). A later child
that needs the server (its CPU copies were dropped meanwhile) used to ask for the
manifest for ``wait_s`` (5 s) and then recompute; now D judges it from its memory of
the manifests it collected, by the same checks against the child's own prefix.
"""

from __future__ import annotations

from manager_rig import Req, refs
from test_handoff_local_prefix import handoff_view, wait_for_hit
from test_handoff_tail import MANIFEST, publish, tail_of
from test_remote_book import HeldIndex, remote_rig

from kvshm.ipc.protocol import unpack_ids
from kvshm.types import RequestView


def test_a_sibling_after_the_collection_still_loads_from_the_server() -> None:
    """Child "r" of R fetches h0, h1 and the tail into CPU 0, 1, 2 (10 tokens), loads
    them and collects the manifest (gone from the server; collected 1). D's CPU index is
    then dropped (a reset: CPU 0, 1, 2 unindexed, ref 0). Child "r-1" (same tokens, same
    params) looks up: no CPU hit, so it needs the server; its manifest is judged from
    D's memory (manifest_reused 1, consumed 2, no read of the server), the readiness
    keys are asked and answered, the GET fetches the three blocks again into CPU 3, 4,
    5 (fresh blocks come first) and its hit is 10 tokens (refs 1, 1, 1). Nothing is
    collected twice."""
    index = HeldIndex()
    _, r, params = publish(index)
    d = remote_rig(index)
    view = handoff_view(r, params, tail_of(r))
    assert wait_for_hit(d, index, view) == 10
    d.m.allocated("r", [d.gpu.allocate(3)], 10)
    plan = d.step()
    assert plan.load is not None and unpack_ids(plan.load.src_ids) == [0, 1, 2]
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    assert MANIFEST not in index.kv and pd.counters.collected == 1
    d.ack(plan.load, ranks=range(2))
    d.m.finished("r", 11, [[]])
    assert d.m.reset() is True
    assert refs(d.cpu, [0, 1, 2]) == [0, 0, 0] and d.cpu.get_cached(r.h[0]) is None
    sibling = RequestView("r-1", r.h, 11, view.kv_transfer_params, view.tail_hash)
    assert wait_for_hit(d, index, sibling) == 10
    assert [d.cpu.get_cached(k) for k in (r.h[0], r.h[1], tail_of(r))] == [3, 4, 5]
    assert refs(d.cpu, [3, 4, 5]) == [1, 1, 1]
    assert (pd.counters.manifest_reused, pd.counters.consumed) == (1, 2)
    assert (pd.counters.manifest_missing, pd.counters.collected) == (0, 1)
    d.m.allocated("r-1", [d.gpu.allocate(3)], 10)
    d.m.finished("r-1", 11, [[]])
    assert pd.counters.collected == 1
    d.m.check_invariants()


def test_a_remembered_manifest_lets_in_no_request_of_another_prefix() -> None:
    """A request naming R's collected manifest with other tokens (X: 11 tokens from
    100, no block in D's CPU tier; R's params -- a hostile client, or a request id
    reused for another prompt) fails the memory's check: it is not judged from memory
    (manifest_reused 0) but asks the server, as without the memory. The manifest is gone
    there, so X waits ``wait_s`` (5 s) and recomputes (manifest_missing 1)."""
    index = HeldIndex()
    _, r, params = publish(index)
    clock = [0.0]
    d = remote_rig(index, clock=clock)
    view = handoff_view(r, params, tail_of(r))
    assert wait_for_hit(d, index, view) == 10
    d.m.allocated("r", [d.gpu.allocate(3)], 10)
    d.step()
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    assert pd.counters.collected == 1
    other = RequestView("x", Req("x", 11, base=100).h, 11, view.kv_transfer_params, None)
    assert d.m.lookup(other, 0) is None
    assert pd.counters.manifest_reused == 0
    clock[0] = 6.0
    d.step()
    assert d.m.lookup(other, 0) == 0
    assert (pd.counters.manifest_reused, pd.counters.manifest_missing) == (0, 1)
