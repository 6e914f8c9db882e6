"""What the rendezvous server does with each accepted message, and how it drops a peer.

:class:`Handshake` is a base of :class:`~kvshm.ipc.rendezvous.RendezvousServer` (one
object: it declares the server's attributes it uses and holds none of its own). Its
rules, which the server's :meth:`~kvshm.ipc.rendezvous.RendezvousServer.service` order
relies on:

* A Hello is accepted only on a connection that is not a rank's yet, for this world
  size, a rank in range, not connected (a duplicate) and never lost, and only while
  the server is WAITING; otherwise the connection is refused (closed without a reply,
  counted by cause). An accepted Hello promotes the connection to its rank's (never
  evicted) and records the Hello and the peer's pid.
* ``make_ready`` is called once (the state leaves WAITING before the call, so a raise
  cannot repeat it); every rank then gets its Ready and fds, or, when ``make_ready``
  failed or missed a rank, every rank connection is closed (READY_FAILED).
* A stats query is answered on any connection; a stats bug or an oversized snapshot
  answers an error instead; an asker that does not read its answers is dropped
  (``stats_dropped``), a rank never is.
* Refusing a rank's connection loses the rank (``RANK_LOST``, once per rank; a lost
  rank's slot is never refilled).
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Callable
from enum import Enum
from types import MappingProxyType
from typing import Any

from kvshm.errors import ConfigError, KvshmError, PeerDied, VersionMismatch
from kvshm.ipc.fdpass import encode_control, send_datagram
from kvshm.ipc.protocol import Hello, Stats, check_version
from kvshm.ipc.rendezvous_conns import Conn, ConnTable
from kvshm.ipc.rendezvous_events import EventKind, MakeReady, RendezvousEvent

__all__ = ["Handshake", "ServerState"]


class ServerState(Enum):
    """Lifecycle of a :class:`RendezvousServer`."""

    WAITING = "waiting"            # collecting Hellos
    READY = "ready"                # Ready sent to every rank
    READY_FAILED = "ready_failed"  # make_ready failed; rank connections closed
    CLOSED = "closed"


class Handshake:
    """Base of the rendezvous server: Hello checks, Ready, stats answers, refusals (the
    module docstring states the rules). The attributes are the server's."""

    name: str
    world_size: int
    _make_ready: MakeReady
    _stats: Callable[[], dict[str, Any]]
    _table: ConnTable
    _hellos: dict[int, Hello]
    _pids: dict[int, int]
    _lost: set[int]
    _counts: Counter[str]
    _state: ServerState

    def _hello_problem(self, conn: Conn, hello: Hello) -> tuple[str, str] | None:
        """(counter, reason) if this Hello must be refused, else None."""
        if conn.rank is not None:
            return "refused_protocol", f"second Hello on rank {conn.rank}'s connection"
        if hello.world_size != self.world_size:
            return "refused_hello", (f"refused rank {hello.rank} (pid {conn.cred.pid}): "
                                     f"world size {hello.world_size} != {self.world_size} "
                                     f"(the Hello says world_size {hello.world_size}, but "
                                     f"{self.name!r} serves world_size {self.world_size})")
        if not 0 <= hello.rank < self.world_size:
            return "refused_hello", (f"Hello from pid {conn.cred.pid}: rank {hello.rank} out "
                                     f"of range [0, {self.world_size})")
        if (twin := self._table.rank_conn(hello.rank)) is not None:
            other = twin.cred.pid
            return "refused_hello", (f"duplicate rank {hello.rank} from pid {conn.cred.pid}: "
                                     f"already connected from pid {other}")
        if hello.rank in self._lost:
            return "refused_hello", (f"rank {hello.rank} was lost earlier; rank restart is "
                                     "not supported")
        if self._state is not ServerState.WAITING:
            return "refused_hello", f"rendezvous {self.name!r} is {self._state.value}"
        return None

    def _on_hello(self, conn: Conn, hello: Hello, events: list[RendezvousEvent]) -> None:
        try:
            check_version(hello.version)
        except VersionMismatch as e:
            self._refuse(conn, events, "refused_version", str(e), e)
            return
        problem = self._hello_problem(conn, hello)
        if problem is not None:
            self._refuse(conn, events, *problem)
            return
        self._table.promote(conn, hello.rank)  # a rank: never evicted
        self._hellos[hello.rank] = hello
        self._pids[hello.rank] = conn.cred.pid
        events.append(RendezvousEvent(EventKind.HELLO, rank=hello.rank, pid=conn.cred.pid))

    def _answer_stats(self, conn: Conn, events: list[RendezvousEvent]) -> None:
        try:
            data = encode_control(Stats(data=self._stats()))
        except Exception as e:  # noqa: BLE001 - a stats bug must not take the scheduler down
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
                self._table.close(conn)
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
            ranks = self._table.rank_conns()
            missing = sorted(set(ranks) - set(plan))
            if missing:
                raise ConfigError(f"make_ready returned no Ready for ranks {missing}")
        except Exception as e:  # noqa: BLE001 - any make_ready failure fails the start, not the loop
            self._fail_ready(events, e)
            return
        lost: list[tuple[Conn, str]] = []
        for rank, conn in sorted(ranks.items()):
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
        for conn in self._table.rank_conns().values():
            self._table.close(conn)
        why = error if isinstance(error, KvshmError) else f"{type(error).__name__}: {error}"
        events.append(RendezvousEvent(EventKind.READY_FAILED,
                                      reason=f"rendezvous {self.name!r} failed: {why}",
                                      error=error))

    def _refuse(self, conn: Conn, events: list[RendezvousEvent], counter: str, reason: str,
                error: BaseException | None = None) -> None:
        """Close ``conn`` without a reply; a rank's connection is also RANK_LOST."""
        self._counts[counter] += 1
        events.append(RendezvousEvent(EventKind.REFUSED, rank=-1 if conn.rank is None
                                      else conn.rank, pid=conn.cred.pid, reason=reason,
                                      error=error))
        self._lose(conn, events, reason)

    def _lose(self, conn: Conn, events: list[RendezvousEvent], why: str, *,
              peer_closed: bool = False) -> None:
        rank = conn.rank
        self._table.close(conn)
        if rank is None or rank in self._lost:
            return
        self._lost.add(rank)
        self._hellos.pop(rank, None)
        self._counts["ranks_lost"] += 1
        events.append(RendezvousEvent(EventKind.RANK_LOST, rank=rank, pid=conn.cred.pid,
                                      reason=why, peer_closed=peer_closed,
                                      farewell=conn.farewell if peer_closed else ""))
