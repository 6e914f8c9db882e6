"""One worker's Dones, from the moment a job ends to the scheduler and the host.

Every ``Done`` of a :class:`~workers.worker.Worker` -- reported by its copy engine
(``poll`` or ``wait``) or made by the worker itself for a job it never ran (refused once
revoked, a bad Transfer, still queued when it detached or shut down) -- enters through
:meth:`DoneBook.record`, exactly once. There:

* its job leaves :attr:`DoneBook.inflight`, the set the lifeline waits on (the socket
  closes only once it is empty: see :mod:`workers.revocation`);
* it is counted (``jobs_ok`` / ``jobs_failed``);
* while the worker is linked it joins :attr:`DoneBook.outbox`; :meth:`DoneBook.send`, the
  one loop that puts Dones on the ``done`` ring, publishes the outbox in order, as many
  as fit now, and keeps the rest for the next call (it never waits);
* unless the caller hands it to the host itself (``Worker.wait``), it is kept until
  :meth:`DoneBook.take_local` returns it, once (``Worker.poll``).

The worker reads the revocation word before each :meth:`DoneBook.send` (no Done is
published once it is set). Once detached nothing more goes over the ring: the outbox is
dropped (:meth:`DoneBook.drop_outbox`, counted ``dones_unsent``) and later Dones only
reach the host. Single-threaded: the worker's thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Protocol

from kvshm.ipc.protocol import Done

__all__ = ["DoneBook", "DoneSink"]


class DoneSink(Protocol):
    """Where :meth:`DoneBook.send` publishes: the worker side of the rank's channel."""

    def send_available(self, dones: Sequence[Done]) -> int:
        """Publish as many leading ``dones`` as fit now, in order; how many. Never waits."""


class DoneBook:
    """In-flight jobs, the outbox for the ``done`` ring and the Dones the host has not
    taken yet; ``counts`` is the worker's counter (shared, so one snapshot shows all)."""

    def __init__(self, counts: Counter[str]) -> None:
        self.inflight: set[int] = set()
        self.outbox: list[Done] = []
        self._local: list[Done] = []
        self._counts = counts

    def started(self, job_id: int) -> None:
        """Job ``job_id`` went to the copy engine: in flight until its Done is recorded."""
        self.inflight.add(job_id)
        self._counts["jobs_submitted"] += 1

    def record(self, dones: list[Done], *, linked: bool, local: bool = True) -> list[Done]:
        """The one entry of every Done (see the module docstring); returns ``dones``.

        ``linked``: the worker is READY or DRAINING, so they also go to the outbox.
        ``local``: keep them for :meth:`take_local` (False: the caller returns them).
        """
        for d in dones:
            self.inflight.discard(d.job_id)
            self._counts["jobs_ok" if d.ok else "jobs_failed"] += 1
        if linked:
            self.outbox += dones
        if local:
            self._local += dones
        return dones

    def send(self, sink: DoneSink) -> None:
        """Publish the outbox, in order, as many as fit; the rest stays for the next call.

        The caller has checked the revocation word; a TransportError from ``sink``
        propagates with the outbox unchanged.
        """
        sent = sink.send_available(self.outbox)
        self._counts["dones_sent"] += sent
        if sent < len(self.outbox):
            self._counts["done_ring_full"] += 1
        del self.outbox[:sent]

    def local_ids(self) -> set[int]:
        """The job ids of the kept Dones (finished, not yet handed to the host)."""
        return {d.job_id for d in self._local}

    def take_local(self, job_ids: Collection[int] | None = None) -> list[Done]:
        """The kept Dones (only those of ``job_ids``, if given), each returned once."""
        if job_ids is None:
            out, self._local = self._local, []
            return out
        out = [d for d in self._local if d.job_id in job_ids]
        if out:
            self._local = [d for d in self._local if d.job_id not in job_ids]
        return out

    def drop_outbox(self) -> None:
        """Detached: what was not sent never will be (counted ``dones_unsent``)."""
        self._counts["dones_unsent"] += len(self.outbox)
        self.outbox = []

    def drop_all(self) -> int:
        """Closed: forget the outbox (counted ``dones_unsent``, as at a detach) and the
        kept Dones; how many kept ones were dropped."""
        self.drop_outbox()
        dropped = len(self._local)
        self._local = []
        return dropped
