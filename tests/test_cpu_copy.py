"""CPU copy engine, host pool and the shared completion tracker: real tensors, real threads."""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from kvshm.errors import ConfigError, ProtocolError
from kvshm.ipc.protocol import PROTOCOL_VERSION, Direction, Done, Ready, Transfer, pack_ids
from kvshm.layout import KVLayout, host_pool_plan
from workers.copy_engine import CompletionTracker, CopyEngine, CopyJob, CpuFence, pair_runs
from workers.cpu_copy import CpuCopyEngine, CpuCopyMethod, FaultInjection
from workers.host_pool import HostPool

NUM_GPU = 96
NUM_CPU = 128
WAIT_S = 30.0  # generous: the machine is shared and noisy


def rank_tensors(seed: int, num_blocks: int = NUM_GPU) -> list[torch.Tensor]:
    """A rank's KV tensors: a K/V-outer bf16 tensor, a padded uint8 one, a float32 one."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(2, num_blocks, 4, 16, generator=g).to(torch.bfloat16)
    padded = torch.randint(0, 256, (num_blocks, 40), generator=g, dtype=torch.uint8)[:, :33]
    plain = torch.randn(num_blocks, 3, 5, generator=g)
    return [kv, padded, plain]


def make_layout(tensors: list[torch.Tensor]) -> KVLayout:
    return KVLayout.from_tensors(tensors, kv_outer=[True, False, False])


def snapshot(layout: KVLayout) -> list[torch.Tensor]:
    return [r.clone() for r in layout.regions]


@pytest.fixture
def rig() -> Iterator[tuple[KVLayout, HostPool, CpuCopyEngine]]:
    layout = make_layout(rank_tensors(0))
    host = HostPool.for_tests(layout, NUM_CPU)
    eng = CpuCopyEngine(0, layout, host)
    yield layout, host, eng
    eng.close()
    host.close()


def collect(eng: CopyEngine, n: int) -> list[Done]:
    out: list[Done] = []
    deadline = time.monotonic() + WAIT_S
    while len(out) < n and time.monotonic() < deadline:
        out += eng.poll()
        time.sleep(0.001)
    return out


def test_engine_satisfies_protocol(rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    assert isinstance(rig[2], CopyEngine)


@pytest.mark.parametrize("method", list(CpuCopyMethod))
def test_round_trip_two_ranks_byte_exact(method: CpuCopyMethod) -> None:
    g = torch.Generator().manual_seed(7)
    ranks = []
    for rank in range(2):
        layout = make_layout(rank_tensors(100 + rank))
        host = HostPool.for_tests(layout, NUM_CPU, rank=rank)
        ranks.append((layout, host, CpuCopyEngine(rank, layout, host, method=method)))
    try:
        # 9 store jobs of 30 pairs; a later job may overwrite a CPU row (the last one counts).
        jobs = [(torch.randperm(NUM_GPU, generator=g)[:30].tolist(),
                 torch.randperm(NUM_CPU, generator=g)[:30].tolist()) for _ in range(9)]
        for _layout, _, eng in ranks:
            for j, (s, d) in enumerate(jobs):
                eng.submit(CopyJob.from_ids(j, Direction.STORE, s, d))
        expect: dict[int, int] = {}
        for s_ids, d_ids in jobs:
            expect.update(zip(d_ids, s_ids))
        before = [snapshot(layout) for layout, _, _ in ranks]
        for rank, (layout, host, eng) in enumerate(ranks):
            dones = eng.wait(range(len(jobs)), timeout=WAIT_S)
            assert [d.job_id for d in dones] == list(range(len(jobs)))
            assert all(d.ok and d.rank == rank for d in dones)
            for d_id, s_id in expect.items():
                for h, dev in zip(host.regions, layout.regions):
                    assert torch.equal(h[d_id], dev[s_id])
            for r in layout.regions:  # wipe the device, then load everything back
                r.zero_()
            cpu_ids = sorted(expect)
            eng.submit(CopyJob.from_ids(99, Direction.LOAD, cpu_ids, [expect[c] for c in cpu_ids]))
            (done,) = eng.wait([99], timeout=WAIT_S)
            assert done.ok, done.error
            for s_id in set(expect.values()):
                for r, old in zip(layout.regions, before[rank]):
                    assert torch.equal(r[s_id], old[s_id])
        # The two ranks held different shards: their host rows differ.
        assert not torch.equal(ranks[0][1].regions[0], ranks[1][1].regions[0])
    finally:
        for _, host, eng in ranks:
            eng.close()
            host.close()


def test_random_completion_order_reports_each_job_once_fifo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    finish_order: list[int] = []
    real_finish = CompletionTracker.finish

    def spy(self: CompletionTracker, seq: int, done: Done, **kw: int) -> None:
        finish_order.append(done.job_id)
        real_finish(self, seq, done, **kw)

    monkeypatch.setattr(CompletionTracker, "finish", spy)
    layout = make_layout(rank_tensors(1))
    host = HostPool.for_tests(layout, NUM_CPU)
    fault = FaultInjection(seed=3, max_delay_s=0.02)
    eng = CpuCopyEngine(0, layout, host, num_threads=4, fault=fault)
    try:
        directions = {}
        for j in range(40):
            d = Direction.LOAD if j % 5 == 4 else Direction.STORE
            directions[j] = d
            eng.submit(CopyJob.from_ids(j, d, [j % NUM_GPU], [j % NUM_GPU]))
        dones = collect(eng, 40)
        ids = [d.job_id for d in dones]
        assert sorted(ids) == list(range(40)) and all(d.ok for d in dones)
        assert finish_order != sorted(finish_order)  # the copies really finished out of order
        for direction in Direction:
            lane = [j for j in ids if directions[j] == direction]
            assert lane == sorted(lane)
        assert eng.poll() == []
    finally:
        eng.close()
        host.close()


def test_tracker_holds_later_jobs_behind_an_unfinished_head() -> None:
    t = CompletionTracker()
    seqs = [t.add(j, Direction.STORE) for j in range(3)]
    load = t.add(10, Direction.LOAD)
    t.finish(seqs[2], Done(2, 0, True))
    t.finish(seqs[1], Done(1, 0, True))
    t.finish(load, Done(10, 0, True))
    assert [d.job_id for d in t.take_ready()] == [10]  # loads do not wait behind stores
    t.finish(seqs[0], Done(0, 0, True))
    assert [d.job_id for d in t.take_ready()] == [0, 1, 2]
    assert len(t) == 0


def test_copy_thread_error_fails_the_job_and_later_jobs_still_run(
        rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    """Hazard "copy thread error": jobs 3 and 5 raise on the copy thread; each becomes a
    ``Done(ok=False)`` naming the error, and jobs 0-2, 4, 6, 7 are copied and reported."""
    layout, host, _ = rig
    fault = FaultInjection(fail_job_ids=frozenset({3}), fail_nth=5)
    with CpuCopyEngine(0, layout, host, fault=fault) as eng:
        for j in range(8):
            eng.submit(CopyJob.from_ids(j, Direction.STORE, [j], [j]))
        dones = eng.wait(range(8), timeout=WAIT_S)
        failed = {d.job_id for d in dones if not d.ok}
        assert failed == {3, 5}
        assert all("injected failure" in d.error for d in dones if not d.ok)
        assert torch.equal(host.regions[0][7], layout.regions[0][7])
        assert eng.stats()["jobs_failed"] == 2 and eng.stats()["jobs_ok"] == 6


def test_bad_ids_fail_the_job_naming_the_id(
        rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    _, _, eng = rig
    eng.submit(CopyJob.from_ids(1, Direction.STORE, [0, NUM_GPU + 5], [0, 1]))
    eng.submit(CopyJob.from_ids(2, Direction.LOAD, [0, -1], [0, 1]))
    eng.submit(CopyJob.from_ids(3, Direction.STORE, [0, 1], [2]))
    eng.submit(CopyJob.from_ids(4, Direction.STORE, [1], [2]))
    dones = {d.job_id: d for d in eng.wait([1, 2, 3, 4], timeout=WAIT_S)}
    assert not dones[1].ok and f"src block id {NUM_GPU + 5} out of range" in dones[1].error
    assert not dones[2].ok and "src block id -1" in dones[2].error
    assert not dones[3].ok and "equal length" in dones[3].error
    assert dones[4].ok


def slow_writer(block: torch.Tensor, fence: CpuFence | None, started: threading.Event,
                resume: threading.Event | None = None) -> None:
    """Write ``block`` to 0xAB in 128 pieces with a sleep between, then set the fence.
    ``resume``: after the first piece, wait for it (the test lets the copy land there,
    so the unfenced race is decided, not left to the scheduler)."""
    step = max(1, block.numel() // 128)
    pieces = [block[i:i + step] for i in range(0, block.numel(), step)]
    for i, p in enumerate(pieces):
        p.fill_(0xAB)
        if i == 0:
            started.set()
            if resume is not None:
                assert resume.wait(WAIT_S)
        time.sleep(0.002)
    if fence is not None:
        fence.set()


@pytest.mark.parametrize("fenced", [True, False])
def test_store_after_fence_sees_final_bytes_and_unfenced_is_torn(fenced: bool) -> None:
    block = torch.zeros(4, 64 << 10, dtype=torch.uint8)  # 256 KiB per block
    layout = KVLayout.from_tensors([block])
    with HostPool.for_tests(layout, 4) as host, CpuCopyEngine(0, layout, host) as eng:
        fence = CpuFence()
        started = threading.Event()
        resume = None if fenced else threading.Event()
        writer = threading.Thread(target=slow_writer,
                                  args=(layout.regions[0][2], fence, started, resume))
        writer.start()
        assert started.wait(WAIT_S)
        eng.submit(CopyJob.from_ids(1, Direction.STORE, [2], [3]), after=fence if fenced else None)
        (done,) = eng.wait([1], timeout=WAIT_S)
        if resume is not None:
            resume.set()  # the copy landed after the first piece: now the rest
        writer.join()
        assert done.ok
        stored = host.regions[0][3]
        final = layout.regions[0][2]
        assert bool((final == 0xAB).all())
        if fenced:
            assert torch.equal(stored, final)
        else:  # copied while half written: neither the old nor the new bytes
            assert not torch.equal(stored, final)
            assert bool((stored == 0xAB).any()) and bool((stored == 0).any())


def slow_reader(row: torch.Tensor, seen: list[torch.Tensor], fence: CpuFence | None,
                started: threading.Event, resume: threading.Event | None = None) -> None:
    """The previous reader of a block (attention of the step before): reads it in 16
    slices, 2 ms apart, then signals that the block may be overwritten. ``resume``: as
    :func:`slow_writer`'s."""
    step = row.numel() // 16
    for i in range(16):
        seen.append(row[i * step:(i + 1) * step].clone())
        if i == 0:
            started.set()
            if resume is not None:
                assert resume.wait(WAIT_S)
        time.sleep(0.002)
    if fence is not None:
        fence.set()


@pytest.mark.parametrize("fenced", [True, False])
def test_load_after_fence_waits_for_reader_and_unfenced_overwrites_it(fenced: bool) -> None:
    """Hazard "load overwrites a block still read": device block 2 (all zeros) is still
    being read when a load of host row 3 (all 0xCD) into it is submitted. With the
    reader's fence as ``after`` the reader sees only the old bytes and the block ends as
    row 3; without it the load lands mid-read and the reader sees both."""
    block = torch.zeros(4, 64 << 10, dtype=torch.uint8)
    layout = KVLayout.from_tensors([block])
    with HostPool.for_tests(layout, 4) as host, CpuCopyEngine(0, layout, host) as eng:
        host.regions[0][3].fill_(0xCD)
        fence = CpuFence()
        started = threading.Event()
        seen: list[torch.Tensor] = []
        resume = None if fenced else threading.Event()
        reader = threading.Thread(target=slow_reader,
                                  args=(layout.regions[0][2], seen, fence, started, resume))
        reader.start()
        assert started.wait(WAIT_S)
        eng.submit(CopyJob.from_ids(1, Direction.LOAD, [3], [2]), after=fence if fenced else None)
        (done,) = eng.wait([1], timeout=WAIT_S)
        if resume is not None:
            resume.set()  # the load landed after the first slice: now the rest
        reader.join()
        assert done.ok
        assert torch.equal(layout.regions[0][2], host.regions[0][3])
        read = torch.cat(seen)
        if fenced:
            assert bool((read == 0).all())
        else:  # the reader's later slices already hold the loaded bytes
            assert bool((read == 0xCD).any()) and bool((read == 0).any())


def test_wait_waits_for_exactly_the_named_jobs(
        rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    layout, host, _ = rig
    with CpuCopyEngine(0, layout, host, num_threads=2) as eng:
        gate = CpuFence()
        eng.submit(CopyJob.from_ids(1, Direction.STORE, [1], [1]), after=gate)
        eng.submit(CopyJob.from_ids(2, Direction.STORE, [2], [2]))
        assert [d.job_id for d in eng.wait([2], timeout=WAIT_S)] == [2]
        assert eng.wait([1], timeout=0.05) == []  # still gated: times out, not reported
        assert eng.poll() == []
        assert eng.wait([77], timeout=WAIT_S) == []  # unknown ids are ignored and counted
        stats = eng.stats()
        assert stats["wait_unknown_ids"] == 1 and stats["wait_timeouts"] == 1
        gate.set()
        assert [d.job_id for d in collect(eng, 1)] == [1]  # job 2 is never reported twice
        assert eng.poll() == []


def test_notify_fd_is_readable_after_completion(
        rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    _, _, eng = rig
    fd = eng.notify_fd()
    assert select.select([fd], [], [], 0)[0] == []
    gate = CpuFence()
    eng.submit(CopyJob.from_ids(5, Direction.STORE, [0], [0]), after=gate)
    assert select.select([fd], [], [], 0.05)[0] == []
    gate.set()
    assert select.select([fd], [], [], WAIT_S)[0] == [fd]
    assert [d.job_id for d in eng.poll()] == [5]
    # The copy thread rings the fd before it counts the ring (CpuCopyEngine.poll), so
    # the poll above may have run between the two and left the fd readable: a later
    # poll must drain it -- a fd left readable for good would spin a parked loop.
    assert drained_by_polls(eng, fd)


def drained_by_polls(eng: CpuCopyEngine, fd: int) -> bool:
    """Some poll (of a few, 1 ms apart) leaves ``fd`` unreadable and reports no job."""
    for _ in range(200):
        assert eng.poll() == []
        if select.select([fd], [], [], 0)[0] == []:
            return True
        time.sleep(0.001)
    return False


def test_fence_timeout_fails_the_job_only(rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    layout, host, _ = rig
    with CpuCopyEngine(0, layout, host, fence_timeout_s=0.1) as eng:
        eng.submit(CopyJob.from_ids(1, Direction.STORE, [1], [1]), after=CpuFence())
        eng.submit(CopyJob.from_ids(2, Direction.STORE, [2], [2]))
        dones = eng.wait([1, 2], timeout=WAIT_S)
        assert [(d.job_id, d.ok) for d in dones] == [(1, False), (2, True)]
        assert "fence not signalled" in dones[0].error
        assert eng.stats()["fence_timeouts"] == 1


def test_close_fails_waiting_jobs_and_later_submits(
        rig: tuple[KVLayout, HostPool, CpuCopyEngine]) -> None:
    layout, host, _ = rig
    eng = CpuCopyEngine(0, layout, host)
    eng.submit(CopyJob.from_ids(1, Direction.STORE, [1], [1]), after=CpuFence())
    eng.submit(CopyJob.from_ids(2, Direction.STORE, [2], [2]))
    eng.close()
    eng.close()
    eng.submit(CopyJob.from_ids(3, Direction.LOAD, [2], [2]))
    dones = eng.poll()
    assert [(d.job_id, d.ok) for d in dones] == [(1, False), (2, False), (3, False)]
    assert "closed" in dones[0].error and "closed" in dones[2].error
    assert eng.stats()["rejected_closed"] == 1
    with pytest.raises(ConfigError):
        eng.notify_fd()


def test_copy_job_from_transfer() -> None:
    msg = Transfer(1, 42, Direction.LOAD, pack_ids([3, 4_000_000_000]), pack_ids([0, 1]))
    job = CopyJob.from_transfer(msg)
    assert job.job_id == 42 and job.direction is Direction.LOAD and len(job) == 2
    assert job.src_ids.tolist() == [3, 4_000_000_000] and job.src_ids.dtype == torch.int64
    with pytest.raises(ProtocolError):
        CopyJob.from_transfer(Transfer(1, 1, Direction.LOAD, b"abc", b""))


def test_pair_runs() -> None:
    assert pair_runs([], []) == []
    assert pair_runs([1, 2, 3, 9, 4], [5, 6, 7, 8, 9]) == [(1, 5, 3), (9, 8, 1), (4, 9, 1)]


def test_engine_refuses_mismatched_host_pool() -> None:
    layout = make_layout(rank_tensors(0))
    other = KVLayout.from_tensors([torch.zeros(NUM_GPU, 8)])
    with HostPool.for_tests(other, 4) as host, pytest.raises(ConfigError, match="regions"):
        CpuCopyEngine(0, layout, host)


def test_host_pool_from_fd_checks_plan_and_size() -> None:
    layout = make_layout(rank_tensors(0))
    spec = layout.to_spec()
    offsets, total = host_pool_plan(spec, 8)
    good = Ready(PROTOCOL_VERSION, 0, spec, 8, 0, 0, offsets, total)
    fd = os.memfd_create("kvshm-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, total - 4096)
    with pytest.raises(ConfigError, match="expected at least"):
        HostPool.from_fd(fd, good)  # takes the fd, closes it on error
    with pytest.raises(OSError):
        os.fstat(fd)
    bad = Ready(PROTOCOL_VERSION, 0, spec, 8, 0, 0, offsets, offsets[-1])
    fd = os.memfd_create("kvshm-test", os.MFD_CLOEXEC)
    with pytest.raises(ConfigError, match="out of bounds"):
        HostPool.from_fd(fd, bad)
    with HostPool.for_tests(layout, 8) as pool:
        shapes = [tuple(r.shape) for r in pool.regions]
        assert shapes == [(8, r.bytes_per_block) for r in spec.regions]
        # pinned (cudaHostRegister) by default exactly where CUDA is available
        assert pool.pinned == torch.cuda.is_available()
        assert pool.bytes_per_block == layout.bytes_per_block
    assert pool.closed and pool.regions == ()


@pytest.mark.parametrize("inline", [True, False])
def test_inline_loads_copy_in_the_caller_while_the_copy_thread_is_held(inline: bool) -> None:
    """``inline``: an unfenced load is copied by ``submit`` itself, so it is done
    (byte-exact, its Done ready for ``poll``) when ``submit`` returns even while the one
    copy thread is held by a store waiting for its fence; the store still goes to the
    thread and lands once the fence is set. Without ``inline`` the load waits
    behind the store on the thread."""
    layout = make_layout(rank_tensors(3))
    with HostPool.for_tests(layout, NUM_CPU) as host, \
            CpuCopyEngine(0, layout, host, inline=inline) as eng:
        for i, r in enumerate(host.regions):
            r[7].fill_(0x30 + i)
        fence = CpuFence()
        eng.submit(CopyJob.from_ids(1, Direction.STORE, [4], [9]), after=fence)
        eng.submit(CopyJob.from_ids(2, Direction.LOAD, [7], [5]))
        ready = eng.poll()
        if inline:
            assert [(d.job_id, d.ok) for d in ready] == [(2, True)]
            for dev, hst in zip(layout.regions, host.regions):
                assert torch.equal(dev[5], hst[7])
        else:
            assert ready == []
        fence.set()
        ids = [1] if inline else [1, 2]  # an inline load's Done went out through poll
        done = eng.wait(ids, timeout=WAIT_S)
        assert sorted(d.job_id for d in done if d.ok) == ids
        for dev, hst in zip(layout.regions, host.regions):
            assert torch.equal(hst[9], dev[4]) and torch.equal(dev[5], hst[7])
        assert eng.stats()["jobs_outstanding"] == 0


def test_inline_copies_an_unfenced_store_in_the_caller() -> None:
    """An unfenced store is copied by ``submit`` itself too (vLLM on the CPU submits its
    stores after the forward wrote the blocks): done, byte-exact, its Done ready for
    ``poll`` when ``submit`` returns, even while the copy thread is held by a fenced
    job. On the thread, a store waited for the GIL after each of its pieces while the
    host's loop ran Python."""
    layout = make_layout(rank_tensors(5))
    with HostPool.for_tests(layout, NUM_CPU) as host, \
            CpuCopyEngine(0, layout, host, inline=True) as eng:
        fence = CpuFence()
        eng.submit(CopyJob.from_ids(1, Direction.LOAD, [2], [3]), after=fence)
        eng.submit(CopyJob.from_ids(2, Direction.STORE, [4, 5], [8, 9]))
        assert [(d.job_id, d.ok) for d in eng.poll()] == [(2, True)]
        for dev, hst in zip(layout.regions, host.regions):
            assert torch.equal(hst[8], dev[4]) and torch.equal(hst[9], dev[5])
        fence.set()
        (done,) = eng.wait([1], timeout=WAIT_S)
        assert done.ok and eng.stats()["jobs_outstanding"] == 0


def test_inline_leaves_a_fenced_load_to_the_thread() -> None:
    """A load with a fence (it must wait for a reader) is never copied inline."""
    layout = make_layout(rank_tensors(4))
    with HostPool.for_tests(layout, NUM_CPU) as host, \
            CpuCopyEngine(0, layout, host, inline=True) as eng:
        fence = CpuFence()
        eng.submit(CopyJob.from_ids(1, Direction.LOAD, [2], [3]), after=fence)
        assert eng.poll() == []
        fence.set()
        (done,) = eng.wait([1], timeout=WAIT_S)
        assert done.ok


def test_a_long_copy_marks_progress_every_few_thousand_pieces_and_a_short_one_none() -> None:
    """A job of many single-row pieces (descending ids: no pair coalesces) marks the
    rank's copy progress after every ``PROGRESS_PIECES`` ``memmove`` calls, so a copy
    that runs for seconds keeps the scheduler's hang check at bay (see
    ``RankWatch.stalled_for``); a short job marks nothing (its Done is the progress).
    The bytes are exact either way."""
    from workers.cpu_copy import PROGRESS_PIECES

    n = 3000
    layout = KVLayout.from_tensors([torch.arange(n * 4, dtype=torch.int32).reshape(n, 4)
                                    for _ in range(3)], kv_outer=[False] * 3)
    host = HostPool.for_tests(layout, n)
    marks: list[int] = []
    eng = CpuCopyEngine(0, layout, host, progress=lambda: marks.append(1))
    try:
        src, dst = list(range(n)), list(range(n - 1, -1, -1))  # 3 regions x 3000 pieces
        eng.submit(CopyJob.from_ids(1, Direction.STORE, src, dst))
        (done,) = eng.wait([1], timeout=WAIT_S)
        assert done.ok, done.error
        assert len(marks) == (3 * n) // PROGRESS_PIECES == 2  # 9,000 pieces: 2 marks
        for h, dev in zip(host.regions, layout.regions):
            assert torch.equal(h.flip(0), dev)
        eng.submit(CopyJob.from_ids(2, Direction.LOAD, src[:100], dst[:100]))
        (done,) = eng.wait([2], timeout=WAIT_S)
        assert done.ok and len(marks) == 2
    finally:
        eng.close()
        host.close()


def test_a_long_copy_of_one_run_marks_progress_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store whose pairs are consecutive on both sides (a request's blocks into fresh
    CPU blocks) is one ``memmove`` a region: counting calls alone, a 5 GiB such copy
    stamped nothing for its whole 0.5 s (a review of the stamp). Marks now also come
    every ``PROGRESS_BYTES``, a run longer than that going in several calls: here
    (64 KiB for the test) 1,000 rows of 1 KiB are 16 calls and 15 marks, bytes exact."""
    import workers.cpu_copy as cpu_copy

    monkeypatch.setattr(cpu_copy, "PROGRESS_BYTES", 64 << 10)
    n = 1000
    layout = KVLayout.from_tensors([torch.randint(0, 256, (n, 1024), dtype=torch.uint8)],
                                   kv_outer=[False])
    host = HostPool.for_tests(layout, n)
    marks: list[int] = []
    eng = CpuCopyEngine(0, layout, host, progress=lambda: marks.append(1))
    try:
        eng.submit(CopyJob.from_ids(1, Direction.STORE, list(range(n)), list(range(n))))
        (done,) = eng.wait([1], timeout=WAIT_S)
        assert done.ok, done.error
        assert len(marks) == 15
        assert torch.equal(host.regions[0], layout.regions[0])
    finally:
        eng.close()
        host.close()
