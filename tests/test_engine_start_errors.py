"""Start errors a user can act on: device caches that cannot serve the GPU pool are
refused before any worker is spawned, and a start that times out names the ranks that
never said Hello."""

from __future__ import annotations

import os

import pytest
import torch
from engine_rig import GPU_BLOCKS, ROW, config, shards

from kvshm.engine import ATTACH, SPAWN, Engine
from kvshm.errors import ConfigError
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor


def _children() -> set[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as f:
        return {int(p) for p in f.read().split()}


async def test_device_caches_smaller_than_the_gpu_pool_are_refused_before_spawning() -> None:
    """Rank 1's cache has 16 rows for a 32-block GPU pool: every job touching rows
    16..31 would fail on it. Refused at launch, naming rank, region and both counts,
    and no worker process was started."""
    small = shared_tensor((GPU_BLOCKS // 2, ROW), torch.uint8)
    before = _children()
    with pytest.raises(ConfigError, match=r"rank 1 region 0: device cache has 16 blocks, "
                                          r"but the GPU pool has 32"):
        await Engine.launch(config(), workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[shards(1)[0]], [small]])
    assert _children() == before


async def test_ranks_with_different_block_counts_are_refused() -> None:
    """Both caches cover the pool, but rank 1 has 40 rows and rank 0 32: refused."""
    big = shared_tensor((GPU_BLOCKS + 8, ROW), torch.uint8)
    with pytest.raises(ConfigError, match=r"rank 1 region 0: 40 device blocks, rank 0 has 32"):
        await Engine.launch(config(), workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=[[shards(1)[0]], [big]])


async def test_start_timeout_names_the_ranks_that_never_said_hello() -> None:
    """tp=64, nobody attaches: the TimeoutError says 0 of 64 said Hello, lists the
    missing ranks compactly and says what to run."""
    with pytest.raises(TimeoutError) as info:
        await Engine.launch(config(tp=64, connect_timeout_s=0.3), workers=ATTACH,
                            gpu_blocks=BlockPool(GPU_BLOCKS))
    msg = str(info.value)
    assert "0 of 64 ranks said Hello within 0.3s" in msg
    assert "never heard from rank(s) 0-63" in msg
    assert "kvshm-workers --name " in msg and "--world-size 64" in msg


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
        with pytest.raises(InvalidRequest, match="finished"):
            client.finished(["x"], 0, [[]])  # type: ignore[arg-type]
        client.step(StepInput(2, [good]))
        assert client._core._admission.pre_ready == {"ok"}
    finally:
        client.close()
