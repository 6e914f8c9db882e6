"""The Valkey backend against a real 6-process cluster (3 primaries + 3 replicas,
cluster-node-timeout 2000 ms): blocks spread over every primary, and a SIGKILLed primary
costs only its own slots, for a few seconds, until its replica takes over; no call
hangs, no byte is wrong."""

from __future__ import annotations

import time
from typing import Any

import pytest
from remote_rig import Rows as RowsT

from kvshm.remote.glide_client import key_slot
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyCluster, ValkeyServer
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, GetOutcome, RemoteSpec, block_key, ready_key
from kvshm.remote.valkey import ValkeyBlockStore
from kvshm.remote.valkey_index import ValkeyReadyIndex

ROW = 256 << 10
FP = "tiny-llama.bf16.bs16.nhd"
TIMEOUT_MS = 300
N = 48


def Rows(n: int, seed: int | None = None) -> RowsT:
    """``n`` rows of this module's ``ROW`` bytes (``remote_rig.Rows``)."""
    return RowsT(n, seed, row=ROW)


def call(server: ValkeyServer, *args: str | bytes) -> Any:
    return parse_reply(command(server.host, server.port, *args))


def setup(cluster: ValkeyCluster) -> tuple[ValkeyBlockStore, list[str], list[BlockHeader],
                                           RowsT]:
    """48 blocks put with generous deadlines; a store with short ones to read them."""
    hs = [BlockHeader(fingerprint=FP, block_hash=i.to_bytes(16, "big"), rank=0, world=1,
                      length=ROW) for i in range(N)]
    keys = [block_key(KEY_PREFIX, FP, 0, 1, h.block_hash) for h in hs]
    src = Rows(N, 5)
    calm = ValkeyBlockStore(RemoteSpec.parse(cluster.url, ttl_s=600,
                                             request_timeout_ms=5000))
    try:
        assert calm.put_many(keys, src.views, hs) == [True] * N
    finally:
        calm.close()
    store = ValkeyBlockStore(RemoteSpec.parse(cluster.url, ttl_s=600,
                                              request_timeout_ms=TIMEOUT_MS,
                                              connect_timeout_ms=TIMEOUT_MS),
                             breaker_backoff_s=0.2, breaker_max_backoff_s=1.0)
    return store, keys, hs, src


def owner(cluster: ValkeyCluster, key: str) -> ValkeyServer:
    """The primary that serves ``key``'s slot now."""
    slot = key_slot(key)
    for p in cluster.primaries():
        for lo, hi, primary, *_replicas in call(p, "CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return next(n for n in cluster.nodes if n.port == primary[1])
    raise AssertionError(f"no primary serves slot {slot}")


def test_blocks_and_their_headers_spread_over_all_three_primaries(
        valkey_cluster: ValkeyCluster) -> None:
    """48 blocks land on every primary (no hash tag around the request), each block's
    header in its payload's slot; the gets are byte-exact; the ready index works across
    slots (its pipeline is split per node by the client)."""
    store, keys, hs, src = setup(valkey_cluster)
    try:
        primaries = valkey_cluster.primaries()
        assert len(primaries) == 3
        sizes = [call(p, "DBSIZE") for p in primaries]
        assert sum(sizes) == 2 * N and all(s >= 6 for s in sizes), sizes
        dst = Rows(N)
        out = store.get_many_into(keys, dst.views, hs)
        assert out == [GetOutcome.HIT] * N and src == dst
        assert len(store.statistics()["breakers"]) >= 3
        idx = ValkeyReadyIndex(RemoteSpec.parse(valkey_cluster.url, ttl_s=60,
                                                request_timeout_ms=5000))
        try:
            chain = [ready_key(FP, 1, h.block_hash) for h in hs[:20]]
            idx.publish(chain[:12] + chain[13:])
            idx.query(1, chain)
            deadline = time.monotonic() + 5
            got: list[tuple[int, int]] = []
            while not got:
                assert time.monotonic() < deadline
                time.sleep(0.01)
                got = idx.answers()
            assert got == [(1, 12)]
        finally:
            idx.close()
    finally:
        store.close()


@pytest.mark.slow
def test_a_killed_primary_costs_its_slots_only_until_its_replica_takes_over(
        valkey_cluster: ValkeyCluster) -> None:
    """SIGKILL one primary: the keys of the other two stay HIT in every call; the dead
    one's keys are ERROR or MISS (never BAD, never a HIT with wrong bytes); no call takes
    longer than a few request deadlines; within ~5 s of the failover (node timeout 2 s)
    every key is a HIT again, byte-exact, served by the promoted replica. The ready index
    meanwhile answers every query quickly with at most the true prefix (it stops at the
    first key of the dead shard), and the whole chain again after the failover."""
    store, keys, hs, src = setup(valkey_cluster)
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey_cluster.url, ttl_s=600,
                                            request_timeout_ms=TIMEOUT_MS,
                                            connect_timeout_ms=TIMEOUT_MS),
                           breaker_backoff_s=0.2, breaker_max_backoff_s=1.0)
    chain = [ready_key(FP, 1, h.block_hash) for h in hs]
    try:
        idx.publish(chain)
        assert ask(idx, 0, chain) == N
        valkey_cluster.wait_replicated()
        victim = owner(valkey_cluster, keys[0])
        on_victim = [i for i, k in enumerate(keys) if owner(valkey_cluster, k) is victim]
        others = [i for i in range(N) if i not in on_victim]
        first_ready_lost = next(i for i, k in enumerate(chain)
                                if owner(valkey_cluster, k) is victim)
        assert on_victim and others
        victim.kill()
        killed = time.monotonic()
        dst = Rows(N)
        worst = 0.0
        rounds = 0
        while True:
            dst.clear()
            t0 = time.monotonic()
            out = store.get_many_into(keys, dst.views, hs)
            worst = max(worst, time.monotonic() - t0)
            rounds += 1
            for i, o in enumerate(out):
                assert o is not GetOutcome.BAD
                if o is GetOutcome.HIT:
                    assert dst[i] == src[i], i
            assert all(out[i] is GetOutcome.HIT for i in others), (
                rounds, time.monotonic() - killed, [(i, out[i].value) for i in others
                                                    if out[i] is not GetOutcome.HIT],
                store.statistics())
            prefix = ask(idx, rounds, chain)
            assert prefix <= first_ready_lost or prefix == N, (prefix, first_ready_lost)
            if all(o is GetOutcome.HIT for o in out) and prefix == N:
                break
            assert time.monotonic() - killed < 15, store.statistics()
            time.sleep(0.2)
        recovered = time.monotonic() - killed
        assert worst < 4 * TIMEOUT_MS / 1000 + 1.0, worst
        assert rounds > 1  # the victim's keys were unavailable for a while
        new_owner = owner(valkey_cluster, keys[on_victim[0]])
        assert new_owner is not victim and new_owner.running()
        stats = store.statistics()
        assert stats["breaker_opens"] >= 1 and stats["bad"] == 0
        print(f"recovered after {recovered:.1f} s, {rounds} rounds, worst call "
              f"{worst * 1e3:.0f} ms, {stats['errors']} errors")
    finally:
        store.close()
        idx.close()


def ask(idx: ValkeyReadyIndex, token: int, chain: list[str]) -> int:
    """The index's answer to one query; it must come within a couple of deadlines."""
    idx.query(token, chain)
    deadline = time.monotonic() + 3 * TIMEOUT_MS / 1000 + 1.0
    while True:
        got = idx.answers()
        if got:
            assert [t for t, _ in got] == [token]
            return got[0][1]
        assert time.monotonic() < deadline, idx.statistics()
        time.sleep(0.005)
