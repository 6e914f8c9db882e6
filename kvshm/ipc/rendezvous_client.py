"""Worker side of the rendezvous, and the one-shot stats query (``kvshm stats --name``).

:class:`RendezvousClient` never blocks except in :meth:`~RendezvousClient.wait_ready`
(for standalone worker processes): an embedded worker calls :meth:`connect_nowait` and
:meth:`send_hello` from one host-engine hook and :meth:`poll_ready` from later ones.

Every message read from the socket, by any method, goes to an in-order inbox first, so
no call ever drops a message another call is waiting for: :meth:`check_alive` may read
the ``Ready`` that :meth:`poll_ready` later returns. EOF is remembered, and reported only
after every message that arrived before it. The connection is the lifeline:
:meth:`fileno` becomes readable, and :meth:`check_alive` False, once the scheduler is
gone.

Who is listening is checked before anything is said: an abstract name belongs to whoever
binds it first, and no file permission guards it. :meth:`RendezvousClient.connect_nowait`
reads the listener's credentials (SO_PEERCRED, fixed by the kernel at the listener's
``listen()``) right after ``connect()`` and, unless its uid is this process's effective
uid, closes the socket and raises :class:`~kvshm.errors.UntrustedPeer` -- before a Hello,
a StatsRequest or any fd can go out. There is no knob for another uid: the scheduler
refuses every peer of another uid itself, so such a pair could never rendezvous anyway.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections import deque
from typing import Any, Final

from kvshm.config import check_timeout
from kvshm.errors import (
    ClosedError,
    EngineNotRunning,
    KvshmError,
    PeerDied,
    ProtocolError,
    StateError,
    UntrustedPeer,
    WouldBlock,
)
from kvshm.ipc.fdpass import (
    MAX_FDS,
    PeerCred,
    connect_nowait,
    decode_control,
    encode_control,
    peer_cred,
    recv_datagram,
    send_datagram,
    socket_address,
)
from kvshm.ipc.protocol import (
    ControlMsg,
    Goodbye,
    Hello,
    Ready,
    SetupFailed,
    Stats,
    StatsRequest,
    check_version,
)

__all__ = ["RendezvousClient", "check_scheduler_cred", "query_stats"]

#: Largest message the scheduler may send (a Ready with a big layout, a Stats snapshot).
_MAX_INBOUND: Final = 1 << 20

_REFUSED_HINT: Final = ("it refused this connection (protocol version, world_size, rank "
                        "range, duplicate rank or uid; see the scheduler's log) or died")


class RendezvousClient:
    """One worker's (or a stats asker's) connection to the scheduler named ``name``."""

    def __init__(self, name: str) -> None:
        socket_address(name)  # validates the name now: ConfigError
        self.name = name
        self._sock: socket.socket | None = None
        self._closed = False
        self._eof = False
        self._hello: Hello | None = None
        self._inbox: deque[tuple[ControlMsg, list[int]]] = deque()
        self._readable = select.poll()  # gate: skip recvmsg's 1 MiB buffer when idle

    # ------------------------------------------------------------------ connection

    @property
    def connected(self) -> bool:
        return self._sock is not None and not self._closed

    def connect_nowait(self) -> None:
        """Connect without waiting, then check who listens (see the module docstring).

        PeerDied if nobody listens (yet); WouldBlock if the scheduler's backlog is full;
        UntrustedPeer if the listener runs as another uid (the socket is closed, nothing
        was sent; a later call may try again); StateError if already connected.
        """
        self._check_open()
        if self._sock is not None:
            raise StateError(f"already connected to {self.name!r}")
        sock = connect_nowait(self.name)
        try:
            check_scheduler_cred(self.name, peer_cred(sock))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._readable.register(sock.fileno(), select.POLLIN)

    def send(self, msg: ControlMsg) -> None:
        """Send one control message without waiting (WouldBlock if the buffer is full)."""
        sock = self._connected_sock()
        try:
            send_datagram(sock, encode_control(msg))
        except BlockingIOError:
            raise WouldBlock(f"rendezvous socket to {self.name!r} is full") from None
        except PeerDied:
            self._eof = True
            raise PeerDied(f"kvshm scheduler {self.name!r} closed the connection: "
                           f"{_REFUSED_HINT}") from None

    def send_goodbye(self, rank: int, reason: str) -> bool:
        """Best effort, never raises: tell the scheduler this rank is leaving cleanly
        (:class:`~kvshm.ipc.protocol.Goodbye`); False if it could not be sent (not
        connected, no Hello sent, buffer full, peer gone)."""
        return self._send_after_hello(Goodbye(rank, reason))

    def send_setup_failed(self, rank: int, reason: str) -> bool:
        """Best effort, never raises: tell the scheduler why this rank could not set up
        what its Ready named (:class:`~kvshm.ipc.protocol.SetupFailed`), just before
        closing; False if it could not be sent."""
        return self._send_after_hello(SetupFailed(rank, reason))

    def _send_after_hello(self, msg: Goodbye | SetupFailed) -> bool:
        """``msg`` sent on a connection that said Hello; False, never raising, where it
        could not be (no Hello sent, not connected, buffer full, peer gone)."""
        if self._hello is None:
            return False
        try:
            self.send(msg)
        except (KvshmError, OSError):
            return False
        return True

    def send_hello(self, hello: Hello) -> None:
        """Say hello (once per connection)."""
        if self._hello is not None:
            raise StateError(f"Hello already sent to {self.name!r} as rank {self._hello.rank}")
        self.send(hello)
        self._hello = hello

    # ------------------------------------------------------------------ receiving

    def poll_ready(self) -> tuple[Ready, list[int]] | None:
        """The Ready and its fds (caller owns them) if it has arrived, else None.

        Never blocks. VersionMismatch if the scheduler speaks another protocol version
        (its fds are closed); PeerDied if the connection ended before a Ready.
        """
        self._pump()
        for i, (msg, fds) in enumerate(self._inbox):
            if isinstance(msg, Ready):
                del self._inbox[i]
                return self._checked_ready(msg, fds)
        if self._eof:
            raise PeerDied(f"kvshm scheduler {self.name!r} closed the connection before "
                           f"Ready: {_REFUSED_HINT}")
        return None

    def _checked_ready(self, ready: Ready, fds: list[int]) -> tuple[Ready, list[int]]:
        try:
            check_version(ready.version)
            if self._hello is not None and ready.rank != self._hello.rank:
                raise ProtocolError(f"Ready for rank {ready.rank} sent to rank {self._hello.rank}",
                                    ring="rendezvous", offset=0)
        except BaseException:
            _close_all(fds)
            raise
        return ready, fds

    def wait_ready(self, timeout: float) -> tuple[Ready, list[int]]:
        """Block up to ``timeout`` seconds for the Ready (standalone processes only).

        Raises TimeoutError when none arrived in time, plus what :meth:`poll_ready` raises.
        """
        deadline = time.monotonic() + timeout
        while True:
            got = self.poll_ready()
            if got is not None:
                return got
            self._wait_readable(deadline, "Ready")

    def take_messages(self) -> list[ControlMsg]:
        """Drain messages other than Ready that have arrived (e.g. Shutdown, Stats)."""
        self._pump()
        out: list[ControlMsg] = [msg for msg, _ in self._inbox if not isinstance(msg, Ready)]
        kept = [(msg, fds) for msg, fds in self._inbox if isinstance(msg, Ready)]
        self._inbox = deque(kept)
        return out

    def take_lifeline(self) -> tuple[bool, list[ControlMsg]]:
        """:meth:`check_alive` and :meth:`take_messages` in one read of the socket (one
        ``poll`` syscall, not two): whether the scheduler side is still there, and the
        messages other than Ready that arrived (those before an EOF included)."""
        self._pump()
        out: list[ControlMsg] = []
        if self._inbox:
            out = [msg for msg, _ in self._inbox if not isinstance(msg, Ready)]
            self._inbox = deque((msg, fds) for msg, fds in self._inbox
                                if isinstance(msg, Ready))
        return not self._eof, out

    def fileno(self) -> int:
        """The lifeline: readable on a message or once the scheduler is gone."""
        return self._connected_sock().fileno()

    def check_alive(self) -> bool:
        """False once the scheduler side is gone (EOF). Never blocks; whatever it reads
        is kept in the inbox for :meth:`poll_ready` / :meth:`take_messages`."""
        self._pump()
        return not self._eof

    def _pump(self) -> None:
        """Move every datagram already queued on the socket to the inbox, in order."""
        sock = self._connected_sock()
        if self._eof or not self._readable.poll(0):
            return
        while not self._eof:
            dg = recv_datagram(sock, _MAX_INBOUND, MAX_FDS)
            if dg is None:
                return
            if dg.eof:
                self._eof = True
                return
            if dg.truncated:
                raise ProtocolError(f"message from {self.name!r} over {_MAX_INBOUND} bytes "
                                    "or with too many fds", ring="rendezvous", offset=0)
            try:
                msg = decode_control(dg.data)
            except BaseException:
                _close_all(dg.fds)
                raise
            if not isinstance(msg, Ready) and dg.fds:
                _close_all(dg.fds)  # only Ready carries fds
                dg.fds = []
            self._inbox.append((msg, dg.fds))

    def _wait_readable(self, deadline: float, what: str) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no {what} from kvshm scheduler {self.name!r} in time")
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        poller.poll(max(1, int(remaining * 1000)))

    def _connected_sock(self) -> socket.socket:
        self._check_open()
        if self._sock is None:
            raise StateError(f"not connected to {self.name!r}: call connect_nowait() first")
        return self._sock

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"rendezvous client for {self.name!r} is closed")

    def close(self) -> None:
        """Close the connection and any fds still in the inbox (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for _, fds in self._inbox:
            _close_all(fds)
        self._inbox.clear()
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> RendezvousClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_scheduler_cred(name: str, cred: PeerCred) -> None:
    """UntrustedPeer unless ``cred`` (the listener on ``name``) has this process's uid.

    The effective uid on both sides: it is what SO_PEERCRED reports for the listener, and
    what the scheduler's own check will see of this process.
    """
    expected = os.geteuid()
    if cred.uid != expected:
        raise UntrustedPeer(name, cred.pid, cred.uid, expected)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def query_stats(name: str, timeout: float = 2.0) -> dict[str, Any]:
    """Ask the engine named ``name`` for its statistics.

    EngineNotRunning (a ConfigError) if no engine listens on that name; UntrustedPeer if
    the listener runs as another uid (nothing is sent to it); TimeoutError if it does not
    answer within ``timeout`` seconds; PeerDied if it closes the connection (e.g. it
    refused this uid). ConfigError for a timeout that is not a finite number of seconds
    > 0 (at most a day).
    """
    timeout = check_timeout("query_stats: timeout", timeout)
    with RendezvousClient(name) as client:
        try:
            client.connect_nowait()
        except PeerDied:
            raise EngineNotRunning(name) from None
        client.send(StatsRequest())
        deadline = time.monotonic() + timeout
        while True:
            for msg in client.take_messages():
                if isinstance(msg, Stats):
                    return dict(msg.data)
            if not client.check_alive():
                raise PeerDied(f"kvshm engine {name!r} closed the connection without "
                               "answering the stats request")
            client._wait_readable(deadline, "Stats")
