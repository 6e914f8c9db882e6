"""Transport stress across real processes: torn reads, lost wake-ups, idle CPU.

* torn reads: another process moves a ring position 10**6 times (across the 2**32
  boundary); every load this side makes must be monotonic and every record intact.
  A control shows the detector does see a torn store: a writer stores the same word
  byte by byte and, at every carry, holds the half-written value until the reader has
  loaded it (a handshake, so the tear is seen whatever the machine's load).
* lost wake-ups: a writer publishes at random instants relative to the reader's park
  handshake; no wake-up may be left to the 1 s poll timeout (``rescues == 0``), and the
  worst wake-up latency is printed. 10**4 races here, 10**5 in the ``slow`` variant.
  The writer rings with ``doorbell.notify``, the function both channel ends call after
  every publish, so the race exercises the shipped path.
* an idle parked worker uses < 2 % of a CPU.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import random
import struct
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

from kvshm.ipc import protocol as p
from kvshm.ipc.doorbell import Doorbell, Parker, create_eventfd, notify
from kvshm.ipc.ring_pair import RingPair, segment_size
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.ipc.worker_channel import WorkerChannel
from kvshm.shm import Segment, create_segment, map_segment

CTX = mp.get_context("fork")
CAP = 1 << 16
START = 2**32 - 8 * CAP  # positions cross 2**32 early in every run


@pytest.fixture
def seg() -> Iterator[Segment]:
    s = create_segment(segment_size(CAP, CAP), purpose="test stress")
    yield s
    s.close()


def run_child(target: Any, *args: Any) -> Any:
    proc = CTX.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def finish(proc: Any, timeout: float = 60) -> None:
    proc.join(timeout)
    if proc.is_alive():  # pragma: no cover - the failure being guarded against
        proc.kill()
        proc.join()
        pytest.fail("child process hung")
    assert proc.exitcode == 0


# -------------------------------------------------------------------- torn reads


def position_writer(fd: int, size: int, updates: int) -> None:
    """Publish ``updates`` records (one head store each) of 8 + (seq % 4) * 8 bytes."""
    seg = map_segment(fd, size)
    ring = RingPair.attach(seg.buf).cmd
    for seq in range(updates):
        payload = seq.to_bytes(8, "little") * (1 + seq % 4)
        while not ring.try_write(payload):
            pass


HEAD_AT = 128  # cmd.head's byte offset in the segment (kvshm.ipc.ring_pair's layout)


def wait_loads(loads: Any, n: int, deadline: float) -> None:
    """Spin (yielding the CPU) until the reader has completed ``n`` more loads of the head
    than now. The one that completes the count ``now + 2`` began after the count read
    here, so after every store this process made before calling."""
    target = loads.value + n
    while loads.value < target:
        if time.monotonic() > deadline:
            raise SystemExit("the reader stopped loading the head")
        time.sleep(0)


def tearing_writer(fd: int, size: int, updates: int, loads: Any) -> None:
    """The control: the head word stored byte by byte, low byte first, as a torn store
    would land. Where the low byte wraps (a carry into the next byte, every 32 updates),
    the writer holds the half-written word -- new low byte, old high bytes: a value below
    the old one -- until the reader has loaded the old value and then the torn one."""
    seg = map_segment(fd, size)
    deadline = time.monotonic() + 50
    for v in range(1, updates + 1):
        new = (START + 8 * v).to_bytes(8, "little")
        if seg.buf[HEAD_AT] > new[0]:  # this store carries: tear it where it is seen
            wait_loads(loads, 2, deadline)  # the reader has the old value
            seg.buf[HEAD_AT] = new[0]
            wait_loads(loads, 2, deadline)  # ... and has loaded the torn one
            seg.buf[HEAD_AT + 1:HEAD_AT + 8] = new[1:]
        else:
            struct.pack_into("<Q", seg.buf, HEAD_AT, START + 8 * v)


def watch_head(rings: RingPair, updates: int, consume: bool,
               loads_out: Any = None) -> tuple[int, int, int]:
    """Load cmd.head until it stops moving; returns (loads, non-monotonic, records).
    ``loads_out`` (a shared counter) gets the number of completed loads after each."""
    ring = rings.cmd
    last, loads, anomalies, seq = ring.head, 0, 0, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        head = ring.head
        loads += 1
        if loads_out is not None:
            loads_out.value = loads
        if head < last:
            anomalies += 1
        last = max(last, head)
        if consume and not ring.is_empty():
            for view in ring.read_available():
                assert bytes(view) == seq.to_bytes(8, "little") * (1 + seq % 4), seq
                seq += 1
                view.release()
            ring.commit_read()
        if (seq if consume else (last - START) // 8) >= updates:
            break
    return loads, anomalies, seq


def test_torn_read_stress_positions_are_never_torn(seg: Segment) -> None:
    updates = 10**6
    rings = RingPair.init(seg.buf, CAP, CAP, start_pos=START)
    proc = run_child(position_writer, seg.fd, seg.size, updates)
    t0 = time.monotonic()
    try:
        loads, anomalies, records = watch_head(rings, updates, consume=True)
    finally:
        finish(proc)
    print(f"torn-read stress: {updates} head stores, {loads} concurrent loads, "
          f"{anomalies} non-monotonic, {time.monotonic() - t0:.1f} s")  # fmt: skip
    assert records == updates
    assert anomalies == 0
    assert rings.cmd.head > 2**32 and rings.cmd.tail == rings.cmd.head
    rings.close()


def test_torn_read_detector_sees_every_torn_store(seg: Segment) -> None:
    """Control: the detector the stress test relies on (``watch_head``: a load below an
    earlier one) catches a torn head store every time the reader loads one.

    It used to let ``struct.pack_into`` (which stores byte by byte) race the reader and
    asserted that some tear was seen: that needs both processes on a CPU at the same
    nanoseconds, which a loaded machine does not give (it failed with 0 tears under load
    and passed alone). Here the writer holds each torn value until the reader has loaded
    it (a handshake on a shared load counter), so the number of tears the reader is shown
    is fixed -- one per carry out of the low byte -- and the detector must count each."""
    updates = 2000
    carries = sum((START + 8 * v) & 0xFF == 0 for v in range(1, updates + 1))
    loads_seen = CTX.RawValue(ctypes.c_uint64, 0)
    rings = RingPair.init(seg.buf, CAP, CAP, start_pos=START)
    proc = run_child(tearing_writer, seg.fd, seg.size, updates, loads_seen)
    try:
        loads, anomalies, _ = watch_head(rings, updates, consume=False, loads_out=loads_seen)
    finally:
        finish(proc)
    print(f"torn-store control: {loads} loads, {anomalies} non-monotonic, {carries} torn")
    assert carries == updates // 32
    assert anomalies >= carries
    rings.close()


# ----------------------------------------------------------------- lost wake-ups


def racing_writer(fd: int, size: int, efd: int, count: int, max_gap_us: int) -> None:
    """Publish ``count`` (seq, t_ns) records at random instants, ringing only a parked
    reader; the gaps straddle the reader's drain/park/re-check window."""
    seg = map_segment(fd, size)
    ring = RingPair.attach(seg.buf).cmd
    bell = Doorbell(efd)
    rnd = random.Random(1234)
    for seq in range(count):
        gap_ns = rnd.randrange(max_gap_us * 1000)
        end = time.perf_counter_ns() + gap_ns
        while time.perf_counter_ns() < end:
            pass
        rec = struct.pack("<QQ", seq, time.monotonic_ns())
        while not ring.try_write(rec):
            pass
        notify(ring, bell)


def lost_wakeup_stress(seg: Segment, count: int) -> None:
    rings = RingPair.init(seg.buf, CAP, CAP)
    efd = create_eventfd()
    bell = Doorbell(efd)
    parker = Parker(rings.cmd, bell)
    proc = run_child(racing_writer, seg.fd, seg.size, efd, count, 40)
    worst = 0
    lat: list[int] = []
    nxt = 0
    try:
        while nxt < count:
            views = rings.cmd.read_available()
            now = time.monotonic_ns()
            for view in views:
                seq, t_ns = struct.unpack("<QQ", view)
                assert seq == nxt
                nxt += 1
                lat.append(now - t_ns)
                view.release()
            rings.cmd.commit_read()
            if not views:
                parker.park(1.0)
    finally:
        finish(proc)
        bell.close()
        rings.close()
    lat.sort()
    worst = lat[-1]
    print(f"lost-wake-up stress: {count} records, parks {parker.parks}, re-check saves "
          f"{parker.rechecks}, spurious {parker.spurious}, timeouts {parker.timeouts}, "
          f"rescues {parker.rescues}; latency p50 {lat[len(lat) // 2] / 1e3:.1f} us, "
          f"p99 {lat[len(lat) * 99 // 100] / 1e3:.1f} us, worst {worst / 1e3:.1f} us")  # fmt: skip
    assert parker.rescues == 0  # no wake-up was left to the poll timeout
    assert worst < 0.9e9  # below the 1 s safety net (0.5 s left a loaded machine no room)
    assert parker.parks > count // 100  # the reader really did park and race


def test_lost_wakeup_stress(seg: Segment) -> None:
    lost_wakeup_stress(seg, 10**4)


@pytest.mark.slow
def test_lost_wakeup_stress_long(seg: Segment) -> None:
    lost_wakeup_stress(seg, 10**5)


def echo_worker(fd: int, size: int, cmd: int, done: int, rnd_seed: int) -> None:
    """Worker that parks at once and answers after a random short spin."""
    seg = map_segment(fd, size)
    ch = WorkerChannel(0, RingPair.attach(seg.buf), cmd, done, None, spin_us=0)
    rnd = random.Random(rnd_seed)
    while True:
        msgs = ch.receive(None)
        end = time.perf_counter_ns() + rnd.randrange(30_000)
        while time.perf_counter_ns() < end:
            pass
        if any(isinstance(m, p.Shutdown) for m in msgs):
            assert ch.statistics().rescues == 0
            return
        ch.send_many([p.Done(m.job_id, 0, True) for m in msgs if isinstance(m, p.Transfer)])


async def test_channel_wakeups_race_both_directions(seg: Segment) -> None:
    """Scheduler on asyncio and a parking worker, random windows: no rescues anywhere."""
    rings = RingPair.init(seg.buf, CAP, CAP)
    cmd, done = create_eventfd(), create_eventfd()
    proc = run_child(echo_worker, seg.fd, seg.size, cmd, done, 99)
    ch = SchedulerChannel(0, rings, cmd, done, recheck_interval=0.5)
    loop = asyncio.get_running_loop()
    rnd = random.Random(5)
    total, got = 3000, 0
    finished: asyncio.Future[None] = loop.create_future()
    ids = p.pack_ids([1])

    def on_done(msgs: list[p.Done]) -> None:
        nonlocal got
        got += len(msgs)
        if got >= total and not finished.done():
            finished.set_result(None)

    ch.attach(loop, on_done)
    try:
        sent = 0
        while sent < total:
            k = min(total - sent, rnd.choice([1, 1, 2, 5]))
            ch.post_many([p.Transfer(0, sent + i, p.Direction.LOAD, ids, ids) for i in range(k)])
            sent += k
            await asyncio.sleep(rnd.choice([0, 0, 20e-6, 100e-6]))
        await asyncio.wait_for(finished, 30)
        ch.post(p.Shutdown())
        finish(proc)
    finally:
        if proc.is_alive():
            proc.kill()
        ch.close()
    st = ch.statistics()
    print(f"channel race: {st}")
    assert got == total and st.rescues == 0


# ----------------------------------------------------------------------- idle CPU


def idle_worker(fd: int, size: int, cmd: int, done: int, out: Connection) -> None:
    seg = map_segment(fd, size)
    ch = WorkerChannel(0, RingPair.attach(seg.buf), cmd, done, None)
    ch.receive(0.05)  # warm up
    c0, t0 = time.process_time(), time.monotonic()
    assert ch.receive(1.0) == []
    out.send((time.process_time() - c0, time.monotonic() - t0, ch.statistics().parks))


def test_idle_parked_worker_uses_under_2_percent_cpu(seg: Segment) -> None:
    RingPair.init(seg.buf, CAP, CAP).close()
    cmd, done = create_eventfd(), create_eventfd()
    rx, tx = CTX.Pipe(duplex=False)
    proc = run_child(idle_worker, seg.fd, seg.size, cmd, done, tx)
    try:
        cpu, wall, parks = rx.recv()
    finally:
        finish(proc)
    for fd in (cmd, done):
        Doorbell(fd).close()
    print(f"idle worker: {cpu * 1e3:.2f} ms CPU over {wall:.2f} s ({100 * cpu / wall:.3f} %), "
          f"{parks} parks")  # fmt: skip
    assert wall >= 0.9 and parks >= 1
    assert cpu / wall < 0.02
