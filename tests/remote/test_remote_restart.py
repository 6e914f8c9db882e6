"""A remote server that lost its data is noticed: real engines (two embedded ranks each)
and a real Valkey server, restarted empty under load.

An engine remembers the blocks it put (and fetched) and does not put them again while
they should still be on the server (half its TTL, 30 min by default). The readiness
index reads the server's ``run_id`` at most every second; a new one (a restart, a
failover) makes the engine forget that memory (``server_restarts``), so write-through
refills the tier within seconds (issue 31: after a standalone Valkey restarted empty,
18,635 puts were skipped as duplicates and the remote hit count stayed flat).
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from engine_rig import BS, Client, embedded_engine
from remote_engine_rig import BLOCKS, MODEL, ask, prompt, remote, server_keys, store_and_publish

from kvshm.ratelog import RateLimitedLog
from kvshm.remote import glide_client, valkey_index
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyServer
from kvshm.remote.tier import RemoteSpec
from kvshm.remote.valkey_index import ValkeyReadyIndex


def call(server: ValkeyServer, *args: str) -> object:
    """One raw command to ``server``."""
    return parse_reply(command(server.host, server.port, *args))


@pytest.mark.asyncio
@pytest.mark.parametrize("loss", ["restart", "flushall"])
async def test_a_restarted_server_is_refilled_within_seconds(valkey: ValkeyServer,
                                                             loss: str) -> None:
    """Writer A serves 4 prompts (write-through: 32 blocks put and published). The
    server is SIGKILLed and started again on its port, empty (``restart``), or emptied by
    a ``FLUSHALL`` while it runs (``flushall``: its run_id stays; A's index notices its
    sentinel key gone, ``index_flushes_seen``). A goes on serving the same
    prompts, round after round; each round its CPU tier is dropped first (under load
    its blocks would be evicted), so it stores them again. A reader B asks for the 4
    prompts after each round. Within a few seconds A has noticed the new run_id
    (server_restarts 1), put the blocks again and B hits all 4 prompts from the server.
    Before, A skipped every re-put as a duplicate for ``ttl_s / 2`` and B never hit (a
    flush went unnoticed until the sentinel came: a review)."""
    toks = [prompt(60 + i) for i in range(4)]
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ea, ga, _, _):
        ca = Client(ea, ga)
        for i, t in enumerate(toks):
            await store_and_publish(ca, f"w{i}", t)
        if loss == "restart":
            valkey.kill()
            valkey.start()
        else:
            assert call(valkey, "FLUSHALL") == b"OK"
        assert server_keys(valkey.host, valkey.port) == []               # empty
        t0 = time.monotonic()
        async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (eb, gb, _, _):
            cb = Client(eb, gb)
            for rnd in range(1, 1000):
                assert await ea.reset(timeout=10.0)
                for i, t in enumerate(toks):                              # A's load
                    table, _ = ca.compute(f"w{rnd}-{i}", t)
                    ca.finish(f"w{rnd}-{i}", table, len(t))
                await ca.settle()
                hits = [await ask(cb, f"r{rnd}-{i}", t) for i, t in enumerate(toks)]
                if hits == [BLOCKS * BS] * len(toks):
                    break
                ra = remote(ea)
                assert time.monotonic() - t0 < 15.0, (hits, {
                    k: ra.get(k) for k in ("put_skipped_duplicate", "put_blocks",
                                           "server_restarts", "index_run_id_checks")})
                await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            rb = remote(eb)
        ra = remote(ea)
    assert took < 15.0
    print(f"remote hits back {took:.1f} s after the restart")
    changes, flushes = (1, 0) if loss == "restart" else (0, 1)
    assert (ra["server_restarts"], ra["index_run_id_changes"],
            ra["index_flushes_seen"]) == (1, changes, flushes), ra
    assert rb["server_restarts"] == 0 and rb["hit_blocks"] == len(toks) * BLOCKS, rb


def round_trip(idx: ValkeyReadyIndex, token: int) -> None:
    """One readiness query through ``idx``, waited for (a run_id check follows it)."""
    idx.query(token, ["kvshm:v1:fp:ready/1:00"])
    deadline = time.monotonic() + 10.0
    while not idx.answers():
        assert time.monotonic() < deadline, idx.statistics()
        time.sleep(0.01)


def test_the_index_counts_a_new_run_id_once(valkey: ValkeyServer) -> None:
    """The index alone: a first read of the run_id is no restart; the same server read
    again is none either; after a restart (a new run_id) ``restarts()`` is 1, and it
    stays 1 while the server runs on."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url), run_id_every_s=0.0)
    try:
        round_trip(idx, 1)
        round_trip(idx, 2)
        assert idx.restarts() == 0 and idx.statistics()["run_id_checks"] >= 2
        valkey.kill()
        valkey.start()
        deadline = time.monotonic() + 20.0
        token = 3
        while idx.restarts() == 0:
            assert time.monotonic() < deadline, idx.statistics()
            round_trip(idx, token)
            token += 1
            time.sleep(0.05)
        for t in range(token, token + 3):
            round_trip(idx, t)
        assert idx.restarts() == 1 and idx.statistics()["run_id_changes"] == 1
    finally:
        idx.close()


def test_an_acl_without_info_is_named_not_silent(
        valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The hazard: a server whose ACL refuses ``INFO`` (``-info``, a hardened default
    user). The index reads the server's run_id with ``INFO server``, and glide itself
    sends ``INFO`` when it connects, so every round failed and every lookup missed,
    counted ``errors`` and ``run_id_errors`` and nothing else: no line said the remote
    tier was off, nor that a restart of the server would go unnoticed. Now each is one
    WARNING a minute that quotes the server's refusal; the queries answer 0 as before."""
    fresh, failures = RateLimitedLog(valkey_index.log), RateLimitedLog(glide_client.log)
    monkeypatch.setattr(valkey_index, "rlog", fresh)  # not the suite's history
    monkeypatch.setattr(glide_client, "_failure_log", failures)
    caplog.set_level(logging.WARNING)
    assert call(valkey, "ACL", "SETUSER", "default", "-info") == b"OK"
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url), run_id_every_s=0.0,
                           breaker_threshold=100)  # every round reaches the server
    try:
        for token in range(3):
            idx.query(token, ["kvshm:v1:fp:ready/1:00"])
            deadline = time.monotonic() + 10.0
            while not (got := idx.answers()):
                assert time.monotonic() < deadline, idx.statistics()
                time.sleep(0.01)
            assert got == [(token, 0)]
        st = idx.statistics()
        assert st["run_id_errors"] == 3 and st["run_id_checks"] == 0 and st["errors"] == 3
    finally:
        idx.close()
    lines = sorted(r.getMessage() for r in caplog.records if r.name.startswith("kvshm"))
    assert len(lines) == 2, lines
    assert "cannot read the server's run_id" in lines[1] and "a request to" in lines[0]
    assert all("no permissions to run the 'info' command" in line for line in lines)
    assert (fresh.suppressed, failures.suppressed) == (2, 2)


def test_an_index_deletes_its_sentinel_at_close(valkey: ValkeyServer) -> None:
    """Each index writes a sentinel key of its own (10-minute TTL) to notice a flush;
    its close left it behind, so a probe's 20 engine restarts left 20 on the server.
    Now the close deletes it: no ``kvshm-sentinel:*`` key is left."""
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url), run_id_every_s=0.0)
    try:
        for token in range(2):  # the first check writes the sentinel
            round_trip(idx, token)
        assert call(valkey, "KEYS", "kvshm-sentinel:*") != []
    finally:
        idx.close()
    assert call(valkey, "KEYS", "kvshm-sentinel:*") == []


def test_evictions_by_a_full_server_are_counted_and_said(
        valkey: ValkeyServer, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The hazard (a hostile probe at production scale): a server at its ``maxmemory``
    under ``volatile-lru`` evicted 204,000 keys -- every prefix's first blocks, written
    earliest -- and a second engine hit nothing, while no line said the server was
    full. The index's periodic INFO read now takes ``evicted_keys`` too: a rise is
    counted (``server_evictions``) and one WARNING a minute says what it costs."""
    fresh = RateLimitedLog(valkey_index.log)
    monkeypatch.setattr(valkey_index, "rlog", fresh)
    caplog.set_level(logging.WARNING)
    idx = ValkeyReadyIndex(RemoteSpec.parse(valkey.url), run_id_every_s=0.0)
    try:
        round_trip(idx, 0)  # the first read: the count so far, nothing said
        assert call(valkey, "CONFIG", "SET", "maxmemory", "4mb") == b"OK"
        for i in range(200):  # 100 KiB a key with a TTL: volatile-lru evicts them
            call(valkey, "SET", f"filler:{i}", "x" * 100_000, "EX", "600")
        round_trip(idx, 1)
        st = idx.statistics()
        assert st["server_evictions"] > 100, st
    finally:
        idx.close()
    said = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert len(said) == 1 and "maxmemory reached" in said[0], said
