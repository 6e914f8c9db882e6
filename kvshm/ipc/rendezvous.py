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

Beside this module: :mod:`kvshm.ipc.rendezvous_conns` keeps the connections (the poll
set, the pending ones oldest first, the ranks'); :mod:`kvshm.ipc.rendezvous_events` has
the event and ``make_ready`` types; the server holds a
:class:`~kvshm.ipc.rendezvous_handshake.Handshake` (its own object, with its own state:
the Hellos, the peers' pids, the lost ranks, the lifecycle) that decides what each
accepted message does: the Hello checks, Ready, refusals and losses; a
:class:`~kvshm.ipc.rendezvous_stats.StatsDesk` answers stats queries; the server keeps
the sockets, the listener and the service loop. Worker side:
:class:`~kvshm.ipc.rendezvous_client.RendezvousClient` and
:func:`~kvshm.ipc.rendezvous_client.query_stats`.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from kvshm.errors import (
    ClosedError,
    ConfigError,
    ProtocolError,
    StateError,
    VersionMismatch,
)
from kvshm.ipc.fdpass import (
    decode_control,
    listen,
    peer_cred,
    recv_datagram,
)
from kvshm.ipc.protocol import Goodbye, Hello, SetupFailed, StatsRequest
from kvshm.ipc.rendezvous_conns import Conn, ConnTable
from kvshm.ipc.rendezvous_events import EventKind, MakeReady, RendezvousCount, RendezvousEvent
from kvshm.ipc.rendezvous_handshake import Handshake, ServerState
from kvshm.ipc.rendezvous_stats import StatsDesk

if TYPE_CHECKING:  # pragma: no cover - typing only
    import asyncio

__all__ = ["RendezvousServer"]

#: Largest message a worker may send (a Hello with a big layout is a few KiB).
_MAX_INBOUND: Final = 1 << 16
#: Messages one connection's read takes per service (:meth:`RendezvousServer._read_all`).
READS_PER_SERVICE: Final = 64
#: Connections one service accepts (:meth:`RendezvousServer._accept_all`); the listener
#: stays readable and the rest wait for the next (level-triggered: poll, add_reader).
#: Unbounded, a flood of connections from *another uid* -- each refused at once, but
#: the backlog kept full -- held the loop in one call for seconds: Dones went unread,
#: ticks late, a healthy rank was judged hung.
ACCEPTS_PER_SERVICE: Final = 64


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
        self._listener = listen(name, backlog=max(64, 4 * world_size))
        self._spare = SpareFd()
        self._table = ConnTable(self._listener.fileno(), world_size)
        self._counts: dict[RendezvousCount, int] = dict.fromkeys(RendezvousCount, 0)
        self._handshake = Handshake(name, world_size, self._table, self._counts,
                                    make_ready=make_ready)
        self._stats_desk = StatsDesk(self._table, self._counts, stats)
        self._on_events: Callable[[list[RendezvousEvent]], None] | None = None

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> ServerState:
        """The handshake's lifecycle (WAITING, READY, READY_FAILED, CLOSED)."""
        return self._handshake.state

    @property
    def pending_cap(self) -> int:
        """Most connections without an accepted Hello kept open (the oldest goes first)."""
        return self._table.pending_cap

    def fileno(self) -> int:
        """The listening socket (readable when a connection is pending)."""
        return self._listener.fileno()

    def connection_fds(self) -> dict[int, int]:
        """rank -> fd of each live rank connection (readable on a message or EOF)."""
        return {rank: c.sock.fileno() for rank, c in self._table.rank_conns().items()}

    def all_fds(self) -> list[int]:
        """The listener and every open connection, rank or not (all to be watched)."""
        return self._table.fds()

    def peer_pid(self, rank: int) -> int:
        """pid of the process that said hello as ``rank`` (SO_PEERCRED; kept after loss)."""
        return self._handshake.peer_pid(rank)

    def hellos(self) -> Mapping[int, Hello]:
        """Accepted Hellos by rank (read-only view)."""
        return self._handshake.hellos()

    def lost_ranks(self) -> frozenset[int]:
        """Ranks lost so far (never refilled)."""
        return self._handshake.lost_ranks()

    def counters(self) -> dict[str, int]:
        """Every :class:`RendezvousCount` by name, zeros included."""
        return {c.value: n for c, n in self._counts.items()}

    # ------------------------------------------------------------------ service

    def service(self) -> list[RendezvousEvent]:
        """Do every piece of pending work without waiting; the events, in order."""
        if self.state is ServerState.CLOSED:
            raise ClosedError(f"rendezvous {self.name!r} is closed")
        events: list[RendezvousEvent] = []
        for fd in self._table.ready():
            if fd == self._listener.fileno():
                self._accept_guarded(events)
            elif (conn := self._table.get(fd)) is not None:
                self._read_guarded(conn, events)
        self._handshake.ready_when_complete(events)
        return events

    def _accept_guarded(self, events: list[RendezvousEvent]) -> None:
        """:meth:`_accept_all`; an unexpected exception is counted and reported, and the
        listener stays watched (what is left is accepted on the next call)."""
        try:
            self._accept_all(events)
        except Exception as e:  # noqa: BLE001 - must not lose the events collected so far
            self._counts[RendezvousCount.SERVICE_ERRORS] += 1
            events.append(RendezvousEvent(
                EventKind.REFUSED, reason=f"accepting on {self.name!r} failed: "
                                          f"{type(e).__name__}: {e}", error=e,
                counter=RendezvousCount.SERVICE_ERRORS))

    def _read_guarded(self, conn: Conn, events: list[RendezvousEvent]) -> None:
        """:meth:`_read_all`; an unexpected exception refuses this connection only."""
        try:
            self._read_all(conn, events)
        except Exception as e:  # noqa: BLE001 - must not lose the events collected so far
            why = f"internal error on this connection: {type(e).__name__}: {e}"
            if conn.sock.fileno() >= 0:
                self._handshake.refuse(conn, events, RendezvousCount.SERVICE_ERRORS, why, e)
                return
            self._counts[RendezvousCount.SERVICE_ERRORS] += 1
            events.append(RendezvousEvent(EventKind.REFUSED, rank=-1 if conn.rank is None
                                          else conn.rank, pid=conn.cred.pid, reason=why,
                                          error=e, counter=RendezvousCount.SERVICE_ERRORS))

    def _accept_all(self, events: list[RendezvousEvent]) -> None:
        """Accept at most :data:`ACCEPTS_PER_SERVICE` connections; each is admitted or
        refused, and an admitted one's queued messages read. Out of fds, one connection
        is accepted into the spare's slot (:class:`SpareFd`), taken again here later."""
        self._spare.restore()
        spared = False
        for _ in range(ACCEPTS_PER_SERVICE):
            if spared:  # (out of fds, accept fails even with nothing queued: next time)
                return
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as e:  # EMFILE/ENFILE/ENOBUFS: retried on the next service()
                got = (self._spare.accept(self._listener)
                       if e.errno in (errno.EMFILE, errno.ENFILE) else None)
                if got is None:
                    self._refuse_accept(e, events)
                    return
                sock, spared = got, True
            try:
                conn = self._admit(sock, events)
            except BaseException:
                if sock.fileno() >= 0 and not self._table.has(sock.fileno()):
                    sock.close()  # not registered yet: nobody else would close it
                raise
            if conn is not None:
                self._read_guarded(conn, events)  # its Hello is usually already queued

    def _refuse_accept(self, e: OSError, events: list[RendezvousEvent]) -> None:
        """An ``accept`` that failed, counted and reported (out of fds: how to fix it)."""
        self._counts[RendezvousCount.ACCEPT_ERRORS] += 1
        why = f"accept() failed: {e}"
        if e.errno in (errno.EMFILE, errno.ENFILE):
            why += (f" -- this process is out of file descriptors (soft limit "
                    f"{resource.getrlimit(resource.RLIMIT_NOFILE)[0]}: raise it, e.g. "
                    "`ulimit -n`)")
            self._table.pause_listener(LISTENER_PAUSE_S)  # the connection stays queued
        events.append(RendezvousEvent(EventKind.REFUSED, reason=why, error=e,
                                      counter=RendezvousCount.ACCEPT_ERRORS))

    def _admit(self, sock: socket.socket, events: list[RendezvousEvent]) -> Conn | None:
        """Register a freshly accepted connection (evicting the oldest pending one when
        the cap is reached); None if it was refused (another uid) and closed."""
        try:
            sock.setblocking(False)
            cred = peer_cred(sock)
        except OSError as e:
            sock.close()
            self._counts[RendezvousCount.ACCEPT_ERRORS] += 1
            events.append(RendezvousEvent(EventKind.REFUSED,
                                          reason=f"accepted connection unusable: {e}", error=e,
                                          counter=RendezvousCount.ACCEPT_ERRORS))
            return None
        if cred.uid != os.geteuid():
            sock.close()
            self._counts[RendezvousCount.REFUSED_UID] += 1
            events.append(RendezvousEvent(
                EventKind.REFUSED, pid=cred.pid,
                reason=f"connection from uid {cred.uid} (pid {cred.pid}) refused: "
                       f"only uid {os.geteuid()} may use {self.name!r}",
                counter=RendezvousCount.REFUSED_UID))
            return None
        self._evict_pending(events)
        self._counts[RendezvousCount.ACCEPTED] += 1
        return self._table.add(sock, cred)

    def _evict_pending(self, events: list[RendezvousEvent]) -> None:
        """Make room for one more pending connection: close the oldest ones over the cap.
        Every pending connection is read first, so one whose Hello (or stats query) is
        already queued becomes a rank (or is answered) rather than being evicted."""
        table = self._table
        if table.pending_full():
            for conn in table.pending():
                self._read_guarded(conn, events)
        while table.pending_full():
            oldest = table.pop_oldest_pending()
            self._handshake.refuse(oldest, events, RendezvousCount.REFUSED_PENDING_CAP,
                         f"{table.pending_cap} connections to {self.name!r} have not said "
                         f"Hello: the oldest (pid {oldest.cred.pid}) is closed to admit a "
                         "new one")

    def _read_all(self, conn: Conn, events: list[RendezvousEvent]) -> None:
        """What ``conn`` sent, up to :data:`READS_PER_SERVICE` messages (the rest at the
        next service: the socket stays readable). Unbounded, one connection flooding
        stats requests kept the loop in here: no timer ran, an ATTACH start waited past
        its connect timeout for as long as the flood lasted."""
        for _ in range(READS_PER_SERVICE):
            if conn.sock.fileno() < 0:
                return
            dg = recv_datagram(conn.sock, _MAX_INBOUND)
            if dg is None:
                return
            if dg.eof:
                self._handshake.lose(conn, events, "connection closed (EOF)", peer_closed=True)
                return
            if dg.truncated:
                self._handshake.refuse(conn, events, RendezvousCount.REFUSED_PROTOCOL,
                             f"message larger than {_MAX_INBOUND} bytes")
                return
            try:
                msg = decode_control(dg.data)
            except VersionMismatch as e:
                self._handshake.refuse(conn, events, RendezvousCount.REFUSED_VERSION, str(e), e)
                return
            except ProtocolError as e:
                self._handshake.refuse(conn, events, RendezvousCount.REFUSED_PROTOCOL, str(e), e)
                return
            if isinstance(msg, Hello):
                self._handshake.on_hello(conn, msg, events)
            elif isinstance(msg, StatsRequest):
                if not self._stats_desk.answer(conn):
                    self._handshake.lose(conn, events, "connection closed while answering "
                                         "stats", peer_closed=True)
            elif isinstance(msg, Goodbye) and conn.rank is not None and msg.rank == conn.rank:
                conn.farewell = msg.reason or "the worker closed"
                self._counts[RendezvousCount.GOODBYES] += 1
            elif isinstance(msg, SetupFailed) and conn.rank is not None \
                    and msg.rank == conn.rank:
                conn.failure = msg.reason[:_REASON_CHARS] or "its setup failed"
            else:
                self._handshake.refuse(conn, events, RendezvousCount.REFUSED_PROTOCOL,
                             f"unexpected {type(msg).__name__} from pid {conn.cred.pid}")

    # ------------------------------------------------------------------ asyncio

    def attach(self, loop: asyncio.AbstractEventLoop,
               on_events: Callable[[list[RendezvousEvent]], None]) -> None:
        """Drive :meth:`service` from ``loop`` (add_reader on the listener and every
        connection); ``on_events`` gets each non-empty batch, on the loop's thread."""
        if self.state is ServerState.CLOSED:
            raise ClosedError(f"rendezvous {self.name!r} is closed")
        if self._table.attached:
            raise StateError(f"rendezvous {self.name!r} is already attached to a loop")
        self._on_events = on_events
        self._table.attach(loop, self._on_readable)
        loop.call_soon(self._on_readable)  # work that arrived before attach

    def detach(self) -> None:
        """Stop watching fds from the loop (idempotent); service() still works."""
        self._table.detach()
        self._on_events = None

    def disown(self) -> None:
        """This process is a fork of the server's owner (:mod:`kvshm.engine.forks`): its
        copied loop callback does nothing (no connection of the parent's is read here)."""
        self._on_events = None

    def _on_readable(self) -> None:
        if self.state is ServerState.CLOSED or self._on_events is None:
            return
        events = self.service()
        if events:
            self._on_events(events)

    def close(self) -> None:
        """Close every connection (workers see EOF) and the listener (idempotent)."""
        if self.state is ServerState.CLOSED:
            return
        self.detach()
        self._table.close_all()
        self._listener.close()
        self._spare.close()
        self._handshake.close()

    def __enter__(self) -> RendezvousServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: Most characters of a rank's SetupFailed reason kept (a peer's text, into a log line).
_REASON_CHARS: Final = 500
#: Seconds the loop stops watching the listener when a queued connection cannot be
#: accepted for want of fds (then tries again).
LISTENER_PAUSE_S: Final = 0.1


class SpareFd:
    """One file descriptor held in reserve (``/dev/null``) for when the process has run
    out. ``accept`` then fails with EMFILE and leaves the connection queued, the
    listener stays readable, and a loop that watches it calls the service again at once
    -- a probe's scheduler burned a core for its whole 60 s start timeout that way.
    :meth:`accept` gives the spare's slot to the waiting connection, which is admitted
    as any other (a rank's Hello goes on; if the process is still out of fds when its
    Ready's fds are duplicated, the start fails at once, naming the fd limit);
    :meth:`restore` takes a spare again once an fd is free. With no spare and no free
    fd a queued connection waits: the refusal names the fd limit, and a loop stops
    watching the listener for :data:`LISTENER_PAUSE_S` (ten tries a second, not a
    spin)."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self.restore()

    def restore(self) -> None:
        """Take a spare if none is held (never raises: out of fds, none is taken)."""
        if self._fd is None:
            try:
                self._fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = None

    def accept(self, listener: socket.socket) -> socket.socket | None:
        """The first queued connection, accepted into the spare's slot (None: no spare,
        or the accept failed anyway; the spare is then taken back). Never raises."""
        if self._fd is None:
            return None
        os.close(self._fd)
        self._fd = None
        try:
            sock, _ = listener.accept()
        except OSError:
            self.restore()
            return None
        return sock

    def close(self) -> None:
        """Release the spare (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
