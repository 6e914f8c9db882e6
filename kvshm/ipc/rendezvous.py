"""Rendezvous: the scheduler's abstract socket where workers say Hello and get Ready + fds.

The scheduler listens on the abstract AF_UNIX SOCK_SEQPACKET socket ``\\0kvshm.<name>``
(see :mod:`kvshm.ipc.fdpass`); one control message (:mod:`kvshm.ipc.protocol`) per datagram.

Scheduler side, :class:`RendezvousServer` -- **never blocks**. Each :meth:`service` call,
in this order:

1. accepts every pending connection; a peer with another uid (SO_PEERCRED) is closed at
   once and counted (``REFUSED``). Connections that have not said Hello (yet) are
   *pending*; at most :attr:`~RendezvousServer.pending_cap` of them (4 x world_size, at
   least 16) stay open: each accept beyond that first closes the **oldest** pending one
   (``REFUSED``, ``refused_pending_cap``), so idle connections cannot pile up fds while a
   rank's fresh connection, or a ``kvshm stats`` query (answered in the service() that
   accepts it), gets through. A rank's connection (Hello accepted) is never evicted;
2. reads every pending message of every connection (a fresh one included): a ``Hello``
   is validated (protocol version, world size, rank range, duplicate or lost rank) --
   accepted gives ``HELLO``, anything else closes that connection and gives ``REFUSED``;
   a frame that cannot be decoded (for whatever reason the decoder gives: garbage, a
   frame nested too deep to decode, ...) is ``REFUSED`` as ``refused_protocol``;
   a ``StatsRequest`` is answered on any connection; EOF or ECONNRESET on a rank's
   connection gives ``RANK_LOST`` (a lost rank's slot is never refilled: no restarts);
3. once every rank has said hello, calls ``make_ready`` exactly once and sends each rank
   its ``Ready`` with its fds (SCM_RIGHTS) -> ``ALL_READY`` (or ``READY_FAILED`` when
   ``make_ready`` raised or missed a rank; every rank connection is then closed, so the
   workers see EOF). The server never closes the fds ``make_ready`` returned: the caller
   closes them after ``service`` returns ``ALL_READY`` / ``READY_FAILED`` (the kernel has
   duplicated them into the messages by then).

Events already collected are never lost to a failure on one connection: an unexpected
exception while handling a connection is counted (``service_errors``), that connection is
refused (closed: ``REFUSED``, and ``RANK_LOST`` if it was a rank's), and the call goes on
with the others; only a closed server raises.

Each rank's connection stays open afterwards: it is the lifeline (EOF = the peer is gone,
either way). :meth:`attach` drives ``service`` from an asyncio loop's ``add_reader`` on
the listener and on every connection; nothing polls or spins.

Worker side: :class:`~kvshm.ipc.rendezvous_client.RendezvousClient` and
:func:`~kvshm.ipc.rendezvous_client.query_stats`, re-exported here.
"""

from __future__ import annotations

import errno
import os
import select
import socket
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeAlias

from kvshm.errors import (
    ClosedError,
    ConfigError,
    KvshmError,
    PeerDied,
    ProtocolError,
    StateError,
    VersionMismatch,
)
from kvshm.ipc.fdpass import (
    PeerCred,
    decode_control,
    encode_control,
    listen,
    peer_cred,
    recv_datagram,
    send_datagram,
)
from kvshm.ipc.protocol import Hello, Ready, Stats, StatsRequest, check_version
from kvshm.ipc.rendezvous_client import RendezvousClient, query_stats

if TYPE_CHECKING:  # pragma: no cover - typing only
    import asyncio

__all__ = [
    "AllReadyPlan",
    "EventKind",
    "MakeReady",
    "RendezvousClient",
    "RendezvousEvent",
    "RendezvousServer",
    "ServerState",
    "query_stats",
]

#: Largest message a worker may send (a Hello with a big layout is a few KiB).
_MAX_INBOUND: Final = 1 << 16
#: Pending (not yet Hello'd) connections kept: this many per rank, and at least the floor.
_PENDING_PER_RANK: Final = 4
_PENDING_FLOOR: Final = 16
_POLLIN: Final = select.POLLIN | select.POLLHUP | select.POLLERR

AllReadyPlan: TypeAlias = Mapping[int, tuple[Ready, Sequence[int]]]
#: ``make_ready(hellos by rank) -> {rank: (Ready, fds in READY_FIXED_FDS order)}``.
MakeReady: TypeAlias = Callable[[Mapping[int, Hello]], AllReadyPlan]


class EventKind(Enum):
    """What :meth:`RendezvousServer.service` saw."""

    HELLO = "hello"                  #: rank, pid: a valid Hello was accepted
    ALL_READY = "all_ready"          #: every rank got its Ready; caller may close its fds
    RANK_LOST = "rank_lost"          #: rank, pid: that rank's connection hit EOF / reset
    REFUSED = "refused"              #: reason (+ error): a connection was refused and closed
    READY_FAILED = "ready_failed"    #: reason, error: make_ready raised or missed a rank


@dataclass(frozen=True, slots=True)
class RendezvousEvent:
    """One event; ``rank``/``pid`` are -1 where they do not apply or are unknown.

    ``peer_closed`` (RANK_LOST only): the worker closed its end (EOF, reset) -- kvshm's
    worker does that only once none of its copies runs, so the scheduler may take it as
    a fence. False when this server closed the connection itself (a refused message, a
    Ready it could not send): the rank may still be copying.
    """

    kind: EventKind
    rank: int = -1
    pid: int = -1
    reason: str = ""
    error: BaseException | None = None
    peer_closed: bool = False


class ServerState(Enum):
    """Lifecycle of a :class:`RendezvousServer`."""

    WAITING = "waiting"            # collecting Hellos
    READY = "ready"                # Ready sent to every rank
    READY_FAILED = "ready_failed"  # make_ready failed; rank connections closed
    CLOSED = "closed"


@dataclass(slots=True)
class _Conn:
    sock: socket.socket
    cred: PeerCred
    rank: int | None = None  # set once its Hello is accepted


class RendezvousServer:
    """Scheduler side of the rendezvous (see the module docstring for the order of work).

    ``stats()`` returns the plain-data snapshot sent in answer to a ``StatsRequest``.
    Counters of every declined or failed outcome: :meth:`counters`.
    """

    def __init__(self, name: str, world_size: int, *, make_ready: MakeReady,
                 stats: Callable[[], dict[str, Any]]) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
        self.name = name
        self.world_size = world_size
        self._make_ready = make_ready
        self._stats = stats
        self._listener = listen(name, backlog=max(64, 4 * world_size))
        self._poll = select.poll()
        self._poll.register(self._listener.fileno(), _POLLIN)
        self._conns: dict[int, _Conn] = {}
        self._pending: dict[int, _Conn] = {}  # not Hello'd yet, by fd, oldest first
        self._pending_cap = max(_PENDING_FLOOR, _PENDING_PER_RANK * world_size)
        self._by_rank: dict[int, _Conn] = {}
        self._hellos: dict[int, Hello] = {}
        self._pids: dict[int, int] = {}
        self._lost: set[int] = set()
        self._counts: Counter[str] = Counter()
        self._state = ServerState.WAITING
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_events: Callable[[list[RendezvousEvent]], None] | None = None

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> ServerState:
        return self._state

    @property
    def pending_cap(self) -> int:
        """Most connections without an accepted Hello kept open (the oldest goes first)."""
        return self._pending_cap

    def fileno(self) -> int:
        """The listening socket (readable when a connection is pending)."""
        return self._listener.fileno()

    def connection_fds(self) -> dict[int, int]:
        """rank -> fd of each live rank connection (readable on a message or EOF)."""
        return {rank: c.sock.fileno() for rank, c in self._by_rank.items()}

    def all_fds(self) -> list[int]:
        """The listener and every open connection, rank or not (all to be watched)."""
        return [self._listener.fileno(), *self._conns]

    def peer_pid(self, rank: int) -> int:
        """pid of the process that said hello as ``rank`` (SO_PEERCRED; kept after loss)."""
        try:
            return self._pids[rank]
        except KeyError:
            raise StateError(f"rank {rank} has not said hello on {self.name!r}") from None

    def hellos(self) -> Mapping[int, Hello]:
        """Accepted Hellos by rank (read-only view)."""
        return MappingProxyType(self._hellos)

    def lost_ranks(self) -> frozenset[int]:
        return frozenset(self._lost)

    def counters(self) -> dict[str, int]:
        """accepted, accept_errors, refused_uid, refused_pending_cap, refused_version,
        refused_hello, refused_protocol, service_errors, ranks_lost, stats_served,
        stats_errors, stats_dropped, ready_sent, ready_failed (only those that happened
        appear)."""
        return dict(self._counts)

    # ------------------------------------------------------------------ service

    def service(self) -> list[RendezvousEvent]:
        """Do every piece of pending work without waiting; the events, in order."""
        if self._state is ServerState.CLOSED:
            raise ClosedError(f"rendezvous {self.name!r} is closed")
        events: list[RendezvousEvent] = []
        for fd, _ in self._poll.poll(0):
            if fd == self._listener.fileno():
                self._accept_guarded(events)
            elif (conn := self._conns.get(fd)) is not None:
                self._read_guarded(conn, events)
        if self._state is ServerState.WAITING and len(self._hellos) == self.world_size:
            self._send_ready(events)
        return events

    def _accept_guarded(self, events: list[RendezvousEvent]) -> None:
        """:meth:`_accept_all`; an unexpected exception is counted and reported, and the
        listener stays watched (what is left is accepted on the next call)."""
        try:
            self._accept_all(events)
        except Exception as e:  # noqa: BLE001 - must not lose the events collected so far
            self._counts["service_errors"] += 1
            events.append(RendezvousEvent(
                EventKind.REFUSED, reason=f"accepting on {self.name!r} failed: "
                                          f"{type(e).__name__}: {e}", error=e))

    def _read_guarded(self, conn: _Conn, events: list[RendezvousEvent]) -> None:
        """:meth:`_read_all`; an unexpected exception refuses this connection only."""
        try:
            self._read_all(conn, events)
        except Exception as e:  # noqa: BLE001 - must not lose the events collected so far
            why = f"internal error on this connection: {type(e).__name__}: {e}"
            if conn.sock.fileno() >= 0:
                self._refuse(conn, events, "service_errors", why, e)
                return
            self._counts["service_errors"] += 1
            events.append(RendezvousEvent(EventKind.REFUSED, rank=-1 if conn.rank is None
                                          else conn.rank, pid=conn.cred.pid, reason=why,
                                          error=e))

    def _accept_all(self, events: list[RendezvousEvent]) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE/ENFILE/ENOBUFS: retried on the next service()
                self._counts["accept_errors"] += 1
                events.append(RendezvousEvent(EventKind.REFUSED,
                                              reason=f"accept() failed: {e}", error=e))
                return
            try:
                conn = self._admit(sock, events)
            except BaseException:
                if sock.fileno() >= 0 and sock.fileno() not in self._conns:
                    sock.close()  # not registered yet: nobody else would close it
                raise
            if conn is not None:
                self._read_guarded(conn, events)  # its Hello is usually already queued

    def _admit(self, sock: socket.socket, events: list[RendezvousEvent]) -> _Conn | None:
        """Register a freshly accepted connection (evicting the oldest pending one when
        the cap is reached); None if it was refused (another uid) and closed."""
        try:
            sock.setblocking(False)
            cred = peer_cred(sock)
        except OSError as e:
            sock.close()
            self._counts["accept_errors"] += 1
            events.append(RendezvousEvent(EventKind.REFUSED,
                                          reason=f"accepted connection unusable: {e}", error=e))
            return None
        if cred.uid != os.geteuid():
            sock.close()
            self._counts["refused_uid"] += 1
            events.append(RendezvousEvent(
                EventKind.REFUSED, pid=cred.pid,
                reason=f"connection from uid {cred.uid} (pid {cred.pid}) refused: "
                       f"only uid {os.geteuid()} may use {self.name!r}"))
            return None
        self._evict_pending(events)
        self._counts["accepted"] += 1
        conn = _Conn(sock, cred)
        self._conns[sock.fileno()] = conn
        self._pending[sock.fileno()] = conn
        self._poll.register(sock.fileno(), _POLLIN)
        if self._loop is not None:
            self._loop.add_reader(sock.fileno(), self._on_readable)
        return conn

    def _evict_pending(self, events: list[RendezvousEvent]) -> None:
        """Make room for one more pending connection: close the oldest ones over the cap.
        Every pending connection is read first, so one whose Hello (or stats query) is
        already queued becomes a rank (or is answered) rather than being evicted."""
        if len(self._pending) >= self._pending_cap:
            for conn in list(self._pending.values()):
                self._read_guarded(conn, events)
        while len(self._pending) >= self._pending_cap:
            fd = next(iter(self._pending))
            oldest = self._pending.pop(fd)
            self._refuse(oldest, events, "refused_pending_cap",
                         f"{self._pending_cap} connections to {self.name!r} have not said "
                         f"Hello: the oldest (pid {oldest.cred.pid}) is closed to admit a "
                         "new one")

    def _read_all(self, conn: _Conn, events: list[RendezvousEvent]) -> None:
        while conn.sock.fileno() >= 0:
            dg = recv_datagram(conn.sock, _MAX_INBOUND)
            if dg is None:
                return
            if dg.eof:
                self._lose(conn, events, "connection closed (EOF)", peer_closed=True)
                return
            if dg.truncated:
                self._refuse(conn, events, "refused_protocol",
                             f"message larger than {_MAX_INBOUND} bytes")
                return
            try:
                msg = decode_control(dg.data)
            except VersionMismatch as e:
                self._refuse(conn, events, "refused_version", str(e), e)
                return
            except ProtocolError as e:
                self._refuse(conn, events, "refused_protocol", str(e), e)
                return
            if isinstance(msg, Hello):
                self._on_hello(conn, msg, events)
            elif isinstance(msg, StatsRequest):
                self._answer_stats(conn, events)
            else:
                self._refuse(conn, events, "refused_protocol",
                             f"unexpected {type(msg).__name__} from pid {conn.cred.pid}")

    def _hello_problem(self, conn: _Conn, hello: Hello) -> tuple[str, str] | None:
        """(counter, reason) if this Hello must be refused, else None."""
        if conn.rank is not None:
            return "refused_protocol", f"second Hello on rank {conn.rank}'s connection"
        if hello.world_size != self.world_size:
            return "refused_hello", (f"Hello from pid {conn.cred.pid} says world_size "
                                     f"{hello.world_size}, but {self.name!r} serves "
                                     f"world_size {self.world_size}")
        if not 0 <= hello.rank < self.world_size:
            return "refused_hello", (f"Hello from pid {conn.cred.pid}: rank {hello.rank} out "
                                     f"of range [0, {self.world_size})")
        if hello.rank in self._by_rank:
            other = self._by_rank[hello.rank].cred.pid
            return "refused_hello", (f"duplicate rank {hello.rank} from pid {conn.cred.pid}: "
                                     f"already connected from pid {other}")
        if hello.rank in self._lost:
            return "refused_hello", (f"rank {hello.rank} was lost earlier; rank restart is "
                                     "not supported")
        if self._state is not ServerState.WAITING:
            return "refused_hello", f"rendezvous {self.name!r} is {self._state.value}"
        return None

    def _on_hello(self, conn: _Conn, hello: Hello, events: list[RendezvousEvent]) -> None:
        try:
            check_version(hello.version)
        except VersionMismatch as e:
            self._refuse(conn, events, "refused_version", str(e), e)
            return
        problem = self._hello_problem(conn, hello)
        if problem is not None:
            self._refuse(conn, events, *problem)
            return
        conn.rank = hello.rank
        self._pending.pop(conn.sock.fileno(), None)  # a rank: never evicted
        self._by_rank[hello.rank] = conn
        self._hellos[hello.rank] = hello
        self._pids[hello.rank] = conn.cred.pid
        events.append(RendezvousEvent(EventKind.HELLO, rank=hello.rank, pid=conn.cred.pid))

    def _answer_stats(self, conn: _Conn, events: list[RendezvousEvent]) -> None:
        try:
            data = encode_control(Stats(data=self._stats()))
        except Exception as e:  # a stats bug must not take the scheduler down
            self._counts["stats_errors"] += 1
            data = encode_control(Stats(data={"error": f"{type(e).__name__}: {e}"}))
        try:
            try:
                send_datagram(conn.sock, data)
            except OSError as e:
                if e.errno != errno.EMSGSIZE:
                    raise
                self._counts["stats_errors"] += 1
                send_datagram(conn.sock, encode_control(Stats(data={
                    "error": f"stats snapshot of {len(data)} bytes is too large to send"})))
        except BlockingIOError:
            self._counts["stats_dropped"] += 1  # asker does not read its answers
            if conn.rank is None:
                self._close_conn(conn)
            return
        except PeerDied:
            self._lose(conn, events, "connection closed while answering stats",
                       peer_closed=True)
            return
        self._counts["stats_served"] += 1

    def _send_ready(self, events: list[RendezvousEvent]) -> None:
        self._state = ServerState.READY  # make_ready is called once, even if it raises
        try:
            plan = self._make_ready(MappingProxyType(dict(self._hellos)))
            missing = sorted(set(self._by_rank) - set(plan))
            if missing:
                raise ConfigError(f"make_ready returned no Ready for ranks {missing}")
        except Exception as e:
            self._fail_ready(events, e)
            return
        lost: list[tuple[_Conn, str]] = []
        for rank, conn in sorted(self._by_rank.items()):
            ready, fds = plan[rank]
            try:
                send_datagram(conn.sock, encode_control(ready), fds)
                self._counts["ready_sent"] += 1
            except (PeerDied, OSError) as e:  # BlockingIOError, EMSGSIZE, ETOOMANYREFS, ...
                lost.append((conn, f"could not send Ready: {e or type(e).__name__}"))
        events.append(RendezvousEvent(EventKind.ALL_READY))
        for conn, why in lost:
            self._lose(conn, events, why)

    def _fail_ready(self, events: list[RendezvousEvent], error: Exception) -> None:
        self._state = ServerState.READY_FAILED
        self._counts["ready_failed"] += 1
        for conn in list(self._by_rank.values()):
            self._close_conn(conn)
        why = error if isinstance(error, KvshmError) else f"{type(error).__name__}: {error}"
        events.append(RendezvousEvent(EventKind.READY_FAILED,
                                      reason=f"rendezvous {self.name!r} failed: {why}",
                                      error=error))

    def _refuse(self, conn: _Conn, events: list[RendezvousEvent], counter: str, reason: str,
                error: BaseException | None = None) -> None:
        """Close ``conn`` without a reply; a rank's connection is also RANK_LOST."""
        self._counts[counter] += 1
        events.append(RendezvousEvent(EventKind.REFUSED, rank=-1 if conn.rank is None
                                      else conn.rank, pid=conn.cred.pid, reason=reason,
                                      error=error))
        self._lose(conn, events, reason)

    def _lose(self, conn: _Conn, events: list[RendezvousEvent], why: str, *,
              peer_closed: bool = False) -> None:
        rank = conn.rank
        self._close_conn(conn)
        if rank is None or rank in self._lost:
            return
        self._lost.add(rank)
        self._hellos.pop(rank, None)
        self._counts["ranks_lost"] += 1
        events.append(RendezvousEvent(EventKind.RANK_LOST, rank=rank, pid=conn.cred.pid,
                                      reason=why, peer_closed=peer_closed))

    def _close_conn(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd < 0:
            return
        if self._loop is not None:
            self._loop.remove_reader(fd)  # before close: the fd number may be reused
        self._poll.unregister(fd)
        del self._conns[fd]
        self._pending.pop(fd, None)
        if conn.rank is not None and self._by_rank.get(conn.rank) is conn:
            del self._by_rank[conn.rank]
        conn.sock.close()

    # ------------------------------------------------------------------ asyncio

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_events: Callable[[list[RendezvousEvent]], None]) -> None:
        """Drive :meth:`service` from ``loop`` (add_reader on the listener and every
        connection); ``on_events`` gets each non-empty batch, on the loop's thread."""
        if self._state is ServerState.CLOSED:
            raise ClosedError(f"rendezvous {self.name!r} is closed")
        if self._loop is not None:
            raise StateError(f"rendezvous {self.name!r} is already attached to a loop")
        self._loop, self._on_events = loop, on_events
        for fd in self.all_fds():
            loop.add_reader(fd, self._on_readable)
        loop.call_soon(self._on_readable)  # work that arrived before attach

    def detach(self) -> None:
        """Stop watching fds from the loop (idempotent); service() still works."""
        if self._loop is None:
            return
        for fd in self.all_fds():
            self._loop.remove_reader(fd)
        self._loop = self._on_events = None

    def _on_readable(self) -> None:
        if self._state is ServerState.CLOSED or self._on_events is None:
            return
        events = self.service()
        if events:
            self._on_events(events)

    def close(self) -> None:
        """Close every connection (workers see EOF) and the listener (idempotent)."""
        if self._state is ServerState.CLOSED:
            return
        self.detach()
        for conn in list(self._conns.values()):
            self._close_conn(conn)
        self._listener.close()
        self._state = ServerState.CLOSED

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
