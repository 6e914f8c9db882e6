"""The Valkey backend against a real standalone server: bytes land exact in the caller's
views, every wrong value is BAD and never a HIT, every key carries the TTL, the ready
index answers the longest present prefix in one round trip, and a killed server costs
one deadline, opens the breaker, and is used again once it is back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from remote_rig import Rows as RowsT

from kvshm.ratelog import RateLimitedLog
from kvshm.remote import glide_client
from kvshm.remote import valkey as valkey_mod
from kvshm.remote.glide_client import header_key
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyServer
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, GetOutcome, RemoteSpec, block_key, ready_key
from kvshm.remote.valkey import ValkeyBlockStore
from kvshm.remote.valkey_index import ValkeyReadyIndex

ROW = 2 << 20  # 2 MiB, a typical block shard
FP = "tiny-llama.bf16.bs16.nhd"
TIMEOUT_MS = 300
#: What a call may take when the server dies under it: a few request deadlines (the
#: breaker opens after 3 consecutive failures over 4 threads) and slack for a loaded
#: 2-core machine. Without the breaker and the explicit timeouts: seconds per key.
DEAD_CALL_S = 4 * TIMEOUT_MS / 1000 + 1.5
#: The tests of outcomes (not of failures) give a loaded CI machine generous deadlines.
CALM = {"request_timeout_ms": 5000, "connect_timeout_ms": 5000}


def call(server: ValkeyServer, *args: str | bytes) -> Any:
    """One raw command to ``server`` (the test's own look at the data: TTL, DEL ...)."""
    return parse_reply(command(server.host, server.port, *args))


def headers(n: int, rank: int, world: int, *, fp: str = FP, first: int = 0,
            length: int = ROW) -> list[BlockHeader]:
    return [BlockHeader(fingerprint=fp, block_hash=(first + i).to_bytes(16, "big"),
                        rank=rank, world=world, length=length) for i in range(n)]


def keys_of(hs: list[BlockHeader]) -> list[str]:
    return [block_key(KEY_PREFIX, h.fingerprint, h.rank, h.world, h.block_hash) for h in hs]


def Rows(n: int, seed: int | None = None) -> RowsT:
    """``n`` rows of this module's ``ROW`` bytes (``remote_rig.Rows``)."""
    return RowsT(n, seed, row=ROW)


def rows(n: int, seed: int) -> RowsT:
    return Rows(n, seed)


def views(a: RowsT) -> list[memoryview]:
    return a.views


@pytest.fixture
def store(valkey: ValkeyServer) -> Iterator[ValkeyBlockStore]:
    s = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM))
    yield s
    s.close()


def test_tp2_round_trip_lands_byte_exact_in_the_target_views(valkey: ValkeyServer) -> None:
    """Two ranks, each its own store and its own key set: 16 rows of 2 MiB each; every
    get is a HIT and the destination rows equal the source rows bit for bit."""
    spec = RemoteSpec.parse(valkey.url, ttl_s=600, **CALM)
    stores = [ValkeyBlockStore(spec), ValkeyBlockStore(spec)]
    try:
        for rank, st in enumerate(stores):
            src, dst = rows(16, rank), Rows(16)
            hs = headers(16, rank, 2)
            assert st.put_many(keys_of(hs), views(src), hs) == [True] * 16
            assert st.get_many_into(keys_of(hs), views(dst), hs) == [GetOutcome.HIT] * 16
            assert src == dst
        # the two ranks' shards of one block are two keys: rank 0's bytes never answer
        # rank 1's get (the rank is in the key and in the header)
        assert keys_of(headers(1, 0, 2)) != keys_of(headers(1, 1, 2))
        stats = stores[0].statistics()
        assert (stats["hits"], stats["bytes_got"], stats["put_ok"]) == (16, 16 * ROW, 16)
        assert stats["errors"] == stats["bad"] == stats["misses"] == 0
    finally:
        for st in stores:
            st.close()


def test_a_header_that_does_not_match_is_bad_never_a_hit(store: ValkeyBlockStore) -> None:
    """The value under a key is checked against what the reader expects: another
    fingerprint, rank, world size or block hash in the expected header is BAD."""
    src = rows(1, 7)
    hs = headers(1, 0, 2)
    key = keys_of(hs)
    assert store.put_many(key, views(src), hs) == [True]
    h = hs[0]
    wrong = [BlockHeader(fingerprint="other-model", block_hash=h.block_hash, rank=0,
                         world=2, length=ROW),
             BlockHeader(fingerprint=FP, block_hash=h.block_hash, rank=1, world=2,
                         length=ROW),
             BlockHeader(fingerprint=FP, block_hash=h.block_hash, rank=0, world=4,
                         length=ROW),
             BlockHeader(fingerprint=FP, block_hash=b"\xff" * 16, rank=0, world=2,
                         length=ROW)]
    dst = Rows(1)
    for expected in wrong:
        assert store.get_many_into(key, views(dst), [expected]) == [GetOutcome.BAD]
    # and the right one still hits
    assert store.get_many_into(key, views(dst), hs) == [GetOutcome.HIT]
    assert store.statistics()["bad"] == 4


def test_truncated_longer_and_corrupted_values_are_bad(valkey: ValkeyServer,
                                                       store: ValkeyBlockStore) -> None:
    """A value cut short, one longer than the view (it does not fit: the client refuses
    it), and one byte flipped in the payload (the checksum) are each BAD."""
    src = rows(3, 9)
    hs = headers(3, 0, 1)
    keys = keys_of(hs)
    assert store.put_many(keys, views(src), hs) == [True] * 3
    call(valkey, "SET", keys[0], bytes(src[0][: ROW - 1]))          # truncated
    call(valkey, "SET", keys[1], bytes(src[1]) + b"x")              # longer
    flipped = bytearray(src[2])
    flipped[ROW // 2] ^= 1
    call(valkey, "SET", keys[2], bytes(flipped))                    # corrupted
    dst = Rows(3)
    assert store.get_many_into(keys, views(dst), hs) == [GetOutcome.BAD] * 3
    assert store.statistics()["bad"] == 3
    # a header cut short is BAD too
    call(valkey, "SET", header_key(keys[0]), b"KVB1")
    assert store.get_many_into(keys[:1], dst.views[:1], hs[:1]) == [GetOutcome.BAD]


def test_a_header_naming_no_checksum_is_bad_and_never_loaded(valkey: ValkeyServer,
                                                             store: ValkeyBlockStore) -> None:
    """Needs write access to the server (or a corrupting one). Block 0 is put with the
    engine's checksum; then its header's checksum id is set to 0 (``none``, which the
    engine never writes) with none's checksum (0), and one payload byte is flipped. The
    reader, configured with the engine's checksum, gets BAD (counted ``bad`` and
    ``checksum_refused``), never a HIT. Block 1, written by a writer configured with
    ``none`` and untouched, is BAD for it too; a reader configured with ``none`` (a
    benchmark's) reads it. Before, the reader verified with whatever the header named:
    block 0 was a HIT, one wrong block loaded (and served again from the CPU tier)."""
    src = rows(2, 21)
    hs = headers(2, 0, 1)
    bare = [BlockHeader(fingerprint=FP, block_hash=h.block_hash, rank=0, world=1,
                        length=ROW, checksum="none") for h in hs]
    keys = keys_of(hs)
    assert store.put_many(keys[:1], views(src)[:1], hs[:1]) == [True]
    assert store.put_many(keys[1:], views(src)[1:], bare[1:]) == [True]
    raw = bytearray(call(valkey, "GET", header_key(keys[0])))
    assert raw[6] != 0
    raw[6] = 0                                                      # "none" ...
    raw[12:16] = bytes(4)                                           # ... and its sum
    call(valkey, "SET", header_key(keys[0]), bytes(raw))
    flipped = bytearray(src[0])
    flipped[ROW // 3] ^= 0x40
    call(valkey, "SET", keys[0], bytes(flipped))
    dst = Rows(2)
    assert store.get_many_into(keys, views(dst), hs) == [GetOutcome.BAD] * 2
    stats = store.statistics()
    assert (stats["bad"], stats["checksum_refused"], stats["hits"]) == (2, 2, 0)
    assert store.get_many_into(keys[1:], views(dst)[1:], bare[1:]) == [GetOutcome.HIT]
    assert bytes(dst[1]) == bytes(src[1])


def test_missing_payload_or_header_is_a_miss(valkey: ValkeyServer,
                                             store: ValkeyBlockStore) -> None:
    """Never stored: MISS. Payload stored but its header gone (evicted alone): MISS."""
    src = rows(2, 3)
    hs = headers(2, 0, 1)
    keys = keys_of(hs)
    dst = Rows(2)
    assert store.get_many_into(keys, views(dst), hs) == [GetOutcome.MISS] * 2
    assert store.put_many(keys, views(src), hs) == [True] * 2
    call(valkey, "DEL", header_key(keys[0]))
    call(valkey, "DEL", keys[1])
    assert store.get_many_into(keys, views(dst), hs) == [GetOutcome.MISS] * 2
    assert store.statistics()["misses"] == 4


def test_every_block_key_and_its_header_carry_the_ttl(valkey: ValkeyServer,
                                                      store: ValkeyBlockStore) -> None:
    """volatile-lru evicts only keys with a TTL: every key a put writes has one."""
    hs = headers(4, 0, 1)
    assert store.put_many(keys_of(hs), views(rows(4, 1)), hs) == [True] * 4
    for key in keys_of(hs):
        for k in (key, header_key(key)):
            ttl = call(valkey, "TTL", k)
            assert isinstance(ttl, int) and 590 <= ttl <= 600, (k, ttl)
    policy = call(valkey, "CONFIG", "GET", "maxmemory-policy")
    assert policy == [b"maxmemory-policy", b"volatile-lru"]


def test_a_view_of_the_wrong_size_is_bad_and_nothing_is_written_past_it(
        store: ValkeyBlockStore) -> None:
    """The reader's view is smaller than the stored payload: BAD, and the bytes after
    the view (the next host row) are untouched."""
    hs = headers(1, 0, 1)
    assert store.put_many(keys_of(hs), views(rows(1, 5)), hs) == [True]
    buf = bytearray(2 * ROW)
    small = BlockHeader(fingerprint=FP, block_hash=hs[0].block_hash, rank=0, world=1,
                        length=ROW // 2)
    out = store.get_many_into(keys_of(hs), [memoryview(buf)[: ROW // 2]], [small])
    assert out == [GetOutcome.BAD]
    assert buf[ROW // 2:] == bytes(len(buf) - ROW // 2)


def test_ready_index_answers_the_longest_present_prefix_in_one_round_trip(
        valkey: ValkeyServer) -> None:
    """Publish blocks 0-4 and 6-9 of a 12-block chain: the prefix is 5 (block 5 is
    missing, so 6-9 do not count). The query is one pipelined batch: the server ran
    exactly one EXISTS per key of the chain, and the index did one round trip."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM))
    try:
        chain = [ready_key(FP, 2, i.to_bytes(16, "big")) for i in range(12)]
        idx.publish(chain[:5] + chain[6:10])
        _wait(lambda: idx.statistics()["published"] == 9)
        for k in chain[:5]:
            assert 50 <= call(valkey, "TTL", k) <= 60
        call(valkey, "CONFIG", "RESETSTAT")
        before = idx.statistics()["round_trips"]
        # query() only enqueues: it returns while the server answers nobody for 2 s (a
        # call that waited for its round trip would take the pause; a wall bound of a
        # few ms, as before, failed on a loaded machine without telling the two apart)
        call(valkey, "CLIENT", "PAUSE", "2000", "ALL")
        t0 = time.perf_counter()
        idx.query(41, chain)
        assert time.perf_counter() - t0 < 1.0
        got = _wait(idx.answers)
        assert got == [(41, 5)]
        assert idx.statistics()["round_trips"] == before + 1
        stats = call(valkey, "INFO", "commandstats")
        assert isinstance(stats, bytes)
        assert b"cmdstat_exists:calls=12," in stats
        # an empty chain and an all-missing chain answer 0
        idx.query(42, [])
        idx.query(43, [ready_key(FP, 2, b"\x00" * 15 + b"\x77")])
        answers: list[tuple[int, int]] = []

        def two() -> bool:
            answers.extend(idx.answers())
            return len(answers) == 2
        _wait(two)
        assert sorted(answers) == [(42, 0), (43, 0)]
    finally:
        idx.close()


def test_a_manifest_read_and_a_readiness_query_go_in_one_batch_the_read_first(
        valkey: ValkeyServer) -> None:
    """A decoder's manifest read and the readiness query sent with it (queued together,
    as a hand-off's lookup does) are one batch: one round trip, so one wait for the GIL
    after it (before: a readiness round, then a values round: two). To make both land in
    one drain, the index's thread is held at the end of an earlier round (it waits for
    the answers' lock, held here) while they are queued."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM))
    try:
        chain = [ready_key(FP, 2, i.to_bytes(16, "big")) for i in range(4)]
        idx.publish(chain)
        idx.put_value("kvshm:v1:pd:fp:2:r", b"manifest", 60)
        _wait(lambda: idx.statistics()["values_set"] == 1)
        before = idx.statistics()["round_trips"]
        with idx._lock:  # the thread finishes query 6's round, then waits for this lock
            idx.query(6, chain[:1])
            _wait(lambda: idx.statistics()["round_trips"] == before + 1)
            idx.get_value(7, "kvshm:v1:pd:fp:2:r")
            idx.query(8, chain)
        assert _wait(idx.values) == [(7, b"manifest")]
        answers: list[tuple[int, int]] = []

        def both() -> bool:
            answers.extend(idx.answers())
            return len(answers) == 2
        _wait(both)
        assert sorted(answers) == [(6, 1), (8, 4)]
        assert idx.statistics()["round_trips"] == before + 2
    finally:
        idx.close()


def test_a_manifest_is_held_back_by_its_own_refused_readiness_key_only(
        valkey: ValkeyServer) -> None:
    """The hazard: one drain of the index's queue held hand-off A's last readiness keys,
    an unrelated block's readiness key and A's manifest. The server refused the
    unrelated key (an ACL here; an OOM, or a cluster primary that is down), and every
    manifest of the drain was dropped -- A's too, although its keys were stored: its
    decoder waited 5 s and recomputed. Now a manifest names the readiness keys it
    vouches for (``after``) and only a refusal of one of them holds it back: B's
    manifest, which vouches for the refused key, is not written."""
    ok_keys = [ready_key(FP, 2, bytes([0xAA, i]) + bytes(14)) for i in range(2)]
    refused = ready_key(FP, 2, bytes([0xBB]) + bytes(15))
    writable = ok_keys[0][:-len(bytes(16).hex())] + "aa*"
    assert call(valkey, "ACL", "SETUSER", "default", "resetkeys", "%R~*",
                "%W~kvshm:v1:pd:*", f"%W~{writable}") == b"OK"
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM))
    try:
        before = idx.statistics()["round_trips"]
        with idx._lock:  # the thread ends query 1's round, then waits: one drain for all
            idx.query(1, ok_keys[:1])
            _wait(lambda: idx.statistics()["round_trips"] == before + 1)
            idx.publish(ok_keys, keep=True)
            idx.publish([refused])
            idx.put_value("kvshm:v1:pd:fp:2:a", b"A", 60, after=ok_keys)
            idx.put_value("kvshm:v1:pd:fp:2:b", b"B", 60, after=[ok_keys[0], refused])
        _wait(lambda: idx.statistics()["values_dropped"] == 1)
        assert idx.refused() == [refused]
        idx.get_value(2, "kvshm:v1:pd:fp:2:a")
        idx.get_value(3, "kvshm:v1:pd:fp:2:b")
        got: list[tuple[int, bytes | None]] = []

        def both() -> bool:
            got.extend(idx.values())
            return len(got) == 2
        _wait(both)
        assert sorted(got) == [(2, b"A"), (3, None)]
        st = idx.statistics()
        assert (st["published"], st["publish_failed"], st["values_set"]) == (2, 1, 1)
    finally:
        idx.close()


def test_a_refused_manifest_write_is_counted_refused_not_set(valkey: ValkeyServer) -> None:
    """The hazard: on a server that answers the manifest's SET with an error (read-only
    ACL here; an OOM likewise), ``values_set`` counted it as written and no counter
    recorded the refusal. Now it counts as refused, as do a refused DEL and EXPIRE."""
    assert call(valkey, "ACL", "SETUSER", "default", "resetkeys", "%R~*") == b"OK"
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM))
    try:
        idx.put_value("kvshm:v1:pd:fp:2:r", b"manifest", 60)
        idx.delete_if_same("kvshm:v1:pd:fp:2:r", b"manifest")
        idx.expire(["kvshm:v1:pd:fp:2:r"])
        idx.get_value(1, "kvshm:v1:pd:fp:2:r")
        assert _wait(idx.values) == [(1, None)]
        st = idx.statistics()
        assert (st["values_set"], st["values_refused"], st["errors"]) == (0, 3, 0)
    finally:
        idx.close()


def test_ready_index_small_values_alone_are_no_error_and_a_probe_closes_the_breaker(
        valkey: ValkeyServer) -> None:
    """Manifest traffic with no query or publish queued (a decoder's GET, a DEL, an
    EXPIRE): no empty batch is sent (glide refuses one: it counted as a server error and,
    as the half-open probe, kept the breaker open for good). With the breaker opened by
    hand, the next GET after the backoff is the probe and closes it."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM),
                           breaker_backoff_s=0.1)
    try:
        idx.put_value("kvshm:v1:pd:fp:2:r", b"manifest", 60)
        idx.get_value(1, "kvshm:v1:pd:fp:2:r")
        assert _wait(idx.values) == [(1, b"manifest")]
        idx.expire(["kvshm:v1:pd:fp:2:r"])
        idx.delete_if_same("kvshm:v1:pd:fp:2:r", b"manifest")
        idx.get_value(2, "kvshm:v1:pd:fp:2:r")
        assert _wait(idx.values) == [(2, None)]
        assert idx.statistics()["errors"] == 0
        for _ in range(3):
            idx.breaker.failure()
        assert not idx.healthy()
        time.sleep(0.15)
        idx.get_value(3, "kvshm:v1:pd:fp:2:none")
        assert _wait(idx.values) == [(3, None)]
        assert idx.statistics()["breaker_state"] == "closed"
    finally:
        idx.close()


def test_a_get_past_its_deadline_never_writes_the_row_later(valkey: ValkeyServer) -> None:
    """A GET times out (the server is paused past the 150 ms deadline): ERROR, and when
    the server answers afterwards nothing lands in the row -- the row goes back to the
    CPU tier after the failed job and may hold another block by then."""
    src, dst = rows(2, seed=5), Rows(2)
    hs = headers(2, 0, 1)
    # the values go in with a generous deadline (a put at 150 ms can time out on a
    # loaded machine); the store under test only reads
    writer = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, threads=1))
    try:
        assert writer.put_many(keys_of(hs), views(src), hs) == [True, True]
    finally:
        writer.close()
    st = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, request_timeout_ms=150,
                                           connect_timeout_ms=2000, threads=1))
    try:
        # connect first (a handshake during the pause would wait it out); a warm-up
        # read that missed its 150 ms on a loaded machine is asked again
        assert any(st.get_many_into(keys_of(hs), views(dst), hs) == [GetOutcome.HIT] * 2
                   for _ in range(5))
        dst.clear()
        call(valkey, "CLIENT", "PAUSE", "700", "ALL")
        got = st.get_many_into(keys_of(hs), views(dst), hs)
        assert got[0] is GetOutcome.ERROR
        time.sleep(1.2)  # the server is back and has sent its (late) replies
        assert dst.buf == bytes(len(dst.buf))
        assert st.get_many_into(keys_of(hs), views(dst), hs) == [GetOutcome.HIT] * 2
        assert dst == src
    finally:
        st.close()


T = TypeVar("T")


def _wait(probe: Callable[[], T], timeout_s: float = 5.0) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        got = probe()
        if got:
            return got
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_server_sigkill_mid_put_and_mid_get_costs_one_deadline_opens_and_closes_the_breaker(
        valkey: ValkeyServer) -> None:
    """A put of 64 rows is under way when the server is SIGKILLed: the call returns
    within a few request deadlines (the breaker opens after 3 consecutive failures, the
    rest of the keys are refused without a request), some puts are False, none raises.
    While the breaker is open a get costs no network time. After a restart on the same
    port the breaker's probe closes it and puts and gets work again (the restarted
    server is empty: the get of a block put before the crash is a MISS)."""
    spec = RemoteSpec.parse(valkey.url, ttl_s=600, request_timeout_ms=TIMEOUT_MS,
                            connect_timeout_ms=TIMEOUT_MS)
    store = ValkeyBlockStore(spec, breaker_backoff_s=0.2)
    try:
        n = 64
        src, dst = rows(n, 11), Rows(n)
        hs = headers(n, 0, 1)
        keys = keys_of(hs)
        result: list[bool] = []
        took: list[float] = []

        def put() -> None:
            t0 = time.monotonic()
            result.extend(store.put_many(keys, views(src), hs))
            took.append(time.monotonic() - t0)

        t = threading.Thread(target=put)
        t.start()
        time.sleep(0.02)
        valkey.kill()
        t.join(10)
        assert not t.is_alive()
        assert took[0] < DEAD_CALL_S, took
        assert False in result
        stats = store.statistics()
        # opened once, and each failed probe (every backoff) opened it again
        assert stats["breaker_opens"] >= 1 and stats["breaker_state"] == "open"
        assert stats["errors"] >= 3

        # mid-get on a dead server: every key ERROR, fast (the breaker is open)
        t0 = time.monotonic()
        out = store.get_many_into(keys, views(dst), hs)
        assert time.monotonic() - t0 < 0.1
        assert set(out) == {GetOutcome.ERROR}

        valkey.start()  # the same port, empty
        deadline = time.monotonic() + 5
        while store.put_many(keys[:1], src.views[:1], hs[:1]) != [True]:
            assert time.monotonic() < deadline, store.statistics()
            time.sleep(0.05)
        stats = store.statistics()
        # closed again (at least once: under load a request of the put may time out
        # before the kill, and a probe then close it early)
        assert stats["breaker_state"] == "closed" and stats["breaker_closes"] >= 1
        assert store.get_many_into(keys[:2], dst.views[:2], hs[:2]) == [
            GetOutcome.HIT, GetOutcome.MISS]
        assert dst[0] == src[0]
        assert stats["clients_created"] > spec.threads  # re-created after the crash
    finally:
        store.close()


def test_server_sigkill_mid_get_returns_within_the_deadline(valkey: ValkeyServer) -> None:
    """128 HITs under way when the server dies: the call returns within a few deadlines,
    each key is HIT (landed before the crash) or ERROR, and every HIT is byte-exact."""
    spec = RemoteSpec.parse(valkey.url, ttl_s=600, request_timeout_ms=TIMEOUT_MS,
                            connect_timeout_ms=TIMEOUT_MS)
    store = ValkeyBlockStore(spec)
    try:
        n = 128  # 256 MiB: the gets take ~0.1-0.3 s here, the kill lands in the middle
        src, dst = rows(n, 12), Rows(n)
        hs = headers(n, 0, 1)
        keys = keys_of(hs)
        calm = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM))
        try:
            assert calm.put_many(keys, views(src), hs) == [True] * n
        finally:
            calm.close()
        out: list[GetOutcome] = []
        t = threading.Thread(target=lambda: out.extend(
            store.get_many_into(keys, views(dst), hs)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.005)
        valkey.kill()
        t.join(10)
        took = time.monotonic() - t0
        assert not t.is_alive() and took < DEAD_CALL_S, took
        assert set(out) <= {GetOutcome.HIT, GetOutcome.ERROR}
        assert GetOutcome.ERROR in out
        for i, o in enumerate(out):
            if o is GetOutcome.HIT:
                assert dst[i] == src[i]
    finally:
        store.close()


def test_a_drain_that_raises_answers_its_callers_and_the_index_thread_lives_on(
        valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault where none is expected (injected: the batch runner raises once, as a
    client library bug would): the index thread died with it, and every later query
    and manifest read went unanswered -- each lookup asking again until its deadline,
    for the rest of the run. Now the failed drain answers its query 0 and its read
    None, counts ``drains_failed``, makes a new client, and the next query is answered
    from the server as before."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=60, **CALM))
    try:
        chain = [ready_key(FP, 2, i.to_bytes(16, "big")) for i in range(3)]
        idx.publish(chain)
        _wait(lambda: idx.statistics()["published"] == 3)
        real = idx._batches.run
        calls = {"n": 0}

        def flaky(client: Any, cmds: Any) -> list[Any]:
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected")
            return real(client, cmds)
        monkeypatch.setattr(idx._batches, "run", flaky)
        idx.query(1, chain)
        idx.get_value(2, "kvshm:nothing")
        assert _wait(idx.answers) == [(1, 0)]
        assert _wait(idx.values) == [(2, None)]
        stats = idx.statistics()
        assert stats["drains_failed"] == 1 and stats["errors"] == 1, stats
        idx.query(3, chain)
        assert _wait(idx.answers) == [(3, 3)]
        assert idx._thread.is_alive() and idx.statistics()["clients_created"] == 2
    finally:
        idx.close()


def test_ready_index_on_a_dead_server_answers_zero_and_never_blocks_the_caller(
        valkey: ValkeyServer) -> None:
    """query() and publish() return at once while the server is down; the answers are
    0; the breaker opens; after a restart a published key is found again."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, request_timeout_ms=TIMEOUT_MS,
                                            connect_timeout_ms=TIMEOUT_MS),
                           breaker_backoff_s=0.2)
    try:
        chain = [ready_key(FP, 1, i.to_bytes(16, "big")) for i in range(4)]
        valkey.kill()
        worst = 0.0
        for tok in range(3):  # three rounds, each one timeout: the breaker opens
            t0 = time.perf_counter()
            idx.publish(chain)
            idx.query(tok, chain)
            worst = max(worst, time.perf_counter() - t0)
            assert _wait(idx.answers) == [(tok, 0)]
        # never blocked: a call that waited for the dead server would take a whole
        # timeout; the bound is half of one, not a wall figure a loaded machine misses
        # (2 ms failed at 2.8 ms under load 12)
        assert worst < TIMEOUT_MS / 1000 / 2
        stats = idx.statistics()
        assert stats["breaker_opens"] == 1 and stats["timeouts"] + stats["errors"] >= 3
        # open: answered 0 without waiting for the dead server (within one deadline: a
        # 50 ms bound counted the index thread's wake-up and the poll's sleeps too)
        t0 = time.perf_counter()
        idx.query(7, chain)
        assert _wait(idx.answers) == [(7, 0)]
        assert time.perf_counter() - t0 < TIMEOUT_MS / 1000
        valkey.start()
        deadline = time.monotonic() + 5
        while True:
            idx.publish(chain)
            idx.query(99, chain)
            got = _wait(idx.answers)
            if got == [(99, 4)]:
                break
            assert time.monotonic() < deadline, idx.statistics()
            time.sleep(0.1)
        assert idx.statistics()["breaker_state"] == "closed"
    finally:
        idx.close()


def test_a_callers_wrong_view_is_refused_without_touching_the_breaker(
        store: ValkeyBlockStore) -> None:
    """A put whose view is not its header's length, a get into a read-only view, and
    mismatched list lengths are the caller's errors: refused (False / ERROR), counted
    as invalid, and the breaker stays closed however many there are."""
    hs = headers(1, 0, 1)
    short = memoryview(bytearray(ROW - 1))
    for _ in range(5):
        assert store.put_many(keys_of(hs), [short], hs) == [False]
        assert store.get_many_into(keys_of(hs), [memoryview(bytes(ROW))], hs) == [
            GetOutcome.ERROR]
    assert store.put_many(keys_of(hs), [], hs) == [False]
    assert store.get_many_into(keys_of(hs), [], hs) == [GetOutcome.ERROR]
    stats = store.statistics()
    assert stats["invalid_calls"] == 12
    assert stats["breaker_opens"] == 0 and stats["breaker_state"] == "closed"
    src = rows(1, 2)
    assert store.put_many(keys_of(hs), views(src), hs) == [True]


def test_a_non_contiguous_view_in_a_put_is_refused_alone(store: ValkeyBlockStore) -> None:
    """The hazard: ``put_many`` of three blocks whose middle view is strided (the
    right length, not contiguous). Its checksum raised BufferError, which the per-block
    refusal did not catch: the whole part failed -- both good neighbours not stored --
    and it counted as an internal error, not the caller's. Now that block alone is
    refused (invalid_calls), the neighbours are stored and read back byte-exact."""
    hs = headers(3, 0, 1)
    src = rows(3, 4)
    strided = memoryview(bytearray(2 * ROW))[::2]
    assert strided.nbytes == ROW and not strided.c_contiguous
    assert store.put_many(keys_of(hs), [src.views[0], strided, src.views[2]], hs) == [
        True, False, True]
    stats = store.statistics()
    assert (stats["invalid_calls"], stats["errors"], stats["put_ok"]) == (1, 0, 2)
    dst = Rows(2)
    assert store.get_many_into([keys_of(hs)[0], keys_of(hs)[2]], views(dst),
                               [hs[0], hs[2]]) == [GetOutcome.HIT, GetOutcome.HIT]
    assert dst[0] == src[0] and dst[1] == src[2]


def test_a_store_dropped_unclosed_is_freed_at_once_with_its_pool(valkey: ValkeyServer) -> None:
    """A store whose owner forgot to close it (an exception between open and close):
    with the collector off, dropping the last reference frees it -- no reference cycle
    through its fan-out's or clients' callbacks keeps its pool threads and clients
    alive until a collection that may never come."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        s = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM))
        s.warm()  # the pool's threads started, every thread's client made
        ref = weakref.ref(s)
        del s
        assert ref() is None
    finally:
        gc.enable()


def test_the_first_call_after_a_restart_probes_alone_and_stores_every_block(
        valkey: ValkeyServer) -> None:
    """The server was SIGKILLed (the breaker opened) and is back. The first put after
    the backoff is eight one-block requests over four threads: the shard's breaker is
    not closed, so its parts go one at a time -- the first is the probe, which closes
    the breaker, and the other seven follow it. Raced over the threads instead, the
    half-open breaker would let the probe through and refuse the rest (False)."""
    # CALM deadlines, not TIMEOUT_MS: a refused connect fails at once either way, and
    # with 300 ms the probe's reconnect to the restarted server timed out on a loaded
    # 2-core machine (the breaker then stayed open: flaky in two full runs)
    spec = RemoteSpec.parse(valkey.url, ttl_s=600, threads=4, **CALM)
    store = ValkeyBlockStore(spec, breaker_backoff_s=0.2, part_bytes=0)
    try:
        n = 8
        src, hs = rows(n, 12), headers(n, 0, 1)
        keys = keys_of(hs)
        valkey.kill()
        deadline = time.monotonic() + 10
        while store.statistics()["breaker_state"] != "open":
            assert time.monotonic() < deadline
            store.put_many(keys, views(src), hs)
        valkey.start()
        (breaker,) = store._shards.breakers.live().values()
        while not breaker.would_allow():  # the backoff ran out: the next request probes
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert store.put_many(keys, views(src), hs) == [True] * n
        assert store.statistics()["breaker_state"] == "closed"
    finally:
        store.close()


def test_a_server_that_wants_a_password_is_named_in_one_warning_a_side(
        valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The hazard: a server that wants a password (``requirepass``, which kvshm has no
    way to give) refuses every connection with ``NOAUTH``. The store and the index
    counted ``errors`` and every block was a miss, but kvshm wrote no line: the operator
    saw glide's native stderr noise at best, nothing that named kvshm's tier. Now the
    first failed request of each side writes one WARNING that names the server and
    glide's text; the others within the interval are only counted. A server that
    answers a put with an error (a read-only ACL here; ``OOM`` likewise) is one WARNING
    with its text, where it was a DEBUG line."""
    fresh = RateLimitedLog(logging.getLogger("kvshm.remote"))
    monkeypatch.setattr(glide_client, "_failure_log", fresh)  # not the suite's history
    monkeypatch.setattr(valkey_mod, "rlog", RateLimitedLog(valkey_mod.log))
    caplog.set_level(logging.WARNING)
    assert call(valkey, "CONFIG", "SET", "requirepass", "hunter2") == b"OK"
    spec = RemoteSpec.parse(valkey.url, ttl_s=600, **CALM)
    # one request a call of two 2 MiB blocks (the counts below assume it)
    st, idx = ValkeyBlockStore(spec, part_bytes=4 << 20), ValkeyReadyIndex(spec)
    try:
        hs = headers(2, 0, 1)
        for _ in range(3):
            assert st.put_many(keys_of(hs), views(rows(2, 1)), hs) == [False, False]
        assert st.get_many_into(keys_of(hs), views(Rows(2)), hs) == [GetOutcome.ERROR] * 2
        for tok in range(2):
            idx.query(tok, [ready_key(FP, 1, b"\0" * 16)])
            assert _wait(idx.answers) == [(tok, 0)]
        assert st.statistics()["errors"] == 8 and idx.statistics()["errors"] == 2
    finally:
        st.close()
        idx.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvshm.remote"]
    where = f"{valkey.host}:{valkey.port}"
    assert len(lines) == 2, lines  # one a side: 3 + 2 requests failed (the get found
    # the store's breaker open after its 3 puts: refused without a request, no line)
    assert {line.split(")")[0] for line in lines} == {"kvshm remote tier (store",
                                                      "kvshm remote tier (index"}
    assert all(where in line and "NOAUTH" in line for line in lines), lines
    assert fresh.suppressed == 3


def test_a_put_the_server_refuses_is_one_warning_with_its_text(
        valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A server that answers a put with an error (a read-only ACL here; ``OOM`` under
    ``noeviction`` likewise) was a DEBUG line per put: at the default level nothing
    said why no block ever reached the tier. Now one WARNING an interval, with the
    server's text; the puts are counted ``put_refused``."""
    fresh = RateLimitedLog(valkey_mod.log)
    monkeypatch.setattr(valkey_mod, "rlog", fresh)
    caplog.set_level(logging.WARNING)
    assert call(valkey, "ACL", "SETUSER", "default", "resetkeys", "%R~*") == b"OK"
    st = ValkeyBlockStore(RemoteSpec.parse(valkey.url, ttl_s=600, **CALM),
                          part_bytes=4 << 20)  # one request a call (the counts assume it)
    try:
        hs = headers(2, 0, 1)
        for _ in range(3):
            assert st.put_many(keys_of(hs), views(rows(2, 1)), hs) == [False, False]
        assert st.statistics()["put_refused"] == 6
        assert st.statistics()["errors"] == 0  # an answer: the breaker stays closed
    finally:
        st.close()
    lines = [r.getMessage() for r in caplog.records if r.name == valkey_mod.log.name]
    assert len(lines) == 1 and "refused a put" in lines[0], lines
    assert "No permissions to access a key" in lines[0], lines  # the server's reason
    assert fresh.suppressed == 2


def test_a_collection_deletes_only_the_manifest_it_read_and_never_shortens_a_ttl(
        valkey: ValkeyServer) -> None:
    """Two hazards of a hand-off's collection (a hostile probe):
    * "a collection's DEL took a manifest published anew": the decoder read M1, the
      prefill published M2 under the same name (a proxy retrying the request), and the
      decoder's DEL removed M2: its own decoder waited 5 s and recomputed. The delete is
      now a compare-and-delete of the bytes read: M2 stays, and M2's own reader's goes.
    * "a demotion shortened a live hand-off's blocks": EXPIRE with a deployment's (or a
      janitor's) short ``ttl_s`` put blocks that another live hand-off names, held for
      1,800 s, on a 5 s TTL, and they were gone before its decoder read them. EXPIRE now
      only lengthens (GT): the held key keeps its TTL, a key with less left gets the
      ordinary one."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url, ttl_s=5, **CALM))
    name, held, short = "kvshm:v1:pd:fp:2:r", "kvshm:v1:blk:held", "kvshm:v1:blk:short"
    try:
        call(valkey, "SET", held, "1", "EX", "1800")
        call(valkey, "SET", short, "1", "EX", "2")
        idx.put_value(name, b"M2", 60)
        idx.delete_if_same(name, b"M1")  # the first decoder's collection of what it read
        idx.expire([held, short])
        idx.get_value(1, name)
        assert _wait(idx.values) == [(1, b"M2")]
        assert int(call(valkey, "TTL", held)) > 1700
        assert 3 <= int(call(valkey, "TTL", short)) <= 5
        idx.delete_if_same(name, b"M2")  # the retry's decoder
        idx.get_value(2, name)
        assert _wait(idx.values) == [(2, None)]
        assert idx.statistics()["errors"] == 0
    finally:
        idx.close()
