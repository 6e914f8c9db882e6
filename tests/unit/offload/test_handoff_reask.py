"""A decoder that asks for a hand-off before its manifest exists (a proxy that routes
the decode request early, or a prefill engine that died): how often it reads again.

Real managers on a fake clock: the decode manager D and the prefill manager P share one
:class:`HeldIndex`, which answers every manifest read at once (a server a round trip
away answers within a millisecond). D looks the request up every 0.25 ms of the fake
clock, as a vLLM engine with nothing to run steps (thousands of steps a second).

Hazard: *a missing manifest polled at the round trip's rate*. A "not there" answer was
read again at once, and the readiness query sent beside it asked again at every lookup:
one read and one query per index round for the whole wait (5 s), 600 a second per
request on the dev VM, each a wake-up of the index's thread. Now a read goes again only
after :func:`~kvshm.offload.pd.consume.reask_delay` (1/16 of the time waited, 1-10 ms)
and a readiness query at most once per manifest read.
"""

from __future__ import annotations

from typing import Any

from manager_rig import REMOTE, Req, Rig
from test_handoff_tail import MANIFEST, publish
from test_remote_book import HeldIndex, remote_rig

from kvshm.offload.pd.consume import REASK_MAX_S, reask_delay
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Verdict
from kvshm.types import RequestView

TICK = 0.00025  # D's engine steps: one lookup each
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, MANIFEST_PARAM: MANIFEST}


class CountingIndex(HeldIndex):
    """A HeldIndex that records when each manifest read was sent (fake clock)."""

    def __init__(self, now: list[float]) -> None:
        super().__init__()
        self.now = now
        self.reads: list[float] = []
        self.queries_sent = 0

    def get_value(self, token: int, key: str) -> None:
        self.reads.append(self.now[0])
        super().get_value(token, key)

    def query(self, token: int, keys: Any) -> None:
        self.queries_sent += 1
        super().query(token, keys)


def _decoder() -> tuple[CountingIndex, Rig, RequestView, list[float]]:
    now = [0.0]
    index = CountingIndex(now)
    d = remote_rig(index, clock=now)
    r = Req("r", 11, params=REMOTE)
    return index, d, RequestView("r", r.h, len(r.toks), PARAMS, None), now


def _publish(index: HeldIndex) -> None:
    """P hands R off through an index of its own, then "the server" (``index``) holds
    what P wrote: P's steps would otherwise drain D's answers from the shared fake."""
    own = HeldIndex()
    publish(own)
    index.kv.update(own.kv)
    index.ready.update(own.ready)


def _wait_until(d: Rig, index: CountingIndex, view: RequestView, now: list[float],
                until: float) -> int | None:
    """D looks ``view`` up every TICK until ``until`` (fake seconds) or an answer."""
    hit = None
    while now[0] < until and hit is None:
        now[0] += TICK
        hit = d.m.lookup(view, 0)
        index.answer_all()
    return hit


def test_a_missing_manifest_is_read_again_after_a_growing_delay() -> None:
    """R's manifest never comes: D looks R up 19,200 times over 4.8 s (fake clock)
    and reads the manifest about 530 times: every millisecond for the first 16 ms,
    then every 1/16 of the time waited, then every 10 ms -- each read at least
    ``reask_delay`` after the one before. The readiness query goes with a read at most
    (at most one per read). Before: 19,200 reads and as many queries (one per index
    answer, and the fake index answers at once)."""
    index, d, view, now = _decoder()
    assert _wait_until(d, index, view, now, 4.8) is None
    reads = index.reads
    assert 450 < len(reads) < 600, len(reads)
    assert index.queries_sent <= len(reads), (index.queries_sent, len(reads))
    for before, after in zip(reads, reads[1:], strict=False):  # timed from each send
        assert after - before >= reask_delay(before - reads[0]) - 1e-9
    assert reads[-1] - reads[-2] <= REASK_MAX_S + 2 * TICK + 1e-9  # answer, then send
    assert d.m.lookup(view, 0) is None  # still waiting: the 5 s bound is not reached
    now[0] = 5.1                        # past it: the next "not there" answer refuses
    assert _wait_until(d, index, view, now, 5.2) == 0
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.manifest_missing == 1


def test_a_late_manifest_is_found_within_a_sixteenth_of_the_wait() -> None:
    """P publishes R's manifest 300 ms after D's first lookup: D's next read comes at
    most 300 / 16 = 18.75 ms later (+ a tick), and R's hit follows (8 tokens: its two
    full blocks; this view carries no tail key)."""
    index, d, view, now = _decoder()
    assert _wait_until(d, index, view, now, 0.3) is None
    _publish(index)
    n = len(index.reads)
    while len(index.reads) == n:
        now[0] += TICK
        assert d.m.lookup(view, 0) is None
        index.answer_all()
    assert index.reads[-1] - 0.3 <= 0.3 / 16 + TICK
    assert _ack_gets_until_hit(d, index, view, now) == 8


def _ack_gets_until_hit(d: Rig, index: CountingIndex, view: RequestView,
                        now: list[float]) -> int:
    """Step D, acking its GETs on both ranks, until R's lookup answers a hit."""
    from test_remote_book import ack_remote
    for _ in range(50):
        plan = d.step()
        for msg in plan.remote:
            ack_remote(d, msg)
        now[0] += TICK
        hit = d.m.lookup(view, 0)
        index.answer_all()
        if hit:
            return hit
    raise AssertionError("no hit")


def test_a_request_ending_while_its_read_is_due_still_collects_the_manifest() -> None:
    """R's first read found nothing; its next is due 1 ms later. P publishes, and R
    ends before that read was sent (the engine recomputed it): the end sends the read
    at once, as an orphan, and D's next step collects the manifest (deleted from the
    server). Without the read at the end, no read was in flight and the manifest stayed
    until its TTL."""
    index, d, view, now = _decoder()
    assert d.m.lookup(view, 0) is None
    index.answer_all()
    now[0] += TICK
    assert d.m.lookup(view, 0) is None     # the "not there" answer: a read is due
    assert len(index.reads) == 1
    _publish(index)
    d.m.finished("r", 11, [[]])
    assert len(index.reads) == 2           # sent by the end
    d.step()
    assert MANIFEST not in index.kv        # collected
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.collected == 1


def test_an_engine_with_long_steps_reads_again_at_every_step() -> None:
    """D's steps take 20 ms (a loaded engine): each step's lookup polls the answer of
    the read the step before sent. The next read is due ``reask_delay`` after the last
    was *sent*, long past by then, so it goes at once: one read a step (50 in the first
    second), and the manifest P publishes 300 ms in is read at the next step. (Timed
    from the answer's arrival instead, a read waited for the step after: one every two
    steps, 25 a second, and a late manifest found up to a step later -- a review.)"""
    index, d, view, now = _decoder()
    step = 0.020
    while now[0] < 1.0 - 1e-9:
        now[0] += step
        assert d.m.lookup(view, 0) is None
        index.answer_all()
    assert 49 <= len(index.reads) <= 51, len(index.reads)
    while now[0] < 1.3 - 1e-9:
        now[0] += step
        d.m.lookup(view, 0)
        index.answer_all()
    _publish(index)
    n = len(index.reads)
    now[0] += step
    d.m.lookup(view, 0)
    assert len(index.reads) == n + 1        # read at the very next step ...
    assert MANIFEST in index.kv             # ... and found there
    index.answer_all()
    now[0] += step
    d.m.lookup(view, 0)
    assert d.m.remote is not None and d.m.remote.pd is not None
    assert d.m.remote.pd.counters.consumed == 1


def test_a_request_that_ends_before_its_prefill_publishes_still_collects_the_manifest(
        ) -> None:
    """R reads no cache (prompt logprobs): ``lookup_skipped`` sends its manifest read
    and R runs 3 steps of 5 ms, then ends; the manifest is not there yet (the prefill
    writes it after every block's PUT). Its read becomes an orphan; the orphan's "not
    there" answer is read again, as a live request's would be, and P publishes 50 ms
    later: the orphan finds the manifest and collects it (deleted). Before, the first
    "not there" dropped the orphan (orphans_dropped 1) and the manifest stayed for its
    hold TTL (a review)."""
    index, d, view, now = _decoder()
    d.m.lookup_skipped(view)
    for _ in range(3):
        now[0] += 0.005
        d.step()
        index.answer_all()
    d.m.finished("r", 11, [[]])
    while now[0] < 0.065:
        now[0] += 0.005
        d.step()
        index.answer_all()
    _publish(index)
    while now[0] < 0.1:
        now[0] += 0.005
        d.step()
        index.answer_all()
    assert MANIFEST not in index.kv
    assert d.m.remote is not None and d.m.remote.pd is not None
    pd = d.m.remote.pd
    assert (pd.counters.collected, pd.counters.orphans_dropped) == (1, 0)
    assert pd.consumers._orphans == {} and pd.consumers._orphans_due == {}


def _retry(publish_after: float) -> tuple[Verdict, bool]:
    """R waits 0.5 s and is aborted (its read goes on as an orphan); the proxy retries
    under the same id 0.5 s later, its prefill publishing ``publish_after`` after the
    retry's first lookup: the retry's verdict 50 ms after the publication, and whether
    the manifest is still on the server."""
    index, d, view, now = _decoder()
    assert _wait_until(d, index, view, now, 0.5) is None
    d.m.finished("r", 11, [[]])                       # aborted: R's read, an orphan
    while now[0] < 1.0:
        now[0] += TICK
        d.step()
        index.answer_all()
    assert _wait_until(d, index, view, now, now[0] + publish_after) is None
    _publish(index)
    _wait_until(d, index, view, now, now[0] + 0.05)
    assert d.m.remote is not None and d.m.remote.pd is not None
    return d.m.remote.pd.consumers._reqs["r"].verdict, MANIFEST in index.kv


def test_a_retry_under_the_same_id_is_not_shut_out_by_its_first_trys_orphan() -> None:
    """R (X-Request-Id ``r``) waits for its manifest and is aborted; its read becomes an
    orphan that reads again until ``wait_s``. The proxy retries under the same id (the
    same manifest name); P publishes. Whichever read lands first, the retry goes GO: if
    the orphan's read found the manifest first and collected it (deleted from the
    server), the retry judges it from the decoder's memory of collected manifests
    (``manifest_reused``). Before, the retry's reads found nothing from then on and it
    waited out the 5 s and recomputed (a review: 8 of 120 timings)."""
    for k in range(12):
        verdict, _ = _retry(k * 0.00075)
        assert verdict is Verdict.GO, k
