"""The lifecycle of a :class:`~workers.worker.Worker`: its phases and why it detaches.

Plain enums (no torch, no I/O), so a process that only supervises workers -- the parent
form of ``kvshm-workers``, a test -- can name them without loading the copy engines::

    NEW --connect + Hello--> CONNECTING --Ready--> READY --Shutdown--> DRAINING --drained--+
    (retried while nobody      | refused,           | lifeline EOF,       |                |
     listens on the name)      | bad Ready          | bad record,         v                v
                               |                    | revoked             |                |
                               +--------------------+-------------> DETACHED    close(): CLOSED

Only :data:`LINKED` phases talk to the scheduler: once DETACHED nothing more goes over the
rings (copies already running still finish and report to the host).
"""

from __future__ import annotations

from enum import Enum
from typing import Final

__all__ = ["LINKED", "DetachReason", "Phase"]


class Phase(Enum):
    """Lifecycle of a :class:`~workers.worker.Worker` (see the module docstring)."""

    NEW = "new"
    CONNECTING = "connecting"
    READY = "ready"
    DRAINING = "draining"
    DETACHED = "detached"
    CLOSED = "closed"


class DetachReason(Enum):
    """Why a worker left READY (``Worker.detach_reason``)."""

    SHUTDOWN = "shutdown"  # the scheduler asked; queued work finished first
    PEER_DIED = "peer_died"  # lifeline EOF after Ready: the scheduler is gone
    REFUSED = "refused"  # the scheduler closed the connection before Ready
    SETUP_FAILED = "setup_failed"  # a bad Ready: version, layout, fds, segments
    PROTOCOL_ERROR = "protocol_error"  # an undecodable record or message after Ready
    REVOKED = "revoked"  # the scheduler declared this rank dead (hang, broken ring)
    CLOSED = "closed"  # close() was called first


#: The phases with a live link to the scheduler.
LINKED: Final = (Phase.READY, Phase.DRAINING)
