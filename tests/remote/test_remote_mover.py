"""A worker's remote jobs (workers.remote_mover) against a real Valkey server: CPU rows go
out and come back byte-exact (one region: the row itself is the value; three regions:
gathered and scattered), another rank's or another engine's keys never load, a dead
server fails the job within the deadline -- failure = miss = recompute."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from kvshm.hashing import chain_hashes
from kvshm.ipc.protocol import (
    Disk,
    DiskOp,
    DiskSetup,
    Done,
    LayoutSpec,
    RegionSpec,
    Remote,
    RemoteOp,
    RemoteSetup,
    pack_ids,
)
from kvshm.remote.resp import command, parse_reply
from kvshm.remote.server import ValkeyServer
from kvshm.remote.tier import KEY_PREFIX, RemoteSpec, block_key
from kvshm.remote.valkey import ValkeyBlockStore
from workers.disk_mover import DiskMover
from workers.host_pool import HostPool
from workers.remote_mover import RemoteMover

FP = "test-model.bf16.bs4"
BLOCKS = 16


def _pool(region_bytes: tuple[int, ...], seed: int, inference: bool = False) -> HostPool:
    """A host pool of random rows; ``inference``: its region tensors are made under
    ``torch.inference_mode`` (inference tensors), as in vLLM's worker process."""
    spec = LayoutSpec(tuple(RegionSpec(b, BLOCKS, "uint8") for b in region_bytes))
    with torch.inference_mode(inference):
        pool = HostPool.for_tests(spec, BLOCKS, pin=False)
        g = torch.Generator().manual_seed(seed)
        for r in pool.regions:
            r.copy_(torch.randint(0, 256, tuple(r.shape), dtype=torch.uint8, generator=g))
    assert all(r.is_inference() == inference for r in pool.regions)
    return pool


def _mover(server: ValkeyServer, pool: HostPool, rank: int = 0, world: int = 2,
           fp: str = FP) -> RemoteMover:
    spec = RemoteSpec.parse(server.url, request_timeout_ms=300, connect_timeout_ms=300)
    return RemoteMover(rank, world, RemoteSetup(server.url, fp), pool,
                       ValkeyBlockStore(spec))


def _job(job_id: int, op: RemoteOp, rows: list[int], hashes: list[bytes]) -> Remote:
    return Remote(job_id, op, pack_ids(rows), b"".join(hashes), len(hashes[0]))


def _wait(mover: RemoteMover, n: int = 1, timeout: float = 10.0) -> list[Done]:
    got: list[Done] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {got} of {n} Dones"
        got += mover.poll()
        time.sleep(0.005)
    return got


def _close(mover: RemoteMover) -> None:
    mover.close()
    mover.release()


def _round_trip(server: ValkeyServer, region_bytes: tuple[int, ...],
                inference: bool = False) -> None:
    hashes = chain_hashes(list(range(4 * 8)), 4)  # 8 blocks
    src = _pool(region_bytes, seed=1, inference=inference)
    dst = _pool(region_bytes, seed=2, inference=inference)
    a, b = _mover(server, src), _mover(server, dst)
    try:
        a.submit(_job(1, RemoteOp.PUT, list(range(8)), hashes))
        assert _wait(a) == [Done(1, 0, True)]
        rows = [15, 3, 9, 0, 1, 2, 12, 7]
        b.submit(_job(2, RemoteOp.GET, rows, hashes))
        assert _wait(b) == [Done(2, 0, True)]
        for s, d in zip(src.regions, dst.regions):
            assert torch.equal(d[rows], s[:8])
        key = block_key(KEY_PREFIX, FP, 0, 2, hashes[0])
        ttl = parse_reply(command(server.host, server.port, "TTL", key))
        assert isinstance(ttl, int) and 0 < ttl <= 3600
        assert a.statistics()["mover"]["put_stored"] == 8
        assert b.statistics()["mover"]["get_hit"] == 8
    finally:
        _close(a)
        _close(b)


def test_one_region_rows_round_trip_byte_exact(valkey: ValkeyServer) -> None:
    _round_trip(valkey, (4096,))


def test_three_regions_are_gathered_and_scattered_byte_exact(valkey: ValkeyServer) -> None:
    _round_trip(valkey, (1024, 3000, 64))


def test_rows_that_are_inference_tensors_round_trip(valkey: ValkeyServer) -> None:
    """vLLM's worker builds its host pool under inference_mode: the GET's scatter into
    those rows (three regions: staging -> rows) must run in inference mode too (it
    raised "Inplace update to inference tensor outside InferenceMode" on the mover's
    thread: every GET failed inside vLLM)."""
    _round_trip(valkey, (96, 160, 64), inference=True)


def test_other_rank_or_engine_keys_never_load(valkey: ValkeyServer) -> None:
    """Rank 0 of fingerprint FP stored 4 blocks. Rank 1 (its own keys: none) and an
    engine of another fingerprint get MISSes: their jobs fail, saying so, and their
    rows keep their bytes where the GET missed."""
    hashes = chain_hashes(list(range(16)), 4)
    pool = _pool((2048,), seed=3)
    writer = _mover(valkey, pool)
    other_rank = _mover(valkey, _pool((2048,), seed=4), rank=1)
    other_fp = _mover(valkey, _pool((2048,), seed=5), fp="other-model.fp16.bs4")
    try:
        writer.submit(_job(1, RemoteOp.PUT, [0, 1, 2, 3], hashes))
        assert _wait(writer)[0].ok
        for m in (other_rank, other_fp):
            before = m._host.regions[0][4:8].clone()
            m.submit(_job(2, RemoteOp.GET, [4, 5, 6, 7], hashes))
            [done] = _wait(m)
            assert not done.ok and done.error == "RemoteError: GET of 4 block(s): 4 miss"
            assert torch.equal(m._host.regions[0][4:8], before)
    finally:
        for m in (writer, other_rank, other_fp):
            _close(m)


def test_a_dead_server_fails_the_job_within_the_deadline(valkey: ValkeyServer) -> None:
    """SIGKILL the server: a PUT of 4 blocks ends failed (not stored), fast -- nothing
    waits past the configured deadlines; close() returns at once afterwards."""
    hashes = chain_hashes(list(range(16)), 4)
    mover = _mover(valkey, _pool((2048,), seed=6))
    try:
        assert valkey.pid is not None
        os.kill(valkey.pid, signal.SIGKILL)
        time.sleep(0.2)
        t0 = time.monotonic()
        mover.submit(_job(1, RemoteOp.PUT, [0, 1, 2, 3], hashes))
        [done] = _wait(mover)
        assert time.monotonic() - t0 < 3.0
        assert not done.ok and done.error.startswith("RemoteError: PUT of 4 block(s): ")
        assert "4 not_stored" in done.error
    finally:
        t0 = time.monotonic()
        _close(mover)
        assert time.monotonic() - t0 < 3.0


def test_bad_jobs_fail_alone(valkey: ValkeyServer) -> None:
    """A hash list that does not match the rows, or a row out of range: that job fails
    with the reason; the next job runs."""
    hashes = chain_hashes(list(range(8)), 4)
    mover = _mover(valkey, _pool((512,), seed=7))
    try:
        mover.submit(Remote(1, RemoteOp.PUT, pack_ids([0, 1]), hashes[0], len(hashes[0])))
        mover.submit(_job(2, RemoteOp.PUT, [0, BLOCKS], hashes))
        mover.submit(_job(3, RemoteOp.PUT, [0, 1], hashes))
        d1, d2, d3 = _wait(mover, 3)
        assert not d1.ok and "2 rows but" in d1.error
        assert not d2.ok and f"CPU row out of range [0, {BLOCKS})" in d2.error
        assert d3 == Done(3, 0, True)
        assert mover.counts["bad_jobs"] == 2
    finally:
        _close(mover)


@dataclass
class _FencedRig:
    """Rank 0 of two with both tiers: ``a`` (source rows) has PUT block X (chain
    position 3, ``hx``) to Valkey; ``b`` (destination rows, the rank under test) asks
    ``disk``'s row fence (5 s) before a GET fills a row; ``disk`` (one thread) holds
    each WRITE in its gate -- ``held`` set -- until ``go``."""

    hx: list[bytes]
    src: HostPool
    dst: HostPool
    a: RemoteMover
    b: RemoteMover
    disk: DiskMover
    go: threading.Event
    held: threading.Event


@contextmanager
def _fenced_rig(valkey: ValkeyServer, tmp_path: Path) -> Iterator[_FencedRig]:
    hx = chain_hashes(list(range(4)), 4)
    src, dst = _pool((4096,), seed=1), _pool((4096,), seed=2)
    a, b = _mover(valkey, src), _mover(valkey, dst)
    disk = DiskMover(0, 2, DiskSetup(str(tmp_path / "r0.slab"), 8, FP, True), dst, threads=1)
    go, held = threading.Event(), threading.Event()

    def gate() -> bool:
        held.set()
        return go.wait(10)
    try:
        a.submit(_job(1, RemoteOp.PUT, [3], hx))
        assert _wait(a) == [Done(1, 0, True)]
        b.fence_rows(partial(disk.wait_rows, timeout=5.0))
        disk.set_gate(gate)
        yield _FencedRig(hx, src, dst, a, b, disk, go, held)
    finally:
        go.set()
        _close(a)
        _close(b)
        disk.close()
        disk.release()


def test_a_get_into_a_row_a_disk_write_still_reads_waits_for_that_write(
        valkey: ValkeyServer, tmp_path: Path) -> None:
    """The row fence on a rank with both tiers: the scheduler evicted row 0's block for a
    GET and posted its write-down (WRITE row 0 -> slot 5) first. The WRITE is held (the
    disk mover's gate waits for the test); the GET of block X into row 0, submitted
    after it, must not start: 100 ms later it has no Done and row 0 still holds its old
    bytes. Once the WRITE goes on, the GET ends ok, row 0 holds X's bytes and slot 5 the
    old ones (read back into row 2). A second GET whose fence times out (a WRITE held
    past the timeout) fails without touching its row, counted ``gets_fence_timed_out``."""
    with _fenced_rig(valkey, tmp_path) as r:
        hx, src, dst, b, disk, go, held = r.hx, r.src, r.dst, r.b, r.disk, r.go, r.held
        old0 = dst.regions[0][0].clone()
        dh = [hashlib.sha256(b"victim").digest()]
        disk.submit(Disk(7, DiskOp.WRITE, pack_ids([0]), pack_ids([5]), dh[0], 32))
        assert held.wait(10)
        b.submit(_job(2, RemoteOp.GET, [0], hx))
        time.sleep(0.1)
        assert b.poll() == [] and torch.equal(dst.regions[0][0], old0)
        go.set()
        assert _wait(b) == [Done(2, 0, True)]
        assert torch.equal(dst.regions[0][0], src.regions[0][3])
        disk.submit(Disk(8, DiskOp.READ, pack_ids([2]), pack_ids([5]), dh[0], 32))
        deadline = time.monotonic() + 10
        done: list[Done] = []
        while len(done) < 2:
            assert time.monotonic() < deadline, done
            done += disk.poll()
            time.sleep(0.005)
        assert sorted(d.job_id for d in done if d.ok) == [7, 8]
        assert torch.equal(dst.regions[0][2], old0)

        go.clear()
        held.clear()
        b.fence_rows(partial(disk.wait_rows, timeout=0.1))
        disk.submit(Disk(9, DiskOp.WRITE, pack_ids([1]), pack_ids([6]), dh[0], 32))
        assert held.wait(10)
        old1 = dst.regions[0][1].clone()
        b.submit(_job(3, RemoteOp.GET, [1], hx))
        (d,) = _wait(b)
        assert (d.job_id, d.ok) == (3, False) and "disk WRITE still reads" in d.error
        assert torch.equal(dst.regions[0][1], old1)
        assert b.statistics()["mover"]["gets_fence_timed_out"] == 1
        go.set()


def test_closing_the_disk_mover_first_releases_a_get_waiting_on_its_fence(
        valkey: ValkeyServer, tmp_path: Path) -> None:
    """Shutdown order (``Session.close`` closes the disk mover first): one disk thread,
    WRITE 7 (row 5) held in the gate, WRITE 8 (row 0) queued behind it, the GET of X
    into row 0 waiting on the fence (5 s). ``disk.close()`` cancels the queued WRITE 8
    at once, which ends the GET's wait: the GET is done while WRITE 7 is still held
    (long before the 5 s fence), and row 0 holds X."""
    with _fenced_rig(valkey, tmp_path) as r:
        hx, src, dst, b, disk, go, held = r.hx, r.src, r.dst, r.b, r.disk, r.go, r.held
        closer = threading.Thread(target=disk.close)
        try:
            h = hashlib.sha256(b"v").digest()
            disk.submit(Disk(7, DiskOp.WRITE, pack_ids([5]), pack_ids([5]), h, 32))
            assert held.wait(10)
            disk.submit(Disk(8, DiskOp.WRITE, pack_ids([0]), pack_ids([6]), h, 32))
            b.submit(_job(2, RemoteOp.GET, [0], hx))
            time.sleep(0.1)
            assert b.poll() == []                                     # fenced on WRITE 8
            t0 = time.monotonic()
            closer.start()
            assert _wait(b, timeout=3.0) == [Done(2, 0, True)]
            assert time.monotonic() - t0 < 2.0 and not go.is_set()    # WRITE 7 still held
            assert torch.equal(dst.regions[0][0], src.regions[0][3])
        finally:
            go.set()
            if closer.ident is not None:
                closer.join(10)
