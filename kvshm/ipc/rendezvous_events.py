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

__all__ = ["AllReadyPlan", "EventKind", "MakeReady", "RendezvousEvent"]

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
    counter: str = ""
