"""Device caches a spawned worker cannot use are refused by ``Engine.launch`` before any
process is spawned or any socket listened on, with a ConfigError that names the entry
(``device_caches[rank][i]``) and says what to do (``kvshm.shared_tensor``); and the
names the README's API snippet uses are exported from ``kvshm``."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import pytest
import torch
from engine_rig import GPU_BLOCKS, ROW, config, shards

import kvshm
from kvshm.engine import SPAWN, Engine
from kvshm.errors import ConfigError
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor


def _children() -> set[int]:
    path = f"/proc/{os.getpid()}/task/{os.getpid()}/children"
    with open(path) as f:
        return {int(p) for p in f.read().split()}


async def _refused(caches: object, match: str) -> str:
    """Launch SPAWN with ``caches``: ConfigError matching ``match``, in well under a
    second, and no child process started. Returns the message."""
    before = _children()
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=match) as info:
        await Engine.launch(config(), workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                            device_caches=caches)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 1.0
    assert _children() == before
    return str(info.value)


async def test_plain_torch_zeros_caches_are_refused_before_spawning() -> None:
    """The issue's case: torch.zeros caches failed ~6 s in, after the workers spawned,
    behind misleading worker lines. Now: at once, naming the entry and the fix."""
    caches = [[torch.zeros((GPU_BLOCKS, ROW), dtype=torch.uint8)] for _ in range(2)]
    msg = await _refused(caches, r"device_caches\[0\]\[0\] \(shape \(32, 1024\), uint8, "
                                 r"device cpu\) is ordinary process memory")
    assert "kvshm's worker processes cannot see it" in msg
    assert "kvshm.shared_tensor(shape, dtype)" in msg


async def test_second_rank_plain_tensor_is_named() -> None:
    good = shards(1)[0]
    await _refused([[good], [torch.zeros((GPU_BLOCKS, ROW), dtype=torch.uint8)]],
                   r"device_caches\[1\]\[0\] .* is ordinary process memory")


async def test_bare_tensors_instead_of_one_list_per_rank() -> None:
    """[k0, k1] instead of [[k0], [k1]]: each entry is a tensor, not a list."""
    await _refused(shards(2), r"device_caches\[0\] must be a list of tensors \(one list "
                              r"per rank\), got Tensor; write \[\[k0\], \[k1\]\], not "
                              r"\[k0, k1\]")


async def test_a_view_with_an_offset_is_refused() -> None:
    """A slice of a shared tensor passes the shared-memory test but its bytes start
    elsewhere: the worker maps the segment from byte 0, so it would copy other rows."""
    big = kvshm.shared_tensor((GPU_BLOCKS + 4, ROW), torch.uint8)
    await _refused([[shards(1)[0]], [big[4:]]],
                   r"device_caches\[1\]\[0\] \(shape \(32, 1024\), uint8, device cpu, "
                   r"offset 4096, strides \(1024, 1\)\) is a view")


async def test_a_transposed_view_is_refused() -> None:
    sq = kvshm.shared_tensor((GPU_BLOCKS, GPU_BLOCKS), torch.float16)
    other = kvshm.shared_tensor((GPU_BLOCKS, GPU_BLOCKS), torch.float16)
    await _refused([[other], [sq.t()]], r"device_caches\[1\]\[0\] .* is a view: pass whole "
                                        r"contiguous tensors")


async def test_wrong_number_of_ranks_and_empty_entries() -> None:
    await _refused([[shards(1)[0]]], r"device_caches has 1 entries, world_size is 2 "
                                     r"\(one list of tensors per rank\)")
    await _refused([[shards(1)[0]], ["k"]],
                   r"device_caches\[1\]\[0\]: expected a torch.Tensor, got str")


async def test_bad_shape_is_named_with_its_rank() -> None:
    """A 0-d tensor has no block dimension: the layout's error, prefixed with the rank."""
    scalar = kvshm.shared_tensor((1,), torch.float32).view(())
    await _refused([[shards(1)[0]], [scalar]],
                   r"device_caches\[1\]: tensor 0: a KV tensor needs blocks of at least one "
                   r"byte as dim 0, got shape \(\)")


async def test_block_counts_still_checked_after_the_new_rules() -> None:
    small = kvshm.shared_tensor((GPU_BLOCKS // 2, ROW), torch.uint8)
    await _refused([[shards(1)[0]], [small]],
                   r"rank 1 region 0: device cache has 16 blocks, but the GPU pool has 32")


def test_spawned_check_wants_every_rank_to_have_caches() -> None:
    """With ``spawned`` (kvshm starts the workers) an empty rank is refused; without it
    an empty rank is an embedded worker that brings its own layout."""
    from kvshm.engine.provision import check_caches

    caches: Sequence[Sequence[torch.Tensor]] = [[shards(1)[0]], []]
    check_caches(caches, 2, GPU_BLOCKS)
    with pytest.raises(ConfigError, match=r"device_caches\[1\] is empty: a worker kvshm "
                                          r"spawns needs its rank's caches"):
        check_caches(caches, 2, GPU_BLOCKS, spawned=True)


async def test_spawn_without_device_caches_is_refused_before_spawning() -> None:
    """SPAWN with no device_caches at all failed 8.9 s in, after spawning, with "rank 0
    is a standalone worker ... no device_caches were given". Now: at once."""
    msg = await _refused(None, r"SPAWN mode needs device_caches: one list per rank")
    assert "kvshm.shared_tensor(shape, dtype)" in msg


def test_readme_names_are_exported_from_kvshm() -> None:
    """The README snippet uses kvshm.shared_tensor and kvshm.chain_hashes."""
    from kvshm.hashing import chain_hashes
    from kvshm.shm import shared_tensor

    assert kvshm.shared_tensor is shared_tensor
    assert kvshm.chain_hashes is chain_hashes
    assert {"shared_tensor", "chain_hashes"} <= set(kvshm.__all__)
    with open(os.path.join(os.path.dirname(__file__), "..", "README.md")) as f:
        readme = f.read()
    assert "kvshm.shared_tensor(" in readme and "kvshm.chain_hashes(" in readme


async def test_an_engine_without_a_size_gets_one_gib_per_rank() -> None:
    """The issue's toy took 9.8 GiB a rank; now 1 GiB: with 1 KiB blocks, 2**20 CPU
    blocks (the host pool is exactly 1 GiB)."""
    from kvshm.config import DEFAULT_CPU_BYTES_PER_RANK, EngineConfig

    cfg = EngineConfig(block_size=4, tp=1, connect_timeout_s=30.0)
    assert cfg.num_cpu_blocks is None
    async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=BlockPool(GPU_BLOCKS),
                             device_caches=[[shards(1)[0]]]) as eng:
        stats = eng.statistics()
    assert stats.num_cpu_blocks == DEFAULT_CPU_BYTES_PER_RANK // ROW == 1 << 20


def test_device_cache_specs_are_all_or_nothing_on_fds() -> None:
    """A bad tensor after a good one: ConfigError, and the fd duplicated for the good one
    is closed again (provision's error path holds no fd of this list)."""
    from kvshm.engine.provision import _tensor_specs

    good = shared_tensor((8, 64), torch.uint8)
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError, match="not views"):
        _tensor_specs([good, good[1:]])
    assert len(os.listdir("/proc/self/fd")) == fds_before


@pytest.mark.parametrize(("kw", "match"), [
    ({"workers": "spawn"}, "workers must be kvshm.SPAWN or kvshm.ATTACH, got 'spawn'"),
    ({"workers": None}, "workers must be kvshm.SPAWN or kvshm.ATTACH, got None"),
    ({"config": None}, "config must be a kvshm.EngineConfig, got NoneType"),
    ({"config": {"block_size": 4}}, "config must be a kvshm.EngineConfig, got dict"),
    ({"gpu_blocks": None}, "gpu_blocks must be the engine's GPU block pool"),
    ({"gpu_blocks": 32}, "gpu_blocks must be the engine's GPU block pool .* got int"),
])
async def test_launch_arguments_of_the_wrong_kind_are_refused_before_spawning(
        kw: dict[str, object], match: str) -> None:
    """Found by a hostile probe: ``workers="spawn"`` ran as ATTACH and failed 60 s later
    with "run kvshm-workers"; a pool that is not one failed with an AttributeError at
    READY, the ranks already spawned; a config that is not one with an AttributeError.
    Each is a ConfigError at once, no process started."""
    before = _children()
    args: dict[str, object] = {"config": config(), "workers": SPAWN,
                               "gpu_blocks": BlockPool(GPU_BLOCKS),
                               "device_caches": [[k] for k in shards()]}
    args.update(kw)
    cfg = args.pop("config")
    with pytest.raises(ConfigError, match=match):
        await Engine.launch(cfg, **args)  # type: ignore[arg-type]
    assert _children() == before


async def test_more_cpu_caches_than_a_ready_can_pass_are_refused_before_spawning() -> None:
    """A 126-layer model with K and V as separate tensors gives a rank 252 CPU cache
    tensors. Its Ready must pass one fd for each beside 4 of its own, and one message
    carries at most 253: the send raised ConfigError out of the rendezvous loop's
    callback, the start waited its whole connect timeout (60 s) and then blamed the
    worker ("1 of 1 ranks connected ... missing rank(s) .", or "worker rank 0 died").
    Now 250 tensors are refused at once, naming the limit; 249 still start."""
    from kvshm.engine.provision import MAX_CPU_CACHES

    assert MAX_CPU_CACHES == 249
    many = [[shared_tensor((GPU_BLOCKS, 1), torch.uint8) for _ in range(MAX_CPU_CACHES + 1)],
            [shared_tensor((GPU_BLOCKS, 1), torch.uint8)]]
    await _refused(many, r"device_caches\[0\] has 250 CPU tensors, at most 249: the "
                         r"rank's Ready passes one fd per CPU tensor")
    from kvshm.engine.provision import check_caches

    check_caches([many[0][:MAX_CPU_CACHES], many[1]], 2, GPU_BLOCKS, spawned=True)
