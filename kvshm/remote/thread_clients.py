"""One glide_sync client per thread, renewed after their server was lost.

A glide_sync client serializes its own calls, so each thread that talks to the server
holds its own (:meth:`ThreadClients.get`): parallel requests need no lock of ours. A
client is created on its thread's first call (lazily connected: creating it never
blocks) and every client created is listed, so :meth:`ThreadClients.close` reaches the
clients of threads that have gone.

**Generations.** :meth:`ThreadClients.renew` starts a new generation; each thread's
next :meth:`ThreadClients.get` closes its client of an older generation and makes a new
one (lazily: a thread that never calls again keeps its old client until ``close``). The
store renews after its standalone server's breaker opened, so the threads reconnect once
the server is back rather than each waiting out glide's reconnect backoff on a dead
connection. Ordering: an old client is closed only by its own thread, in its next
``get``, so a renewal never closes a client under a request; only ``close`` reaches the
other threads' clients, hence its precondition (no thread calls ``get`` any more).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from kvshm.remote.glide_client import make_client
from kvshm.remote.tier import RemoteSpec

__all__ = ["ThreadClients"]


class ThreadClients:
    """Per-thread clients for ``spec`` (module docstring). ``created`` is called once per
    client made (the owner counts them)."""

    def __init__(self, spec: RemoteSpec, created: Callable[[], None]) -> None:
        self.spec = spec
        self._created = created
        self._local = threading.local()
        self._gen = 0
        self._clients: list[Any] = []
        self._lock = threading.Lock()

    def get(self) -> Any:
        """This thread's client of the current generation (made now if it has none)."""
        local = self._local
        gen = self._gen  # read once: the client made is tagged with what was asked for
        if getattr(local, "gen", -1) != gen or local.client is None:
            old = getattr(local, "client", None)
            if old is not None:
                self._close_one(old)
            local.client = make_client(self.spec)
            local.gen = gen
            with self._lock:
                self._clients.append(local.client)
            self._created()
        return local.client

    def renew(self) -> None:
        """Every thread's next :meth:`get` makes a new client (the old one closed)."""
        self._gen += 1

    def close(self) -> None:
        """Close every client made (the threads must no longer call :meth:`get`)."""
        with self._lock:
            clients, self._clients = self._clients, []
        for c in clients:
            _close_quietly(c)

    def _close_one(self, client: Any) -> None:
        with self._lock:
            if client in self._clients:
                self._clients.remove(client)
        _close_quietly(client)


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - closing a broken client: nothing to do
        pass
