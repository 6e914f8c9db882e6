"""Rendezvous plumbing: abstract AF_UNIX SOCK_SEQPACKET sockets, fd passing, control codec.

Every socket here is non-blocking and close-on-exec. One control message is one
SEQPACKET datagram (the kernel keeps message boundaries, so there is no framing); file
descriptors ride in the same datagram as SCM_RIGHTS ancillary data. A zero-length read
is end-of-file (the protocol never sends an empty datagram); ECONNRESET is treated the
same way. Abstract names (``\\0kvshm.<name>``) never touch the filesystem, so nothing is
left behind when a process dies -- and no file permission guards them: anyone may bind or
connect, so each side checks the other's uid with :func:`peer_cred` (SO_PEERCRED).

Decoding never lets a peer's bytes raise anything but our own errors: whatever a frame
makes the decoder raise (msgspec's DecodeError, a RecursionError from a deeply nested
frame, ...) becomes a :class:`~kvshm.errors.ProtocolError` (or VersionMismatch).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import msgspec

from kvshm.errors import (
    ConfigError,
    NameInUse,
    PeerDied,
    ProtocolError,
    VersionMismatch,
    WouldBlock,
)
from kvshm.ipc.protocol import (
    PROTOCOL_VERSION,
    ControlMsg,
    Hello,
    Ready,
    control_decoder,
    control_encoder,
)

__all__ = [
    "MAX_FDS",
    "Datagram",
    "PeerCred",
    "connect_nowait",
    "decode_control",
    "encode_control",
    "listen",
    "peer_cred",
    "recv_datagram",
    "send_datagram",
    "socket_address",
]

#: Most fds one datagram may carry (the kernel's SCM_MAX_FD).
MAX_FDS: Final = 253
#: Longest name accepted: sun_path is 108 bytes, minus NUL, minus "kvshm.".
_MAX_NAME_BYTES: Final = 108 - 1 - len("kvshm.")
_UCRED: Final = struct.Struct("iII")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
_DISCONNECTED: Final = (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN)

_VERSIONED_TAGS: Final = (Hello.__struct_config__.tag, Ready.__struct_config__.tag)

_ENCODER = control_encoder()
_DECODER = control_decoder()


def socket_address(name: str) -> bytes:
    """The abstract socket address of engine ``name``; ConfigError for an unusable name."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"kvshm name must be a non-empty string, got {name!r}")
    raw = name.encode("utf-8")
    if b"\0" in raw or len(raw) > _MAX_NAME_BYTES:
        raise ConfigError(f"kvshm name {name!r} must have no NUL and at most "
                          f"{_MAX_NAME_BYTES} bytes")
    return b"\0kvshm." + raw


def _seqpacket() -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    sock.setblocking(False)
    return sock


def listen(name: str, backlog: int) -> socket.socket:
    """A non-blocking listening socket on ``\\0kvshm.<name>``; NameInUse if taken."""
    addr = socket_address(name)
    sock = _seqpacket()
    try:
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise NameInUse(name) from None
        raise
    return sock


def connect_nowait(name: str) -> socket.socket:
    """A non-blocking connected socket to ``\\0kvshm.<name>`` (never waits).

    Raises PeerDied if nobody listens there (not started yet, or gone), WouldBlock if the
    listener's backlog is full (retry later).
    """
    addr = socket_address(name)
    sock = _seqpacket()
    try:
        sock.connect(addr)
    except OSError as e:
        sock.close()
        if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
            raise PeerDied(f"no kvshm scheduler listens on name {name!r} "
                           "(not started yet, or gone)") from None
        if e.errno in (errno.EAGAIN, errno.EINPROGRESS):
            raise WouldBlock(f"kvshm scheduler {name!r} has a full accept backlog") from None
        raise
    return sock


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The connecting process as the kernel saw it at connect() (SO_PEERCRED)."""

    pid: int
    uid: int
    gid: int


def peer_cred(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected AF_UNIX socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return PeerCred(pid, uid, gid)


@dataclass(slots=True)
class Datagram:
    """One received datagram. ``eof``: the peer is gone. ``truncated``: too large (its fds
    and data are unusable; the fds were already closed)."""

    data: bytes = b""
    fds: list[int] = field(default_factory=list)
    eof: bool = False
    truncated: bool = False


def recv_datagram(sock: socket.socket, bufsize: int, maxfds: int = 0) -> Datagram | None:
    """Receive one datagram without waiting; None if there is none yet.

    With ``maxfds`` 0 any fds a peer sends are discarded (closed) by the kernel. The
    caller owns the returned fds.
    """
    anc = socket.CMSG_SPACE(maxfds * 4) if maxfds else 0
    try:
        data, ancdata, flags, _ = sock.recvmsg(bufsize, anc)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError as e:
        if e.errno in _DISCONNECTED:
            return Datagram(eof=True)
        raise
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array("i")
            got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
            fds.extend(got)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in fds:
            os.close(fd)
        return Datagram(data=data, truncated=True)
    if not data:
        for fd in fds:
            os.close(fd)
        # a zero-length message and the peer's close both read as no bytes: only a
        # hang-up is EOF (an empty message is the peer's, undecodable: its process
        # lives on, so it must never pass for the lifeline's end -- a rank's fence)
        return Datagram(eof=True) if _hung_up(sock) else Datagram(data=b"")
    return Datagram(data=data, fds=fds)


def _hung_up(sock: socket.socket) -> bool:
    """Whether the peer of ``sock`` closed its end (POLLHUP / POLLRDHUP now)."""
    p = select.poll()
    p.register(sock, select.POLLRDHUP | select.POLLHUP)
    return any(ev & (select.POLLRDHUP | select.POLLHUP) for _, ev in p.poll(0))


def send_datagram(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
    """Send one datagram (with ``fds`` as SCM_RIGHTS) without waiting.

    The kernel duplicates the fds into the message: the caller may close its copies as
    soon as this returns. Raises BlockingIOError if the socket buffer is full and
    PeerDied if the peer is gone.
    """
    if len(fds) > MAX_FDS:
        raise ConfigError(f"{len(fds)} fds in one message; at most {MAX_FDS}")
    try:
        if fds:
            sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))])
        else:
            sock.send(data)
    except OSError as e:
        if e.errno in _DISCONNECTED:
            raise PeerDied("the peer closed the rendezvous connection") from None
        raise


def encode_control(msg: ControlMsg) -> bytes:
    """msgpack bytes of one control message."""
    return _ENCODER.encode(msg)


def decode_control(data: bytes) -> ControlMsg:
    """Decode one control message; VersionMismatch or ProtocolError if it cannot be used.

    Any exception the decoder raises on a peer's bytes -- not only msgspec's DecodeError,
    also e.g. the RecursionError of a frame nested thousands of levels deep -- is a
    ProtocolError: a hostile frame can never raise anything the caller does not expect.
    A Hello or Ready from a peer with another PROTOCOL_VERSION may not decode against our
    schema; then the raw array is inspected so the error names both versions.
    """
    try:
        msg = _DECODER.decode(data)
    except Exception as e:  # noqa: BLE001 - a peer's bytes may make the decoder raise anything
        theirs = _raw_version(data)
        if theirs is not None and theirs != PROTOCOL_VERSION:
            raise VersionMismatch(PROTOCOL_VERSION, theirs) from None
        raise ProtocolError(f"undecodable rendezvous message ({len(data)} bytes): "
                            f"{type(e).__name__}: {e}", ring="rendezvous", offset=0) from None
    return msg


def _raw_version(data: bytes) -> int | None:
    """The version field of a raw Hello/Ready array (``[tag, version, ...]``), if any."""
    try:
        raw = msgspec.msgpack.decode(data)
    except Exception:  # noqa: BLE001 - undecodable in any way: no version to report
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] in _VERSIONED_TAGS and type(raw[1]) is int:
        return raw[1]
    return None
