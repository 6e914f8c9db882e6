"""CUDA copy engine. GPU tests are marked ``gpu`` (skipped without CUDA); the module itself
must import and refuse cleanly everywhere."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvshm.errors import ConfigError, CopyError
from kvshm.ipc.protocol import Direction
from kvshm.layout import KVLayout
from workers.copy_engine import CopyEngine, CopyJob, CpuFence
from workers.cuda_batch import load_batch_memcpy
from workers.cuda_copy import CudaCopyEngine, CudaCopyMethod, CudaFence
from workers.host_pool import HostPool

NUM_GPU = 96
NUM_CPU = 128
WAIT_S = 30.0
cuda: Any = torch.cuda  # Stream() and _sleep() are untyped in torch's stubs


def rank_tensors(seed: int, device: str) -> list[torch.Tensor]:
    """A K/V-outer bf16 tensor, a padded uint8 one (rows 40 B apart, 33 B used), a float32 one."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, NUM_GPU, 4, 16, generator=g).to(torch.bfloat16)
    padded = torch.randint(0, 256, (NUM_GPU, 40), generator=g, dtype=torch.uint8)
    plain = torch.randn(NUM_GPU, 3, 5, generator=g)
    return [kv.to(device), padded.to(device)[:, :33], plain.to(device)]


class _Event:
    """A CUDA event as the engine sees it, completed when the test says (a timing seam:
    the hardware's order of completion); ``error``: every query raises, as a CUDA
    error does."""

    def __init__(self, *, error: bool = False) -> None:
        self.done, self.error, self.queries = False, error, 0

    def query(self) -> bool:
        self.queries += 1
        if self.error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self.done

    def synchronize(self) -> None:
        if self.error:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        while not self.done:
            time.sleep(0.001)

    def record(self, stream: Any = None) -> None:
        pass


def test_a_wait_on_a_failed_event_behind_a_running_one_naps_and_keeps_its_deadline(
        ) -> None:
    """Job 2's event failed (a CUDA error: every query raises) while job 1 ahead of it
    in the same lane still runs. ``wait([2], timeout=0.1)``: the failure is reported
    only once job 2 heads its lane, so the wait raised, caught, reaped nothing and
    asked again -- a spin at full speed, past its timeout, until job 1 completed. Now
    it naps between tries, returns at its deadline (counted a wait timeout), and once
    job 1 completes job 2 ends failed with the CUDA error."""
    from workers.copy_engine import CompletionTracker
    from workers.cuda_copy import _Pending

    eng = object.__new__(CudaCopyEngine)  # (no CUDA here: only wait's bookkeeping)
    eng.rank, eng._tracker = 0, CompletionTracker()
    running, failed = _Event(), _Event(error=True)
    lane = collections.deque(_Pending(eng._tracker.add(j, Direction.STORE), j, ev, 0, 0, "", None)
                             for j, ev in ((1, running), (2, failed)))
    eng._pending = {Direction.STORE: lane}
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(eng.wait([2], timeout=0.1)), daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(5)
    assert not t.is_alive(), "the wait spun past its deadline"
    assert out == [[]] and time.monotonic() - t0 < 2
    assert failed.queries < 1000, failed.queries  # naps of 1 ms, not a spin
    assert eng._tracker.stats.wait_timeouts == 1
    running.done = True
    (done,) = eng.wait([2], timeout=1)
    assert not done.ok and "illegal memory access" in (done.error or "")


def test_refuses_without_cuda_or_with_a_cpu_layout() -> None:
    layout = KVLayout.from_tensors(rank_tensors(0, "cpu"), kv_outer=[True, False, False])
    with HostPool.for_tests(layout, 4, pin=False) as host, \
            pytest.raises(ConfigError, match="CUDA"):
        CudaCopyEngine(0, layout, host)


def _skip_without_batch(method: CudaCopyMethod) -> None:
    """BATCH needs a CUDA >= 12.8 driver; on an older one the engine refuses it."""
    if method is CudaCopyMethod.BATCH and load_batch_memcpy(torch.cuda.current_device()) is None:
        pytest.skip("this driver has no cuMemcpyBatchAsync")


@pytest.fixture(params=list(CudaCopyMethod), ids=lambda m: m.value)
def rig(request: pytest.FixtureRequest) -> Iterator[tuple[KVLayout, HostPool, CudaCopyEngine]]:
    """Dense and padded regions, with each copy method."""
    layout = KVLayout.from_tensors(rank_tensors(0, "cuda"), kv_outer=[True, False, False])
    host = HostPool.for_tests(layout, NUM_CPU)
    assert host.pinned
    _skip_without_batch(request.param)
    eng = CudaCopyEngine(0, layout, host, method=request.param)
    assert eng.method is request.param
    yield layout, host, eng
    eng.close()
    host.close()


@pytest.mark.gpu
def test_round_trip_byte_exact(rig: tuple[KVLayout, HostPool, CudaCopyEngine]) -> None:
    layout, host, eng = rig
    assert isinstance(eng, CopyEngine)
    g = torch.Generator().manual_seed(1)
    runs_src, runs_dst = list(range(10, 20)), list(range(100, 110))  # a coalesced run too
    src = [b for b in torch.randperm(NUM_GPU, generator=g).tolist() if b not in runs_src][:80]
    dst = [b for b in torch.randperm(NUM_CPU, generator=g).tolist() if b not in runs_dst][:80]
    before = [r.clone() for r in layout.regions]
    eng.submit(CopyJob.from_ids(1, Direction.STORE, src, dst))
    eng.submit(CopyJob.from_ids(2, Direction.STORE, runs_src, runs_dst))
    dones = eng.wait([1, 2], timeout=WAIT_S)
    assert [(d.job_id, d.ok) for d in dones] == [(1, True), (2, True)], dones
    for s, d in zip(src + runs_src, dst + runs_dst):
        for h, dev in zip(host.regions, layout.regions):
            assert torch.equal(h[d], dev[s].cpu())
    for r in layout.regions:
        r.zero_()
    eng.submit(CopyJob.from_ids(3, Direction.LOAD, dst + runs_dst, src + runs_src))
    (done,) = eng.wait([3], timeout=WAIT_S)
    assert done.ok, done.error
    for s in src + runs_src:
        for r, old in zip(layout.regions, before):
            assert torch.equal(r[s], old[s])
    assert eng.stats()["jobs_ok"] == 3
    assert eng.stats()["batch_fallbacks"] == 0


@pytest.mark.gpu
def test_refused_batch_falls_back_to_indexed_copies(
        rig: tuple[KVLayout, HostPool, CudaCopyEngine]) -> None:
    """A driver that refuses the batch (seen in the wild as CUDA_ERROR_INVALID_VALUE):
    the job is enqueued again with indexed copies and succeeds; the engine stays on
    INDEXED and counts the fallback."""
    layout, host, eng = rig
    method = eng.method
    if method is not CudaCopyMethod.BATCH:
        pytest.skip("the INDEXED engine never batches")

    def refuse(*_: object) -> None:
        raise CopyError("cuMemcpyBatchAsync failed: CUDA_ERROR_INVALID_VALUE (copy 0 of 2)")

    eng._batch = refuse  # type: ignore[assignment]  # the seam: the driver call itself
    eng.submit(CopyJob.from_ids(1, Direction.STORE, [4, 7], [9, 2]))
    (done,) = eng.wait([1], timeout=WAIT_S)
    assert done.ok, done.error
    for h, dev in zip(host.regions, layout.regions):
        assert torch.equal(h[9], dev[4].cpu()) and torch.equal(h[2], dev[7].cpu())
    assert eng.method is CudaCopyMethod.INDEXED and eng.stats()["batch_fallbacks"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(CudaCopyMethod), ids=lambda m: m.value)
@pytest.mark.parametrize("fenced", [True, False])
def test_store_waits_for_the_compute_fence(fenced: bool, method: CudaCopyMethod) -> None:
    _skip_without_batch(method)
    block = torch.zeros(4, 1 << 20, dtype=torch.uint8, device="cuda")
    layout = KVLayout.from_tensors([block])
    with HostPool.for_tests(layout, 4) as host, \
            CudaCopyEngine(0, layout, host, method=method) as eng:
        compute = cuda.Stream()
        with torch.cuda.stream(compute):
            cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the write
            layout.regions[0][2].fill_(0xAB)
            fence = CudaFence.record(compute)
        eng.submit(CopyJob.from_ids(1, Direction.STORE, [2], [3]), after=fence if fenced else None)
        (done,) = eng.wait([1], timeout=WAIT_S)
        assert done.ok
        compute.synchronize()
        stored = host.regions[0][3]
        if fenced:
            assert bool((stored == 0xAB).all())
        else:  # the copy ran while the compute stream slept: the old bytes
            assert not bool((stored == 0xAB).all())


@pytest.mark.gpu
def test_failures_are_reported_and_later_jobs_run(
        rig: tuple[KVLayout, HostPool, CudaCopyEngine]) -> None:
    _, _, eng = rig
    eng.submit(CopyJob.from_ids(1, Direction.STORE, [NUM_GPU], [0]))
    eng.submit(CopyJob.from_ids(2, Direction.STORE, [0], [0]), after=CpuFence())
    eng.submit(CopyJob.from_ids(3, Direction.LOAD, [0], [0]))
    dones = {d.job_id: d for d in eng.wait([1, 2, 3], timeout=WAIT_S)}
    assert not dones[1].ok and f"src block id {NUM_GPU} out of range" in dones[1].error
    assert not dones[2].ok and "CudaFence" in dones[2].error
    assert dones[3].ok
    assert eng.stats()["jobs_failed"] == 2


@pytest.mark.gpu
def test_wait_for_exactly_the_named_jobs_and_fifo_poll(
        rig: tuple[KVLayout, HostPool, CudaCopyEngine]) -> None:
    _, _, eng = rig
    gate_stream = cuda.Stream()
    with torch.cuda.stream(gate_stream):
        cuda._sleep(200_000_000)
        gate = CudaFence.record(gate_stream)
    eng.submit(CopyJob.from_ids(1, Direction.STORE, [1], [1]), after=gate)
    eng.submit(CopyJob.from_ids(2, Direction.LOAD, [2], [2]))
    assert [d.job_id for d in eng.wait([2], timeout=WAIT_S)] == [2]
    assert eng.wait([1], timeout=0.001) == []
    assert [d.job_id for d in eng.wait([1], timeout=WAIT_S)] == [1]
    for j in range(10, 20):
        eng.submit(CopyJob.from_ids(j, Direction.STORE, [j], [j]))
    eng.close()
    assert [d.job_id for d in eng.poll()] == list(range(10, 20))
