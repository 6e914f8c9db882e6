"""The rendezvous server's connections: who is watched, who is pending, who is a rank.

:class:`ConnTable` keeps every fd a :class:`~kvshm.ipc.rendezvous.RendezvousServer`
watches (the listener and each open connection) in one ``poll`` set, and while the
server is attached to an asyncio loop, as that loop's readers too. Each open connection
is in exactly one of two groups:

* *pending*: no Hello accepted (yet). Kept in order of age and bounded by
  :attr:`ConnTable.pending_cap` (4 x world_size, at least 16); the server evicts the
  oldest ones when a new connection would go over it (policy: module doc of
  :mod:`kvshm.ipc.rendezvous`).
* *ranks*: its Hello was accepted (:meth:`ConnTable.promote`); never evicted, at most
  one connection per rank.

A closed connection is in neither, and its fd is out of the poll set and the loop
before the socket closes (the fd number may be reused at once).
"""

from __future__ import annotations

import select
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvshm.ipc.fdpass import PeerCred

if TYPE_CHECKING:  # pragma: no cover - typing only
    import asyncio

__all__ = ["Conn", "ConnTable"]

#: Pending (not yet Hello'd) connections kept: this many per rank, and at least the floor.
_PENDING_PER_RANK: Final = 4
_PENDING_FLOOR: Final = 16
_POLLIN: Final = select.POLLIN | select.POLLHUP | select.POLLERR


@dataclass(slots=True)
class Conn:
    """One accepted connection and its peer's credentials (SO_PEERCRED)."""

    sock: socket.socket
    cred: PeerCred
    rank: int | None = None  # set once its Hello is accepted
    farewell: str = ""  # the rank's Goodbye reason: its coming EOF is a clean departure
    failure: str = ""  # the rank's SetupFailed reason: its coming EOF is why it died


class ConnTable:
    """The listener and every open connection of one server (see the module doc)."""

    def __init__(self, listener_fd: int, world_size: int) -> None:
        self._listener_fd = listener_fd
        self._poll = select.poll()
        self._poll.register(listener_fd, _POLLIN)
        self._conns: dict[int, Conn] = {}  # every open connection, by fd
        self._pending: dict[int, Conn] = {}  # not Hello'd yet, by fd, oldest first
        self._pending_cap = max(_PENDING_FLOOR, _PENDING_PER_RANK * world_size)
        self._by_rank: dict[int, Conn] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_readable: Callable[[], None] | None = None
        self._listener_paused = False

    @property
    def pending_cap(self) -> int:
        """Most connections without an accepted Hello kept open."""
        return self._pending_cap

    @property
    def attached(self) -> bool:
        """True while a loop watches the fds."""
        return self._loop is not None

    # ------------------------------------------------------------------ queries

    def ready(self) -> list[int]:
        """fds with something to do now (the listener's among them); never waits."""
        return [fd for fd, _ in self._poll.poll(0)]

    def get(self, fd: int) -> Conn | None:
        """The open connection on ``fd``, or None."""
        return self._conns.get(fd)

    def has(self, fd: int) -> bool:
        """True when ``fd`` is an open connection of this table."""
        return fd in self._conns

    def fds(self) -> list[int]:
        """The listener, then every open connection in order of acceptance."""
        return [self._listener_fd, *self._conns]

    def rank_conn(self, rank: int) -> Conn | None:
        """The live connection of ``rank``, or None."""
        return self._by_rank.get(rank)

    def rank_conns(self) -> dict[int, Conn]:
        """rank -> live connection (a copy)."""
        return dict(self._by_rank)

    def pending(self) -> list[Conn]:
        """Pending connections, oldest first (a copy)."""
        return list(self._pending.values())

    def pending_full(self) -> bool:
        """True when admitting one more pending connection would exceed the cap."""
        return len(self._pending) >= self._pending_cap

    # ------------------------------------------------------------------ changes

    def add(self, sock: socket.socket, cred: PeerCred) -> Conn:
        """Register a freshly accepted (non-blocking) socket as the newest pending one."""
        conn = Conn(sock, cred)
        fd = sock.fileno()
        self._conns[fd] = conn
        self._pending[fd] = conn
        self._poll.register(fd, _POLLIN)
        if self._loop is not None:
            assert self._on_readable is not None
            self._loop.add_reader(fd, self._on_readable)
        return conn

    def promote(self, conn: Conn, rank: int) -> None:
        """``conn``'s Hello was accepted as ``rank``: it leaves pending for good."""
        conn.rank = rank
        self._pending.pop(conn.sock.fileno(), None)
        self._by_rank[rank] = conn

    def pop_oldest_pending(self) -> Conn:
        """Take the oldest pending connection out of pending (the caller closes it)."""
        return self._pending.pop(next(iter(self._pending)))

    def close(self, conn: Conn) -> None:
        """Unwatch, forget and close ``conn`` (idempotent)."""
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

    def close_all(self) -> None:
        """Close every open connection (the listener is the caller's)."""
        for conn in list(self._conns.values()):
            self.close(conn)

    # ------------------------------------------------------------------ asyncio

    def attach(self, loop: asyncio.AbstractEventLoop, on_readable: Callable[[], None]) -> None:
        """Watch every fd, now and as they are added, with ``loop.add_reader``."""
        self._loop, self._on_readable = loop, on_readable
        for fd in self.fds():
            loop.add_reader(fd, on_readable)

    def pause_listener(self, seconds: float) -> bool:
        """Stop watching the listener for ``seconds``; True if it was watched. For a
        connection that cannot be accepted yet (the process out of fds, no spare left):
        the listener stays readable and the loop, which reports readiness as long as it
        lasts, would call the service again at once for as long as the shortage does (a
        review: 72,000 calls a second)."""
        if self._loop is None or self._listener_paused:
            return False
        self._loop.remove_reader(self._listener_fd)
        self._listener_paused = True
        self._loop.call_later(seconds, self._resume_listener)
        return True

    def _resume_listener(self) -> None:
        """Watch the listener again after :meth:`pause_listener` (if still attached)."""
        if not self._listener_paused:
            return
        self._listener_paused = False
        if self._loop is not None and self._on_readable is not None:
            self._loop.add_reader(self._listener_fd, self._on_readable)

    def detach(self) -> None:
        """Stop watching from the loop (idempotent); :meth:`ready` still works."""
        if self._loop is None:
            return
        for fd in self.fds():
            self._loop.remove_reader(fd)
        self._loop = self._on_readable = None
