"""The rendezvous's answers to ``StatsRequest`` (``kvshm stats``, a rank's own query).

:class:`StatsDesk` is an object the :class:`~kvshm.ipc.rendezvous.RendezvousServer`
holds beside its :class:`~kvshm.ipc.rendezvous_handshake.Handshake`: the handshake
decides who is a rank, the desk answers whoever asks. It is handed the server's
connection table (it closes an asker that does not read) and counters.

Invariants, at every return of :meth:`StatsDesk.answer`:

* Exactly one of ``stats_served``, ``stats_dropped`` moved, or the answer reports that
  the peer died (the caller loses it, if it was a rank); a snapshot that raised or is too
  large to send answers an error snapshot instead and also counts ``stats_errors``.
* A connection that is nobody's rank and does not read its answers is closed (an idle
  asker cannot hold an fd); a rank's never is -- it is the rank's lifeline, and closing
  it would read as the rank's death.
* It never blocks: every send is non-blocking.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import Any

from kvshm.errors import PeerDied
from kvshm.ipc.fdpass import encode_control, send_datagram
from kvshm.ipc.protocol import Stats, stats_failure
from kvshm.ipc.rendezvous_conns import Conn, ConnTable
from kvshm.ipc.rendezvous_events import RendezvousCount

__all__ = ["StatsDesk"]


class StatsDesk:
    """Answers stats queries on any connection (see the module docstring)."""

    def __init__(self, table: ConnTable, counts: dict[RendezvousCount, int],
                 stats: Callable[[], dict[str, Any]]) -> None:
        self._table = table
        self._counts = counts
        self._stats = stats

    def answer(self, conn: Conn) -> bool:
        """Answer a ``StatsRequest`` on ``conn``; False when its peer was found dead
        (the caller loses it: a rank's death is the handshake's to record)."""
        data = self._snapshot()
        counts = self._counts
        try:
            try:
                send_datagram(conn.sock, data)
            except OSError as e:
                if e.errno != errno.EMSGSIZE:
                    raise
                counts[RendezvousCount.STATS_ERRORS] += 1
                send_datagram(conn.sock, encode_control(stats_failure(
                    f"stats snapshot of {len(data)} bytes is too large to send")))
        except BlockingIOError:
            counts[RendezvousCount.STATS_DROPPED] += 1  # asker does not read its answers
            if conn.rank is None:
                self._table.close(conn)
            return True
        except PeerDied:
            return False
        counts[RendezvousCount.STATS_SERVED] += 1
        return True

    def _snapshot(self) -> bytes:
        """The encoded answer: the engine's statistics, or an error snapshot when
        producing them raised (a stats bug must not take the scheduler down)."""
        try:
            return encode_control(Stats(data=self._stats()))
        except Exception as e:  # noqa: BLE001 - whatever the engine's snapshot raised
            self._counts[RendezvousCount.STATS_ERRORS] += 1
            return encode_control(stats_failure(f"{type(e).__name__}: {e}"))
