"""The decode step's one-pass check of a listed request (issue 15, the manager's own
step cost: ``RequestTracker._decode_step``) decides exactly what the full checks decide.

A known request is listed with every field drawn from good and bad values (wrong types,
ids out of range, a hash of the wrong length where the walk reads it, counts past the
next block, a str subclass for the id, a duck-typed record, listed twice); the tracker's
classification with the shortcut and without it (``_decode_step`` answering 0, so
``CallCheck.listed`` and ``_check_change`` run) must raise the same refusal or return the
same change, and the shortcut must have answered only for requests the full checks hand
back unchanged."""

from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manager_rig import BS, Rig

from kvshm.errors import InvalidRequest
from kvshm.offload.requests import DIRTY, EXTEND, RequestTracker
from kvshm.types import ScheduledRequest, StoreMode

GOOD = [bytes([i]) * 16 for i in range(8)]


class _Rid(str):
    """A str subclass equal to the request's id (not a plain str: the full checks copy)."""


def _admitted(mode: StoreMode, blocks: int, confirmed_blocks: int) -> tuple[Rig, list[int]]:
    """A rig whose request "a" is listed once with ``blocks`` GPU blocks, the first
    ``confirmed_blocks`` of them computed (and stored in eager mode)."""
    rig = Rig(cpu=16, gpu=16, mode=mode)
    ids = rig.alloc(blocks, GOOD[:confirmed_blocks])
    rig.step(ScheduledRequest("a", GOOD[:confirmed_blocks], blocks * BS, (tuple(ids),), True,
                              confirmed_blocks * BS))
    return rig, ids


ids_s = st.one_of(st.integers(-2, 18), st.just(True), st.just(3.0), st.just("1"))
hashes_s = st.one_of(
    st.lists(st.sampled_from([*GOOD, b"short", "str", None]), max_size=6),
    st.lists(st.sampled_from(GOOD), max_size=6).map(tuple),
    st.just("not a list"))
nb_s = st.one_of(ids_s.map(lambda b: ((b,),)), st.just("NO_NEW"), st.just(((),)), st.just(()),
                 st.tuples(ids_s, ids_s).map(lambda t: (t,)), ids_s.map(lambda b: ([b],)),
                 ids_s.map(lambda b: ((b,), (b,))))
count_s = st.one_of(st.integers(0, 6).map(lambda k: k * BS), st.integers(-5, 40),
                    st.just(8.0), st.just(True), st.just(None))
params_s = st.sampled_from([None, {}, {"do_remote_decode": False}, "params", NS()])


def _classify(tracker: RequestTracker, rig: Rig, listing: list[Any]) -> Any:
    try:
        return [(r, kind) for r, kind in tracker._classify(listing, (), rig.m._check)]
    except InvalidRequest as exc:
        return str(exc)


@settings(max_examples=400, deadline=None)
@given(mode=st.sampled_from([StoreMode.EAGER, StoreMode.LAZY]), blocks=st.integers(1, 4),
       done=st.integers(0, 4), hashes=hashes_s, num_tokens=count_s, nb=nb_s,
       confirmed=count_s, params=params_s, rid=st.sampled_from(["a", _Rid("a")]),
       shape=st.sampled_from(["struct", "duck", "twice"]))
def test_the_decode_shortcut_decides_what_the_full_checks_decide(
        mode: StoreMode, blocks: int, done: int, hashes: Any, num_tokens: Any, nb: Any,
        confirmed: Any, params: Any, rid: str, shape: str) -> None:
    rig, _ = _admitted(mode, blocks, min(done, blocks))
    tracker = rig.m._track
    if nb == "NO_NEW":  # the tracker's own "no new blocks" table, as an adapter passes it
        nb = tracker._no_new
    fields = (rid, hashes, num_tokens, nb, False, confirmed, False, params)
    r: Any = (NS(**dict(zip(ScheduledRequest.__struct_fields__, fields)))
              if shape == "duck" else ScheduledRequest(*fields))
    listing = [r, r] if shape == "twice" else [r]
    fast = _classify(tracker, rig, listing)
    answered: list[int] = []
    shortcut = tracker._decode_step

    def spy(*args: Any) -> int:
        kind = shortcut(*args)
        answered.append(kind)
        return kind

    tracker._decode_step = spy  # type: ignore[method-assign, assignment]
    assert _classify(tracker, rig, listing) == fast
    tracker._decode_step = lambda *args: 0  # type: ignore[method-assign]
    slow = _classify(tracker, rig, listing)
    assert slow == fast
    if any(answered) and shape != "twice":
        # the shortcut answered: the full checks hand the request back as it is
        assert isinstance(slow, list) and [got for got, _ in slow] == [r]
        assert slow[0][1] in (EXTEND, EXTEND | DIRTY, DIRTY)


@pytest.mark.parametrize(("confirmed_blocks", "grow", "want"),
                         [(2, True, EXTEND), (3, True, EXTEND | DIRTY), (3, False, DIRTY)])
def test_the_decode_shortcut_answers_a_plain_decode_step(confirmed_blocks: int, grow: bool,
                                                         want: int) -> None:
    """Request "a" (3 blocks, 2 computed and stored: its store cursor and next look at
    block 2) gets GPU block ``ids[2] + 1`` appended: with 2 blocks confirmed it is an
    EXTEND, with 3 the walk reads hash 2 as well: EXTEND | DIRTY; with nothing appended
    and 3 confirmed, DIRTY; each answered by the shortcut (a test that cannot tell would
    pass with the shortcut switched off)."""
    rig, ids = _admitted(StoreMode.EAGER, 3, 2)
    tracker = rig.m._track
    assert tracker.watch["a"] == 3 and tracker.reqs["a"].cursor == 2
    nb = ((ids[2] + 1,),) if grow else tracker._no_new
    r = ScheduledRequest("a", GOOD[:3], 4 * BS, nb, False, confirmed_blocks * BS)
    assert tracker._decode_step(r, r.new_block_ids, confirmed_blocks, 3, set(),
                                rig.m._check) == want
    assert tracker._classify([r], (), rig.m._check) == [(r, want)]


@pytest.mark.parametrize("bad", [b"short", "str", b"x" * 65])
def test_a_bad_hash_where_the_walk_reads_is_refused_with_the_shortcut(bad: Any) -> None:
    """As above with 3 blocks confirmed, but hash 2 (the one the walk reads) is bad:
    refused whole, naming it, and the tracker is as it was."""
    rig, ids = _admitted(StoreMode.EAGER, 3, 2)
    tracker = rig.m._track
    r = ScheduledRequest("a", [*GOOD[:2], bad], 4 * BS, ((ids[2] + 1,),), False, 3 * BS)
    assert tracker._decode_step(r, r.new_block_ids, 3, 3, set(), rig.m._check) == 0
    with pytest.raises(InvalidRequest, match=r"block_hashes\[2\]"):
        tracker._classify([r], (), rig.m._check)
    assert tracker.watch["a"] == 3 and tracker.reqs["a"].cursor == 2
