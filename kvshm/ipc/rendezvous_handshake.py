"""The rendezvous handshake: which Hellos are accepted, when Ready goes out, who is lost.

:class:`Handshake` is an object the :class:`~kvshm.ipc.rendezvous.RendezvousServer`
holds. The server keeps the sockets (the listener, the connection table it hands in)
and the service loop; the handshake decides what each accepted message does and owns
what that decides: the accepted Hellos, the peers' pids, the lost ranks and the
lifecycle (:class:`ServerState`). Its rules and invariants are in the class docstring.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from types import MappingProxyType

from kvshm.errors import ConfigError, KvshmError, PeerDied, StateError, VersionMismatch
from kvshm.ipc.fdpass import MAX_FDS, encode_control, send_datagram
from kvshm.ipc.protocol import Hello, check_version
from kvshm.ipc.rendezvous_conns import Conn, ConnTable
from kvshm.ipc.rendezvous_events import EventKind, MakeReady, RendezvousCount, RendezvousEvent

__all__ = ["Handshake", "ServerState"]


class ServerState(Enum):
    """Lifecycle of a rendezvous (:attr:`Handshake.state`)."""

    WAITING = "waiting"            # collecting Hellos
    READY = "ready"                # Ready sent to every rank
    READY_FAILED = "ready_failed"  # make_ready failed; rank connections closed
    CLOSED = "closed"


class Handshake:
    """Hello checks, Ready, refusals and losses of one rendezvous (stats queries are
    :class:`~kvshm.ipc.rendezvous_stats.StatsDesk`'s).

    Owns the accepted Hellos by rank, each rank's peer pid (kept after its loss), the
    lost ranks and the lifecycle state. Handed the server's connection table (it
    promotes accepted connections to ranks and closes refused ones) and the server's
    counters (it counts each outcome there; :meth:`RendezvousServer.counters
    <kvshm.ipc.rendezvous.RendezvousServer.counters>` lists them).

    Invariants, at every return:

    * A Hello is accepted only on a connection that is not a rank's yet, for this world
      size, a rank in range, not connected (a duplicate) and never lost, and only while
      WAITING; otherwise the connection is refused (closed without a reply, counted by
      cause). An accepted Hello promotes the connection to its rank's (never evicted)
      and records the Hello and the peer's pid.
    * ``hellos`` holds exactly the ranks that said Hello and are not lost; a lost rank
      is in ``lost`` for good and its slot is never refilled (no restarts).
    * ``make_ready`` is called at most once: :meth:`ready_when_complete` leaves WAITING
      before the call, so a raise cannot repeat it. Every rank then gets its Ready and
      fds (READY), or, when ``make_ready`` failed or missed a rank, every rank
      connection is closed (READY_FAILED).
    * Refusing a rank's connection loses the rank (``RANK_LOST``, once per rank).
    """

    def __init__(self, name: str, world_size: int, table: ConnTable,
                 counts: dict[RendezvousCount, int], *, make_ready: MakeReady) -> None:
        self.name = name
        self.world_size = world_size
        self._table = table
        self._counts = counts
        self._make_ready = make_ready
        self._hellos: dict[int, Hello] = {}
        self._pids: dict[int, int] = {}
        self._lost: set[int] = set()
        self._state = ServerState.WAITING

    # ------------------------------------------------------------------ views

    @property
    def state(self) -> ServerState:
        """Where the rendezvous stands."""
        return self._state

    def hellos(self) -> Mapping[int, Hello]:
        """Accepted Hellos by rank, lost ranks excluded (read-only view)."""
        return MappingProxyType(self._hellos)

    def lost_ranks(self) -> frozenset[int]:
        """Ranks lost so far (never refilled)."""
        return frozenset(self._lost)

    def peer_pid(self, rank: int) -> int:
        """pid of the process that said hello as ``rank`` (SO_PEERCRED; kept after loss)."""
        try:
            return self._pids[rank]
        except KeyError:
            raise StateError(f"rank {rank} has not said hello on {self.name!r}") from None

    # ------------------------------------------------------------------ messages

    def on_hello(self, conn: Conn, hello: Hello, events: list[RendezvousEvent]) -> None:
        """Accept ``hello`` on ``conn`` (HELLO) or refuse the connection (REFUSED)."""
        try:
            check_version(hello.version)
        except VersionMismatch as e:
            self.refuse(conn, events, RendezvousCount.REFUSED_VERSION, str(e), e)
            return
        problem = self._hello_problem(conn, hello)
        if problem is not None:
            self.refuse(conn, events, *problem)
            return
        self._table.promote(conn, hello.rank)  # a rank: never evicted
        self._hellos[hello.rank] = hello
        self._pids[hello.rank] = conn.cred.pid
        events.append(RendezvousEvent(EventKind.HELLO, rank=hello.rank, pid=conn.cred.pid))

    def _hello_problem(self, conn: Conn, hello: Hello) -> tuple[RendezvousCount, str] | None:
        """(counter, reason) if this Hello must be refused, else None."""
        bad_turn, bad_hello = RendezvousCount.REFUSED_PROTOCOL, RendezvousCount.REFUSED_HELLO
        if conn.rank is not None:
            return bad_turn, f"second Hello on rank {conn.rank}'s connection"
        if hello.world_size != self.world_size:
            return bad_hello, (f"refused rank {hello.rank} (pid {conn.cred.pid}): "
                               f"world size {hello.world_size} != {self.world_size} "
                               f"(the Hello says world_size {hello.world_size}, but "
                               f"{self.name!r} serves world_size {self.world_size})")
        if not 0 <= hello.rank < self.world_size:
            return bad_hello, (f"Hello from pid {conn.cred.pid}: rank {hello.rank} out "
                               f"of range [0, {self.world_size})")
        if (twin := self._table.rank_conn(hello.rank)) is not None:
            other = twin.cred.pid
            return bad_hello, (f"duplicate rank {hello.rank} from pid {conn.cred.pid}: "
                               f"already connected from pid {other}")
        if hello.rank in self._lost:
            return bad_hello, (f"rank {hello.rank} was lost earlier; rank restart is "
                               "not supported")
        if self._state is not ServerState.WAITING:
            return bad_hello, f"rendezvous {self.name!r} is {self._state.value}"
        return None

    # ------------------------------------------------------------------ Ready

    def ready_when_complete(self, events: list[RendezvousEvent]) -> None:
        """Once every rank said Hello (and only while WAITING): call ``make_ready`` and
        send each rank its Ready and fds (ALL_READY), or fail every rank (READY_FAILED).
        A rank whose Ready cannot be sent is lost after ALL_READY."""
        if self._state is not ServerState.WAITING or len(self._hellos) < self.world_size:
            return
        self._state = ServerState.READY  # make_ready is called once, even if it raises
        try:
            plan = self._make_ready(MappingProxyType(dict(self._hellos)))
            ranks = self._table.rank_conns()
            missing = sorted(set(ranks) - set(plan))
            if missing:
                raise ConfigError(f"make_ready returned no Ready for ranks {missing}")
            # every Ready encoded before any is sent: one that cannot be (a str the wire
            # cannot carry) fails the start here, with its cause, instead of raising out
            # of the loop's callback after some ranks got theirs
            wire = {rank: encode_control(plan[rank][0]) for rank in ranks}
            for rank in ranks:  # likewise a Ready with more fds than one message carries
                if len(plan[rank][1]) > MAX_FDS:
                    raise ConfigError(f"rank {rank}'s Ready carries {len(plan[rank][1])} "
                                      f"fds, at most {MAX_FDS} go in one message")
        except Exception as e:  # noqa: BLE001 - any make_ready failure fails the start, not the loop
            self._fail_ready(events, e)
            return
        lost: list[tuple[Conn, str]] = []
        for rank, conn in sorted(ranks.items()):
            fds = plan[rank][1]
            try:
                send_datagram(conn.sock, wire[rank], fds)
                self._counts[RendezvousCount.READY_SENT] += 1
            except (PeerDied, OSError) as e:  # BlockingIOError, EMSGSIZE, ETOOMANYREFS, ...
                lost.append((conn, f"could not send Ready: {e or type(e).__name__}"))
        events.append(RendezvousEvent(EventKind.ALL_READY))
        for conn, why in lost:
            self.lose(conn, events, why)

    def _fail_ready(self, events: list[RendezvousEvent], error: Exception) -> None:
        self._state = ServerState.READY_FAILED
        self._counts[RendezvousCount.READY_FAILED] += 1
        for conn in self._table.rank_conns().values():
            self._table.close(conn)
        why = error if isinstance(error, KvshmError) else f"{type(error).__name__}: {error}"
        events.append(RendezvousEvent(EventKind.READY_FAILED,
                                      reason=f"rendezvous {self.name!r} failed: {why}",
                                      error=error))

    # ------------------------------------------------------------------ endings

    def refuse(self, conn: Conn, events: list[RendezvousEvent], counter: RendezvousCount,
               reason: str,
               error: BaseException | None = None) -> None:
        """Close ``conn`` without a reply, counted under ``counter`` (REFUSED); a rank's
        connection is also RANK_LOST."""
        self._counts[counter] += 1
        events.append(RendezvousEvent(EventKind.REFUSED, rank=-1 if conn.rank is None
                                      else conn.rank, pid=conn.cred.pid, reason=reason,
                                      error=error, counter=counter))
        self.lose(conn, events, reason)

    def lose(self, conn: Conn, events: list[RendezvousEvent], why: str, *,
             peer_closed: bool = False) -> None:
        """Close ``conn``; a rank's is RANK_LOST once (``peer_closed``: the worker closed
        its end, see :class:`~kvshm.ipc.rendezvous_events.RendezvousEvent`)."""
        rank = conn.rank
        self._table.close(conn)
        if rank is None or rank in self._lost:
            return
        self._lost.add(rank)
        self._hellos.pop(rank, None)
        self._counts[RendezvousCount.RANKS_LOST] += 1
        if conn.failure:  # the rank said why before it closed (SetupFailed)
            why = f"{why}; the rank could not set up: {conn.failure}"
        events.append(RendezvousEvent(EventKind.RANK_LOST, rank=rank, pid=conn.cred.pid,
                                      reason=why, peer_closed=peer_closed,
                                      farewell=conn.farewell if peer_closed else ""))

    def close(self) -> None:
        """The server closed: the lifecycle ends (CLOSED)."""
        self._state = ServerState.CLOSED
