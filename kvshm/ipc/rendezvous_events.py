"""What a :class:`~kvshm.ipc.rendezvous.RendezvousServer` reports, and what it asks of
its owner.

:meth:`~kvshm.ipc.rendezvous.RendezvousServer.service` returns
:class:`RendezvousEvent` s (one :class:`EventKind` each, in the order they happened);
once every rank has said Hello it calls the owner's :data:`MakeReady` exactly once for
each rank's Ready and fds. Callers import them from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeAlias

from kvshm.ipc.protocol import Hello, Ready

__all__ = ["AllReadyPlan", "EventKind", "MakeReady", "RendezvousCount", "RendezvousEvent"]

#: What ``make_ready`` returns: rank -> (its Ready, the fds sent with it).
AllReadyPlan: TypeAlias = Mapping[int, tuple[Ready, Sequence[int]]]
#: ``make_ready(hellos by rank) -> {rank: (Ready, fds in READY_FIXED_FDS order)}``.
MakeReady: TypeAlias = Callable[[Mapping[int, Hello]], AllReadyPlan]


class EventKind(Enum):
    """What :meth:`~kvshm.ipc.rendezvous.RendezvousServer.service` saw."""

    HELLO = "hello"                  #: rank, pid: a valid Hello was accepted
    ALL_READY = "all_ready"          #: every rank got its Ready; caller may close its fds
    RANK_LOST = "rank_lost"          #: rank, pid: that rank's connection hit EOF / reset
    REFUSED = "refused"              #: reason (+ error): a connection was refused and closed
    READY_FAILED = "ready_failed"    #: reason, error: make_ready raised or missed a rank


class RendezvousCount(Enum):
    """The rendezvous server's counters (``RendezvousServer.counters``): every outcome,
    accepted, declined or failed, one name each; all are reported, zeros included."""

    ACCEPTED = "accepted"                        #: connections accepted
    ACCEPT_ERRORS = "accept_errors"              #: accept(2) or its credentials failed
    REFUSED_UID = "refused_uid"                  #: a peer of another uid
    REFUSED_PENDING_CAP = "refused_pending_cap"  #: the oldest of too many silent peers
    REFUSED_VERSION = "refused_version"          #: a Hello of another protocol version
    REFUSED_HELLO = "refused_hello"              #: a Hello that names a wrong rank or world
    REFUSED_PROTOCOL = "refused_protocol"        #: a message out of turn or unreadable
    SERVICE_ERRORS = "service_errors"            #: a connection's service raised
    RANKS_LOST = "ranks_lost"                    #: a rank's connection ended
    STATS_SERVED = "stats_served"                #: statistics answered
    STATS_ERRORS = "stats_errors"                #: statistics that could not be built or sent
    STATS_DROPPED = "stats_dropped"              #: answers to an asker that reads none
    READY_SENT = "ready_sent"                    #: Ready messages sent
    READY_FAILED = "ready_failed"                #: Ready plans that failed
    GOODBYES = "goodbyes"                        #: ranks that said Goodbye before their EOF


@dataclass(frozen=True, slots=True)
class RendezvousEvent:
    """One event; ``rank``/``pid`` are -1 where they do not apply or are unknown.

    ``peer_closed`` (RANK_LOST only): the worker closed its end (EOF, reset) -- kvshm's
    worker does that only once none of its copies runs, so the scheduler may take it as
    a fence. False when this server closed the connection itself (a refused message, a
    Ready it could not send): the rank may still be copying. ``farewell`` (RANK_LOST
    only): the reason the rank's ``Goodbye`` gave before its EOF -- its host closed the
    worker (a clean departure, not a death); "" if it said none. ``counter`` (REFUSED
    only): the server's counter the refusal was counted under (``refused_protocol``
    ...): a stable kind, where ``reason`` varies with the peer.
    """

    kind: EventKind
    rank: int = -1
    pid: int = -1
    reason: str = ""
    error: BaseException | None = None
    peer_closed: bool = False
    farewell: str = ""
    counter: RendezvousCount | None = None
