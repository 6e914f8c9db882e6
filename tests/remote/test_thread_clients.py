"""``ThreadClients``: one glide client per thread, renewed together (a real Valkey).

A glide_sync client serializes its calls, so the store's threads each hold their own;
after a standalone server's breaker opened, the store renews them so that every thread
reconnects to the server once it is back. Narrated: a thread keeps its client, two
threads never share one, a renewal closes the old client on that thread's next call,
and close reaches the clients of threads that have ended.
"""

from __future__ import annotations

import threading
from typing import Any

from kvshm.remote.server import ValkeyServer
from kvshm.remote.thread_clients import ThreadClients
from kvshm.remote.tier import RemoteSpec


def _ping(client: Any) -> bool:
    return bool(client.ping() in (b"PONG", "PONG"))


def _closed(client: Any) -> bool:
    try:
        client.ping()
    except Exception:  # noqa: BLE001 - glide's ClosingError: what the test expects
        return True
    return False


def test_each_thread_holds_its_own_client_until_renewed(valkey: ValkeyServer) -> None:
    made: list[int] = []
    tc = ThreadClients(RemoteSpec.parse(valkey.url), lambda: made.append(1))
    try:
        mine = tc.get()
        assert tc.get() is mine and _ping(mine)
        theirs: list[Any] = []
        t = threading.Thread(target=lambda: theirs.append(tc.get()))
        t.start()
        t.join()
        assert theirs[0] is not mine and _ping(theirs[0])
        assert len(made) == 2
        # the server was lost: renew; this thread's next call closes its old client
        tc.renew()
        fresh = tc.get()
        assert fresh is not mine and _closed(mine) and _ping(fresh)
        assert len(made) == 3
        # the other thread ended without calling again: its client is still open,
        # and close() reaches it
        assert _ping(theirs[0])
    finally:
        tc.close()
    assert _closed(theirs[0]) and _closed(fresh)


def test_close_is_idempotent_and_a_client_is_never_listed_twice(
        valkey: ValkeyServer) -> None:
    tc = ThreadClients(RemoteSpec.parse(valkey.url), lambda: None)
    a = tc.get()
    tc.renew()
    b = tc.get()
    assert tc._clients == [b]  # the renewed-away client left the list when closed
    tc.close()
    tc.close()
    assert _closed(a) and _closed(b)

