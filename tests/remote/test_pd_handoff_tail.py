"""The P/D hand-off's partial last block against a real Valkey server and real engines
(two embedded ranks each; BS = 4, 8 full blocks per prompt): the hazards of
``tests/unit/offload/test_handoff_tail_hazards.py`` where a server changes the picture --
a malformed hash beside a good neighbour, manifests readable by the previous release, a
tail hand-off after the decoder's own prefix hit.

Rule: D either loads exactly P's KV (same SHA-256 per rank and block) or recomputes;
never a hang, a bad request never takes its neighbours down.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from engine_rig import BS, Client, embedded_engine, tokens
from remote_engine_rig import BLOCKS, MODEL, digest, prefill, remote, settle_published

from kvshm.errors import InvalidRequest
from kvshm.hashing import chain_hashes, chain_tail
from kvshm.offload.pd.manifest import MANIFEST_PARAM, Manifest
from kvshm.remote.resp import command
from kvshm.remote.server import ValkeyServer
from kvshm.types import RequestView, ScheduledRequest

pytestmark = pytest.mark.asyncio


class _ManifestV1(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The manifest as the release before the tail read it."""

    version: int
    fingerprint: str
    world: int
    block_size: int
    num_tokens: int
    hashes: list[str]
    expires_at: float


def server_manifest(server: ValkeyServer, key: str) -> bytes:
    return command(server.host, server.port, "GET", key).split(b"\r\n", 1)[1][:-2]


async def ask(c: Client, view: RequestView, local: int = 0, timeout: float = 20.0) -> int:
    """D's lookups of ``view`` (stepping meanwhile) until it answers."""
    deadline = time.monotonic() + timeout
    while True:
        hit = c.eng.lookup(view, local)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"{view.req_id} never answered: {remote(c.eng)}"
        c.step()
        await asyncio.sleep(0.005)


def load_from(c: Client, view: RequestView, local: int, hit: int) -> list[int]:
    """Phase B of ``hit`` tokens after a ``local``-token GPU hit, and the step that posts
    the load; the request's whole GPU table."""
    table = c.gpu.allocate(-(-view.num_tokens // BS))
    c.eng.allocated(view.req_id, [table], hit)
    c.step(ScheduledRequest(view.req_id, view.block_hashes, view.num_tokens,
                            (tuple(table),), new_or_resumed=True,
                            num_confirmed_tokens=local))
    return table


async def test_a_malformed_handoff_hash_is_refused_and_the_neighbour_loads_bit_exact(
        valkey: ValkeyServer) -> None:
    """P hands off a 32-token prompt (8 full blocks, no tail). D gets two lookups for
    that manifest: "bad", whose last hash is not a hash (the old lookup check stopped
    one block short of a hand-off's extent, and the manifest check read it), then the
    real request. Before: "bad" said "ask again", and the poll that read the manifest
    raised TypeError out of a neighbour's lookup or D's step, the neighbour's manifest
    answer lost. Now "bad" is refused (InvalidRequest) and the request hits 31 tokens,
    its 8 blocks holding P's bytes."""
    toks = tokens(BLOCKS * BS, 71)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await prefill(cp, "req-a", toks)
        await settle_published(cp)
        src = [digest(k[table[:BLOCKS]]) for k in kp]
    hashes = chain_hashes(toks, BS)
    kv = {"do_remote_prefill": True, **params}
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        bad: list[Any] = [*hashes[:-1], 7]
        with pytest.raises(InvalidRequest, match=r"block_hashes\[7\]"):
            ed.lookup(RequestView("bad", bad, len(toks), kv), 0)
        view = RequestView("req-a", hashes, len(toks), kv)
        assert await ask(cd, view) == len(toks) - 1
        dst = load_from(cd, view, 0, len(toks) - 1)
        assert (await cd.loaded("req-a")).ok
        assert [digest(k[dst[:BLOCKS]]) for k in kd] == src
        assert ed.statistics().state == "ready"


async def test_manifests_without_a_tail_stay_readable_by_the_previous_release(
        valkey: ValkeyServer) -> None:
    """On the server: the manifest of a hand-off without a tail (32 tokens) decodes with
    the previous release's struct (a decoder not yet upgraded trusts it); one with a
    tail (35 tokens: 3-token tail) says ``tail == 1`` and only today's struct reads it."""
    plain, tailed = tokens(BLOCKS * BS, 72), tokens(BLOCKS * BS + 3, 73)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, _, _):
        cp = Client(ep, gp)
        params, _ = await prefill(cp, "req-p", plain)
        params2, _ = await prefill(cp, "req-t", tailed, tail=True)
        await settle_published(cp)
        await settle_published(cp)
    old = msgspec.json.decode(server_manifest(valkey, params[MANIFEST_PARAM]),
                              type=_ManifestV1)
    assert (len(old.hashes), old.num_tokens) == (BLOCKS, BLOCKS * BS)
    raw = server_manifest(valkey, params2[MANIFEST_PARAM])
    assert msgspec.json.decode(raw, type=Manifest).tail == 1
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=_ManifestV1)


@pytest.mark.parametrize(("extra", "local"), [(3, 8), (2, 0), (3, 32)])
async def test_a_tail_handoff_after_the_decoders_own_prefix_hit_loads_the_rest_bit_exact(
        valkey: ValkeyServer, extra: int, local: int) -> None:
    """Sound: P hands off 8 full blocks and an ``extra``-token tail; D's engine already
    holds the first ``local`` tokens itself (its GPU prefix hit). D's hit is every
    token after those but the last (``num_tokens - 1 - local``), loaded into the blocks
    after its own, the tail's included, each holding P's bytes; with the whole prefix
    local only the tail comes over."""
    toks = tokens(BLOCKS * BS + extra, 74 + extra + local)
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ep, gp, kp, _):
        cp = Client(ep, gp)
        params, table = await prefill(cp, "req-l", toks, tail=True)
        await settle_published(cp)
        src = [[digest(k[b:b + 1]) for b in table[:BLOCKS + 1]] for k in kp]
    hashes = chain_hashes(toks, BS)
    view = RequestView("req-l", hashes, len(toks), {"do_remote_prefill": True, **params},
                       chain_tail(toks, BS, hashes))
    async with embedded_engine(remote_url=valkey.url, model_id=MODEL) as (ed, gd, kd, _):
        for k in kd:
            k.zero_()
        cd = Client(ed, gd)
        hit = await ask(cd, view, local)
        assert hit == len(toks) - 1 - local
        dst = load_from(cd, view, local, hit)
        assert (await cd.loaded("req-l")).ok
        first = local // BS
        got = [[digest(k[b:b + 1]) for b in dst[first:BLOCKS + 1]] for k in kd]
        assert got == [s[first:] for s in src]
        assert remote(ed)["hit_blocks"] == BLOCKS + 1 - first
