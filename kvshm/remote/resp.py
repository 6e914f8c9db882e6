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
from typing import Any

__all__ = ["ServerReplyError", "command", "info_field", "parse_reply"]


def command(host: str, port: int, *args: str | bytes, timeout: float = 2.0) -> bytes:
    """Send one command over a fresh connection and return its raw RESP reply (tests and
    the cluster bootstrap; the data path uses glide). Raises OSError when nothing answers."""
    parts = [a.encode() if isinstance(a, str) else a for a in args]
    req = b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(req)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
            if _complete(buf):
                break
    return buf


def _complete(buf: bytes) -> bool:
    """Whether ``buf`` holds one whole RESP reply (simple, error, int, bulk; arrays of
    those one level deep are enough for the commands used here)."""
    def one(pos: int) -> int:
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
            n = int(head) * (2 if kind == b"%" else 1)
            pos = end + 2
            for _ in range(max(n, 0)):
                pos = one(pos)
                if pos < 0:
                    return -1
            return pos
        return end + 2
    return one(0) >= 0


def parse_reply(buf: bytes) -> Any:
    """Decode one RESP2 reply: bytes, int, None, a list, or a :class:`ServerReplyError`
    for an error reply (not raised)."""
    def one(pos: int) -> tuple[Any, int]:
        end = buf.index(b"\r\n", pos)
        kind, head = buf[pos:pos + 1], buf[pos + 1:end]
        if kind == b"+":
            return head, end + 2
        if kind == b"-":
            return ServerReplyError(head.decode(errors="replace")), end + 2
        if kind == b":":
            return int(head), end + 2
        if kind == b"$":
            n = int(head)
            return (None, end + 2) if n < 0 else (buf[end + 2:end + 2 + n], end + 4 + n)
        if kind == b"*":
            n, pos, items = int(head), end + 2, []
            for _ in range(max(n, 0)):
                item, pos = one(pos)
                items.append(item)
            return (items if n >= 0 else None), pos
        raise ValueError(f"unsupported RESP type {kind!r}")
    return one(0)[0]


class ServerReplyError(str):
    """An error reply (``-ERR ...``) decoded by :func:`parse_reply`."""


def info_field(reply: bytes, name: str) -> str | None:
    """A ``name:value`` field of an INFO / CLUSTER INFO reply."""
    for line in reply.decode(errors="replace").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None
