"""A P/D prefill request id used again while its first hand-off still waits for its
blocks' PUTs (hazard table: "a reused prefill request id ...").

The publisher kept its pending publications by request id, and its block waits under
the id too: the second publication replaced the first, whose waits stayed behind, so the
first's failed PUT failed the second -- a hand-off whose every block went up wrote no
manifest, and its decoder waited 5 s and recomputed."""

from __future__ import annotations

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
