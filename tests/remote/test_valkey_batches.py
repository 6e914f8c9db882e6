"""Batched remote I/O of the Valkey block store against real servers (standalone and the
6-process cluster): a call of many small blocks is one round trip per part of
``PART_BYTES`` (one MSETEX of every header and payload -- a pipeline of SETs on a server
without MSETEX --) or ``GET_PART_BYTES`` (one MGET), counted by the server's own command
statistics; in a cluster one request per hash slot; a GET of blocks of
``GET_ALONE_BYTES`` or more one MGET a block; every block of a batch is still
judged on its own (one corrupted value and one missing key among good ones are exactly
one BAD and one MISS), and the bytes land bit-exact in the caller's rows, across the
shards of a cluster too."""

from __future__ import annotations

from typing import Any

import pytest
from remote_rig import Rows

from kvshm.errors import ConfigError
from kvshm.remote.glide_client import header_key, key_slot
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyCluster, ValkeyServer
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, GetOutcome, RemoteSpec, block_key
from kvshm.remote.valkey import GET_ALONE_BYTES, GET_PART_BYTES, PART_BYTES, ValkeyBlockStore

ROW = 128 << 10  # a TP-8 rank's shard of a block: the size batching is for
FP = "tiny-llama.bf16.bs16.nhd"
CALM = {"request_timeout_ms": 5000, "connect_timeout_ms": 5000}


def call(server: ValkeyServer, *args: str | bytes) -> Any:
    return parse_reply(command(server.host, server.port, *args))


def headers(n: int, row: int = ROW) -> list[BlockHeader]:
    return [BlockHeader(fingerprint=FP, block_hash=i.to_bytes(16, "big"), rank=0, world=1,
                        length=row) for i in range(n)]


def keys_of(hs: list[BlockHeader]) -> list[str]:
    return [block_key(KEY_PREFIX, h.fingerprint, h.rank, h.world, h.block_hash) for h in hs]


def calls(server: ValkeyServer, name: str) -> int:
    """How many times ``server`` ran command ``name`` (INFO commandstats)."""
    info = call(server, "INFO", "commandstats").decode()
    for line in info.splitlines():
        if line.startswith(f"cmdstat_{name}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_a_batch_is_one_round_trip_a_part_and_lands_bit_exact(valkey: ValkeyServer) -> None:
    """One put part's worth of 128 KiB blocks (PART_BYTES: 32 of them) is one MSETEX of
    all their headers and payloads (no SET at all), and one GET part's (GET_PART_BYTES,
    also 32) one MGET; 64 blocks are two of each (not 64 requests: one per block before
    batching). Every block is a HIT, the rows equal the source bit for bit, and every
    key has its TTL."""
    per, get_per = PART_BYTES // ROW, GET_PART_BYTES // ROW
    assert per >= 8 and 64 % per == 0 and get_per >= 2 and 64 % get_per == 0
    store = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM))
    try:
        hs = headers(64)
        keys = keys_of(hs)
        src, dst = Rows(64, 7, row=ROW), Rows(64, row=ROW)
        assert store.put_many(keys[:per], src.views[:per], hs[:per]) == [True] * per
        assert (calls(valkey, "msetex"), calls(valkey, "set")) == (1, 0)
        mget0 = calls(valkey, "mget")
        assert store.get_many_into(keys[:get_per], dst.views[:get_per], hs[:get_per]) \
            == [GetOutcome.HIT] * get_per
        assert calls(valkey, "mget") - mget0 == 1
        assert store.put_many(keys, src.views, hs) == [True] * 64
        assert calls(valkey, "msetex") == 1 + 64 // per
        assert store.get_many_into(keys, dst.views, hs) == [GetOutcome.HIT] * 64
        assert calls(valkey, "mget") - mget0 == 1 + 64 // get_per
        assert src == dst
        assert all(call(valkey, "TTL", k) > 0 for k in (keys[0], header_key(keys[63])))
    finally:
        store.close()


def test_a_server_without_msetex_gets_the_pipeline_of_sets(tmp_path: Any) -> None:
    """A server older than Valkey 9.1 has no MSETEX (here: renamed away, so the server
    answers "unknown command" as an old one does). The first put learns it from that
    answer and moves its part again as a pipeline of two SETs a block -- nothing lost,
    counted ``msetex_unsupported`` once -- and every later put goes straight to the
    pipeline (no second MSETEX). The blocks and headers come back HIT, bit-exact, with
    their TTL."""
    server = ValkeyServer(maxmemory="256mb", workdir=tmp_path,
                          extra_args=["--rename-command", "MSETEX", ""]).start()
    store = ValkeyBlockStore(RemoteSpec.parse(server.url, ttl_s=600, **CALM))
    try:
        hs = headers(40)
        keys = keys_of(hs)
        src, dst = Rows(40, 13, row=ROW), Rows(40, row=ROW)
        assert store.put_many(keys[:8], src.views[:8], hs[:8]) == [True] * 8
        assert calls(server, "set") == 16
        assert store.put_many(keys[8:], src.views[8:], hs[8:]) == [True] * 32
        assert calls(server, "set") == 80
        stats = store.statistics()
        assert (stats["msetex_unsupported"], stats["put_ok"], stats["put_refused"],
                stats["errors"]) == (1, 40, 0, 0)
        assert store.get_many_into(keys, dst.views, hs) == [GetOutcome.HIT] * 40
        assert src == dst
        assert all(call(server, "TTL", k) > 0 for k in (keys[39], header_key(keys[0])))
    finally:
        store.close()
        server.close()


def test_part_bytes_zero_is_one_request_a_block(valkey: ValkeyServer) -> None:
    """``part_bytes=0, get_part_bytes=0`` -- the path before batching,
    ``tools.bench_remote``'s ``single`` arm -- moves 8 blocks in 8 MSETEX and 8 MGETs,
    each block still checked and bit-exact; a negative or non-int ``part_bytes`` or
    ``get_part_bytes`` is a ConfigError."""
    store = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM), part_bytes=0,
                             get_part_bytes=0)
    try:
        hs = headers(8)
        keys = keys_of(hs)
        src, dst = Rows(8, 5, row=ROW), Rows(8, row=ROW)
        assert store.put_many(keys, src.views, hs) == [True] * 8
        assert calls(valkey, "msetex") == 8
        mget0 = calls(valkey, "mget")
        assert store.get_many_into(keys, dst.views, hs) == [GetOutcome.HIT] * 8
        assert calls(valkey, "mget") - mget0 == 8
        assert src == dst
    finally:
        store.close()
    for name in ("part_bytes", "get_part_bytes"):
        for bad in (-1, 1.5, True):
            with pytest.raises(ConfigError, match=name):
                ValkeyBlockStore(RemoteSpec.parse(valkey.url), **{name: bad})  # type: ignore[arg-type]


def test_large_blocks_are_read_one_a_request_small_ones_batched(
        valkey: ValkeyServer) -> None:
    """With GET parts of 4 MiB (``get_part_bytes``), a GET of 8 blocks of
    ``GET_ALONE_BYTES`` (2 MiB: a TP-1 rank's block) is 8 MGETs, one a block --
    measured faster than 4 MiB parts at 2 MiB -- while 8 blocks of half that share 4 MiB
    parts (2 MGETs). Each large block is still checked alone: one with a
    flipped payload byte is BAD and one whose header is deleted a MISS, both counted,
    the others HIT bit-exact. A negative or non-int ``get_alone_bytes`` is a
    ConfigError."""
    big, small = GET_ALONE_BYTES, GET_ALONE_BYTES // 2
    parts = 4 << 20
    assert parts // big == 2 and parts // small == 4
    store = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM),
                             get_part_bytes=parts)
    try:
        for row, mgets in ((small, 2), (big, 8)):
            hs = [BlockHeader(fingerprint=f"{FP}.{row}", block_hash=h.block_hash, rank=0,
                              world=1, length=row) for h in headers(8, row)]
            keys = keys_of(hs)
            src, dst = Rows(8, row, row=row), Rows(8, row=row)
            assert store.put_many(keys, src.views, hs) == [True] * 8
            mget0 = calls(valkey, "mget")
            assert store.get_many_into(keys, dst.views, hs) == [GetOutcome.HIT] * 8
            assert calls(valkey, "mget") - mget0 == mgets, row
            assert src == dst
        bad, gone = 2, 5
        payload = bytearray(call(valkey, "GET", keys[bad]))
        payload[big - 1] ^= 0x80
        call(valkey, "SET", keys[bad], bytes(payload))
        call(valkey, "DEL", header_key(keys[gone]))
        before = store.statistics()
        dst = Rows(8, row=big)
        out = store.get_many_into(keys, dst.views, hs)
        want = [GetOutcome.HIT] * 8
        want[bad], want[gone] = GetOutcome.BAD, GetOutcome.MISS
        assert out == want
        assert all(dst[i] == src[i] for i in range(8) if i not in (bad, gone))
        after = store.statistics()
        assert {k: after[k] - before[k] for k in ("hits", "bad", "misses")} == \
            {"hits": 6, "bad": 1, "misses": 1}
    finally:
        store.close()
    for wrong in (-1, 2.0, True):
        with pytest.raises(ConfigError, match="get_alone_bytes"):
            ValkeyBlockStore(RemoteSpec.parse(valkey.url),
                             get_alone_bytes=wrong)  # type: ignore[arg-type]


def test_one_corrupted_and_one_missing_block_spoil_only_themselves(
        valkey: ValkeyServer) -> None:
    """Attack: among 12 good blocks of one batch, one payload byte flipped on the server
    (same length) and one block's keys deleted. The batch answers exactly one BAD and
    one MISS at those places and HIT (bit-exact) everywhere else; a value made longer
    than its row (glide fails the whole MGET for it) is found by reading that part again
    block by block, and is BAD alone too."""
    store = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM))
    try:
        hs = headers(12)
        keys = keys_of(hs)
        src = Rows(12, 3, row=ROW)
        assert store.put_many(keys, src.views, hs) == [True] * 12
        bad, gone, long = 4, 9, 1
        payload = bytearray(call(valkey, "GET", keys[bad]))
        payload[ROW // 2] ^= 0x01
        call(valkey, "SET", keys[bad], bytes(payload))
        call(valkey, "DEL", keys[gone], header_key(keys[gone]))
        dst = Rows(12, row=ROW)
        out = store.get_many_into(keys, dst.views, hs)
        want = [GetOutcome.HIT] * 12
        want[bad], want[gone] = GetOutcome.BAD, GetOutcome.MISS
        assert out == want
        assert all(bytes(dst[i]) == bytes(src[i]) for i in range(12) if i not in (bad, gone))
        stats = store.statistics()
        assert (stats["hits"], stats["bad"], stats["misses"]) == (10, 1, 1)

        call(valkey, "APPEND", keys[long], b"x")
        out = store.get_many_into(keys, Rows(12, row=ROW).views, hs)
        want[long] = GetOutcome.BAD
        assert out == want
        assert store.statistics()["split_retries"] == 1
    finally:
        store.close()


def test_a_cluster_batch_spans_every_shard_one_slot_a_request(
        valkey_cluster: ValkeyCluster) -> None:
    """48 blocks of one batch, in 48 slots, hash to all three primaries: the store cuts
    the batch into one request per slot (a multi-slot MGET stalled the live primaries
    after one was killed: see kvshm.remote.valkey), every block comes back bit-exact,
    and a block deleted on one shard is a MISS alone."""
    hs = [BlockHeader(fingerprint=FP, block_hash=i.to_bytes(16, "big"), rank=0, world=1,
                      length=ROW) for i in range(48)]
    keys = keys_of(hs)
    store = ValkeyBlockStore(RemoteSpec.parse(valkey_cluster.url, ttl_s=600, **CALM))
    try:
        src, dst = Rows(48, 11, row=ROW), Rows(48, row=ROW)
        assert store.put_many(keys, src.views, hs) == [True] * 48
        primaries = valkey_cluster.primaries()
        sizes = [call(p, "DBSIZE") for p in primaries]
        assert sum(sizes) == 96 and all(s >= 6 for s in sizes), sizes
        parts = store._parts(keys, dst.views, range(48), store.part_bytes)
        assert len(parts) == 48 and all(len(p) == 1 for _, p in parts)
        assert store.get_many_into(keys, dst.views, hs) == [GetOutcome.HIT] * 48
        assert src == dst
        assert len({key_slot(k) for k in keys}) == 48
        gone = 17
        owner = next(p for p in primaries if call(p, "EXISTS", keys[gone]) == 1)
        call(owner, "DEL", keys[gone])
        want = [GetOutcome.HIT] * 48
        want[gone] = GetOutcome.MISS
        assert store.get_many_into(keys, Rows(48, row=ROW).views, hs) == want
        assert len(store.statistics()["breakers"]) == 3
    finally:
        store.close()
