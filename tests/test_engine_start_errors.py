"""Start errors a user can act on: device caches that cannot serve the GPU pool are
refused before any worker is spawned, and a start that times out names the ranks that
never said Hello, the command to run and the refusals the engine saw (and logged)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest
import torch
from engine_rig import GPU_BLOCKS, ROW, config, shards
from worker_rig import live_children, unique_name

from kvshm.engine import ATTACH, SPAWN, Engine, EngineState, StartTimeout
from kvshm.errors import ConfigError, KvshmError
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor


async def test_device_caches_smaller_than_the_gpu_pool_are_refused_before_spawning() -> None:
    """Rank 1's cache has 16 rows for a 32-block GPU pool: every job touching rows
    16..31 would fail on it. Refused at launch, naming rank, region and both counts,
    and no worker process was started."""
    small = shared_tensor((GPU_BLOCKS // 2, ROW), torch.uint8)
    before = live_children()
    with pytest.raises(ConfigError, match=r"rank 1 region 0: device cache has 16 blocks, "
                                          r"but the GPU pool has 32"):
        await Engine.launch(config(), workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[shards(1)[0]], [small]])
    assert live_children() == before


async def test_ranks_with_different_block_counts_are_refused() -> None:
    """Both caches cover the pool, but rank 1 has 40 rows and rank 0 32: refused."""
    big = shared_tensor((GPU_BLOCKS + 8, ROW), torch.uint8)
    with pytest.raises(ConfigError, match=r"rank 1 region 0: 40 device blocks, rank 0 has 32"):
        await Engine.launch(config(), workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[shards(1)[0]], [big]])


async def test_an_error_building_the_manager_fails_the_start_at_once_with_its_cause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hazard: an exception raised while the engine finished its start (every rank
    ready: channels, the CPU pool, the manager) escaped from an event-loop callback,
    where asyncio only logged it; the launch then waited its whole connect timeout and
    raised StartTimeout blaming ranks that had all connected. Now the start fails at
    once with that exception, and no worker is left behind."""
    import kvshm.engine.runtime as runtime

    def broken(*args: object, **kw: object) -> None:
        raise RuntimeError("the manager cannot be built")
    monkeypatch.setattr(runtime, "OffloadManager", broken)
    before = live_children()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="the manager cannot be built"):
        await Engine.launch(config(connect_timeout_s=60.0), workers=SPAWN,
                            gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[s] for s in shards(2)])
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 10
    while live_children() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live_children() - before == set()


async def test_start_timeout_names_the_ranks_that_never_said_hello() -> None:
    """tp=64, nobody attaches: the StartTimeout (a TimeoutError) says 0 of 64 connected,
    lists the missing ranks compactly and says what to run."""
    with pytest.raises(StartTimeout) as info:
        await Engine.launch(config(tp=64, connect_timeout_s=0.3), workers=ATTACH,
                            gpu_blocks=BlockPool(GPU_BLOCKS))
    msg = str(info.value)
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, KvshmError)
    assert "0 of 64 ranks connected (said Hello) within 0.3s" in msg
    assert "missing rank(s) 0-63" in msg
    assert "run `kvshm-workers --name " in msg and " --tp 64`" in msg
    assert "Refused" not in msg
    assert info.value.missing == tuple(range(64)) and info.value.connected == ()


def _worker(name: str, *argv: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "workers", "--name", name, *argv],
                            text=True, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_a_tp1_worker_against_a_tp2_engine_is_refused_with_the_reason_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """A standalone ``--tp 1`` worker against a tp=2 engine: the engine logs the refusal
    with its reason (WARNING), the start times out with an error that carries it and the
    right command, and the worker exits 1 pointing at the engine's log. (SyncClient's
    wait_ready, retried in short slices until the refusal is in: the worker's start time
    does not matter; Engine.launch builds the same error.)"""
    from kvshm.engine import SyncClient

    cfg = config(tp=2)
    caplog.set_level(logging.INFO, logger="kvshm.engine")
    proc = _worker(cfg.name, "--tp", "1", "--connect-timeout", "60")
    try:
        with SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
            deadline = time.monotonic() + 60
            while True:
                with pytest.raises(StartTimeout) as info:
                    client.wait_ready(0.2)
                if info.value.refusals or time.monotonic() > deadline:
                    break
        assert proc.wait(timeout=30) == 1
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    msg = str(info.value)
    assert "0 of 2 ranks connected" in msg and "missing rank(s) 0-1" in msg
    assert f"run `kvshm-workers --name {cfg.name} --tp 2`" in msg
    assert "Refused meanwhile (1 kept): refused rank 0 (pid " in msg
    assert "world size 1 != 2" in msg
    assert len(info.value.refusals) == 1
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("refused rank 0" in m and "world size 1 != 2" in m for m in logged), logged
    assert "kvshm-workers[rank 0]: error: the engine refused this rank" in err
    assert "the engine's log names the reason" in err


def test_sync_client_wait_ready_times_out_with_the_same_error() -> None:
    """SyncClient.wait_ready: the same typed error as Engine.launch's."""
    from kvshm.engine import SyncClient

    cfg = config(tp=3, connect_timeout_s=0.2)
    with SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS)) as client:
        with pytest.raises(StartTimeout, match=r"0 of 3 ranks connected \(said Hello\) "
                                               r"within 0.2s; missing rank\(s\) 0-2"):
            client.wait_ready()
        assert client.state is EngineState.STARTING


def test_calls_before_ready_refuse_a_bad_request_id_and_change_nothing() -> None:
    """Before READY the engine remembers listed request ids in a set (to keep them away
    from the manager later): an unhashable id was a bare TypeError from that set, after
    part of the listing had been recorded. Now InvalidRequest, before anything."""
    from kvshm.engine import SyncClient
    from kvshm.errors import InvalidRequest
    from kvshm.types import RequestView, ScheduledRequest, StepInput

    client = SyncClient(config(), gpu_blocks=BlockPool(GPU_BLOCKS))
    try:
        good = ScheduledRequest("ok", [], 0, ((),), new_or_resumed=True)
        bad = ScheduledRequest(["not", "hashable"], [], 0, ((),))  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="build_step: input: req_id"):
            client.step(StepInput(1, [good, bad]))
        assert client._core._admission.pre_ready == set()
        with pytest.raises(InvalidRequest, match="lookup"):
            client.lookup(RequestView(None, [], 0), 0)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="lookup: input: req: a RequestView"):
            client.lookup(None, 0)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="finished"):
            client.finished(["x"], 0, [[]])  # type: ignore[arg-type]
        client.step(StepInput(2, [good]))
        assert client._core._admission.pre_ready == {"ok"}
    finally:
        client.close()


async def test_a_rank_flooding_stats_requests_does_not_hold_the_start_past_its_timeout(
        ) -> None:
    """Attack (a process of this uid): connect to an ATTACH engine, say Hello as rank 0
    of 2, then send StatsRequests without reading the answers. The rendezvous read a
    connection until it was empty, answering each inline: while the flood lasted the
    loop ran nothing else, and the start's 2 s timeout fired only when the flood
    stopped (here after 10 s). Now a read takes at most 64 messages per service: the
    start ends with StartTimeout at its timeout, the flood still going."""
    name = unique_name()
    rogue = subprocess.Popen([sys.executable, "-c", _FLOOD, name], stdin=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        with pytest.raises(StartTimeout):
            await Engine.launch(config(name=name, connect_timeout_s=2.0), workers=ATTACH,
                                gpu_blocks=BlockPool(GPU_BLOCKS))
        elapsed = time.monotonic() - t0
    finally:
        rogue.kill()
        rogue.wait()
    assert elapsed < 6.0, f"the start ended {elapsed:.1f} s in, after the flood"


_FLOOD = """
import os, sys, time
from kvshm.errors import PeerDied
from kvshm.ipc.fdpass import connect_nowait, encode_control
from kvshm.ipc.protocol import PROTOCOL_VERSION, Hello, StatsRequest
deadline = time.monotonic() + 10
while True:
    try:
        sock = connect_nowait(sys.argv[1])
        break
    except (OSError, PeerDied):
        if time.monotonic() > deadline:
            sys.exit(0)
        time.sleep(0.01)
sock.setblocking(True)
sock.settimeout(0.2)
sock.send(encode_control(Hello(PROTOCOL_VERSION, 0, 2, os.getpid(), None, "cpu")))
req = encode_control(StatsRequest())
while time.monotonic() < deadline:
    try:
        sock.send(req)
    except TimeoutError:
        continue
    except OSError:
        break
"""
