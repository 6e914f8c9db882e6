"""A minimal RESP client for control commands: one command per fresh connection.

The data path uses glide; this is for what must not depend on it -- the cluster
bootstrap (``CLUSTER ADDSLOTSRANGE``/``MEET``/``REPLICATE``), the janitor's ``SCAN``,
readiness checks, the tests. :func:`command` sends one command and reads until one whole
reply is in (:func:`_complete`: simple, error, integer, bulk and aggregate types; RESP3
scalars are framed too), or the server closes; :func:`parse_reply` decodes a RESP2 reply,
returning an error reply as a :class:`ServerReplyError` value, never raising it.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Final

__all__ = ["MAX_DEPTH", "MAX_REPLY_BYTES", "ServerReplyError", "command", "info_field",
           "parse_reply"]

#: The longest reply :func:`command` reads (the replies it is for -- ``CLUSTER SLOTS``,
#: ``INFO``, a ``SCAN`` page, a manifest -- are kilobytes): a peer that sends more, or
#: never ends a line, is refused (ValueError) rather than buffered without end.
MAX_REPLY_BYTES: Final = 64 << 20
#: What a server without a password answers an ``AUTH`` with (the command that follows
#: is answered).
_NO_PASSWORD: Final = b"without any password configured"
#: The deepest nesting of aggregate replies parsed (ValueError beyond it; this
#: project's commands nest two levels).
MAX_DEPTH: Final = 16


def command(host: str, port: int, *args: str | bytes, timeout: float = 2.0,
            password: str | None = None) -> bytes:
    """Send one command over a fresh connection and return its raw RESP reply (tests,
    the cluster bootstrap, the slot map, the janitor; the data path uses glide).
    ``password``: an ``AUTH`` goes first, in the same write; its error reply (a wrong
    password) is returned instead of the command's -- but for a server that has no
    password, which answers the command as glide's clients are answered. ``timeout``
    bounds the whole exchange, connect to last byte (a peer that trickles its reply a
    byte at a time does not hold the caller longer). OSError when nothing answers in
    time; ValueError for a reply longer than :data:`MAX_REPLY_BYTES`, nested deeper
    than :data:`MAX_DEPTH` or not RESP."""
    req = _request(args)
    if password is not None:
        req = _request(("AUTH", password)) + req
    deadline = time.monotonic() + timeout
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.settimeout(_left(deadline))
        s.sendall(req)
        buf = bytearray()
        while True:
            s.settimeout(_left(deadline))
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if len(buf) > MAX_REPLY_BYTES:
                raise ValueError(f"{host}:{port}: a reply longer than {MAX_REPLY_BYTES} "
                                 "bytes (not a Valkey server?)")
            if password is None:
                if _complete(buf):
                    break
                continue
            first = _end(buf, 0)
            if first >= 0 and buf[:1] == b"-" and _NO_PASSWORD not in buf[:first]:
                return bytes(buf[:first])  # AUTH refused: that is the answer
            if first >= 0 and _end(buf, first) >= 0:
                return bytes(buf[first:])
    return bytes(buf)


def _request(args: tuple[str | bytes, ...]) -> bytes:
    """One command as a RESP array of bulk strings."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def _left(deadline: float) -> float:
    """Seconds to ``deadline``; TimeoutError (an OSError) once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def _complete(buf: bytes | bytearray) -> bool:
    """Whether ``buf`` holds one whole RESP reply (simple, error, int, bulk, aggregates;
    RESP3 scalars framed too). ValueError for one nested deeper than
    :data:`MAX_DEPTH` or a malformed length."""
    return _end(buf, 0) >= 0


def _end(buf: bytes | bytearray, start: int) -> int:
    """Where the whole RESP reply that starts at ``start`` ends (-1: not all in yet);
    ValueError as :func:`_complete`."""
    def one(pos: int, depth: int) -> int:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return -1
        kind, head = buf[pos:pos + 1], buf[pos + 1:end]
        if kind in (b"+", b"-", b":", b"_", b"#", b","):
            return end + 2
        if kind in (b"$", b"="):
            n = int(head)
            if n < 0:
                return end + 2
            stop = end + 2 + n + 2
            return stop if len(buf) >= stop else -1
        if kind in (b"*", b"%", b"~"):
            if depth >= MAX_DEPTH:
                raise ValueError(f"a reply nested deeper than {MAX_DEPTH} levels")
            n = int(head) * (2 if kind == b"%" else 1)
            pos = end + 2
            for _ in range(max(n, 0)):
                pos = one(pos, depth + 1)
                if pos < 0:
                    return -1
            return pos
        return end + 2
    return one(start, 0)


def parse_reply(buf: bytes) -> Any:
    """Decode one RESP2 reply: bytes, int, None, a list, or a :class:`ServerReplyError`
    for an error reply (not raised). ValueError for anything else (a truncated or
    malformed reply, one nested deeper than :data:`MAX_DEPTH`)."""
    def one(pos: int, depth: int) -> tuple[Any, int]:
        end = buf.find(b"\r\n", pos)
        if end < 0:
            raise ValueError("a truncated RESP reply")
        kind, head = buf[pos:pos + 1], buf[pos + 1:end]
        if kind == b"+":
            return head, end + 2
        if kind == b"-":
            return ServerReplyError(head.decode(errors="replace")), end + 2
        if kind == b":":
            return int(head), end + 2
        if kind == b"$":
            n = int(head)
            if n >= 0 and len(buf) < end + 4 + n:
                raise ValueError("a truncated RESP bulk string")
            return (None, end + 2) if n < 0 else (buf[end + 2:end + 2 + n], end + 4 + n)
        if kind == b"*":
            if depth >= MAX_DEPTH:
                raise ValueError(f"a reply nested deeper than {MAX_DEPTH} levels")
            n, pos, items = int(head), end + 2, []
            for _ in range(max(n, 0)):
                item, pos = one(pos, depth + 1)
                items.append(item)
            return (items if n >= 0 else None), pos
        raise ValueError(f"unsupported RESP type {kind!r}")
    return one(0, 0)[0]


class ServerReplyError(str):
    """An error reply (``-ERR ...``) decoded by :func:`parse_reply`."""


def info_field(reply: bytes, name: str) -> str | None:
    """A ``name:value`` field of an INFO / CLUSTER INFO reply."""
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None
