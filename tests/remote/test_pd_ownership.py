"""A P/D hand-off belongs to its request: black-box attacks through the asyncio API on
real engines (two embedded ranks each) and a real Valkey server.

A manifest's name names the prefill request it belongs to (its *owner*,
:func:`kvshm.offload.pd.manifest.handoff_owner`). Only a decode request of that owner
collects it -- deletes the manifest and gives its blocks the ordinary TTL; any other
request whose prefix matches may read the blocks (they are ordinary cache) but never
deletes or re-times anything. Names are unique per request id, and a collection
re-times only the entries it checked against the request's own blocks.

Each test narrates one attack of issue 31 and failed before its fix.
"""

from __future__ import annotations

import hashlib
import time

import msgspec
import pytest
from engine_rig import BS, Client, embedded_engine
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
    server_keys,
    settle_published,
    ttl,
    wait_for_server,
)

from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest
from kvshm.remote.resp import command
from kvshm.remote.server import ValkeyServer

pytestmark = pytest.mark.asyncio


def _get(server: ValkeyServer, key: str) -> bytes:
    return command(server.host, server.port, "GET", key).split(b"\r\n", 1)[1][:-2]


def _held(server: ValkeyServer, manifest: Manifest) -> list[int]:
    """The TTL of each block's readiness key that ``manifest`` names."""
    fp, world = manifest.fingerprint, manifest.world
    return [ttl(server, f"kvshm:v1:{fp}:ready/{world}:{h}") for h in manifest.hashes]


@pytest.mark.parametrize("foreign", ["extends", "same_prompt"])
async def test_a_foreign_request_reads_a_handoff_but_never_collects_it(
        valkey: ValkeyServer, foreign: str) -> None:
    """P hands off X (``req-x``, 8 blocks). A foreign request ``req-f`` on decoder D1 is
    sent with X's ``kvshm_manifest``: ``extends``, a prompt that extends X's by two
    blocks; ``same_prompt``, X's exact prompt under another request id. Its hashes start
    with X's, so D1 trusts the manifest and loads X's 8 blocks bit-exact -- they are
    ordinary cache -- but ``req-f`` is not X's owner: the manifest stays on the server
    and X's blocks keep their hold TTL (<= 1800 s; pd_not_owner 1, pd_collected 0).
    X's real consumer on a second decoder D2 then reads the manifest at once, loads the
    same bytes and collects it (deleted; the blocks get the ordinary TTL, > 1800 s).
    Before: D1 deleted X's manifest, and D2 waited 5 s and recomputed all 32 tokens
    although the blocks were still on the server."""
    toks = prompt(50)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await prefill(cp, "req-x", toks)
        await settle_published(cp)
        src = [digest(k[table[:BLOCKS]]) for k in kp]
    key = params[MANIFEST_PARAM]
    manifest = msgspec.json.decode(_get(valkey, key), type=Manifest)
    f_toks = toks[:-1] + prompt(51)[:2 * BS + 1] if foreign == "extends" else toks
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (e1, g1, k1, _):
        c1 = Client(e1, g1)
        assert await decode(c1, "req-f", f_toks, params) == BLOCKS * BS
        dst = load(c1, "req-f", f_toks, BLOCKS * BS)
        assert (await c1.loaded("req-f")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in k1] == src          # the right bytes
        c1.finish("req-f", dst, len(f_toks))
        await c1.settle()
        r1 = remote(e1)
    assert exists(valkey, key)                                        # still X's
    assert all(0 < t <= 1800 for t in _held(valkey, manifest))        # not re-timed
    assert (r1["pd_consumed"], r1["pd_collected"], r1["pd_not_owner"]) == (1, 0, 1)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (e2, g2, k2, _):
        for k in k2:
            k.zero_()
        c2 = Client(e2, g2)
        t0 = time.monotonic()
        assert await decode(c2, "req-x", toks, params) == BLOCKS * BS
        assert time.monotonic() - t0 < 4.0                            # no 5 s wait
        dst = load(c2, "req-x", toks, BLOCKS * BS)
        assert (await c2.loaded("req-x")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in k2] == src
        r2 = remote(e2)
        assert (r2["pd_manifest_missing"], r2["pd_collected"], r2["pd_not_owner"]) == (0, 1, 0)
        await wait_for_server(lambda: not exists(valkey, key))
    assert all(t > 1800 for t in _held(valkey, manifest))             # demoted by X


async def test_an_id_equal_to_another_ids_hash_names_its_own_manifest(
        valkey: ValkeyServer) -> None:
    """Request ids outside ``[A-Za-z0-9._=-]`` are written hashed (SHA-256 hex) in a
    manifest's name. P hands off U under the unsafe id ``"req u"`` and S, another
    prompt, under the safe id equal to ``sha256("req u").hexdigest()``: the two names
    differ (the hashed one is marked), so both manifests stay, and a decoder loads each
    request's own bytes under its own id. Before, both mapped to one key: S's manifest
    replaced U's, and U's decoder found a manifest of another prompt, refused it and
    recomputed."""
    unsafe = "req u"
    safe = hashlib.sha256(unsafe.encode()).hexdigest()
    tu, ts = prompt(52), prompt(53)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        pu, table_u = await prefill(cp, unsafe, tu)
        ps, table_s = await prefill(cp, safe, ts)
        await settle_published(cp)
        await wait_for_server(lambda: remote(ep)["index_values_set"] >= 2)
        src_u = [digest(k[table_u[:BLOCKS]]) for k in kp]
        src_s = [digest(k[table_s[:BLOCKS]]) for k in kp]
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        cd = Client(ed, gd)
        for rid, toks, params, src in ((unsafe, tu, pu, src_u), (safe, ts, ps, src_s)):
            assert await decode(cd, rid, toks, params) == BLOCKS * BS
            dst = load(cd, rid, toks, BLOCKS * BS)
            assert (await cd.loaded(rid)).ok
            assert [digest(k[dst[:BLOCKS]]) for k in kd] == src
            cd.finish(rid, dst, len(toks))
            await cd.settle()
        rd = remote(ed)
        assert (rd["pd_manifest_refused"], rd["pd_collected"]) == (0, 2)
    assert pu[MANIFEST_PARAM] != ps[MANIFEST_PARAM]


async def test_a_forged_tail_cannot_retime_another_handoffs_blocks(
        valkey: ValkeyServer) -> None:
    """Needs write access to the server. P hands off Y (``req-y``, 8 blocks, hold TTL
    <= 1800 s) and the attacker's own A (``req-a``). The attacker rewrites A's manifest:
    Y's 8 hashes appended as ``tail`` entries (tail = 8). A's decoder trusts it (its full
    blocks are A's own prefix), loads A and, as A's owner, collects it: A's blocks get
    the ordinary TTL and the manifest goes, but the 8 tail entries are not A's own
    blocks (pd_entries_unchecked 8): Y's blocks keep their hold TTL. Before, collecting
    the forged manifest re-timed Y's blocks too."""
    ty, ta = prompt(54), prompt(55)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        py, _ = await prefill(cp, "req-y", ty)
        pa, _ = await prefill(cp, "req-a", ta)
        await settle_published(cp)
        await wait_for_server(lambda: remote(ep)["index_values_set"] >= 2)
    my = msgspec.json.decode(_get(valkey, py[MANIFEST_PARAM]), type=Manifest)
    ma = msgspec.json.decode(_get(valkey, pa[MANIFEST_PARAM]), type=Manifest)
    forged = msgspec.structs.replace(ma, hashes=ma.hashes + my.hashes, tail=len(my.hashes))
    command(valkey.host, valkey.port, "SET", pa[MANIFEST_PARAM], msgspec.json.encode(forged))
    assert all(0 < t <= 1800 for t in _held(valkey, my))
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, _, _):
        cd = Client(ed, gd)
        assert await decode(cd, "req-a", ta, pa) == BLOCKS * BS
        load(cd, "req-a", ta, BLOCKS * BS)
        assert (await cd.loaded("req-a")).ok
        rd = remote(ed)
        await wait_for_server(lambda: not exists(valkey, pa[MANIFEST_PARAM]))
        await wait_for_server(lambda: all(t > 1800 for t in _held(valkey, ma)))
    assert all(0 < t <= 1800 for t in _held(valkey, my))               # Y's untouched
    assert (rd["pd_collected"], rd["pd_entries_unchecked"]) == (1, BLOCKS)
    assert exists(valkey, py[MANIFEST_PARAM])
    assert len(server_keys(valkey.host, valkey.port, "kvshm:v1:pd:*")) == 1
