"""Rendezvous hazards from the issue tracker, each with a real socket:

* a deeply nested msgpack frame (RecursionError in the decoder) must refuse only that
  connection, never lose the other events of the same ``service()`` batch;
* a worker must not talk to a listener of another uid squatting ``\\0kvshm.NAME``;
* idle connections that never say Hello must not pile up fds in the scheduler.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence

import pytest

from kvshm.errors import ProtocolError, UntrustedPeer, VersionMismatch
from kvshm.ipc import rendezvous as rendezvous_mod
from kvshm.ipc import rendezvous_client
from kvshm.ipc.fdpass import (
    MAX_FDS,
    PeerCred,
    decode_control,
    encode_control,
    listen,
    send_datagram,
)
from kvshm.ipc.protocol import PROTOCOL_VERSION, Hello, LayoutSpec, Ready, Stats, StatsRequest
from kvshm.ipc.rendezvous import ACCEPTS_PER_SERVICE, RendezvousServer
from kvshm.ipc.rendezvous_client import RendezvousClient, query_stats
from kvshm.ipc.rendezvous_events import EventKind, RendezvousEvent
from workers.session import Connector, SessionOptions
from workers.worker import DetachReason, Phase, Worker

#: Frames nested 20,000 levels deep make msgspec raise RecursionError: in the schema's
#: one free-form field (Stats.data: Any), and as a bare array (which fails the schema, and
#: then the raw decode that looks for a version number).
_NESTED = b"\x91" * 20_000 + b"\xc0"
DEEP_IN_STATS = encode_control(Stats(data={"k": 1}))[:-1] + _NESTED
DEEP_BARE = _NESTED
DEEP_FRAMES = pytest.mark.parametrize("frame", [DEEP_IN_STATS, DEEP_BARE],
                                      ids=["in_stats_data", "bare"])
NOBODY = 65534


def _name() -> str:
    return f"test-hz-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _hello(rank: int, world: int) -> Hello:
    return Hello(version=PROTOCOL_VERSION, rank=rank, world_size=world, pid=os.getpid())


def _no_fds(hellos: Mapping[int, Hello]) -> dict[int, tuple[Ready, list[int]]]:
    return {rank: (Ready(version=PROTOCOL_VERSION, rank=rank, layout=LayoutSpec(regions=()),
                         num_cpu_blocks=0, cmd_capacity=0, done_capacity=0, host_offsets=(),
                         host_bytes=0), []) for rank in hellos}


@pytest.fixture
def server() -> Iterator[RendezvousServer]:
    srv = RendezvousServer(_name(), 1, make_ready=_no_fds, stats=lambda: {"engine": "hz"})
    yield srv
    srv.close()


def _raw_connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.connect(b"\0kvshm." + name.encode())
    return sock


def _service_until(server: RendezvousServer, done: Callable[[list[RendezvousEvent]], bool],
                   timeout: float = 20.0) -> list[RendezvousEvent]:
    deadline = time.monotonic() + timeout
    events: list[RendezvousEvent] = []
    while not done(events):
        assert time.monotonic() < deadline, f"timed out; events so far: {events}"
        select.select(server.all_fds(), [], [], 0.2)
        events += server.service()
    return events


def _kinds(events: Sequence[RendezvousEvent]) -> list[EventKind]:
    return [e.kind for e in events]


def _wait_readable(fds: Sequence[int], timeout: float = 10.0) -> None:
    """Until every fd in ``fds`` is readable (so one service() sees them all)."""
    deadline = time.monotonic() + timeout
    while True:
        ready = select.select(list(fds), [], [], 0.1)[0]
        if set(ready) == set(fds):
            return
        assert time.monotonic() < deadline, f"only {ready} of {fds} readable"


def _server_side_fd(server: RendezvousServer, known: set[int]) -> int:
    [fd] = set(server.all_fds()) - {server.fileno()} - known
    return fd


# ---------------------------------------------------------------- 1. decode robustness


@DEEP_FRAMES
def test_deeply_nested_frame_is_a_protocol_error_not_a_recursion_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="undecodable rendezvous message") as info:
        decode_control(frame)
    assert not isinstance(info.value, VersionMismatch)


@DEEP_FRAMES
def test_deeply_nested_frame_refused_while_rank_lost_in_same_batch_still_reported(
        frame: bytes) -> None:
    """The rogue's frame and the rank's EOF reach one service() call: the rank's
    RANK_LOST must come out of it (it was dropped with the RecursionError), the rogue
    is refused and counted."""
    server = RendezvousServer(_name(), 2, make_ready=_no_fds, stats=dict)
    try:
        rank = RendezvousClient(server.name)
        rank.connect_nowait()
        rank.send_hello(_hello(0, 2))
        _service_until(server, lambda ev: EventKind.HELLO in _kinds(ev))
        rank_fd = server.connection_fds()[0]
        rogue = _raw_connect(server.name)  # accepted after the rank: polled after it
        _service_until(server, lambda ev: len(server.all_fds()) == 3)
        rogue_fd = _server_side_fd(server, {rank_fd})
        rank.close()  # the rank's process is gone: EOF
        rogue.send(frame)
        _wait_readable([rank_fd, rogue_fd])
        events = server.service()
        lost = [e for e in events if e.kind is EventKind.RANK_LOST]
        assert [(e.rank, e.pid) for e in lost] == [(0, os.getpid())]
        [refused] = [e for e in events if e.kind is EventKind.REFUSED]
        assert isinstance(refused.error, ProtocolError)
        assert "undecodable rendezvous message" in refused.reason
        assert server.counters()["refused_protocol"] == 1
        assert server.lost_ranks() == {0} and server.all_fds() == [server.fileno()]
        rogue.settimeout(5)
        assert rogue.recv(100) == b""  # refused: closed without a reply
        rogue.close()
    finally:
        server.close()


def test_unexpected_error_on_one_connection_keeps_the_other_events_of_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug while handling one connection (here: answering stats) refuses that one,
    counted as service_errors; the RANK_LOST of another connection in the same
    service() call still comes out."""
    server = RendezvousServer(_name(), 2, make_ready=_no_fds, stats=dict)
    try:
        rank = RendezvousClient(server.name)
        rank.connect_nowait()
        rank.send_hello(_hello(1, 2))
        _service_until(server, lambda ev: EventKind.HELLO in _kinds(ev))
        rank_fd = server.connection_fds()[1]
        asker = RendezvousClient(server.name)
        asker.connect_nowait()
        _service_until(server, lambda ev: len(server.all_fds()) == 3)
        asker_fd = _server_side_fd(server, {rank_fd})

        def broken(*_: object) -> None:
            raise RuntimeError("stats path bug")

        monkeypatch.setattr(server._stats_desk, "answer", broken)
        rank.close()
        asker.send(StatsRequest())
        _wait_readable([rank_fd, asker_fd])
        events = server.service()
        assert [e.rank for e in events if e.kind is EventKind.RANK_LOST] == [1]
        [refused] = [e for e in events if e.kind is EventKind.REFUSED]
        assert isinstance(refused.error, RuntimeError) and "stats path bug" in refused.reason
        assert server.counters()["service_errors"] == 1
        assert server.all_fds() == [server.fileno()]
        assert not asker.check_alive()  # refused: closed
        asker.close()
    finally:
        server.close()


@DEEP_FRAMES
def test_deeply_nested_frame_from_the_scheduler_is_a_protocol_error_on_the_worker(
        frame: bytes) -> None:
    name = _name()
    with listen(name, 4) as listener, RendezvousClient(name) as client:
        client.connect_nowait()
        conn, _ = listener.accept()
        send_datagram(conn, frame)
        assert select.select([client.fileno()], [], [], 5)[0]
        with pytest.raises(ProtocolError, match="undecodable"):
            client.check_alive()
        conn.close()


# ---------------------------------------------------------------- 2. who we connect to


def _rogue_uid_peer(monkeypatch: pytest.MonkeyPatch, pid: int, uid: int) -> None:
    """Make every worker-side connect see a listener of ``uid`` (no root needed)."""
    monkeypatch.setattr(rendezvous_client, "peer_cred", lambda sock: PeerCred(pid, uid, uid),
                        raising=False)  # (absent before the check existed: then no effect)


def _assert_nothing_received(listener: socket.socket) -> None:
    """The one connection queued on ``listener`` brought no datagram and no fd: EOF."""
    listener.settimeout(5)
    conn, _ = listener.accept()
    conn.settimeout(5)
    data, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
    conn.close()
    assert (data, anc) == (b"", [])


def test_check_scheduler_cred_refuses_another_uid_naming_both() -> None:
    me = os.geteuid()
    check = rendezvous_client.check_scheduler_cred
    check("x", PeerCred(pid=123, uid=me, gid=0))  # same uid: fine
    with pytest.raises(UntrustedPeer) as info:
        check("x", PeerCred(pid=4242, uid=me + 7, gid=0))
    err = info.value
    assert (err.pid, err.uid, err.expected_uid) == (4242, me + 7, me)
    assert f"pid 4242 running as uid {me + 7}" in str(err)
    assert f"must run as uid {me}" in str(err)


def test_foreign_uid_listener_gets_no_hello_from_connector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The refusal path without root: the worker's Connector sees (faked) another uid
    on the listener and raises before its Hello goes out; the listener gets only EOF."""
    name = _name()
    _rogue_uid_peer(monkeypatch, pid=4242, uid=os.geteuid() + 1)
    with listen(name, 4) as listener:
        connector = Connector(name, 0, 1, None, SessionOptions())
        with pytest.raises(UntrustedPeer, match="pid 4242"):
            connector.poll()
        assert connector.client is None
        _assert_nothing_received(listener)
        with RendezvousClient(name) as client:  # the stats path is checked the same way
            with pytest.raises(UntrustedPeer):
                client.connect_nowait()
            assert not client.connected
        _assert_nothing_received(listener)
        with pytest.raises(UntrustedPeer):
            query_stats(name, timeout=1)
        _assert_nothing_received(listener)


def _squat_as(uid: int, name: str, conns: int) -> tuple[int, int]:
    """Fork a child that binds ``\\0kvshm.<name>`` as ``uid`` and checks ``conns``
    connections: exit 0 iff each brought nothing (no datagram, no fd) before EOF.
    Returns (pid, read end of a pipe that gets one byte once it listens)."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only raw syscalls, then _exit
        code = 3
        try:
            os.close(ready_r)
            os.setuid(uid)
            lsock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            lsock.bind(b"\0kvshm." + name.encode())
            lsock.listen(8)
            os.write(ready_w, b"1")
            lsock.settimeout(20)
            code = 0
            for _ in range(conns):
                conn, _ = lsock.accept()
                conn.settimeout(20)
                data, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
                if data or anc:
                    code = 1  # the worker talked to us: the hazard
                conn.close()
        finally:
            os._exit(code)
    os.close(ready_w)
    return pid, ready_r


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a listener as another uid")
def test_scheduler_name_squatted_by_another_uid_gets_nothing_from_workers() -> None:
    name = _name()
    pid, ready = _squat_as(NOBODY, name, conns=2)
    try:
        assert os.read(ready, 1) == b"1"
        with RendezvousClient(name) as client:
            with pytest.raises(UntrustedPeer) as info:
                client.connect_nowait()
        err = info.value
        assert (err.pid, err.uid, err.expected_uid) == (pid, NOBODY, 0)
        assert f"pid {pid} running as uid {NOBODY}" in str(err) and "uid 0" in str(err)
        worker = Worker.attach(name, 0, 1, None)  # a standalone rank, as kvshm-workers runs
        worker.service()
        assert worker.phase is Phase.DETACHED
        assert worker.detach_reason is DetachReason.SETUP_FAILED
        assert isinstance(worker.last_error, UntrustedPeer)
        worker.close()
    finally:
        os.close(ready)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the squatter got no datagram, no fd


# ---------------------------------------------------------------- 3. pending-connection cap


def _accepted(server: RendezvousServer, n: int) -> Callable[[list[RendezvousEvent]], bool]:
    return lambda _events: server.counters().get("accepted") == n


def test_idle_connections_cannot_pile_up_server_fds(server: RendezvousServer) -> None:
    cap = 16  # world_size 1: the floor
    idle: list[socket.socket] = []
    for _ in range(10):  # 200 connections, in batches below the accept backlog
        idle += [_raw_connect(server.name) for _ in range(20)]
        _service_until(server, _accepted(server, len(idle)))
        assert len(server.all_fds()) <= 1 + cap
    evicted = len(idle) - cap
    assert server.counters()["refused_pending_cap"] == evicted
    assert server.counters()["accepted"] == len(idle)
    for sock in idle[:evicted]:  # the oldest went first: they see EOF
        sock.settimeout(5)
        assert sock.recv(16) == b""
    for sock in idle[evicted:]:
        sock.setblocking(False)
        with pytest.raises(BlockingIOError):
            sock.recv(16)  # still open, nothing said

    got: list[dict[str, object]] = []
    asker = threading.Thread(target=lambda: got.append(query_stats(server.name, 10)))
    asker.start()  # kvshm stats still works at the cap
    while asker.is_alive():
        select.select(server.all_fds(), [], [], 0.05)
        server.service()
    asker.join()
    assert got == [{"engine": "hz"}]

    with RendezvousClient(server.name) as rank:  # and a real rank still gets in
        rank.connect_nowait()
        rank.send_hello(_hello(0, 1))
        events = _service_until(server, lambda ev: EventKind.ALL_READY in _kinds(ev))
        assert _kinds(events)[-2:] == [EventKind.HELLO, EventKind.ALL_READY]
        more = [_raw_connect(server.name) for _ in range(2 * cap)]
        _service_until(server, lambda ev: server.counters().get("accepted") ==
                       len(idle) + 1 + len(more) + 1)  # + stats asker, + rank
        assert len(server.all_fds()) <= 1 + cap + 1
        assert rank.check_alive() and set(server.connection_fds()) == {0}  # never evicted
        assert rank.wait_ready(timeout=5)[0].rank == 0
    for sock in idle + more:
        sock.close()
    assert server.pending_cap == cap


def test_a_hello_queued_at_the_cap_is_read_before_anyone_is_evicted(
        server: RendezvousServer) -> None:
    """Review: the cap evicted the oldest pending connection at accept time, before the
    batch read the others -- a rank that connected, then said Hello while 16 idle
    connections arrived behind it, was closed as the oldest. Now every pending
    connection is read before eviction: the rank's queued Hello makes it a rank."""
    with RendezvousClient(server.name) as rank:
        rank.connect_nowait()
        _service_until(server, lambda ev: server.counters().get("accepted") == 1)
        rank.send_hello(_hello(0, 1))  # queued, not read yet
        idle = [_raw_connect(server.name) for _ in range(20)]
        events = _service_until(server, lambda ev: EventKind.ALL_READY in _kinds(ev))
        assert EventKind.HELLO in _kinds(events)
        assert rank.check_alive() and set(server.connection_fds()) == {0}
        assert server.counters().get("refused_pending_cap", 0) <= len(idle) - 16 + 1
        for sock in idle:
            sock.close()


def test_pending_cap_scales_with_world_size() -> None:
    srv = RendezvousServer(_name(), 8, make_ready=_no_fds, stats=dict)
    try:
        assert srv.pending_cap == 32
    finally:
        srv.close()


def test_a_flood_of_foreign_connections_is_accepted_a_bounded_batch_per_service(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hazard: processes of *another uid* (engine names are public in
    /proc/net/unix) connect and close in a loop. Each connection is refused at once,
    but ``_accept_all`` accepted until the backlog was empty, and the flood kept it
    full: one ``service()`` ran for 1.8 - 3.0 s on the engine's loop (57k - 98k
    refusals), Dones sat unread, and with ``hang_timeout_s=1`` a healthy rank was judged
    hung and killed. Now one call accepts at most ``ACCEPTS_PER_SERVICE``: 129 queued
    connections (uid faked: no root needed) take three calls, and each is counted."""
    monkeypatch.setattr(rendezvous_mod, "peer_cred",
                        lambda sock: PeerCred(4242, os.geteuid() + 1, 0))
    srv = RendezvousServer(_name(), 32, make_ready=_no_fds, stats=dict)  # backlog 128
    socks = []
    try:
        for _ in range(129):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK)
            s.connect(b"\0kvshm." + srv.name.encode())
            socks.append(s)
        refused = []
        for _ in range(3):
            srv.service()
            refused.append(srv.counters()["refused_uid"])
        assert refused == [ACCEPTS_PER_SERVICE, 2 * ACCEPTS_PER_SERVICE, 129]
    finally:
        for s in socks:
            s.close()
        srv.close()
