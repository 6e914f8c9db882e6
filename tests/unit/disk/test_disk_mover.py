"""workers.disk_mover.DiskMover in one process: real host pools (memfd), real slab files
under tmp_path, real threads. Its counters (the numbers a rank reports under
``statistics()["disk"]``), and every way a job fails without touching the disk: a
malformed job, a revoked rank (the gate), a closed mover. And the row fence: a READ into
a row that an earlier WRITE still reads waits for it. And how a READ is cut into runs:
neighbouring slots stay in one run (one thread, one vectored read)."""

from __future__ import annotations

import hashlib
import os
import select
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvshm.disk import PAGE, SlabFile, SlabSpec
from kvshm.ipc.protocol import Disk, DiskOp, DiskSetup, Done, LayoutSpec, RegionSpec, pack_ids
from workers import slab_opener
from workers.disk_mover import DiskMover, read_runs
from workers.host_pool import HostPool

FP = "mover-test.fp16.bs16"
BLOCKS = 16


def pool(region_bytes: tuple[int, ...], seed: int) -> HostPool:
    spec = LayoutSpec(tuple(RegionSpec(b, BLOCKS, "uint8") for b in region_bytes))
    p = HostPool.for_tests(spec, BLOCKS, pin=False)
    g = torch.Generator().manual_seed(seed)
    for r in p.regions:
        r.copy_(torch.randint(0, 256, tuple(r.shape), dtype=torch.uint8, generator=g))
    return p


def hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(bytes([k])).digest() for k in range(n)]


def job(job_id: int, op: DiskOp, rows: list[int], slots: list[int], hs: list[bytes],
        hash_len: int | None = None) -> Disk:
    return Disk(job_id, op, pack_ids(rows), pack_ids(slots), b"".join(hs),
                len(hs[0]) if hash_len is None else hash_len)


def wait(mover: DiskMover, n: int = 1) -> list[Done]:
    got: list[Done] = []
    while len(got) < n:
        ready, _, _ = select.select([mover.notify_fd()], [], [], 10.0)
        assert ready, f"only {got} of {n} Dones"
        got += mover.poll()
    return got


class FirstRunHeld:
    """A mover gate that holds the first run that asks it until ``go`` is set (``held``
    says it is held), and lets every later run through: one job occupies a thread while
    the test queues others behind it."""

    def __init__(self) -> None:
        self.go, self.held = threading.Event(), threading.Event()
        self._calls = 0

    def __call__(self) -> bool:
        self._calls += 1
        if self._calls == 1:
            self.held.set()
            assert self.go.wait(10)
        return True


@pytest.fixture
def movers() -> Iterator[list[DiskMover]]:
    made: list[DiskMover] = []
    yield made
    for m in made:
        m.close()
        m.release()


def make(movers: list[DiskMover], tmp_path: Path, p: HostPool, **kw: int) -> DiskMover:
    m = DiskMover(0, 1, DiskSetup(str(tmp_path / "m.slab"), 8, FP, True), p, **kw)
    movers.append(m)
    return m


def test_a_slab_still_locked_at_the_start_is_opened_once_its_holder_lets_go(
        tmp_path: Path, movers: list[DiskMover], monkeypatch: pytest.MonkeyPatch) -> None:
    """Restart under the same name while the previous run's rank still holds the slab's
    lock (a rank slow to exit; here this test holds it). The mover's one open at Ready
    raised SlabLocked: the rank had no disk tier for the new engine's whole life -- every
    Disk job failed, warm slots were dropped one failed READ at a time -- though the lock
    was free seconds later (a hostile probe). Now the mover starts without its slab,
    fails each job saying why (``jobs_refused_no_slab``), and a thread of its own tries
    the open every ``RETRY_S`` (off the rank's loop: a review) until the holder lets
    go: then a WRITE and a READ back go through."""
    monkeypatch.setattr(slab_opener, "RETRY_S", 0.05)
    p = pool((PAGE,), seed=12)
    path = str(tmp_path / "m.slab")
    holder = SlabFile.open(path, SlabSpec(FP, 0, 1, 8, PAGE), direct=True)
    m = DiskMover(0, 1, DiskSetup(path, 8, FP, True), p)
    movers.append(m)
    hs = hashes(2)
    m.submit(job(1, DiskOp.WRITE, [0, 1], [3, 4], hs))
    (done,) = wait(m)
    assert not done.ok and "the slab is not open yet (SlabLocked" in (done.error or "")
    st = m.statistics()
    assert st["jobs_refused_no_slab"] == 1 and "in use by another engine" in st["waiting"]
    holder.close()
    deadline = time.monotonic() + 10
    while "waiting" in m.statistics():
        assert time.monotonic() < deadline, m.statistics()
        time.sleep(0.02)
    assert m.statistics()["open_retries"] >= 1
    m.submit(job(2, DiskOp.WRITE, [0, 1], [3, 4], hs))
    assert wait(m)[0].ok
    want = p.regions[0][[0, 1]].clone()
    m.submit(job(3, DiskOp.READ, [8, 9], [3, 4], hs))
    assert wait(m)[0].ok
    assert torch.equal(p.regions[0][[8, 9]], want)
    assert m.statistics()["writes"] == 2 and "waiting" not in m.statistics()


def test_a_mover_closed_while_its_slab_is_still_locked_stops_trying(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mover closes (the engine goes) while another process still holds the slab:
    its retry thread ends with the close, opens nothing afterwards, and the holder's
    file and lock are untouched (the close removes no file it never opened)."""
    monkeypatch.setattr(slab_opener, "RETRY_S", 0.02)
    p = pool((PAGE,), seed=13)
    path = str(tmp_path / "m.slab")
    holder = SlabFile.open(path, SlabSpec(FP, 0, 1, 8, PAGE), direct=True)
    try:
        m = DiskMover(0, 1, DiskSetup(path, 8, FP, False), p)  # keep=False: not removed
        time.sleep(0.1)
        m.close()
        m.release()
        assert not any(t.name == "kvshm-slab-r0" for t in threading.enumerate())
        assert m.statistics()["open_retries"] >= 1 and os.path.exists(path)
    finally:
        holder.close()
    SlabFile.open(path, SlabSpec(FP, 0, 1, 8, PAGE), direct=True).close()  # free


def test_a_mover_whose_threads_cannot_start_releases_its_slab(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slab is open and locked when the mover starts its threads; a thread that
    cannot start ("can't start new thread", faked at that seam) used to leave the fd and
    its lock held, so the rank's next mover on the same slab was refused (SlabLocked).
    Now the error propagates and a new mover opens the slab."""
    p = pool((PAGE,), seed=9)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    setup = DiskSetup(str(tmp_path / "m.slab"), 8, FP, True)
    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        DiskMover(0, 1, setup, p)
    monkeypatch.undo()
    m = DiskMover(0, 1, setup, p)
    m.close()
    m.release()


@pytest.mark.parametrize("regions,bounced", [((PAGE, 2 * PAGE), False), ((1000, 3000), True)],
                         ids=["aligned", "unaligned"])
def test_round_trip_and_counters(tmp_path: Path, movers: list[DiskMover],
                                 regions: tuple[int, ...], bounced: bool) -> None:
    src = pool(regions, seed=1)
    m = make(movers, tmp_path, src, threads=3)
    hs = hashes(6)
    m.submit(job(1, DiskOp.WRITE, [0, 1, 2, 3, 4, 5], [7, 6, 5, 0, 1, 2], hs))
    assert wait(m) == [Done(1, 0, True)]
    m.submit(job(2, DiskOp.READ, [10, 11, 12, 13, 14, 15], [7, 6, 5, 0, 1, 2], hs))
    assert wait(m) == [Done(2, 0, True)]
    for r in src.regions:
        assert torch.equal(r[10:16], r[0:6])
    st = m.statistics()
    assert st["writes"] == st["reads"] == 6 and st["failures"] == 0
    assert st["bytes_written"] == st["bytes_read"] == 6 * sum(regions)
    assert (st["bounce"] == 12) is bounced and (st["bounce"] == 0) is not bounced
    assert st["jobs_ok"] == 2 and st["direct"] is True and st["slots"] == 8


@pytest.mark.parametrize("threads", [1, 4], ids=["one-run", "runs-of-one"])
def test_a_bad_slot_fails_the_read_naming_crc_and_header(tmp_path: Path,
                                                        movers: list[DiskMover],
                                                        threads: int) -> None:
    """Slots 0-3 read as one vectored read (one thread: one run) or one each: the same
    outcomes per slot, the bad ones never HITs."""
    p = pool((PAGE,), seed=2)
    m = make(movers, tmp_path, p, threads=threads)
    hs = hashes(3)
    m.submit(job(1, DiskOp.WRITE, [0, 1, 2], [0, 1, 2], hs))
    assert wait(m)[0].ok
    off = SlabSpec(FP, 0, 1, 8, PAGE).slot_offset(1) + PAGE + 100
    with open(tmp_path / "m.slab", "r+b") as f:
        f.seek(off)
        f.write(b"\xff\x00\xff")
    m.submit(job(2, DiskOp.READ, [5, 6, 7, 8], [0, 1, 2, 3], [hs[0], hs[1], hs[0], hs[0]]))
    [done] = wait(m)
    assert not done.ok
    assert done.error == "DiskError: READ of 4 slot(s): 1 ok, 1 crc, 1 empty, 1 header"
    st = m.statistics()
    assert st["crc_mismatch"] == st["bad_header"] == st["empty"] == 1
    assert st["failures"] == 3 and st["jobs_failed"] == 1


@pytest.mark.parametrize("bad,why", [
    (Disk(1, DiskOp.WRITE, pack_ids([0, 1]), pack_ids([0]), b"x" * 64, 32), "2 rows but 1 slots"),
    (Disk(1, DiskOp.WRITE, pack_ids([0]), pack_ids([0]), b"x" * 65, 65), "hash_len 65"),
    (Disk(1, DiskOp.WRITE, pack_ids([0]), pack_ids([0]), b"", 0), "hash_len 0"),
    (Disk(1, DiskOp.READ, pack_ids([BLOCKS]), pack_ids([0]), b"x" * 8, 8), "CPU row out of range"),
    (Disk(1, DiskOp.READ, pack_ids([0]), pack_ids([8]), b"x" * 8, 8), "slot out of range"),
    (Disk(1, DiskOp.READ, b"\x00\x01\x02", pack_ids([0]), b"x" * 8, 8), "not a multiple of 4"),
])
def test_a_malformed_job_fails_at_once_with_the_reason(tmp_path: Path, movers: list[DiskMover],
                                                        bad: Disk, why: str) -> None:
    m = make(movers, tmp_path, pool((PAGE,), seed=3))
    m.submit(bad)
    [done] = wait(m)
    assert not done.ok and why in done.error and done.error.startswith("DiskError: ")
    assert m.statistics()["bad_jobs"] == 1 and m.statistics().get("writes", 0) == 0


def test_a_revoked_rank_touches_no_slot(tmp_path: Path, movers: list[DiskMover]) -> None:
    m = make(movers, tmp_path, pool((PAGE,), seed=4))
    m.set_gate(lambda: False)
    m.submit(job(1, DiskOp.WRITE, [0, 1], [0, 1], hashes(2)))
    [done] = wait(m)
    assert not done.ok and "2 revoked" in done.error and "rank revoked" in done.error
    st = m.statistics()
    assert st.get("writes", 0) == 0 and st["slots_refused"] == 2


def test_a_closed_mover_refuses_jobs_and_an_empty_job_is_ok(tmp_path: Path,
                                                           movers: list[DiskMover]) -> None:
    m = make(movers, tmp_path, pool((PAGE,), seed=5))
    m.submit(Disk(1, DiskOp.READ, b"", b"", b"", 32))
    assert wait(m) == [Done(1, 0, True)]
    m.close()
    m.submit(job(2, DiskOp.WRITE, [0], [0], hashes(1)))
    assert m.poll() == [Done(2, 0, False, "DiskError: mover closed")]
    assert m.statistics()["jobs_refused"] == 1


def test_a_read_into_a_row_a_write_still_reads_waits_for_that_write(
        tmp_path: Path, movers: list[DiskMover]) -> None:
    """The row fence: WRITE row 0 -> slot 5 is held in the gate (the first run asks it,
    and it waits for the test); a READ of slot 6 into the same row 0, submitted after,
    does not start (``reads_fenced``) -- on 3 threads it would otherwise overwrite row
    0 before the WRITE copies it -- and ``wait_rows`` on row 0 times out. Once the
    WRITE goes on, slot 5 holds row 0's old bytes and row 0 slot 6's."""
    p = pool((PAGE,), seed=3)
    m = make(movers, tmp_path, p, threads=3)
    hs = hashes(2)
    old0, row1 = p.regions[0][0].clone(), p.regions[0][1].clone()
    m.submit(job(1, DiskOp.WRITE, [1], [6], [hs[1]]))              # slot 6 := row 1
    assert wait(m) == [Done(1, 0, True)]
    gate = FirstRunHeld()
    m.set_gate(gate)
    m.submit(job(2, DiskOp.WRITE, [0], [5], [hs[0]]))
    assert gate.held.wait(10)
    m.submit(job(3, DiskOp.READ, [0], [6], [hs[1]]))
    assert m.statistics()["reads_fenced"] == 1
    assert not m.wait_rows([0], 0.05) and m.wait_rows([2, 3], 0.05)
    time.sleep(0.05)
    assert m.poll() == [] and torch.equal(p.regions[0][0], old0)
    gate.go.set()
    assert sorted(wait(m, 2), key=lambda d: d.job_id) == [Done(2, 0, True), Done(3, 0, True)]
    assert torch.equal(p.regions[0][0], row1) and m.wait_rows([0], 0.0)
    m.submit(job(4, DiskOp.READ, [2], [5], [hs[0]]))                # slot 5: row 0's old
    assert wait(m) == [Done(4, 0, True)] and torch.equal(p.regions[0][2], old0)
    st = m.statistics()
    assert (st["fence_timeouts"], st["reads_fenced"]) == (1, 1)


def test_a_read_fenced_on_a_write_that_close_cancels_is_counted_cancelled(
        tmp_path: Path, movers: list[DiskMover]) -> None:
    """One thread: WRITE 1 (slot 5) holds it in the gate, WRITE 2 (row 0) is queued and
    READ 3 into row 0 waits for it (``reads_fenced`` 1). ``close`` cancels WRITE 2; its
    end releases READ 3 into a closed mover, which fails it as cancelled too: both
    slots are counted in ``slots_cancelled`` (the READ was out of the fenced list, so
    ``cancel_queued`` never saw it), and both jobs' Dones say not ok."""
    m = make(movers, tmp_path, pool((4096,), seed=9), threads=1)
    gate = FirstRunHeld()
    m.set_gate(gate)
    hs = hashes(3)
    m.submit(job(1, DiskOp.WRITE, [5], [1], [hs[0]]))
    assert gate.held.wait(10)
    m.submit(job(2, DiskOp.WRITE, [0], [2], [hs[1]]))
    m.submit(job(3, DiskOp.READ, [0], [3], [hs[2]]))
    assert m.statistics()["reads_fenced"] == 1
    closer = threading.Thread(target=m.close)
    closer.start()
    closer.join(0.3)
    gate.go.set()
    closer.join(10)
    assert not closer.is_alive()
    dones = {d.job_id: d for d in m.poll()}
    assert not dones[2].ok and not dones[3].ok
    assert m.statistics()["slots_cancelled"] == 2


def test_a_reads_neighbouring_slots_stay_in_one_run_and_scattered_ones_are_shared() -> None:
    """``read_runs``: a stretch of neighbouring slots is one run (up to ``most``
    entries); scattered slots are cut every ``run`` entries; a run ends where a stretch
    does; every entry is in exactly one run, in order."""
    assert read_runs(list(range(16)), 4, 28) == [(0, 16)]
    assert read_runs(list(range(60)), 8, 28) == [(0, 28), (28, 56), (56, 60)]
    assert read_runs([1, 5, 9, 13, 20, 30, 40, 50], 2, 28) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert read_runs([1, 2, 3, 10, 11, 12, 13, 14, 30], 2, 28) == [(0, 3), (3, 8), (8, 9)]
    assert read_runs([7, 3], 1, 1) == [(0, 1), (1, 2)]
    assert read_runs([3], 4, 28) == [(0, 1)]
    assert read_runs([], 4, 28) == []


def test_a_read_of_neighbouring_slots_is_one_thread_and_bit_exact(
        tmp_path: Path, movers: list[DiskMover]) -> None:
    """A READ of eight neighbouring slots on a four-thread mover goes to the slab as one
    run (one thread reads all eight); the rows come back bit-exact."""
    src = pool((PAGE, 2 * PAGE), seed=3)
    m = make(movers, tmp_path, src, threads=4)
    hs = hashes(8)
    m.submit(job(1, DiskOp.WRITE, list(range(8)), list(range(8)), hs))
    assert wait(m) == [Done(1, 0, True)]
    seen: list[tuple[int, int, str]] = []
    inner = m._run

    def run(j: object, start: int, end: int) -> list[str]:
        seen.append((start, end, threading.current_thread().name))
        return inner(j, start, end)  # type: ignore[arg-type]

    m._run = run  # type: ignore[method-assign,assignment]
    m.submit(job(2, DiskOp.READ, list(range(8, 16)), list(range(8)), hs))
    assert wait(m) == [Done(2, 0, True)]
    assert [(a, b) for a, b, _ in seen] == [(0, 8)]
    for r in src.regions:
        assert torch.equal(r[8:16], r[0:8])


def test_a_slab_the_rank_refuses_is_said_in_one_line(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    """Hazard "a refused slab turned the disk tier off without a word" (a hostile probe:
    another user's file where a rank's slab goes): the rank's open refused the file, so
    every disk job of the rank failed, and the reason lived only in the Done errors and
    the rank's statistics: at DEBUG the engine's stderr showed nothing. Here the file at
    the slab's path may be written by others (mode 0666, refused as untrusted); the
    session's disk tier is off and one WARNING names the rank and the reason."""
    from kvshm.ipc.protocol import Ready
    from workers.session import _make_disk

    path = tmp_path / "m.slab"
    path.write_bytes(b"\0" * PAGE)
    path.chmod(0o666)
    p = pool((64,), 1)
    ready = Ready(2, 0, p.spec, BLOCKS, 64, 64, (0,), 0, disk=DiskSetup(str(path), 8, FP))
    with caplog.at_level("WARNING", logger="workers.session"):
        mover, why = _make_disk(ready, p, 1)
    assert mover is None and why is not None and "written by others" in why
    (rec,) = [r for r in caplog.records if r.name == "workers.session"]
    assert "rank 0" in rec.getMessage() and "written by others" in rec.getMessage()
    p.close()
