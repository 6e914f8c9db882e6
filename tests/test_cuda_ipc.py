"""Standalone workers on a GPU: the CUDA IPC hand-over of device caches (kvshm.cuda_ipc).

On any machine: the handshake carries the worker's ``--device`` and the caches' kind, and
a rank started for the other device is refused by the engine (before Ready, with the fix
in the error and the log) and, were a Ready to arrive anyway, by the worker (before it
opens anything); a GPU the worker cannot see is a clear error. On a GPU (``-m gpu``): a
real CUDA IPC round trip and a tp=2 SPAWN engine whose ``kvshm-workers --device cuda``
ranks store and load bytes exactly.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import msgspec
import pytest
import torch
from engine_rig import BS, GPU_BLOCKS, ROW, Client, config, tokens

from kvshm.config import EngineConfig
from kvshm.cuda_ipc import export_tensor, open_tensor
from kvshm.engine import SPAWN, Engine, EngineState, StartTimeout, SyncClient
from kvshm.engine.provision import check_caches
from kvshm.errors import ConfigError
from kvshm.ipc.protocol import (
    PROTOCOL_VERSION,
    CudaIpc,
    LayoutSpec,
    Ready,
    RegionSpec,
    TensorSpec,
    control_decoder,
    control_encoder,
)
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from kvshm.types import DeviceKind
from workers.phases import Phase
from workers.session import _Fds, _open_caches, ready_fd_count
from workers.worker import Worker

NO_GPU = "GPU-00000000-0000-0000-0000-000000000000"


def _ipc(uuid: str = NO_GPU, size: int = GPU_BLOCKS * ROW) -> CudaIpc:
    return CudaIpc(uuid, b"\x01" * 64, size, 0, 0, b"/torch_ref", 0, b"\x02" * 64, True)


def _ready(*specs: TensorSpec) -> Ready:
    layout = LayoutSpec((RegionSpec(ROW, GPU_BLOCKS, "uint8", (ROW,)),))
    return Ready(PROTOCOL_VERSION, 0, layout, 8, 64, 64, (0,), 8 * ROW, specs)


def test_a_cuda_tensor_spec_travels_in_ready_without_an_fd() -> None:
    """A CUDA cache rides inside Ready (handle, offsets, GPU UUID) and needs no fd; a CPU
    one needs one: a Ready with one of each must carry the 4 fixed fds + 1."""
    cuda = TensorSpec((GPU_BLOCKS, ROW), "uint8", _ipc())
    cpu = TensorSpec((GPU_BLOCKS, ROW), "uint8")
    ready = _ready(cuda, cpu)
    back = control_decoder().decode(control_encoder().encode(ready))
    assert back == ready and isinstance(back, Ready)
    assert back.device_caches[0].cuda == _ipc() and back.device_caches[1].cuda is None
    assert ready_fd_count(ready) == 5
    assert ready_fd_count(_ready(cuda, cuda)) == 4
    # an older TensorSpec (two fields) still decodes: no handle, i.e. a CPU segment
    old = msgspec.msgpack.encode([[GPU_BLOCKS, ROW], "uint8"])
    assert msgspec.msgpack.decode(old, type=TensorSpec).cuda is None


@pytest.mark.parametrize(("spec_cuda", "device", "kind", "fix"), [
    (True, DeviceKind.CPU, "cuda", "cuda"),
    (False, DeviceKind.CUDA, "cpu", "cpu"),
])
def test_worker_refuses_caches_on_the_other_device_before_opening_any(
        spec_cuda: bool, device: DeviceKind, kind: str, fix: str) -> None:
    """A Ready whose cache 0 is on the other device than the worker's ``--device``:
    ConfigError naming the cache, both devices and the fix; no fd was taken."""
    spec = TensorSpec((GPU_BLOCKS, ROW), "uint8", _ipc() if spec_cuda else None)
    r, w = os.pipe()
    fds = _Fds([r, w])
    try:
        with pytest.raises(ConfigError) as info:
            _open_caches(_ready(spec), fds, device)
        assert str(info.value) == (
            f"rank 0: the engine's device cache 0 is a {kind} tensor, but this worker runs "
            f"--device {device.value}: start kvshm-workers with --device {fix}")
    finally:
        fds.close_rest()  # both still ours: nothing was taken
    with pytest.raises(OSError):
        os.fstat(r)


def test_a_gpu_this_process_cannot_see_is_a_clear_error() -> None:
    """Opening a handle for a GPU UUID this process does not see (here: none, or not that
    one) names the UUID and where to look; nothing is opened."""
    spec = TensorSpec((GPU_BLOCKS, ROW), "uint8", _ipc())
    with pytest.raises(ConfigError, match=rf"the device caches are on GPU {NO_GPU}, "
                       r"(but this process sees no CUDA device|which this process cannot "
                       r"see .*CUDA_VISIBLE_DEVICES)"):
        open_tensor(spec)


def test_a_spec_without_a_cuda_handle_is_a_clear_error() -> None:
    """A spec whose exporter sent no CUDA handle (a host tensor) was refused by an
    ``assert``: a bare AssertionError, or under ``python -O`` an AttributeError further
    on. A ConfigError now, before anything is opened."""
    with pytest.raises(ConfigError, match=r"tensor spec uint8\[32, 1024\] names no CUDA "
                                          r"tensor"):
        open_tensor(TensorSpec((GPU_BLOCKS, ROW), "uint8", None))


def test_a_shape_larger_than_the_exported_storage_is_refused() -> None:
    spec = TensorSpec((GPU_BLOCKS + 1, ROW), "uint8", _ipc())
    with pytest.raises(ConfigError, match=r"CUDA device cache \(33, 1024\) uint8 at element 0 "
                                          r"does not fit the exported 32768-byte storage"):
        open_tensor(spec)


def test_caches_on_a_foreign_device_kind_are_refused_at_launch() -> None:
    """Neither shared memory nor CUDA (a meta tensor stands for mps, xpu, ...)."""
    meta = torch.empty((GPU_BLOCKS, ROW), dtype=torch.uint8, device="meta")
    with pytest.raises(ConfigError, match=r"device_caches\[0\]\[0\] \(shape \(32, 1024\), "
                                          r"uint8, device meta\): kvshm's worker processes copy "
                                          r"CPU shared-memory caches or CUDA tensors"):
        check_caches([[meta]], 1, GPU_BLOCKS)
    with pytest.raises(ConfigError, match=r"a CUDA device cache must be a contiguous tensor "
                                          r"on a GPU, got device cpu, strides \(1, 4\)"):
        export_tensor(torch.zeros(4, 4).t())


def test_a_cuda_worker_against_cpu_caches_is_refused_with_the_fix(
        caplog: pytest.LogCaptureFixture) -> None:
    """The engine's rank 0 caches are shared-memory CPU tensors; a standalone rank
    started with ``--device cuda`` (the real Worker class, in this process: it needs no
    GPU until Ready) says so in Hello. The start fails before any Ready with the rank,
    its pid, both devices and the fix; the engine logs it; the worker is turned away."""
    cfg = config(tp=1)
    caplog.set_level(logging.INFO, logger="kvshm.engine")
    cache = shared_tensor((GPU_BLOCKS, ROW), torch.uint8)
    worker = Worker.attach(cfg.name, 0, 1, None, device=DeviceKind.CUDA)
    want = (f"rank 0 (pid {os.getpid()}) is a standalone worker started with --device "
            "cuda, but its device caches are on cpu: start kvshm-workers with --device cpu")
    try:
        with SyncClient(cfg, gpu_blocks=BlockPool(GPU_BLOCKS),
                        device_caches=[[cache]]) as client:
            deadline = time.monotonic() + 30
            with pytest.raises(ConfigError) as info:
                while time.monotonic() < deadline:
                    worker.service()
                    with contextlib.suppress(StartTimeout):
                        client.wait_ready(0.01)
            assert want in str(info.value)
            assert client.state is EngineState.FAILED
            while worker.phase is not Phase.DETACHED and time.monotonic() < deadline:
                worker.service()
                time.sleep(0.005)
            assert worker.phase is Phase.DETACHED
    finally:
        worker.close()
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(want in m for m in logged), logged


# ---------------------------------------------------------------------------- on a GPU


def _gpu_caches(world: int, blocks: int = GPU_BLOCKS) -> list[list[torch.Tensor]]:
    """One [blocks, ROW] uint8 cache per rank, random, on GPU ``rank % device_count``."""
    out = []
    for r in range(world):
        dev = torch.device("cuda", r % torch.cuda.device_count())
        g = torch.Generator().manual_seed(r)
        out.append([torch.randint(0, 256, (blocks, ROW), dtype=torch.uint8,
                                  generator=g).to(dev)])
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
def test_cuda_ipc_round_trip_in_another_process() -> None:
    """A child process opens the exported tensor by handle, reads it and writes a row:
    the child sees this process's bytes and this process sees the child's write."""
    import subprocess
    import sys

    t = torch.arange(GPU_BLOCKS * ROW, device="cuda").to(torch.uint8).view(GPU_BLOCKS, ROW)
    torch.cuda.synchronize()
    spec = TensorSpec(tuple(t.shape), "uint8", export_tensor(t))
    want = int(t.sum().item())  # before the child writes row 3
    code = (
        "import sys, torch, msgspec\n"
        "from kvshm.cuda_ipc import open_tensor\n"
        "from kvshm.ipc.protocol import TensorSpec\n"
        "spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=TensorSpec)\n"
        "x = open_tensor(spec)\n"
        "print(int(x.sum().item()), x.device)\n"
        "x[3].fill_(7); torch.cuda.synchronize()\n")
    out = subprocess.run([sys.executable, "-c", code], input=msgspec.msgpack.encode(spec),
                         capture_output=True, timeout=120, check=True)
    total, _dev = out.stdout.decode().split()
    assert int(total) == want
    assert bool((t[3] == 7).all())


@pytest.mark.gpu
async def test_tp2_spawned_cuda_workers_store_and_load_bytes_exactly() -> None:
    """Engine.launch(SPAWN) with CUDA device caches starts ``kvshm-workers --device
    cuda`` ranks that open them over CUDA IPC: 6 blocks of request a are stored from both
    ranks, b loads them into other blocks, and every byte matches on both GPUs' caches."""
    caches = _gpu_caches(2)
    gpu = BlockPool(GPU_BLOCKS)
    cfg: EngineConfig = config()
    async with Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                             device_caches=caches) as eng:
        assert eng.state is EngineState.READY
        c = Client(eng, gpu)
        toks = tokens(6 * BS + 1, seed=1)
        table_a, _ = c.compute("a", toks)
        before = [ks[0][table_a].clone() for ks in caches]
        c.finish("a", table_a, len(toks))
        await c.settle()
        gpu.drop_all_hashes()
        hit, table_b, _ = c.load("b", toks)
        assert hit == 6 * BS
        res = await c.loaded("b")
        assert res.ok and res.num_tokens == 6 * BS
        torch.cuda.synchronize()
        for ks, want in zip(caches, before):
            assert torch.equal(ks[0][table_b], want)
        c.finish("b", table_b, len(toks))
        await c.settle()
        st = eng.statistics()
        assert st.pins_held == 0 and st.counters["stored_blocks"] == 6
        assert st.counters["loaded_blocks"] == 6
