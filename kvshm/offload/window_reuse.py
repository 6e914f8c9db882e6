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
loaded ``ok`` by every later hit (found by a fuzzer). The same held for a block that
became another request's load destination (vLLM reports none of those as allocated).

:class:`WindowReuse` remembers, for each GPU id a listing put at an unstored
sliding-window position, which requests and positions they were (a block shared through
a GPU prefix hit may be several requests'), and when a step allocates the id again, or a
phase B makes it a load's destination, it marks those positions stale on their requests
(``ReqState.stale``); the store walk and the finish decline a stale position
(``STALE_WINDOW``). Full-attention groups never free a request's block before it
ends, so nothing is kept for them (no cost for a model without a window).

Invariant: an entry names a request's window position at or past its cursor when
listed; one whose position no longer names that id (a preemption forgot the table, a
resumption listed another) is ignored when the id comes back, and an ended request's
entries go with it (:meth:`WindowReuse.forget`). A mark outlives a re-listing that names
the same block there (:func:`still_stale`); a preemption clears them all.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

__all__ = ["StaleMarks", "WindowReuse", "still_stale"]


class StaleMarks(Protocol):
    """What :class:`WindowReuse` reads and marks of a request
    (:class:`kvshm.offload.requests.ReqState`)."""

    tables: list[list[int]]
    cursor: int
    stale: set[tuple[int, int]] | None


class WindowReuse:
    """See the module docstring. ``windowed``: the sliding-window groups' indexes."""

    __slots__ = ("owners", "windowed")

    def __init__(self, windowed: Sequence[int]) -> None:
        self.windowed = tuple(windowed)
        #: GPU id -> the unstored window positions that named it when listed (several
        #: requests may share one block: a P/D request's walk starts at its GPU hit)
        self.owners: dict[int, list[tuple[StaleMarks, int, int]]] = {}

    def listed(self, st: StaleMarks, start: Sequence[int]) -> None:
        """``st``'s window tables now hold ids from position ``start[i]`` of the i-th
        window group on (an admission: 0; ids appended: the old lengths). Positions
        below its cursor are never stored (a GPU prefix hit shared with the request
        that computed it): not kept."""
        owners = self.owners
        cursor = st.cursor
        for g, lo in zip(self.windowed, start):
            table = st.tables[g]
            for p in range(max(lo, cursor), len(table)):
                b = table[p]
                kept = owners.get(b)
                if kept is None:
                    owners[b] = [(st, g, p)]
                else:  # entries that no longer name b go first
                    kept[:] = [e for e in kept if _names(e, b) and e[0] is not st]
                    kept.append((st, g, p))

    def reallocated(self, ids: Collection[int]) -> int:
        """``ids`` were allocated again (a step's ``allocated_block_ids``, a load's
        destinations): every unstored window position still naming one of them is
        stale. Returns how many were marked."""
        owners = self.owners
        if not owners:
            return 0
        n = 0
        for b in ids:
            kept = owners.pop(b, None)
            if kept is None:
                continue
            for st, g, p in kept:
                if _names((st, g, p), b):
                    if st.stale is None:
                        st.stale = set()
                    st.stale.add((g, p))
                    n += 1
        return n

    def forget(self, st: StaleMarks) -> None:
        """``st`` ended (its unstored blocks are pinned at the finish, if stored at all):
        its entries go, so no ended request is kept alive by them. O(its unstored
        window positions)."""
        owners = self.owners
        for g in self.windowed:
            table = st.tables[g]
            for p in range(st.cursor, len(table)):
                kept = owners.get(table[p])
                if kept is None:
                    continue
                kept[:] = [e for e in kept if e[0] is not st]
                if not kept:
                    del owners[table[p]]


def still_stale(stale: set[tuple[int, int]], old: list[list[int]],
                new: list[list[int]]) -> set[tuple[int, int]] | None:
    """The marks of ``stale`` (on tables ``old``) that still hold once a request is
    listed anew with tables ``new``: where the new table names the same block, it is
    still the reallocated one (a re-listing of the same tables must not clear them)."""
    kept = {(g, p) for g, p in stale
            if p < len(new[g]) and p < len(old[g]) and new[g][p] == old[g][p]}
    return kept or None


def _names(entry: tuple[StaleMarks, int, int], b: int) -> bool:
    """Whether ``entry``'s position still names ``b`` and is not stored yet."""
    st, g, p = entry
    table = st.tables[g]
    return p < len(table) and table[p] == b and p >= st.cursor
