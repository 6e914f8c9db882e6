"""Helpers for the remote tier's engine tests: a writer engine that stores and publishes
a prompt, a reader that asks until the remote answers, and the raw server commands a
test uses to corrupt or evict what a writer published.

Run as a script (``python tests/remote_engine_rig.py URL SEED``), it is the
writer of the two-process test: an engine with two embedded ranks (tp=2) stores the
prompt of ``SEED``, waits until every block's readiness key is published, prints one
JSON line (the SHA-256 of each rank's stored blocks, the remote counters) and exits.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # as a script: the tests' helpers and the repository
    sys.path[:0] = [str(Path(__file__).resolve().parent),
                    str(Path(__file__).resolve().parents[1])]

import hashlib

import torch
from engine_rig import BS, Client, embedded_engine, tokens

from kvshm.engine import Engine
from kvshm.hashing import chain_hashes, chain_tail
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyServer
from kvshm.types import RequestView, ScheduledRequest

#: Full blocks of every test prompt (the prompt has one more token: the hit is all 8).
BLOCKS = 8
MODEL = "remote-test"


def prompt(seed: int) -> list[int]:
    return tokens(BLOCKS * BS + 1, seed)


async def wait_for(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def store_and_publish(c: Client, req_id: str, toks: list[int]) -> list[int]:
    """Compute and finish ``req_id``; wait until every rank acked its blocks' PUT and
    the readiness keys are on the server."""
    table, _ = c.compute(req_id, toks)
    c.finish(req_id, table, len(toks))
    await c.settle()  # store, then the PUT job it queued: both acked by every rank
    r = remote(c.eng)
    assert r["published_blocks"] >= BLOCKS, r
    await wait_for(lambda: remote(c.eng)["index_published"] >= r["published_blocks"],
                   "readiness keys on the server")
    return table


async def ask(c: Client, req_id: str, toks: list[int], timeout: float = 20.0) -> int:
    """Look ``toks`` up until the engine answers (stepping meanwhile, as a scheduler
    does); the answer in tokens."""
    hashes = chain_hashes(toks, BS)
    deadline = time.monotonic() + timeout
    while True:
        hit = c.eng.lookup(RequestView(req_id, hashes, len(toks)), 0)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"lookup of {req_id} never answered"
        c.step()
        await asyncio.sleep(0.005)


def load(c: Client, req_id: str, toks: list[int], hit: int) -> list[int]:
    """Phase B and the step that posts the load of ``hit`` tokens; the GPU table."""
    hashes = chain_hashes(toks, BS)
    table = c.gpu.allocate(-(-len(toks) // BS))
    c.eng.allocated(req_id, [table], hit)
    c.step(ScheduledRequest(req_id, hashes, len(toks), (tuple(table),),
                            new_or_resumed=True, num_confirmed_tokens=0))
    return table


def remote(eng: Engine) -> dict[str, Any]:
    return eng.statistics().remote


def server_keys(host: str, port: int, pattern: str = "kvshm:*") -> list[bytes]:
    """Every key matching ``pattern`` (KEYS: fine on a test server)."""
    reply = parse_reply(command(host, port, "KEYS", pattern))
    assert isinstance(reply, list)
    return [k for k in reply if isinstance(k, bytes)]


PREFILL = {"do_remote_decode": True}


async def prefill(c: Client, rid: str, toks: list[int], *, tail: bool = False
                  ) -> tuple[dict[str, Any], list[int]]:
    """A P/D prefill engine computes ``toks`` for a ``do_remote_decode`` request and
    finishes it (``tail``: with its partial last block's key): its transfer params
    (handed out once) and GPU table."""
    hashes = chain_hashes(toks, BS)
    table = c.gpu.allocate(len(toks) // BS + 1)
    c.eng.allocated(rid, [table], 0)
    c.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True,
                            num_confirmed_tokens=len(toks), kv_transfer_params=PREFILL))
    c.eng.finished(rid, len(toks), [table],
                   tail_hash=chain_tail(toks, BS, hashes) if tail else None)
    params = c.eng.transfer_params(rid)
    assert params is not None and c.eng.transfer_params(rid) is None  # once
    return params, table


async def settle_published(c: Client) -> None:
    """Step until the prefill engine's store, PUT and manifest are done."""
    await c.settle()
    await wait_for(lambda: remote(c.eng)["pd_manifests_written"] > 0
                   and remote(c.eng)["index_values_set"]
                   >= remote(c.eng)["pd_manifests_written"], "the manifest written")


def digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes."""
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


# -- P/D hand-off helpers (test_pd_handoff, test_pd_ownership) --------------------

async def decode(c: Client, rid: str, toks: list[int], params: dict[str, Any],
                 timeout: float = 20.0, *, tail: bool = False) -> int:
    """D looks the request up as a P/D proxy sends it (``tail``: with its partial last
    block's key), until it answers."""
    hashes = chain_hashes(toks, BS)
    view = RequestView(rid, hashes, len(toks), {"do_remote_prefill": True, **params},
                       chain_tail(toks, BS, hashes) if tail else None)
    deadline = time.monotonic() + timeout
    while True:
        hit = c.eng.lookup(view, 0)
        if hit is not None:
            return hit
        assert time.monotonic() < deadline, f"{rid} never answered: {remote(c.eng)}"
        c.step()
        await asyncio.sleep(0.005)


async def serve_whole(c: Client, rid: str, toks: list[int], params: dict[str, Any]
                      ) -> None:
    """D hits ``rid``'s every full block from the server, loads them, and finishes it."""
    assert await decode(c, rid, toks, params) == BLOCKS * BS
    table = load(c, rid, toks, BLOCKS * BS)
    assert (await c.loaded(rid)).ok
    c.finish(rid, table, len(toks))
    await c.settle()


def exists(server: ValkeyServer, key: str) -> bool:
    return command(server.host, server.port, "EXISTS", key).strip() == b":1"


def ttl(server: ValkeyServer, key: str | bytes) -> int:
    """The key's TTL in seconds (-1: none, -2: no such key)."""
    return int(command(server.host, server.port, "TTL", key).strip(b":\r\n"))


async def wait_for_server(cond: Any, timeout: float = 5.0) -> None:
    """The index writes from its own thread: wait until the server shows ``cond``."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "the server never showed it"
        await asyncio.sleep(0.01)


async def _write(url: str, seed: int) -> None:
    async with embedded_engine(remote_url=url, model_id=MODEL) as (eng, gpu, ks, _):
        table = await store_and_publish(Client(eng, gpu), "w", prompt(seed))
        print(json.dumps({"sha256": [digest(k[table[:BLOCKS]]) for k in ks],
                          "remote": remote(eng)}), flush=True)


if __name__ == "__main__":
    asyncio.run(_write(sys.argv[1], int(sys.argv[2])))
