"""The two rules that let the scheduler hand a dead rank's blocks out again.

The scheduler declares a rank dead (a hang verdict, a broken ring) by setting the rank's
revocation word (:meth:`kvshm.ipc.ring_pair.RingPair.revoke`; never cleared). A worker keeps:

* **No copy starts after the word is set.** The worker's thread reads it
  (:meth:`RevocationGate.word`) before each job it submits and before each batch of
  Dones it publishes; once it sees it, it cancels what waits in the copy engine and
  detaches (REVOKED), then publishes nothing more. The copy engine asks
  :meth:`RevocationGate.may_copy` right before a job starts copying, from whatever
  thread starts it (CPU: the copy thread, after the job's fence; CUDA: at submit), so a
  copy that waited on its fence while the rank was declared dead never starts, even
  before the worker's thread next looks.
* **The lifeline closes only when no copy runs** (:func:`close_lifeline_when_idle`): the
  scheduler takes a standalone rank's lifeline EOF as proof that nothing of it can still
  write. A detached worker with copies running keeps the socket open until they finish.
"""

from __future__ import annotations

from collections.abc import Collection

from kvshm.ipc.rendezvous_client import RendezvousClient
from kvshm.ipc.ring_pair import RevokeReason
from workers.session import Session

__all__ = ["RevocationGate", "close_lifeline_when_idle"]


class RevocationGate:
    """The revocation word of one session, for the worker's thread and the copy engine's.

    :meth:`shut` is called by the worker's thread when it detaches REVOKED, before the
    link's views are released; from then on :meth:`may_copy` is False for good. (A
    worker detached for another reason still finishes what it submitted.)
    """

    def __init__(self, session: Session) -> None:
        self._session = session
        self._shut = False

    def word(self) -> RevokeReason | None:
        """Why the scheduler revoked this rank, or None (also once the link is closed).
        The worker's thread only: it alone closes the link."""
        chan = self._session.channel
        return chan.rings.revoked if chan is not None else None

    def shut(self) -> None:
        """The worker detached REVOKED: refuse every copy from now on."""
        self._shut = True

    def may_copy(self) -> bool:
        """The copy engine's gate (any thread): False once revoked. Reads the shared word
        itself, so it does not wait for the worker's thread to look."""
        if self._shut:
            return False
        chan = self._session.channel
        if chan is None:
            return True
        try:
            return chan.rings.revoked is None
        except ValueError:  # the link closed meanwhile (views released): ask again
            return not self._shut


def close_lifeline_when_idle(client: RendezvousClient | None, inflight: Collection[int]) -> None:
    """Close the rendezvous socket once no submitted copy is still running (see module doc)."""
    if client is not None and not inflight:
        client.close()
