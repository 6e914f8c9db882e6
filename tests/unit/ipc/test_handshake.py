"""The rendezvous handshake alone (:class:`kvshm.ipc.rendezvous_handshake.Handshake`):
which Hellos it accepts, when it sends Ready and who it loses -- and the stats desk
beside it (:class:`kvshm.ipc.rendezvous_stats.StatsDesk`: what it does with an asker) --
driven directly, without a listener or a service loop.

Each test hands the handshake a real :class:`~kvshm.ipc.rendezvous_conns.ConnTable`
whose connections are the scheduler ends of real AF_UNIX SOCK_SEQPACKET socketpairs
(peer credentials from SO_PEERCRED, this process's); the other end plays the worker or
the stats asker, and sees what a worker would: a Ready with its fds, an answer, or EOF.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from kvshm.ipc.fdpass import decode_control, peer_cred, recv_datagram
from kvshm.ipc.protocol import PROTOCOL_VERSION, DiskSetup, Hello, LayoutSpec, Ready, Stats
from kvshm.ipc.rendezvous_conns import Conn, ConnTable
from kvshm.ipc.rendezvous_events import (
    AllReadyPlan,
    EventKind,
    RendezvousCount,
    RendezvousEvent,
)
from kvshm.ipc.rendezvous_handshake import Handshake, ServerState
from kvshm.ipc.rendezvous_stats import StatsDesk


def nonzero(counts: dict[RendezvousCount, int]) -> dict[str, int]:
    """The counters that moved, by name (every counter is present, zeros included)."""
    return {c.value: n for c, n in counts.items() if n}


def _hello(rank: int, world: int) -> Hello:
    return Hello(version=PROTOCOL_VERSION, rank=rank, world_size=world, pid=os.getpid())


def _ready(rank: int) -> Ready:
    return Ready(version=PROTOCOL_VERSION, rank=rank, layout=LayoutSpec(regions=()),
                 num_cpu_blocks=0, cmd_capacity=0, done_capacity=0, host_offsets=(),
                 host_bytes=0)


@dataclass
class Rig:
    """A handshake over a real table; ``peers[i]``: the far end of connection ``i``."""

    world: int
    stats: Any = dict
    listener: socket.socket = field(init=False)
    table: ConnTable = field(init=False)
    counts: dict[RendezvousCount, int] = field(
        default_factory=lambda: dict.fromkeys(RendezvousCount, 0))
    hs: Handshake = field(init=False)
    peers: list[socket.socket] = field(default_factory=list)
    make_ready_calls: int = 0
    fail_ready: bool = False
    #: the rank whose Ready names a slab path the wire cannot carry (None: none)
    unencodable: int | None = None

    def __post_init__(self) -> None:
        self.listener, self._listener_peer = socket.socketpair(socket.AF_UNIX,
                                                               socket.SOCK_SEQPACKET)
        self.table = ConnTable(self.listener.fileno(), self.world)
        self.hs = Handshake("hs-test", self.world, self.table, self.counts,
                            make_ready=self._make_ready)
        self.desk = StatsDesk(self.table, self.counts, lambda: self.stats())

    def _make_ready(self, hellos: Mapping[int, Hello]) -> AllReadyPlan:
        self.make_ready_calls += 1
        if self.fail_ready:
            raise RuntimeError("no segment for you")
        plan: dict[int, tuple[Ready, list[int]]] = {rank: (_ready(rank), [])
                                                     for rank in hellos}
        if self.unencodable is not None:
            bad = msgspec.structs.replace(_ready(self.unencodable), disk=DiskSetup(
                "/tmp/latin1-\udce9/kvshm-x.rank0-of-2.slab", 1, "fp"))
            plan[self.unencodable] = (bad, [])
        return plan

    def connect(self) -> Conn:
        """A fresh pending connection (its far end in ``peers``)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mine.setblocking(False)
        theirs.setblocking(False)
        self.peers.append(theirs)
        return self.table.add(mine, peer_cred(mine))

    def close(self) -> None:
        self.table.close_all()
        for s in (*self.peers, self.listener, self._listener_peer):
            s.close()


@pytest.fixture
def rig2() -> Iterator[Rig]:
    r = Rig(world=2)
    yield r
    r.close()


def _kinds(events: list[RendezvousEvent]) -> list[EventKind]:
    return [e.kind for e in events]


def _sees_eof(peer: socket.socket) -> bool:
    dg = recv_datagram(peer, 1 << 16)
    return dg is not None and dg.eof


def test_a_duplicate_rank_is_refused_and_the_first_keeps_its_slot(rig2: Rig) -> None:
    """Two processes both claim rank 0: the first Hello makes its connection rank 0's;
    the second is refused (``refused_hello``, closed without a reply: its worker reads
    EOF), and rank 0 is not lost -- a duplicate must never evict a live rank."""
    first, second = rig2.connect(), rig2.connect()
    events: list[RendezvousEvent] = []
    rig2.hs.on_hello(first, _hello(0, 2), events)
    rig2.hs.on_hello(second, _hello(0, 2), events)
    assert _kinds(events) == [EventKind.HELLO, EventKind.REFUSED]
    assert "duplicate rank 0" in events[1].reason
    assert nonzero(rig2.counts) == {"refused_hello": 1}
    assert rig2.table.rank_conn(0) is first and not rig2.table.has(second.sock.fileno())
    assert _sees_eof(rig2.peers[1])
    assert list(rig2.hs.hellos()) == [0] and rig2.hs.lost_ranks() == frozenset()


def test_a_lost_rank_is_never_refilled_and_ready_never_comes(rig2: Rig) -> None:
    """Rank 1 says Hello, then its worker dies (the server saw EOF: ``lose``): RANK_LOST
    once, its Hello forgotten, its pid kept for the post-mortem. A new process claiming
    rank 1 is refused (no restarts: the engine's plan was made for the first one), so
    the handshake is never complete -- make_ready is never called, even with rank 0
    there."""
    r1 = rig2.connect()
    events: list[RendezvousEvent] = []
    rig2.hs.on_hello(r1, _hello(1, 2), events)
    rig2.hs.lose(r1, events, "connection closed (EOF)", peer_closed=True)
    rig2.hs.lose(r1, events, "again")  # once per rank
    assert _kinds(events) == [EventKind.HELLO, EventKind.RANK_LOST]
    assert events[1].peer_closed and rig2.hs.lost_ranks() == frozenset({1})
    assert rig2.hs.peer_pid(1) == os.getpid() and dict(rig2.hs.hellos()) == {}
    again, r0 = rig2.connect(), rig2.connect()
    events.clear()
    rig2.hs.on_hello(again, _hello(1, 2), events)
    rig2.hs.on_hello(r0, _hello(0, 2), events)
    rig2.hs.ready_when_complete(events)
    assert _kinds(events) == [EventKind.REFUSED, EventKind.HELLO]
    assert "rank 1 was lost earlier" in events[0].reason
    assert rig2.make_ready_calls == 0 and rig2.hs.state is ServerState.WAITING
    assert nonzero(rig2.counts) == {"ranks_lost": 1, "refused_hello": 1}


def test_make_ready_raising_fails_once_and_closes_every_rank(rig2: Rig) -> None:
    """Both ranks said Hello; make_ready raises (the scheduler could not build their
    segments). READY_FAILED carries the error, every rank connection is closed so each
    worker reads EOF instead of waiting for a Ready, and make_ready is not called again
    (the state left WAITING before the call). A late Hello is refused: the rendezvous is
    over."""
    rig2.fail_ready = True
    conns = [rig2.connect(), rig2.connect()]
    events: list[RendezvousEvent] = []
    for rank, conn in enumerate(conns):
        rig2.hs.on_hello(conn, _hello(rank, 2), events)
    rig2.hs.ready_when_complete(events)
    rig2.hs.ready_when_complete(events)
    assert _kinds(events) == [EventKind.HELLO, EventKind.HELLO, EventKind.READY_FAILED]
    assert isinstance(events[-1].error, RuntimeError)
    assert "no segment for you" in events[-1].reason
    assert rig2.make_ready_calls == 1 and rig2.hs.state is ServerState.READY_FAILED
    assert rig2.table.rank_conns() == {} and all(_sees_eof(p) for p in rig2.peers)
    late = rig2.connect()
    rig2.hs.on_hello(late, _hello(0, 2), events)
    assert events[-1].kind is EventKind.REFUSED and "ready_failed" in events[-1].reason
    assert nonzero(rig2.counts) == {"ready_failed": 1, "refused_hello": 1}


def test_a_ready_the_wire_cannot_carry_fails_the_start_before_any_rank_gets_one(
        rig2: Rig) -> None:
    """A hostile probe: a ``disk_path`` that is not valid UTF-8 (a Latin-1 directory
    name) put a str with a lone surrogate in rank 1's Ready; encoding it raised
    UnicodeEncodeError out of the sending loop -- rank 0 had its Ready, rank 1 none,
    the loop's callback swallowed the error, and the engine waited out its connect
    timeout to report "missing rank(s)" (none were). Now every Ready is encoded before
    any is sent: READY_FAILED at once, with the encoder's error, every rank closed (EOF,
    no Ready for anyone). (``EngineConfig`` refuses such a path first, one line.)"""
    rig2.unencodable = 1
    conns = [rig2.connect(), rig2.connect()]
    events: list[RendezvousEvent] = []
    for rank, conn in enumerate(conns):
        rig2.hs.on_hello(conn, _hello(rank, 2), events)
    rig2.hs.ready_when_complete(events)
    assert _kinds(events) == [EventKind.HELLO, EventKind.HELLO, EventKind.READY_FAILED]
    assert isinstance(events[-1].error, UnicodeEncodeError)
    assert rig2.hs.state is ServerState.READY_FAILED
    assert all(_sees_eof(p) for p in rig2.peers)
    assert nonzero(rig2.counts) == {"ready_failed": 1}


def test_every_rank_gets_its_ready_once_complete(rig2: Rig) -> None:
    """The positive path, for contrast: not complete with one Hello (nothing sent);
    with both, each worker reads its own rank's Ready and ALL_READY comes out."""
    conns = [rig2.connect(), rig2.connect()]
    events: list[RendezvousEvent] = []
    rig2.hs.on_hello(conns[1], _hello(1, 2), events)
    rig2.hs.ready_when_complete(events)
    assert rig2.make_ready_calls == 0
    rig2.hs.on_hello(conns[0], _hello(0, 2), events)
    rig2.hs.ready_when_complete(events)
    assert events[-1].kind is EventKind.ALL_READY and rig2.hs.state is ServerState.READY
    for rank, peer in enumerate(rig2.peers):
        dg = recv_datagram(peer, 1 << 16)
        assert dg is not None
        msg = decode_control(dg.data)
        assert isinstance(msg, Ready) and msg.rank == rank
    assert nonzero(rig2.counts) == {"ready_sent": 2}


def _fill(rig: Rig, conn: Conn) -> int:
    """Ask for stats on ``conn`` without its peer reading, until one answer is dropped;
    how many were answered first."""
    events: list[RendezvousEvent] = []
    before = rig.counts[RendezvousCount.STATS_SERVED]
    for _ in range(100_000):
        assert rig.desk.answer(conn)
        if rig.counts[RendezvousCount.STATS_DROPPED]:
            assert events == []
            return rig.counts[RendezvousCount.STATS_SERVED] - before
    raise AssertionError("the peer's queue never filled")


def test_a_stats_asker_that_does_not_read_is_dropped_but_a_rank_never() -> None:
    """A ``kvshm stats`` asker that never reads its answers fills its socket: the next
    answer would block the scheduler, so it is dropped (``stats_dropped``) and, being
    nobody's rank, the connection is closed (an idle asker cannot hold an fd). A rank's
    connection asking the same is only counted: it is the rank's lifeline, and closing
    it would read as the rank's death."""
    rig = Rig(world=1, stats=lambda: {"pad": "x" * 2048})
    try:
        asker, rank = rig.connect(), rig.connect()
        for conn in (asker, rank):
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        assert _fill(rig, asker) > 0
        assert not rig.table.has(asker.sock.fileno()) and asker.sock.fileno() < 0
        events: list[RendezvousEvent] = []
        rig.hs.on_hello(rank, _hello(0, 1), events)
        rig.counts[RendezvousCount.STATS_DROPPED] = 0
        assert _fill(rig, rank) > 0
        assert rig.table.rank_conn(0) is rank and rank.sock.fileno() >= 0
        assert rig.hs.lost_ranks() == frozenset() and rig.counts[RendezvousCount.RANKS_LOST] == 0
        answer = recv_datagram(rig.peers[1], 1 << 16)
        assert answer is not None and isinstance(decode_control(answer.data), Stats)
    finally:
        rig.close()


def test_a_rank_that_died_while_its_stats_were_answered_is_lost_once() -> None:
    """Rank 0 said Hello, asked for stats and closed its end before the answer went
    out: the desk finds the peer dead (``answer`` is False, nothing counted as served or
    dropped) and the handshake -- whose record a rank's death is -- loses rank 0, once."""
    rig = Rig(world=1)
    try:
        conn = rig.connect()
        events: list[RendezvousEvent] = []
        rig.hs.on_hello(conn, _hello(0, 1), events)
        rig.peers[0].close()
        assert rig.desk.answer(conn) is False
        assert rig.counts[RendezvousCount.STATS_SERVED] == 0
        assert rig.counts[RendezvousCount.STATS_DROPPED] == 0
        rig.hs.lose(conn, events, "connection closed while answering stats", peer_closed=True)
        assert rig.hs.lost_ranks() == frozenset({0})
        assert [e.kind for e in events].count(EventKind.RANK_LOST) == 1
    finally:
        rig.close()
