"""A P/D prefill request id used again while its first hand-off still waits for its
blocks' PUTs (hazard table: "a reused prefill request id ...").

The publisher kept its pending publications by request id, and its block waits under
the id too: the second publication replaced the first, whose waits stayed behind, so the
first's failed PUT failed the second -- a hand-off whose every block went up wrote no
manifest, and its decoder waited 5 s and recomputed."""

from __future__ import annotations

from typing import Any

from manager_rig import REMOTE, Req
from test_remote_book import HeldIndex, ack_remote, remote_rig

from kvshm.offload.remote_puts import REMOTE_HASH_BYTES, remote_hash


def test_a_reused_prefill_id_ends_the_first_hand_off_and_the_second_is_written() -> None:
    """Prefill ``p`` (one block, key a) finishes while its store is in flight; a new
    request under the id ``p`` (another prompt, key b) finishes too. Both stores land;
    one PUT a block (``max_job=1``): a's fails on rank 0, b's succeeds on both ranks.
    Now the second publication ends the first at once (``publish_superseded``, its
    blocks' hold given back), and b's manifest is written: exactly one, naming b."""
    index = HeldIndex()
    rig = remote_rig(index, cpu=16, max_job=1)
    m = rig.m
    assert m.remote is not None and m.remote.pd is not None
    pd = m.remote.pd
    a = Req("p", 5, params=REMOTE)
    ga = rig.alloc(1, a.h)
    pa = rig.step(a.sched(ga, confirmed=5, new=True))
    m.finished("p", 5, [ga])
    assert m.transfer_params("p") is not None
    b = Req("p", 5, base=500, params=REMOTE)
    gb = rig.alloc(1, b.h)
    pb = rig.step(b.sched(gb, confirmed=5, new=True))
    m.finished("p", 5, [gb])
    assert m.transfer_params("p") is not None
    assert pd.counters.publish_superseded == 1
    rig.ack(pa.store, ranks=(0, 1))
    rig.ack(pb.store, ranks=(0, 1))
    plan = rig.step()
    ka, kb = remote_hash(a.h[0]), remote_hash(b.h[0])
    for msg in plan.remote:
        keys = [msg.hashes[i:i + REMOTE_HASH_BYTES]
                for i in range(0, len(msg.hashes), REMOTE_HASH_BYTES)]
        ack_remote(rig, msg, (False, True) if keys == [ka] else (True, True))
    assert pd.counters.manifests_written == 1 and pd.counters.publish_failed == 0
    (manifest,) = index.kv.values()                     # the one manifest, b's
    assert kb.hex().encode() in manifest and ka.hex().encode() not in manifest


def _keys(msg: Any) -> list[bytes]:
    return [msg.hashes[i:i + REMOTE_HASH_BYTES]
            for i in range(0, len(msg.hashes), REMOTE_HASH_BYTES)]


def test_ending_the_first_hand_off_keeps_the_hold_of_blocks_the_second_names() -> None:
    """A client retries the same prompt under the same id: the first hand-off put k0
    (held on the server: no TTL) and waits for k1 when the retry publishes. Ending the
    first demoted every block it named -- k0 too, which the second's manifest names,
    so that manifest went out over a block on the ordinary TTL (a review). Now only the
    first's blocks the second does not name are demoted: none here."""
    index = HeldIndex()
    rig = remote_rig(index, cpu=16, max_job=1)
    m = rig.m
    assert m.remote is not None and m.remote.pd is not None
    pd = m.remote.pd
    a = Req("p", 9, params=REMOTE)                      # 2 full blocks: k0, k1
    ga = rig.alloc(2, a.h)
    pa = rig.step(a.sched(ga, confirmed=9, new=True))
    m.finished("p", 9, [ga])
    assert m.transfer_params("p") is not None
    rig.ack(pa.store, ranks=(0, 1))
    k0, k1 = remote_hash(a.h[0]), remote_hash(a.h[1])
    put = {tuple(_keys(msg)): msg for msg in rig.step().remote}
    assert set(put) == {(k0,), (k1,)}
    ack_remote(rig, put[(k0,)])                          # k0 is up and held
    b = Req("p", 9, params=REMOTE)                      # the retry: the same prompt
    gb = rig.alloc(2, b.h)
    rig.step(b.sched(gb, confirmed=9, new=True))
    mark = len(index.log)
    m.finished("p", 9, [gb])
    assert m.transfer_params("p") is not None and pd.counters.publish_superseded == 1
    assert not [e for e in index.log[mark:] if e.startswith("expire")]
    ack_remote(rig, put[(k1,)])
    for msg in rig.step().remote:
        ack_remote(rig, msg)
    assert pd.counters.manifests_written == 1
    (manifest,) = index.kv.values()
    assert k0.hex().encode() in manifest and k1.hex().encode() in manifest
