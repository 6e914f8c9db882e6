"""Prefill/decode hand-off through the remote tier (``kvshm.offload.pd``), asyncio
API, real engines (two embedded ranks each), a real Valkey server.

The prefill engine P serves a request with ``do_remote_decode``; when it finishes,
``transfer_params`` names the manifest; the decode engine D gets the request with
``do_remote_prefill`` and those params, as a P/D proxy sends it. Rule: D either loads
exactly P's KV, or recomputes (missing, expired, foreign or untrustworthy manifest;
evicted blocks; a prefill killed mid-publish) -- never a hang, never a partial load.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from engine_rig import BS, Client, embedded_engine, tokens
from remote_engine_rig import (
    BLOCKS,
    MODEL,
    decode,
    digest,
    exists,
    load,
    prefill,
    prompt,
    remote,
    serve_whole,
    server_keys,
    settle_published,
    ttl,
    wait_for_server,
)

from kvshm.hashing import chain_hashes
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest
from kvshm.remote.resp import command
from kvshm.remote.server import ValkeyServer
from kvshm.types import RequestView

pytestmark = pytest.mark.asyncio
HERE = Path(__file__).parent


def stored_manifest(valkey: ValkeyServer, key: str) -> Manifest:
    """The manifest ``key`` as the server holds it."""
    raw = command(valkey.host, valkey.port, "GET", key).split(b"\r\n", 1)[1][:-2]
    return msgspec.json.decode(raw, type=Manifest)


async def handed_off(valkey: ValkeyServer, cp: Client, rid: str, toks: list[int]
                     ) -> tuple[dict[str, Any], list[int]]:
    """P prefills ``rid`` and publishes it: its transfer params and GPU table, once the
    manifest is on the server."""
    params, table = await prefill(cp, rid, toks)
    await settle_published(cp)
    await wait_for_server(lambda: exists(valkey, params[MANIFEST_PARAM]), 20.0)
    return params, table
async def test_handoff_publish_then_consume_bit_exact_and_collected(
        valkey: ValkeyServer) -> None:
    """P publishes 8 blocks and, last, the manifest; until a decoder loads them the
    blocks and readiness keys carry the hold TTL (1800 s: bounded, so a hand-off nobody
    collects cannot pin server memory for ever), the manifest its own. D (zeroed
    caches) asks with the params: the manifest is read, the readiness keys asked, the
    blocks fetched and loaded bit-exact; then the blocks get the ordinary TTL and the
    manifest is deleted (collected)."""
    toks = prompt(30)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await prefill(cp, "req-1", toks)
        assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                          MANIFEST_PARAM: params[MANIFEST_PARAM]}  # vLLM's P/D convention
        await settle_published(cp)
        src = [digest(k[table[:BLOCKS]]) for k in kp]
        rp = remote(ep)
        assert (rp["pd_published"], rp["pd_manifests_written"]) == (1, 1)
    key = params[MANIFEST_PARAM]
    manifest = stored_manifest(valkey, key)
    assert manifest.world == 2 and manifest.num_tokens == len(toks)
    assert len(manifest.hashes) == BLOCKS
    assert 0 < ttl(valkey, key) <= 1200
    blocks = server_keys(valkey.host, valkey.port, "*kvshm:v1:*")
    assert len(blocks) == 8 * 2 * 2 + 8 + 1                      # shards, headers, ready
    assert all(1700 < ttl(valkey, k) <= 1800 for k in blocks if k != key.encode())
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        assert await decode(cd, "req-1", toks, params) == BLOCKS * BS
        dst = load(cd, "req-1", toks, BLOCKS * BS)
        assert (await cd.loaded("req-1")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in kd] == src
        rd = remote(ed)
        assert (rd["pd_consumed"], rd["pd_collected"], rd["hit_blocks"]) == (1, 1, 8)
        await wait_for_server(lambda: not exists(valkey, key))
        assert all(3500 < ttl(valkey, k) <= 3600 for k in blocks if k != key.encode())


async def test_the_partial_last_block_travels_so_the_decoder_computes_one_token(
        valkey: ValkeyServer) -> None:
    """A 35-token prompt: 8 full blocks and a 3-token tail. P finishes it with the tail
    key: 9 blocks are put (every rank's shard) and the manifest names the tail last
    (``tail == 1``). D (zeroed caches) asks with the same tail key: its hit is 34 tokens
    (all but the last), the 9 blocks load into D's table and hold P's bytes (the tail
    block's too), so D computes only token 34."""
    toks = tokens(BLOCKS * BS + 3, 34)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await prefill(cp, "req-t", toks, tail=True)
        await settle_published(cp)
        src = [digest(k[table[:BLOCKS + 1]]) for k in kp]
        assert remote(ep)["published_blocks"] == BLOCKS + 1
    key = params[MANIFEST_PARAM]
    manifest = stored_manifest(valkey, key)
    assert (len(manifest.hashes), manifest.tail, manifest.num_tokens) == (BLOCKS + 1, 1, 35)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        assert await decode(cd, "req-t", toks, params, tail=True) == len(toks) - 1
        dst = load(cd, "req-t", toks, len(toks) - 1)
        assert (await cd.loaded("req-t")).ok
        assert [digest(k[dst[:BLOCKS + 1]]) for k in kd] == src
        assert remote(ed)["hit_blocks"] == BLOCKS + 1


async def test_a_prefill_process_hands_off_to_a_decode_process_bit_exact(
        valkey: ValkeyServer) -> None:
    """P runs in its own process, publishes and exits; D (this process, zeroed caches)
    consumes the hand-off: its blocks hold P's bytes (same SHA-256 per rank), so the
    decode's logits are the ones a single engine computing everything gets (the toy
    model's logits are bit-exact for equal KV: ``tools.bench_pd`` checks them)."""
    proc = subprocess.run([sys.executable, str(HERE / "pd_prefill_proc.py"), valkey.url,
                           "37", "publish"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        toks = prompt(37)
        assert await decode(cd, "req-k", toks, out["params"]) == BLOCKS * BS
        dst = load(cd, "req-k", toks, BLOCKS * BS)
        assert (await cd.loaded("req-k")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in kd] == out["sha256"]


async def test_decode_asking_before_the_prefill_published_waits_then_hits(
        valkey: ValkeyServer) -> None:
    """D asks first (the manifest does not exist yet): "ask again" while P publishes,
    then the hit -- the P/D race a proxy creates."""
    toks = prompt(31)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _), \
            embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cp, cd = Client(ep, gp), Client(ed, gd)
        params, _ = await prefill(cp, "req-2", toks)
        view = RequestView("req-2", chain_hashes(toks, BS), len(toks),
                           {"do_remote_prefill": True, **params})
        assert ed.lookup(view, 0) is None
        await settle_published(cp)
        assert await decode(cd, "req-2", toks, params) == BLOCKS * BS


async def test_a_manifest_written_before_its_blocks_is_never_trusted(
        valkey: ValkeyServer) -> None:
    """A manifest on the server (forced) whose blocks were never put: D still asks the
    readiness keys, finds none and recomputes (0); nothing is fetched."""
    toks = prompt(32)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        params, _ = await prefill(cp, "req-3", toks)
        await settle_published(cp)
    for k in server_keys(valkey.host, valkey.port, "*:ready/*"):
        command(valkey.host, valkey.port, "DEL", k)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cd = Client(ed, gd)
        assert await decode(cd, "req-3", toks, params) == 0
        rd = remote(ed)
        assert rd["pd_consumed"] == 1 and rd["get_jobs"] == 0 and rd["query_misses"] == 1


async def test_evicted_blocks_behind_a_manifest_recompute(valkey: ValkeyServer) -> None:
    """The manifest and readiness keys are there, rank 0's payloads were evicted: the
    GET fails, D recomputes with nothing pinned."""
    toks = prompt(33)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        params, _ = await prefill(cp, "req-4", toks)
        await settle_published(cp)
    for k in server_keys(valkey.host, valkey.port, "kvshm:v1:*:0/2:*"):
        command(valkey.host, valkey.port, "DEL", k)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cd = Client(ed, gd)
        assert await decode(cd, "req-4", toks, params) == 0
        assert remote(ed)["get_failed_jobs"] == 1 and ed.statistics().pins_held == 0


async def test_an_expired_manifest_is_demoted_and_a_foreign_one_refused(
        valkey: ValkeyServer) -> None:
    """An expired manifest: D answers 0, deletes it and gives its blocks the ordinary TTL
    (demoted). A manifest of another model (another fingerprint): refused, counted,
    logged; D recomputes."""
    toks, other = prompt(34), prompt(35)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        params, _ = await prefill(cp, "req-5", toks)
        params2, _ = await prefill(cp, "req-6", other)
        await settle_published(cp)
    key = params[MANIFEST_PARAM]
    raw = command(valkey.host, valkey.port, "GET", key).split(b"\r\n", 1)[1][:-2]
    m = msgspec.json.decode(raw, type=Manifest)
    stale = msgspec.structs.replace(m, expires_at=time.time() - 1)
    command(valkey.host, valkey.port, "SET", key, msgspec.json.encode(stale))
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cd = Client(ed, gd)
        assert await decode(cd, "req-5", toks, params) == 0
        assert remote(ed)["pd_manifest_expired"] == 1
        await wait_for_server(lambda: not exists(valkey, key))
        ready = server_keys(valkey.host, valkey.port, "*:ready/*")
        assert ready and sum(ttl(valkey, k) > 1800 for k in ready) == BLOCKS  # req-5's
    async with embedded_engine(remote_url=valkey.url,
                               model_id="another-model") as (ef, gf, _, _):
        assert await decode(Client(ef, gf), "req-6", other, params2) == 0
        assert remote(ef)["pd_manifest_refused"] == 1


async def test_a_prefill_killed_mid_publish_leaves_no_manifest_and_decode_recomputes(
        valkey: ValkeyServer) -> None:
    """P (its own process) finishes the request and is SIGKILLed before its store ran:
    no manifest is ever written; D waits for it up to the hand-off's wait (5 s) and
    recomputes."""
    proc = subprocess.run([sys.executable, str(HERE / "pd_prefill_proc.py"), valkey.url,
                           "36", "kill"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    params = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not exists(valkey, params[MANIFEST_PARAM])
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        t0 = time.monotonic()
        assert await decode(Client(ed, gd), "req-k", prompt(36), params) == 0
        assert 4.5 < time.monotonic() - t0 < 10
        assert remote(ed)["pd_manifest_missing"] == 1


async def test_a_decoder_holding_a_shared_prefix_still_fetches_the_rest(
        valkey: ValkeyServer) -> None:
    """Hazard: a hand-off short-cut by a local CPU hit. req-1 and req-2 share their first
    4 blocks (a system prompt); P prefills both and publishes both manifests. D loads
    req-1 whole from Valkey (8 blocks) and finishes it: its CPU tier now holds the
    shared 4. req-2's CPU hit is those 4 blocks, short of its 8-block extent, so D asks
    Valkey for blocks 4..7 only (hit_blocks 8 -> 12), answers the whole prompt and loads
    it bit-exact (the shared blocks as P stored them, from req-1's rows); both manifests
    are collected. Before, the CPU hit ended the lookup at
    16 tokens: D recomputed tokens 16..31 the server held for it, and req-2's manifest
    was never read."""
    head = prompt(40)[:4 * BS]
    t1, t2 = head + prompt(41)[4 * BS:], head + prompt(42)[4 * BS:]
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        p1, table1 = await prefill(cp, "req-1", t1)
        p2, table2 = await prefill(cp, "req-2", t2)
        await settle_published(cp)
        await wait_for_server(lambda: exists(valkey, p2[MANIFEST_PARAM])
                              and exists(valkey, p1[MANIFEST_PARAM]), 20.0)
        # P stored (and put) the shared blocks once, from req-1's GPU rows
        src = [digest(k[table1[:4] + table2[4:BLOCKS]]) for k in kp]
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        await serve_whole(cd, "req-1", t1, p1)
        assert remote(ed)["hit_blocks"] == BLOCKS
        assert await decode(cd, "req-2", t2, p2) == BLOCKS * BS
        assert remote(ed)["hit_blocks"] == BLOCKS + 4
        dst = load(cd, "req-2", t2, BLOCKS * BS)
        assert (await cd.loaded("req-2")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in kd] == src
        assert (remote(ed)["pd_consumed"], remote(ed)["pd_collected"]) == (2, 2)
        await wait_for_server(lambda: not exists(valkey, p2[MANIFEST_PARAM]))


async def test_a_sibling_after_the_collection_loads_from_memory_of_the_manifest(
        valkey: ValkeyServer) -> None:
    """Hazard: a sibling finds its manifest collected (vLLM's parallel sampling: the
    children of one request share its hand-off, under vLLM's ids ``<index>_<parent>``:
    both are the hand-off's owner). D loads child 0_req-1 whole (8 blocks) and the
    manifest is collected -- deleted from Valkey. D's CPU index is then dropped (a
    reset), so child 1_req-1 needs the server: D judges the manifest from its memory of
    those it collected (pd_manifest_reused 1), fetches the 8 blocks again (ordinary TTL
    now, still there) and loads them bit-exact. Before, 1_req-1 asked Valkey for the
    deleted manifest for 5 s, then recomputed."""
    toks = prompt(50)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await handed_off(valkey, cp, "req-1", toks)
        src = [digest(k[table[:BLOCKS]]) for k in kp]
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        await serve_whole(cd, "0_req-1", toks, params)
        await wait_for_server(lambda: not exists(valkey, params[MANIFEST_PARAM]))
        assert await ed.reset(timeout=10.0)
        for k in kd:
            k.zero_()
        t0 = time.monotonic()
        assert await decode(cd, "1_req-1", toks, params) == BLOCKS * BS
        assert time.monotonic() - t0 < 4.0
        dst = load(cd, "1_req-1", toks, BLOCKS * BS)
        assert (await cd.loaded("1_req-1")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in kd] == src
        rd = remote(ed)
        assert (rd["pd_manifest_reused"], rd["pd_consumed"], rd["pd_collected"],
                rd["pd_manifest_missing"], rd["hit_blocks"]) == (1, 2, 1, 0, 2 * BLOCKS), rd


async def test_a_decode_request_that_recomputes_its_prompt_still_collects_its_handoff(
        valkey: ValkeyServer) -> None:
    """Hazard: a hand-off whose decode request reads no cache. vLLM sets
    ``skip_reading_prefix_cache`` on a request that asks for prompt logprobs (every
    prompt token must be computed) and answers 0 for it whatever the connector says;
    the connector then calls ``lookup_skipped``. P hands off req-s (8 blocks, hold TTL
    <= 1800 s). D gets req-s with P's params and prompt logprobs: ``lookup_skipped``
    pins nothing and waits for nothing (returns at once, no job), D computes all 32
    tokens, and req-s ends before or after its manifest arrives: either way the
    manifest, checked against req-s's own prefix, is collected -- deleted, its blocks
    demoted to the ordinary TTL (> 1800 s) -- with no block fetched (hit_blocks 0).
    Before, the connector returned 0 without a word to the engine: the manifest was
    never read, and it and its 8 blocks stayed on the server until the hold TTL."""
    toks = prompt(60)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        params, _ = await handed_off(valkey, cp, "req-s", toks)
    key = params[MANIFEST_PARAM]
    manifest = stored_manifest(valkey, key)
    fp, world = manifest.fingerprint, manifest.world
    ready = [f"kvshm:v1:{fp}:ready/{world}:{h}" for h in manifest.hashes]
    assert all(0 < ttl(valkey, k) <= 1800 for k in ready)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cd = Client(ed, gd)
        hashes = chain_hashes(toks, BS)
        view = RequestView("req-s", hashes, len(toks), {"do_remote_prefill": True, **params})
        cd.eng.lookup_skipped(view)
        assert not cd.eng.has_pending_work()                       # nothing fetched
        table, _ = cd.compute("req-s", toks)                        # all 32 tokens
        cd.finish("req-s", table, len(toks))
        deadline = time.monotonic() + 10.0
        while exists(valkey, key):                                  # an orphan read's
            assert time.monotonic() < deadline, remote(ed)          # answer lands in
            cd.step()                                               # a later step
            await asyncio.sleep(0.01)
        await cd.settle()
        rd = remote(ed)
        assert (rd["pd_collected"], rd["hit_blocks"], rd["pd_manifest_refused"],
                rd["pd_not_owner"], rd["pd_orphans_dropped"]) == (1, 0, 0, 0, 0), rd
        assert ed.statistics().pins_held == 0
    assert all(t > 1800 for t in [ttl(valkey, k) for k in ready])  # demoted
