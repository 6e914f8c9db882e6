"""Window reuse: sliding-window positions whose GPU block was allocated again before
their store.

A sliding-window group frees a request's blocks as they leave the window, and the
engine may hand such a block to another request while the first one's store walk has
not reached it yet (its confirmed tokens listed late, the CPU tier full, a pending load
in the way). ``StepInput.allocated_block_ids`` names every block allocated in a step,
but the walk compared a block only with the ids of the step it ran in. A block taken
in an earlier step whose new owner hashed it under the *same* plain hash -- a request
sharing the prefix, its full-attention KV for that position -- passed every check, and
the full-attention bytes were stored as the first request's sliding-window block,
loaded ``ok`` by every later hit (found by a fuzzer).

:class:`WindowReuse` remembers, for each GPU id a listing put at a sliding-window
position, which request and position it was (the newest listing of that id wins), and
when a step allocates the id again it marks that position stale on the request
(``ReqState.stale``); the store walk declines a stale position (``STALE_WINDOW``).
Full-attention groups never free a request's block before it ends, so nothing is kept
for them (no cost for a model without a window).

Invariant: at most one entry per GPU id; an entry whose position no longer names that
id (a preemption forgot the table, a resumption listed another, the request ended) is
ignored when the id comes back, so entries are never removed one by one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = ["StaleMarks", "WindowReuse"]


class StaleMarks(Protocol):
    """What :class:`WindowReuse` reads and marks of a request
    (:class:`kvshm.offload.requests.ReqState`)."""

    tables: list[list[int]]
    cursor: int
    stale: set[tuple[int, int]] | None


class WindowReuse:
    """See the module docstring. ``windowed``: the sliding-window groups' indexes."""

    __slots__ = ("owner", "windowed")

    def __init__(self, windowed: Sequence[int]) -> None:
        self.windowed = tuple(windowed)
        self.owner: dict[int, tuple[StaleMarks, int, int]] = {}

    def listed(self, st: StaleMarks, start: Sequence[int]) -> None:
        """``st``'s window tables now hold ids from position ``start[i]`` of the i-th
        window group on (an admission: 0; ids appended: the old lengths)."""
        owner = self.owner
        for g, lo in zip(self.windowed, start):
            table = st.tables[g]
            for p in range(lo, len(table)):
                owner[table[p]] = (st, g, p)

    def reallocated(self, ids: Collection[int]) -> int:
        """The step allocated ``ids``: every unstored window position still naming one
        of them is stale. Returns how many were marked."""
        owner = self.owner
        if not owner:
            return 0
        n = 0
        for b in ids:
            entry = owner.pop(b, None)
            if entry is None:
                continue
            st, g, p = entry
            table = st.tables[g]
            if p < len(table) and table[p] == b and p >= st.cursor:
                if st.stale is None:
                    st.stale = set()
                st.stale.add((g, p))
                n += 1
        return n
