"""The tiers below the CPU tier, as the manager asks them: the local disk
(:mod:`kvshm.offload.disk`) first, then the remote tier (:mod:`kvshm.offload.remote`).

:class:`LowerTiers` holds both books (either may be absent) and decides, for the
manager's lookups, which tier a CPU miss or a short CPU hit asks, under one rule -- the
*overdue gate*: while any lower tier has a read past its fetch timeout still out
(``Fetches.overdue``: a rank, stopped or stuck, is not serving tier jobs), no request
starts a new read on either tier (it would wait a whole timeout on that rank, then the
next tier's after it: 30 s a request with both). A request whose own read on a tier
still waits is exempt on that tier (its fetch ends its wait itself). The reads resume
once the overdue job ends (acked, or failed with its rank).

Per request, a lookup of the tiers ends in one of: an answer (:meth:`answered` releases
what a hand-off or a disk read held meanwhile), a CPU hit (:meth:`hit`: what they
fetched is pinned by the hit now), an accepted phase B (:meth:`admitted`: a later lookup
-- a re-admission after a preemption -- reads afresh), or the request's end
(:meth:`forget`). P/D hand-offs are decided by the manager (they wait for their
manifest, never for the disk, and are never gated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvshm.ipc.protocol import Disk, Remote
from kvshm.offload.counters import ManagerCounters
from kvshm.offload.disk import DiskBook
from kvshm.offload.hits import Hit
from kvshm.offload.remote import RemoteBook

__all__ = ["LowerTiers"]


class LowerTiers:
    """See the module docstring. ``active``: some lower tier exists (the manager skips
    every call here otherwise)."""

    __slots__ = ("_counters", "active", "disk", "remote")

    def __init__(self, disk: DiskBook | None, remote: RemoteBook | None,
                 counters: ManagerCounters) -> None:
        self.disk = disk
        self.remote = remote
        self.active = disk is not None or remote is not None
        self._counters = counters
        if remote is not None and disk is not None:
            remote.victims = []  # a GET's victims are written down as a store's

    # ---- the gate ----------------------------------------------------------------------

    def overdue(self) -> bool:
        """A lower tier's read is past its fetch timeout and still out."""
        return ((self.disk is not None and self.disk.fetches.overdue())
                or (self.remote is not None and self.remote.fetches.overdue()))

    def gated(self, rid: str, book: DiskBook | RemoteBook) -> bool:
        """Whether ``rid`` may not start a read from ``book``'s tier now (the module
        docstring's gate). When gated, what ``rid``'s ended fetch on that tier still pins
        is released, as the tier's own lookup would have done (``Fetches.again``). A
        fetch answered meanwhile (a query sent before the job was overdue) is not
        planned either (``Fetches.plan``'s ``overdue``)."""
        if not self.overdue() or book.fetches.waiting(rid):
            return False
        book.fetches.release(rid)
        return True

    def turned_away(self, rid: str) -> int:
        """``rid``'s miss recomputes (0) because a tier is overdue: counted, and what its
        ended fetches on either tier still pin is released."""
        for b in (self.disk, self.remote):
            if b is not None:
                b.fetches.release(rid)
        self._counters.lookups_tier_overdue += 1
        return 0

    # ---- a lookup ----------------------------------------------------------------------

    def miss(self, rid: str, hashes: Sequence[bytes], start: int, n_max: int,
             params: Any, *, handoff: bool) -> int | None:
        """A CPU miss at block ``start`` (``n_max`` blocks after it at most): None while a
        tier reads the blocks (an ordinary CPU hit next time), else 0. The disk first
        (not for a hand-off), then the remote tier."""
        disk = None if handoff else self.disk
        disk_gated = disk is not None and self.gated(rid, disk)
        if disk is not None and not disk_gated \
                and disk.lookup(rid, hashes, start, n_max) is None:
            return None
        remote = self.remote
        if remote is None:
            return self.turned_away(rid) if disk_gated else 0
        if handoff and min(start + n_max, len(hashes)) <= start:
            # the engine holds the whole extent: nothing to wait for (a manifest a
            # sibling collected would cost the 5 s missing-manifest wait)
            remote.served(rid, hashes, params)
            return 0
        if not handoff and self.gated(rid, remote):
            return self.turned_away(rid)
        return remote.lookup(rid, hashes, start, n_max, params)

    def extends(self, rid: str, hashes: Sequence[bytes], hit: Hit, end: int) -> bool:
        """A CPU hit that may end before block ``end``: True while a read of ``rid``'s
        still runs past it -- a remote fetch some of whose jobs are in (the hit is their
        blocks, pinned by the fetch: pinning it now would end the fetch and its later
        jobs would complete for nobody, a review), or the disk reading what follows the
        hit (held meanwhile) -- ask again. The disk is not asked when it is gated for
        ``rid`` and the hit is short (counted: a short hit not extended)."""
        remote = self.remote
        if remote is not None and remote.fetches.reads_past(rid, hit.end):
            return True
        disk = self.disk
        if disk is None:
            return False
        if hit.end < min(end, len(hashes)) and self.gated(rid, disk):
            self._counters.lookups_tier_overdue += 1
            return False
        return disk.extend(rid, hashes, hit, end)

    def hit(self, rid: str, *, disk: bool) -> None:
        """``rid``'s lookup is a CPU hit (pinned): what the tiers fetched for it is pinned
        by the hit now (``disk``: the disk was asked, i.e. no hand-off)."""
        if self.remote is not None:
            self.remote.hit(rid)
        if disk and self.disk is not None:
            self.disk.hit(rid)

    def answered(self, rid: str) -> None:
        """``rid``'s lookup answered: a hand-off's or a disk read's held prefix goes."""
        if self.remote is not None:
            self.remote.unhold(rid)
        if self.disk is not None:
            self.disk.unhold(rid)

    def admitted(self, rid: str) -> None:
        """An accepted phase B ends ``rid``'s lookups: a later one -- a re-admission after
        a preemption -- reads afresh (the record of its first read, FETCHED or DONE,
        answered 0 without asking, until the request ended)."""
        if self.remote is not None:
            self.remote.end_lookup(rid)
        if self.disk is not None:
            self.disk.forget(rid)

    def forget(self, rid: str) -> None:
        """``rid`` ended: its pins and reads go (jobs in flight complete unclaimed)."""
        if self.remote is not None:
            self.remote.forget(rid)
        if self.disk is not None:
            self.disk.forget(rid)

    # ---- a step --------------------------------------------------------------------------

    def plan(self, step: int, victims: list[tuple[int, bytes]]
             ) -> tuple[tuple[Remote, ...], tuple[Disk, ...]]:
        """This step's remote jobs (GETs, then PUTs) and disk jobs: the WRITEs of the
        store's and the GETs' victims (``victims``, extended here) before the READs."""
        overdue = self.overdue()
        remote: tuple[Remote, ...] = ()
        disk: tuple[Disk, ...] = ()
        if self.remote is not None:
            remote = tuple(self.remote.plan(step, overdue=overdue))
            victims += self.remote.take_victims()
        if self.disk is not None:
            disk = (*self.disk.write_victims(step, victims),
                    *self.disk.plan(step, overdue=overdue))
        return remote, disk

    def plan_reads(self, step: int) -> list[Disk]:
        """The disk READs of the lookups answered since the last plan (``[]`` without a
        disk tier or with nothing answered)."""
        disk = self.disk
        if disk is None or not disk.has_pending_work():
            return []
        return disk.plan_reads(step, overdue=self.overdue())

    def fetch_to_plan(self) -> bool:
        """The remote tier holds a fetch answered that only a plan can start (its GET);
        a disk fetch's READ is posted by the lookup itself."""
        return self.remote is not None and self.remote.fetches.pending()

    def has_pending_work(self) -> bool:
        """A tier has reads or writes queued or unanswered."""
        return ((self.remote is not None and self.remote.has_pending_work())
                or (self.disk is not None and self.disk.has_pending_work()))

    def pinned(self) -> tuple[int, ...]:
        """The CPU blocks the tiers' books pin (for the manager's invariants)."""
        return ((() if self.remote is None else tuple(self.remote.pinned()))
                + (() if self.disk is None else tuple(self.disk.pinned())))
