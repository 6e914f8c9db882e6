"""The disk tier's worker side across processes: real ``kvshm-workers`` processes whose
Ready names a slab file (``Ready.disk``) run Disk jobs between their host rows and the
slab bit-exact (page-aligned rows: zero-copy O_DIRECT; odd rows: the bounce buffer); a
slot whose payload was corrupted fails its READ naming the CRC; a rank without a disk
tier, or whose slab another process holds, fails Disk jobs with the reason. And the
slab file against other processes: its lock refuses a second process (and dies with its
holder), and a writer SIGKILLed mid-write never leaves a slot that reads as a wrong HIT.
And an embedded worker (in this process, as vLLM's): its Disk Dones reach the scheduler
as the jobs finish, with no further call from its host (the mover publisher)."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import pytest
import torch
from worker_rig import Sched, transfer

from kvshm.disk import PAGE, SlabFile, SlabSpec, SlotOutcome, scan
from kvshm.ipc.protocol import Direction, Disk, DiskOp, DiskSetup, Hello, Ready, Shutdown, pack_ids
from kvshm.shm import shared_tensor

if TYPE_CHECKING:
    from workers.worker import Worker

NB = 64  # device blocks per rank
FP = "disk-test-model.fp32.bs16"


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [hashlib.sha256(bytes([salt, k])).digest() for k in range(n)]


def disk_job(job_id: int, op: DiskOp, cpu_ids: list[int], slots: list[int],
             hs: list[bytes]) -> Disk:
    return Disk(job_id, op, pack_ids(cpu_ids), pack_ids(slots), b"".join(hs), len(hs[0]))


class DiskSched(Sched):
    """The worker rig's scheduler side, with ``disk(rank)`` as each Ready's disk tier."""

    def __init__(self, world: int, disk: Callable[[int], DiskSetup | None],
                 **kw: object) -> None:
        self._disk = disk
        super().__init__(world, **kw)  # type: ignore[arg-type]

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[Ready, list[int]]]:
        return {r: (msgspec.structs.replace(ready, disk=self._disk(r)), fds)
                for r, (ready, fds) in super()._make_ready(hellos).items()}


def spawn(name: str, tp: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "workers", "--name", name, "--tp", str(tp),
                             "--connect-timeout", "30"], text=True,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop(sched: Sched, proc: subprocess.Popen[str]) -> None:
    sched.post(Shutdown())
    try:
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def random_caches(shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = []
    for shape, dtype in shapes:
        t = shared_tensor(shape, dtype)
        t.view(torch.uint8).copy_(torch.randint(0, 256, tuple(t.view(torch.uint8).shape),
                                                dtype=torch.uint8, generator=g))
        out.append(t)
    return out


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x80]))


#: Page-aligned rows (4 KiB and 8 KiB per block: zero-copy O_DIRECT), and odd ones
#: (1 KiB and 64 B: through the bounce buffer).
CACHES = {"aligned": [((NB, 4096), torch.uint8), ((NB, 2, 1024), torch.float32)],
          "unaligned": [((NB, 2, 128), torch.float32), ((NB, 64), torch.uint8)]}


@pytest.mark.parametrize("kind", sorted(CACHES))
def test_write_then_read_through_a_worker_process_is_bit_exact(tmp_path: Path,
                                                               kind: str) -> None:
    """device -> CPU rows (STORE) -> slab (Disk WRITE) -> other CPU rows (Disk READ) ->
    other device blocks (LOAD): the bytes are the originals; the parent's scan of the
    slab finds exactly the slots written. Then a payload byte of one slot is flipped:
    a READ of it and an intact slot fails naming one CRC mismatch, and a READ under the
    wrong hash names the header."""
    caches = random_caches(CACHES[kind])
    path = str(tmp_path / "r0.slab")
    setup = DiskSetup(path, 16, FP, True)
    sched = DiskSched(1, lambda r: setup, device_caches=[caches], num_cpu_blocks=64)
    proc = spawn(sched.name, 1)
    try:
        sched.wait_for(sched.ready, timeout=60, what="Ready")
        orig = [c.clone() for c in caches]
        slots, hs = [5, 1, 7, 3, 0, 2, 6, 15], hashes(8)
        sched.post(transfer(1, 1, Direction.STORE, range(8), range(8)))
        assert sched.collect([1], timeout=60)[0][1].ok  # WRITE only rows whose store acked
        sched.post(disk_job(2, DiskOp.WRITE, list(range(8)), slots, hs))
        assert sched.collect([2], timeout=60)[0][2].ok
        sched.post(disk_job(3, DiskOp.READ, list(range(20, 28)), slots, hs))
        assert sched.collect([3], timeout=60)[0][3].ok
        sched.post(transfer(2, 4, Direction.LOAD, range(20, 28), range(40, 48)))
        assert sched.collect([4], timeout=60)[0][4].ok
        for c, o in zip(caches, orig):
            assert torch.equal(c[40:48].view(torch.uint8), o[0:8].view(torch.uint8))

        row_bytes = sum(c[0].numel() * c.element_size() for c in caches)
        spec = SlabSpec(FP, 0, 1, 16, row_bytes)
        assert scan(path, spec) == dict(zip(slots, hs))

        _flip(path, spec.slot_offset(5) + PAGE + row_bytes // 2)
        sched.post(disk_job(5, DiskOp.READ, [30, 31], [5, 1], [hs[0], hs[1]]))
        sched.post(disk_job(6, DiskOp.READ, [32], [1], [hs[2]]))
        done = sched.collect([5, 6], timeout=60)[0]
        assert not done[5].ok and "1 crc" in done[5].error and "1 ok" in done[5].error
        assert not done[6].ok and "1 header" in done[6].error
        stop(sched, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sched.close()


def test_disk_jobs_fail_with_the_reason_without_a_usable_disk_tier(tmp_path: Path) -> None:
    """Rank 0's Ready names no disk tier; rank 1's names a slab this process holds (the
    worker's open is refused): both fail every Disk job at once, saying why, and keep
    serving copies."""
    caches = [random_caches([((NB, 1024), torch.uint8)]) for _ in range(2)]
    path = str(tmp_path / "held.slab")
    held = SlabFile.open(path, SlabSpec(FP, 1, 2, 4, 1024), direct=True)
    sched = DiskSched(2, lambda r: None if r == 0 else DiskSetup(path, 4, FP, True),
                      device_caches=caches, num_cpu_blocks=16)
    proc = spawn(sched.name, 2)
    try:
        sched.wait_for(sched.ready, timeout=60, what="Ready")
        sched.post(disk_job(1, DiskOp.WRITE, [0], [0], hashes(1)))
        sched.post(transfer(1, 2, Direction.STORE, [0], [0]))
        got = sched.collect([1, 2], timeout=60)
        assert got[0][1].error == "DiskError: no disk tier"
        assert not got[1][1].ok and "SlabLocked" in got[1][1].error
        assert got[0][2].ok and got[1][2].ok
        stop(sched, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sched.close()
        held.close()


# ---------------------------------------------------------------------------- slab vs processes

_HOLD = """
import sys, time
from kvshm.disk import SlabFile, SlabLocked, SlabSpec
try:
    s = SlabFile.open(sys.argv[1], SlabSpec({fp!r}, 0, 1, 4, 4096), direct=True)
except SlabLocked as exc:
    print("locked:", exc, flush=True)
    sys.exit(3)
print("holding", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], text=True,
                            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)


def test_a_second_process_is_refused_and_the_lock_dies_with_its_holder(tmp_path: Path) -> None:
    path = str(tmp_path / "s.slab")
    code = _HOLD.format(fp=FP)
    mine = SlabFile.open(path, SlabSpec(FP, 0, 1, 4, 4096), direct=True)
    other = _child(code, path, "0")
    out, _ = other.communicate(timeout=60)
    assert other.returncode == 3 and "in use by another engine" in out
    mine.close()
    holder = _child(code, path, "60")
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        with pytest.raises(Exception, match="in use by another engine"):
            SlabFile.open(path, SlabSpec(FP, 0, 1, 4, 4096), direct=True)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        SlabFile.open(path, SlabSpec(FP, 0, 1, 4, 4096), direct=True).close()
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


ROW = 8 << 20  # one large slot: each write takes milliseconds

_WRITER = """
import mmap, random, sys
from kvshm.disk import SlabFile, SlabSpec
s = SlabFile.open(sys.argv[1], SlabSpec({fp!r}, 0, 1, 2, {row}), direct=True)
blocks = []
for seed in (1, 2):
    m = mmap.mmap(-1, {row})
    m[:] = random.Random(seed).randbytes({row})
    blocks.append((memoryview(m), bytes([seed]) * 32))
n = 0
while True:
    view, h = blocks[n % 2]
    s.write(0, [view], h)
    n += 1
    if n == 2:
        print("writing", flush=True)
"""


@pytest.fixture
def expected() -> Iterator[dict[bytes, bytes]]:
    yield {bytes([seed]) * 32: random.Random(seed).randbytes(ROW) for seed in (1, 2)}


def test_a_writer_killed_mid_write_never_leaves_a_wrong_hit(
        tmp_path: Path, expected: dict[bytes, bytes]) -> None:
    """A child rewrites one 8 MiB slot with block 1, block 2, block 1, ... and is
    SIGKILLed at a random moment, several times: afterwards the slot reads as a HIT
    under at most one of the two hashes, and a HIT's bytes are that block's."""
    path = str(tmp_path / "torn.slab")
    spec = SlabSpec(FP, 0, 1, 2, ROW)
    rng = random.Random(11)
    outcomes: list[tuple[SlotOutcome, SlotOutcome]] = []
    buf = mmap.mmap(-1, ROW)
    for _ in range(6):
        child = _child(_WRITER.format(fp=FP, row=ROW), path)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "writing"
            time.sleep(rng.uniform(0.0, 0.05))
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        s = SlabFile.open(path, spec, direct=True)
        try:
            got = []
            for h, want in expected.items():
                outcome = s.read_into(0, [memoryview(buf)], h)
                if outcome is SlotOutcome.HIT:
                    assert buf[:] == want, "a HIT with the wrong bytes"
                got.append(outcome)
            assert got.count(SlotOutcome.HIT) <= 1
            outcomes.append((got[0], got[1]))
        finally:
            s.close()
    assert len(outcomes) == 6
    assert os.path.getsize(path) == spec.file_bytes


@contextlib.contextmanager
def embedded_disk_worker(tmp_path: Path) -> Iterator[tuple[DiskSched, Worker, torch.Tensor]]:
    """A scheduler with a 16-slot disk tier and one embedded rank attached in this
    process, READY: yields the scheduler, the worker and its host rows (rows 0-3 set to
    random bytes); closes both after."""
    from workers.worker import Phase, Worker

    setup = DiskSetup(str(tmp_path / "r0.slab"), 16, FP, True)
    sched = DiskSched(1, lambda r: setup, num_cpu_blocks=64)
    region = torch.randint(0, 256, (NB, 4096), dtype=torch.uint8)
    worker = Worker.attach(sched.name, 0, 1, [region])
    try:
        sched.wait_for(lambda: worker.phase is Phase.READY, tick=worker.service, what="READY")
        assert worker._session is not None  # the host rows, to check bytes
        rows = worker._session.host.regions[0]
        rows[0:4].copy_(torch.randint(0, 256, (4, 4096), dtype=torch.uint8))
        yield sched, worker, rows
    finally:
        worker.close()
        sched.close()


def test_an_embedded_workers_disk_done_reaches_the_scheduler_without_another_call(
        tmp_path: Path) -> None:
    """An embedded worker (vLLM's: it runs only inside its host's hooks) takes a Disk
    WRITE and a Disk READ off the ring in one call and is then never called again: each
    Done still reaches the scheduler's ``done`` ring within a few seconds, published by
    the worker's mover publisher as the job finishes (before it, they waited for the
    host's next call: a disk hit cost vLLM extra engine steps). The READ's Done comes
    only after its rows hold the slot's bytes."""
    with embedded_disk_worker(tmp_path) as (sched, worker, rows):
        want = rows[0:4].clone()
        hs = hashes(4)
        sched.post(disk_job(1, DiskOp.WRITE, [0, 1, 2, 3], [2, 3, 4, 5], hs))
        sched.wait_for(lambda: worker.statistics()["counters"].get("jobs_submitted", 0) >= 1,
                       tick=worker.service, what="the WRITE taken off the ring")
        assert sched.collect([1], timeout=10)[0][1].ok  # no worker call in between
        sched.post(disk_job(2, DiskOp.READ, [10, 11, 12, 13], [2, 3, 4, 5], hs))
        sched.wait_for(lambda: worker.statistics()["counters"].get("jobs_submitted", 0) >= 2,
                       tick=worker.service, what="the READ taken off the ring")
        assert sched.collect([2], timeout=10)[0][2].ok
        assert torch.equal(rows[10:14], want)
        stats = worker.statistics()["counters"]
        assert stats["dones_published_on_finish"] >= 1 and stats["publisher_wakeups"] >= 1


def test_an_embedded_worker_starts_disk_jobs_as_they_arrive_without_a_host_call(
        tmp_path: Path) -> None:
    """An embedded worker with a disk tier whose host makes no call at all once it is
    READY (vLLM's scheduler waiting inside a lookup for a READ it just posted: the
    worker's hooks run only after the lookup returns): a Disk WRITE and then a Disk READ
    posted to its ring are taken off the ring by the mover publisher as they arrive,
    run, and their Dones reach the scheduler; the READ's rows hold the slot's bytes.
    Before, a Disk job waited on the ring for the host's next connector hook."""
    with embedded_disk_worker(tmp_path) as (sched, worker, rows):
        want = rows[0:4].clone()
        hs = hashes(4)
        sched.post(disk_job(1, DiskOp.WRITE, [0, 1, 2, 3], [2, 3, 4, 5], hs))
        assert sched.collect([1], timeout=10)[0][1].ok  # no worker call from here on
        sched.post(disk_job(2, DiskOp.READ, [10, 11, 12, 13], [2, 3, 4, 5], hs))
        assert sched.collect([2], timeout=10)[0][2].ok
        assert torch.equal(rows[10:14], want)
        assert worker.statistics()["counters"]["jobs_taken_on_arrival"] == 2
    assert worker.statistics()["counters"]["publisher_command_wakeups"] >= 2


def test_a_store_into_rows_a_write_still_reads_runs_after_that_write(tmp_path: Path) -> None:
    """The row fence in a worker process: the scheduler hands CPU rows 0-47 to a new
    store while the WRITE of their old blocks, posted just before it (as a victim's
    write-down is), is still queued behind a write-back burst of 192 other rows. The
    rank's store copy waits for that WRITE (whose runs move up): the slots hold the
    rows' old bytes -- read back through other rows, every CRC matching, and loaded to
    device blocks 0-47: their original bytes -- and the store succeeds. Without the
    fence the store overwrites rows the WRITE has not read yet."""
    caches = random_caches(CACHES["aligned"])
    n = 48
    setup = DiskSetup(str(tmp_path / "r0.slab"), 5 * n, FP, True)
    sched = DiskSched(1, lambda r: setup, device_caches=[caches], num_cpu_blocks=6 * n)
    proc = spawn(sched.name, 1)
    try:
        sched.wait_for(sched.ready, timeout=60, what="Ready")
        orig = [c.clone() for c in caches]
        hs = hashes(n, salt=9)
        sched.post(transfer(1, 1, Direction.STORE, range(n), range(n)))
        assert sched.collect([1], timeout=60)[0][1].ok
        burst = list(range(2 * n, 6 * n))                            # 4 jobs of 48
        for k in range(4):
            sched.post(disk_job(10 + k, DiskOp.WRITE, burst[k * n:(k + 1) * n],
                                list(range((k + 1) * n, (k + 2) * n)), hashes(n, salt=k)))
        sched.post(disk_job(3, DiskOp.WRITE, list(range(n)), list(range(n)), hs))
        src = [*range(n, NB), *range(n - (NB - n))]                # other device blocks
        sched.post(transfer(2, 4, Direction.STORE, src, range(n)))
        done = sched.collect([10, 11, 12, 13, 3, 4], timeout=60)[0]
        assert all(d.ok for d in done.values())
        back = list(range(n, 2 * n))
        sched.post(disk_job(5, DiskOp.READ, back, list(range(n)), hs))
        assert sched.collect([5], timeout=60)[0][5].ok             # every CRC matched
        sched.post(transfer(3, 6, Direction.LOAD, back, range(n)))
        assert sched.collect([6], timeout=60)[0][6].ok
        for c, o in zip(caches, orig):
            assert torch.equal(c[0:n].view(torch.uint8), o[0:n].view(torch.uint8))
        stop(sched, proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sched.close()
