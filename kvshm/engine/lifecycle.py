"""The engine lifecycle, :class:`EngineState`: the one place its diagram is drawn.

An :class:`~kvshm.engine.Engine` or :class:`~kvshm.engine.SyncClient` and the
:class:`~kvshm.engine.runtime.Runtime` under it are always in exactly one state, and
only the runtime moves it::

    NEW --open--> STARTING --every rank got Ready--> READY --a rank left--> STOPPED
                     |                                 |                   |
                     | make_ready failed,              | a rank died, hung or broke its
                     | a rank lost while starting      | ring (the verdict)|
                     +-------------> FAILED <----------+-------------------+

    any state but CLOSING and CLOSED --begin_close--> CLOSING --close--> CLOSED

``open`` is ``Engine.launch`` / ``SyncClient(...)``; ``begin_close`` then ``close`` are
``Engine.aclose`` / ``SyncClient.close`` (both idempotent: in CLOSING or CLOSED they
change nothing).

Ordering: a state only moves along an arrow, so FAILED is left only for CLOSING and
CLOSED is final. An ``Engine`` whose start fails is closed before ``launch`` raises:
nobody holds an ``Engine`` that failed to start.

What each state promises the scheduler:

* STARTING -- no manager yet: ``lookup`` returns 0 and ``step`` plans nothing; a
  request listed now is kept away from the manager for its whole life.
* READY -- lookups, loads and stores run.
* FAILED -- serving goes on without offload: ``lookup`` returns 0, ``step`` plans
  nothing new, every pending load resolves failed (the caller recomputes). Nothing
  waits on a dead rank.
* STOPPED -- as FAILED for the scheduler, but nothing failed: a rank's worker said
  ``Goodbye`` and closed (its host is shutting down, e.g. vLLM stops its workers before
  its scheduler). ``ranks_left`` counts it, ``ranks_failed`` does not; it is logged at
  INFO. A real verdict on another rank afterwards still moves it to FAILED.
* CLOSING, CLOSED (:data:`ENDED`) -- every scheduler call raises
  :class:`~kvshm.errors.StateError`; ``statistics`` still answers. A close is not a
  failure: every rank alive at ``begin_close`` is marked detached ("the engine
  closed"), a lifeline EOF or exit seen from then on is no verdict (``ranks_failed``
  does not move, the state does not become FAILED) and the CPU index is kept, so the
  final statistics describe the engine that served.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ENDED", "LIVE", "EngineState"]


class EngineState(Enum):
    """Lifecycle state of an engine (diagram and promises: the module docstring)."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    STOPPED = "stopped"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


#: Opened and not yet closing: the rendezvous is serviced, ranks are watched.
LIVE = frozenset({EngineState.STARTING, EngineState.READY, EngineState.STOPPED,
                  EngineState.FAILED})
#: Closing or closed: scheduler calls raise ``StateError``.
ENDED = frozenset({EngineState.CLOSING, EngineState.CLOSED})
