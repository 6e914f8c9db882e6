"""A hand-off's held local prefix (``HandoffSide.hold``: a decoder waiting for the rest
of its extent pins the CPU hit it extends) and the end of that hold, narrated with exact
block ids and ref counts on real managers: a prefill manager P and a decode manager D
share one :class:`HeldIndex` (BS = 4, two ranks). R has 11 tokens: full blocks h0, h1
and a 3-token tail; Q (5 tokens) shares R's first block h0.

The first three were found by a hostile review of the hold and failed before their fix:
a hold that outlived a lookup's final 0 (a block no request uses, never evictable for a
whole decode), and a hand-off whose hit was being loaded losing what its GET fetched.
The others probe edge cases that held: hybrid groups, an end or a failed rank while
held, a refused call, repeated waits, hostile manifest names.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
from manager_rig import BS, Req, Rig, refs
from test_handoff_local_prefix import q_decoder, wait_for_hit
from test_handoff_tail import MANIFEST, publish
from test_remote_book import WORLD, HeldIndex, ack_remote, key, remote_rig, rkey, settle, store

from kvshm.config import RemoteMode
from kvshm.errors import InvalidRequest
from kvshm.ipc.protocol import unpack_ids
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pd.handoffs import Handoffs
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest
from kvshm.offload.remote import RemoteBook
from kvshm.offload.remote_puts import remote_hash
from kvshm.types import KVGroup, RequestView


def _held(d: Rig) -> dict[str, list[int]]:
    assert d.m.remote is not None and d.m.remote.side is not None
    return d.m.remote.side.holds()


def test_a_hold_goes_when_a_lookup_answers_0() -> None:
    """Hazard: *a hold outlives the wait*. R (11 tokens, handed off without its tail:
    extent h0, h1). D stored Q: h0 in CPU
    0 (ref 0). R's first lookup (no GPU hit) finds CPU 0 short of its extent and waits
    for the manifest, holding CPU 0 (ref 1). Meanwhile D's GPU prefix cache came to hold
    h0 and h1 (another request with R's prompt ran), so R's next lookup is at 8 local
    tokens: nothing left to look up in the CPU tier (no CPU hit), the manifest is
    trusted and the remote range is empty: the lookup answers 0 -- final, the engine
    schedules R and computes its last tokens; phase B accepts 0. CPU 0 is back to ref 0:
    any answer ends the hold (it used to stay ref 1 for R's whole decode, a block no
    request uses that the CPU tier could never evict)."""
    index, d, r, view = q_decoder(tail=False)
    assert d.m.lookup(view, 0) is None
    assert refs(d.cpu, [0]) == [1]                     # held while it waits
    assert d.m.lookup(view, 8) == 0                    # the final answer
    d.m.allocated("r", [d.gpu.allocate(3)], 0)
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [0], f"held {_held(d)}"


def test_an_unaligned_lookup_answering_0_releases_the_hold() -> None:
    """As above, but R's second lookup comes with 2 local tokens (not block-aligned):
    the manager answers 0 at once (``lookups_unaligned``) -- final -- and CPU 0's hold
    goes with it (it used to stay ref 1 until R ended)."""
    index, d, r, view = q_decoder(tail=False)
    assert d.m.lookup(view, 0) is None and refs(d.cpu, [0]) == [1]
    assert d.m.lookup(view, 2) == 0
    d.m.allocated("r", [d.gpu.allocate(3)], 0)
    assert refs(d.cpu, [0]) == [0], f"held {_held(d)}"


def test_a_handoff_asked_again_for_a_loading_block_keeps_what_it_fetched() -> None:
    """Hazard: *a loading prefix drops the fetched rest*. D's CPU tier has two blocks;
    Q stored h0 in CPU 0. R (tail hand-off) waits holding CPU 0 (ref 1); only one block
    is free, so the GET fetches h1 alone into CPU 1 (FETCHED: ref 1, recorded for R).
    Before R looks up again, Q2 (an ordinary request of 5 tokens, h0) hits CPU 0 and its
    load is queued (CPU 0 ref 2: held + load). R's lookup finds CPU 0, 1 (short of the
    tail) with CPU 0 being loaded: it answers None *before* asking the remote book,
    whose final answer (0) would have released FETCHED CPU 1 and the hold on CPU 0 with
    nothing pinned for R -- a one-block store (X) then took CPU 1, evicting h1, and R's
    hit was 4 tokens though 8 were fetched for it. Now CPU 0, 1 stay ref 2, 1: X's
    store finds no free block (declined), and once Q2's load is done R's hit is CPU 0,
    1: 8 tokens."""
    index, d, r, view = q_decoder(cpu=2)
    gets: list[list[int]] = []
    while not gets:
        assert d.m.lookup(view, 0) is None
        index.answer_all()
        for msg in d.step().remote:
            gets.append(unpack_ids(msg.cpu_ids))
            ack_remote(d, msg)
    assert gets == [[1]] and refs(d.cpu, [0, 1]) == [1, 1]
    q2 = Req("q2", 5)
    assert d.m.lookup(q2.view(), 0) == 4
    d.m.allocated("q2", [d.gpu.allocate(2)], 4)
    assert refs(d.cpu, [0, 1]) == [2, 1]
    assert d.m.lookup(view, 0) is None                  # CPU 0 is being loaded
    d.m.check_invariants()
    assert refs(d.cpu, [0, 1]) == [2, 1]
    x = Req("x", 5, base=100)
    g = d.alloc(1, x.h)
    p = d.step(x.sched(g, confirmed=5, new=True))
    assert p.load is not None and p.store is None       # no free CPU block for X
    d.ack(p.load, ranks=range(2))
    assert refs(d.cpu, [0, 1]) == [1, 1]
    assert wait_for_hit(d, index, view) == 8
    assert refs(d.cpu, [0, 1]) == [1, 1]
    d.m.check_invariants()


# ---- edge cases that hold ------------------------------------------------------------------


def _rig_groups(index: HeldIndex, groups: tuple[KVGroup, ...], cpu: int = 16) -> Rig:
    rig = Rig(cpu=cpu, gpu=16, world_size=WORLD, groups=groups)

    def make(cpu_pool: Any, gs: Any, jobs: Any) -> RemoteBook:
        pd = Handoffs(index, "fp", WORLD, BS, remote_hash, key)
        return RemoteBook(cpu_pool, gs, jobs, index, key, mode=RemoteMode.WRITE_THROUGH,
                          handoffs=pd)
    rig.m = OffloadManager(rig.cpu, rig.gpu, block_size=BS, world_size=WORLD,
                           groups=groups, remote=make)
    return rig


def test_a_hybrid_handoff_holds_both_groups_prefix_and_releases_it_once() -> None:
    """Two KV groups (full, 8-token window = 2 blocks). R: 13 tokens, full blocks h0,
    h1, h2 (extent 3 positions). A manifest naming all six keys (position-major) is on
    the server with every readiness key. D's CPU tier holds position 0 of both groups
    (CPU 0 full, CPU 1 window): the hit ends at 1, so R waits holding CPU 0, 1 (refs
    1, 1); the GET fetches positions 1, 2 of both groups (CPU 2..5); R's hit covers 12
    tokens: full 0, 2, 4 and window 3, 5 pinned (the window copy at position 0, CPU 1,
    is no longer needed: ref 0). Accepting none releases every pin; the manifest was
    collected by the GET."""
    groups = (KVGroup.full(), KVGroup.sliding_window(8))
    index = HeldIndex()
    d = _rig_groups(index, groups)
    r = Req("r", 13)
    gk = d.m._gs.key
    keys = [gk(h, g) for h in r.h for g in range(2)]
    index.kv[MANIFEST] = msgspec.json.encode(Manifest(
        1, "fp", WORLD, BS, 13, [remote_hash(k).hex() for k in keys], time.time() + 600))
    index.ready.update(rkey(k) for k in keys)
    assert d.seed_cpu(keys[0], keys[1]) == [0, 1]
    view = RequestView("r", r.h, 13, {"do_remote_prefill": True, MANIFEST_PARAM: MANIFEST})
    assert d.m.lookup(view, 0) is None
    assert refs(d.cpu, [0, 1]) == [1, 1]
    assert wait_for_hit(d, index, view) == 12
    assert [d.cpu.get_cached(k) for k in keys] == [0, 1, 2, 3, 4, 5]
    assert refs(d.cpu, range(6)) == [1, 0, 1, 1, 1, 1]
    assert MANIFEST not in index.kv
    d.m.allocated("r", [d.gpu.allocate(4), d.gpu.allocate(4)], 0)
    d.m.check_invariants()
    assert d.m.pins_held() == 0 and refs(d.cpu, range(6)) == [0] * 6


def _waiting(tail: bool = True) -> tuple[HeldIndex, Rig, Req, RequestView]:
    """D stored Q (h0 in CPU 0); R's first lookup waits holding CPU 0 (ref 1)."""
    index, d, r, view = q_decoder(tail=tail)
    assert d.m.lookup(view, 0) is None and refs(d.cpu, [0]) == [1]
    return index, d, r, view


def test_a_request_finished_or_gone_while_held_releases_the_hold_once() -> None:
    """R waits holding CPU 0 (ref 1) and finishes: CPU 0 ref 0, nothing recorded; a
    second ``finished`` (or a listing as gone) frees nothing twice."""
    _, d, _, view = _waiting()
    d.m.finished("r", 11, [[]])
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [0] and d.m.pins_held() == 0
    d.m.finished("r", 11, [[]])
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [0]


def test_a_failed_rank_while_held_releases_the_hold_and_later_calls_free_nothing() -> None:
    """R waits holding CPU 0; rank 1 is declared dead: the hold goes (ref 0, nothing
    recorded, as a failed manager must), lookups answer 0, and R's end frees nothing
    again."""
    _, d, _, view = _waiting()
    d.m.rank_failed(1)
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [0] and d.m.pins_held() == 0
    assert d.m.lookup(view, 0) == 0
    d.m.finished("r", 11, [[]])
    d.m.check_invariants()
    assert d.m.pins_held() == 0


def test_a_refused_lookup_after_a_hold_changes_nothing() -> None:
    """R waits holding CPU 0; its next lookup is malformed (an unaligned hash list
    of the wrong type): InvalidRequest, and the hold is exactly as before (ref 1)."""
    _, d, r, view = _waiting()
    bad = RequestView("r", [r.h[0], 7], 11, view.kv_transfer_params, None)  # type: ignore[list-item]
    with pytest.raises(InvalidRequest):
        d.m.lookup(bad, 0)
    d.m.check_invariants()
    assert refs(d.cpu, [0]) == [1]


def test_repeated_waits_hold_each_block_once() -> None:
    """R looks up five times while its manifest and query are pending: CPU 0 stays at
    ref 1 (each hold replaces the last), and the hit that ends the wait holds it once
    (ref 1), then phase B accepting 0 leaves it at ref 0."""
    index, d, _, view = _waiting()
    for _ in range(5):
        assert d.m.lookup(view, 0) is None
        assert refs(d.cpu, [0]) == [1]
    assert wait_for_hit(d, index, view) == 10
    assert refs(d.cpu, [0]) == [1]
    d.m.allocated("r", [[]], 0)
    assert d.m.pins_held() == 0


def test_served_from_cpu_with_a_foreign_or_mismatched_manifest_deletes_nothing() -> None:
    """D holds h0, h1 (CPU 0, 1). Two requests hit both at once (served, 8 tokens):
    A names another deployment's manifest (refused unread); B (tokens 100..) names R's
    manifest, whose hashes are not B's prefix (read, refused). Both end: R's manifest
    is still on the server, nothing collected."""
    index = HeldIndex()
    _, r, params = publish(index, 11, tail=False)
    d = remote_rig(index)
    assert store(d, Req("q", 9)) == [0, 1]
    settle(d)
    b = Req("b", 9, base=100)
    assert store(d, b) == [2, 3]
    settle(d)
    assert d.m.pins_held() == 0
    foreign = {"do_remote_prefill": True, MANIFEST_PARAM: "kvshm:v1:pd:other:2:r"}
    va = RequestView("a", r.h, 11, foreign, None)
    vb = RequestView("b", b.h, 9, {"do_remote_prefill": True, **params}, None)
    assert d.m.lookup(va, 0) == 8
    assert d.m.lookup(vb, 0) == 8
    d.step()
    d.m.finished("a", 11, [[]])
    d.m.finished("b", 9, [[]])
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert MANIFEST in index.kv and d.m.remote.pd.counters.collected == 0
    assert d.m.remote.pd.counters.manifest_refused == 2
    d.m.check_invariants()
    assert d.m.pins_held() == 0
