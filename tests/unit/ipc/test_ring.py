"""kvshm.ipc.ring + kvshm.ipc.ring_pair: segment layout, framing, wrap-around, full/empty,
batches, corruption (one process).

Cross-process behaviour (round trips, torn reads, wake-ups) is in test_channel.py and
test_transport_stress.py; here both ends of a ring live in one process over a real
(unlinked) posix shared-memory segment, which is what the worker maps too.
"""

from __future__ import annotations

import platform
import random
from collections.abc import Iterator

import pytest

from kvshm.errors import ConfigError, ProtocolError, UnsupportedPlatform
from kvshm.ipc import ring as ring_mod
from kvshm.ipc.ring import MIN_RING_CAPACITY, Ring, min_capacity
from kvshm.ipc.ring_pair import CONTROL_SIZE, LAYOUT_VERSION, RingPair, WorkerState, segment_size
from kvshm.shm import Segment, create_segment

CAP = 4096


@pytest.fixture
def seg() -> Iterator[Segment]:
    s = create_segment(segment_size(CAP, CAP), purpose="test ring")
    yield s
    s.close()


@pytest.fixture
def pair(seg: Segment) -> Iterator[tuple[RingPair, RingPair]]:
    """(scheduler view, worker view) of one segment."""
    sched = RingPair.init(seg.buf, CAP, CAP)
    worker = RingPair.attach(seg.buf)
    yield sched, worker
    sched.close()
    worker.close()


def drain(r: Ring) -> list[bytes]:
    out = [bytes(v) for v in r.read_available()]
    r.commit_read()
    return out


def test_geometry_and_min_capacity() -> None:
    """The segment size is the control block plus both rings, the done ring starting on
    a 128-byte line. min_capacity(n) is twice the largest Transfer over n GPU blocks (a
    record may take at most half a ring, so it fits at any offset), never below
    MIN_RING_CAPACITY. A capacity that is not a multiple of 8, or below the minimum, and
    a negative block count are ConfigError: a bad geometry is refused before a segment
    exists."""
    assert segment_size(4096, 8192) == CONTROL_SIZE + 4096 + 8192
    assert segment_size(4104, 4096) == CONTROL_SIZE + 4224 + 4096  # done ring 128-aligned
    assert min_capacity(0) == MIN_RING_CAPACITY
    big = min_capacity(100_000)
    assert big >= 2 * (8 * 100_000) and big % 64 == 0
    for bad in (0, 4095, MIN_RING_CAPACITY - 8, 4097):
        with pytest.raises(ConfigError):
            segment_size(bad, 4096)
    with pytest.raises(ConfigError):
        min_capacity(-1)


def test_largest_transfer_fits_min_capacity() -> None:
    """The ring min_capacity(n) sizes takes a Transfer of n ids at every offset the
    previous records leave (seven in a row, each read back by a fresh attach): a
    capacity computed for the largest plan never refuses it."""
    from kvshm.ipc import protocol as p

    n = 5000
    rec = p.cmd_encoder().encode(
        p.Transfer(2**40, 2**40, p.Direction.LOAD, p.pack_ids(range(n)), p.pack_ids(range(n)))
    )
    cap = min_capacity(n)
    s = create_segment(segment_size(cap, 4096), purpose="test ring")
    try:
        rp = RingPair.init(s.buf, cap, 4096)
        assert len(rec) <= rp.cmd.max_payload()
        for _ in range(7):  # every offset the previous records leave
            assert rp.cmd.try_write(rec)
            r = RingPair.attach(s.buf)
            assert [bytes(v) for v in r.cmd.read_available()] == [rec]
            r.cmd.commit_read()
            r.close()
        rp.close()
    finally:
        s.close()


def test_init_validates_buffer_and_start(seg: Segment) -> None:
    """init refuses a buffer too small for the geometry, a read-only one and a start
    position that is not 8-aligned (ConfigError): the scheduler never formats a segment
    its worker could not use."""
    with pytest.raises(ConfigError):
        RingPair.init(bytearray(100), CAP, CAP)
    with pytest.raises(ConfigError):
        RingPair.init(bytes(segment_size(CAP, CAP)), CAP, CAP)  # read-only
    with pytest.raises(ConfigError):
        RingPair.init(seg.buf, CAP, CAP, start_pos=3)


def test_attach_rejects_bad_magic_version_geometry(seg: Segment) -> None:
    """attach validates before it trusts: an unformatted segment (zero magic), another
    layout version, a capacity larger than the segment or not a legal one, and a buffer
    too small for the control block are ProtocolError naming the ring and the offset --
    a worker never reads rings from a segment it does not understand."""
    with pytest.raises(ProtocolError) as e:
        RingPair.attach(seg.buf)  # never formatted: zero magic
    assert e.value.ring == "control" and e.value.offset == 0
    RingPair.init(seg.buf, CAP, CAP).close()
    ctl = memoryview(seg.buf)[:CONTROL_SIZE].cast("Q")
    try:
        ctl[1] = 99
        with pytest.raises(ProtocolError, match="layout version 99") as e:
            RingPair.attach(seg.buf)
        assert e.value.offset == 8
        ctl[1] = LAYOUT_VERSION
        ctl[2] = 1 << 30  # cmd capacity larger than the segment
        with pytest.raises(ProtocolError, match="geometry"):
            RingPair.attach(seg.buf)
        ctl[2] = 12  # not a legal capacity
        with pytest.raises(ProtocolError, match="geometry"):
            RingPair.attach(seg.buf)
    finally:
        ctl.release()
    with pytest.raises(ProtocolError):
        RingPair.attach(bytearray(16))


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "ppc64le", "riscv64"])
def test_refuses_unfenced_platforms(
    monkeypatch: pytest.MonkeyPatch, seg: Segment, machine: str
) -> None:
    """On a weakly ordered CPU (ARM, POWER, RISC-V) the ring's fence-free store order is
    not enough: init and attach refuse with UnsupportedPlatform naming the machine,
    instead of running with torn reads."""
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with pytest.raises(UnsupportedPlatform, match=machine):
        RingPair.init(seg.buf, CAP, CAP)
    with pytest.raises(UnsupportedPlatform):
        RingPair.attach(seg.buf)


def test_empty_ring(pair: tuple[RingPair, RingPair]) -> None:
    """A fresh ring is empty: no records, a commit releases 0 bytes, and publishing nothing
    reports that nothing was published (no doorbell to ring)."""
    _, w = pair
    assert w.cmd.is_empty()
    assert w.cmd.read_available() == []
    assert w.cmd.commit_read() == 0
    assert not w.cmd.publish()


def test_exactly_full_then_room_again(pair: tuple[RingPair, RingPair]) -> None:
    """Four 1024-byte records fill the 4096-byte ring exactly (head - tail == capacity):
    even an empty record is refused then. Reading does not free space -- the views point
    into the ring until commit_read -- and after the commit the writer has room again."""
    s, w = pair
    rec = bytes(1016)  # header 8 + 1016 = 1024: four fill the 4096-byte ring exactly
    for i in range(4):
        assert s.cmd.try_write(bytes([i]) + rec[1:])
    assert s.cmd.used() == CAP
    assert not s.cmd.try_write(b"")  # even an empty record needs 8 bytes
    got = w.cmd.read_available()
    assert [v[0] for v in got] == [0, 1, 2, 3]
    assert not s.cmd.try_write(b"x")  # views still held: no room until the commit
    del got
    assert w.cmd.commit_read() == CAP
    assert s.cmd.try_write(b"x")
    assert drain(w.cmd) == [b"x"]


def test_oversize_refused_at_sender(pair: tuple[RingPair, RingPair]) -> None:
    """A payload above max_payload (capacity // 2 - 8) is refused at the writer with
    ConfigError and nothing written; one of exactly max_payload fits at every offset
    once the ring has drained -- so a writer never waits for room that cannot appear."""
    s, w = pair
    limit = s.cmd.max_payload()
    assert limit == CAP // 2 - 8
    with pytest.raises(ConfigError, match="exceeds"):
        s.cmd.try_write(bytes(limit + 1))
    assert s.cmd.head == 0 and w.cmd.is_empty()  # nothing written
    # the largest legal record fits at every offset once the ring has drained
    for shift in range(0, CAP, 344):
        assert s.cmd.try_write(bytes(shift % 97))
        drain(w.cmd)
        assert s.cmd.try_write(bytes(limit))
        assert drain(w.cmd) == [bytes(limit)]


def test_batch_publish_is_one_head_store(pair: tuple[RingPair, RingPair]) -> None:
    """Staged records are invisible until publish, which makes them all visible with one
    head store; the reader sees every one and releases them with one tail store.
    write_many stops at the first record that does not fit, returning how many went in."""
    s, w = pair
    for i in range(5):
        assert s.cmd.stage(bytes([i]) * (i + 1))
    assert s.cmd.head == 0 and w.cmd.is_empty()  # staged, not visible
    assert s.cmd.publish()
    assert s.cmd.head == sum(8 + ((i + 8) & ~7) for i in range(5))
    views = w.cmd.read_available()
    assert [bytes(v) for v in views] == [bytes([i]) * (i + 1) for i in range(5)]
    assert w.cmd.tail == 0  # nothing released before the commit
    w.cmd.commit_read()
    assert w.cmd.tail == s.cmd.head
    assert s.cmd.write_many([b"a" * 1000] * 10) == 3  # stops at the first that does not fit
    assert len(drain(w.cmd)) == 3


@pytest.mark.parametrize("start", [0, 2**32 - 1024, 2**62 - 4096])
def test_wrap_around_many_laps_random_sizes(seg: Segment, start: int) -> None:
    """200 laps of random-sized batches (0 to max_payload bytes, SKIP records at the end of
    each lap), read at random moments, starting near 0, near 2**32 and near 2**62: every
    record comes out once, in order and intact, and the ring ends empty -- positions are
    u64 byte counts that never wrap in practice."""
    s = RingPair.init(seg.buf, CAP, CAP, start_pos=start)
    w = RingPair.attach(seg.buf)
    rnd = random.Random(start + 7)
    sent: list[bytes] = []
    got: list[bytes] = []
    seq = 0
    while s.cmd.head - start < 200 * CAP:  # 200 laps
        for _ in range(rnd.randint(1, 6)):
            n = rnd.choice([0, 1, 7, 8, 9, rnd.randint(0, s.cmd.max_payload())])
            payload = seq.to_bytes(4, "little") + bytes([seq & 0xFF]) * n
            payload = payload[: s.cmd.max_payload()]
            if not s.cmd.stage(payload):
                break
            sent.append(payload)
            seq += 1
        s.cmd.publish()
        if rnd.random() < 0.7:
            got.extend(drain(w.cmd))
    got.extend(drain(w.cmd))
    assert got == sent
    assert w.cmd.is_empty() and s.cmd.used() == 0
    s.close()
    w.close()


def test_zero_copy_views_point_into_the_segment(pair: tuple[RingPair, RingPair]) -> None:
    """read_available hands out views into the shared segment itself, not copies: a byte
    changed in the segment shows in the view (which is why a view must not outlive
    commit_read)."""
    s, w = pair
    s.done.try_write(b"hello")
    (view,) = w.done.read_available()
    assert bytes(view) == b"hello"
    base = CONTROL_SIZE + CAP  # done data starts after the cmd ring (128-aligned)
    seg_bytes = memoryview(w._mv)  # the segment itself
    seg_bytes[base + 8] = ord("J")
    assert bytes(view) == b"Jello"  # same memory, no copy
    seg_bytes.release()
    view.release()
    w.done.commit_read()


def test_corrupt_length_is_protocol_error_and_breaks_the_ring(
    pair: tuple[RingPair, RingPair],
) -> None:
    """A record whose length runs past the ring: the records before it are still delivered,
    then every read raises the same ProtocolError naming the ring and the offset, and
    the ring is marked broken -- a corrupt ring is never read past, and the process is
    not taken down."""
    s, w = pair
    s.cmd.try_write(b"good")
    pos = s.cmd.head
    s.cmd.try_write(b"bad!")
    s.cmd.try_write(b"after")
    q = memoryview(s._mv)[CONTROL_SIZE : CONTROL_SIZE + CAP].cast("Q")
    q[pos // 8] = (ring_mod._DATA << 32) | 5000  # length beyond the ring
    q.release()
    assert [bytes(v) for v in w.cmd.read_available()] == [b"good"]  # what came before
    for _ in range(3):  # then the same error every time; the process keeps going
        with pytest.raises(ProtocolError) as e:
            w.cmd.read_available()
        assert e.value.ring == "cmd" and e.value.offset == pos
    assert w.cmd.broken is e.value


@pytest.mark.parametrize("word", [0, (ring_mod._SKIP << 32) | 8, 0xDEADBEEF_00000010])
def test_garbled_headers_are_protocol_errors(pair: tuple[RingPair, RingPair], word: int) -> None:
    """A header that is zero, a SKIP that does not run to the end of the ring, or one of
    an unknown kind is ProtocolError naming the ring and offset: zeroed or garbled
    memory never decodes as a record."""
    s, w = pair
    s.done.try_write(b"12345678")
    q = memoryview(s._mv)[CONTROL_SIZE + CAP : CONTROL_SIZE + 2 * CAP].cast("Q")
    q[0] = word
    q.release()
    with pytest.raises(ProtocolError) as e:
        w.done.read_available()
    assert e.value.ring == "done" and e.value.offset == 0


def test_impossible_head_is_protocol_error(pair: tuple[RingPair, RingPair]) -> None:
    """A head more than a ring's worth ahead of the tail (a writer that broke the protocol,
    or corrupt memory) is ProtocolError, not a read of stale data."""
    s, w = pair
    ctl = memoryview(s._mv)[:CONTROL_SIZE].cast("Q")
    ctl[128 // 8] = CAP + 8  # cmd.head: more than a ring's worth ahead of the tail
    ctl.release()
    with pytest.raises(ProtocolError, match="impossible"):
        w.cmd.read_available()


def test_heartbeat_state_progress_and_park_tokens(pair: tuple[RingPair, RingPair]) -> None:
    """The worker's control words reach the scheduler's view of the same segment: the
    heartbeat counts up, the worker state and progress stamp are what it stored. Both
    rings start parked ('ring me'); each park takes a fresh, larger token (so a writer
    rings once per sleep) and unpark clears it."""
    s, w = pair
    assert s.heartbeat == 0 and s.worker_state.name == "UNSET"
    assert [w.beat() for _ in range(3)] == [1, 2, 3]
    assert s.heartbeat == 3
    w.worker_state = WorkerState.PARKED
    assert s.worker_state is WorkerState.PARKED
    w.mark_progress(12345)
    assert s.last_progress_ns == 12345
    assert s.cmd.parked and s.done.parked  # both start "ring me"
    t1 = w.cmd.park()
    t2 = w.cmd.park()
    assert 0 < t1 < t2 == s.cmd.park_token
    w.cmd.unpark()
    assert not s.cmd.parked and s.cmd.park_token == 0


def test_close_is_idempotent_and_releases_views(seg: Segment) -> None:
    """close may be called twice and releases every view of the mapping: the segment's
    buffer can then be closed (a view left behind would raise BufferError and keep the
    mapping alive)."""
    rp = RingPair.init(seg.buf, CAP, CAP)
    rp.close()
    rp.close()
    seg.buf.close()  # would raise BufferError if the pair still exported the mapping
    assert seg.buf.closed
