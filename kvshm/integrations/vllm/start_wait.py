"""The lookups an engine with a disk or remote tier asks again while its ranks connect.

vLLM's worker-side connectors connect at their first step (``bind_connector_metadata``),
so the first request reaches the scheduler side before any rank has: every lookup then
answered 0 (``lookups_not_ready``), and a restarted engine recomputed exactly the
request its disk tier's warm restart (or a shared remote tier) was kept for. Without a
lower tier there is nothing to wait for -- the CPU tier starts empty -- so only an
engine with one waits: while the engine is STARTING, a lookup answers "ask again" (vLLM
steps meanwhile, and that step connects the ranks) for at most :data:`START_WAIT_S` from
the first such lookup; after that, or once the engine left STARTING, never again. The
same wait covers a READY engine whose disk tier still *warms* (its start scan of the
slabs runs on a thread: :mod:`kvshm.engine.warm_scan`; the engine is READY before it
ends, and a restart's first request recomputed what the slab held, a review).
"""

from __future__ import annotations

import time

from kvshm.engine.lifecycle import EngineState

__all__ = ["START_WAIT_S", "StartWait"]

START_WAIT_S = 10.0
"""The longest the first lookups wait for the ranks (from the first one that waits): a
rank that has not connected by then is not waited for again (its engine answers 0, as
before READY always did)."""


class StartWait:
    """Whether a lookup before READY asks again. Once :attr:`over` it never does."""

    __slots__ = ("over", "_since")

    def __init__(self) -> None:
        self.over = False
        self._since: float | None = None

    def asks_again(self, state: EngineState, warming: bool = False) -> bool:
        """True while ``state`` is STARTING, or READY with the disk tier ``warming``, and
        the wait is within its bound; the first False ends the wait for good."""
        if (state is EngineState.STARTING
                or state is EngineState.READY and warming) and not self.over:
            now = time.monotonic()
            if self._since is None:
                self._since = now
            if now - self._since < START_WAIT_S:
                return True
        self.over = True
        return False
