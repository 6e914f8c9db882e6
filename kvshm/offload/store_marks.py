"""The two records a :class:`~kvshm.offload.stores.StorePlanner` holds besides its rules:
which blocks are being stored (:class:`InFlightMarks`) and the stores queued at a
request's end (:class:`FinishQueue`).

Invariants (checked by :mod:`kvshm.offload.invariants`): the marks are exactly the GPU
ids and keys of the store jobs in flight plus the queued finish-time stores, each at most
once; every queued finish-time store holds one GPU pin (taken when it was queued,
released when it is sent -- its job then holds the block -- or dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvshm.offload.counters import DeclineReason, ManagerCounters
from kvshm.offload.jobs import Cand, Selection
from kvshm.types import GpuBlocks

__all__ = ["FinishQueue", "InFlightMarks"]


class InFlightMarks:
    """The in-flight dedup across steps: ``gpu`` the GPU ids and ``keys`` the CPU index
    keys being stored. Set when a block is selected, cleared only when its job completes
    or its queued finish-time store is dropped. The two sets are never replaced (the
    planner's hot loops hold them)."""

    __slots__ = ("gpu", "keys")

    def __init__(self) -> None:
        self.gpu: set[int] = set()
        self.keys: set[bytes] = set()

    def mark(self, c: Cand) -> None:
        """``c`` is selected: in flight until its job completes or its queued store drops."""
        self.gpu.add(c.gpu_id)
        self.keys.add(c.key)

    def unmark(self, b: int, key: bytes) -> None:
        self.gpu.remove(b)
        self.keys.remove(key)

    def unmark_all(self, gpu_ids: Sequence[int], keys: Sequence[bytes]) -> None:
        """:meth:`unmark` of each pair, in C: a job's GPU ids and keys are distinct and
        all marked (they were marked when selected, each only while unmarked)."""
        ig, ik = self.gpu, self.keys
        n_gpu, n_keys = len(ig), len(ik)
        ig.difference_update(gpu_ids)
        ik.difference_update(keys)
        assert len(ig) == n_gpu - len(gpu_ids) and len(ik) == n_keys - len(keys), \
            "a store job's marks were not all set"


class FinishQueue:
    """Stores queued at a request's end (``finished``): each candidate classified,
    marked (``marks``) and GPU-pinned when queued; the next steps send them as CPU blocks
    allow (:meth:`take`). ``on_dropped`` is told the keys of those dropped for want of CPU
    blocks (never stored, so never put): a P/D publication waiting for one of them learns
    it now (:meth:`kvshm.offload.remote.RemoteBook.store_dropped`), not at its timeout."""

    __slots__ = ("_counters", "_gpu", "_marks", "items", "on_dropped")

    def __init__(self, gpu: GpuBlocks, marks: InFlightMarks, counters: ManagerCounters,
                 on_dropped: Callable[[list[bytes]], None] | None = None) -> None:
        self._gpu = gpu
        self._marks = marks
        self._counters = counters
        self.items: list[Cand] = []
        self.on_dropped = on_dropped

    def __len__(self) -> int:
        return len(self.items)

    def queue(self, picks: list[Cand]) -> None:
        """Queue ``picks`` (classified and marked already): pin their GPU blocks."""
        if picks:
            self._gpu.touch([c.gpu_id for c in picks])
            self.items.extend(picks)

    def take(self, avail: int, keep_rest: bool, sel: Selection) -> int:
        """Move up to ``avail`` queued stores into ``sel``. The rest wait while
        ``keep_rest`` (jobs in flight will free CPU blocks), else are dropped as
        ``CPU_FULL``. Returns what is left of ``avail``."""
        q = self.items
        n = min(avail, len(q))
        for c in q[:n]:
            sel.add(c)
        del q[:n]
        if q and not keep_rest:
            dropped = [c.key for c in q]
            self.drop(DeclineReason.CPU_FULL)
            if self.on_dropped is not None:
                self.on_dropped(dropped)
        return avail - n

    def drop(self, reason: DeclineReason) -> None:
        """Release every queued store (never sent): unpin, unmark, count."""
        q, self.items = self.items, []
        for c in q:
            self._marks.unmark(c.gpu_id, c.key)
        self._counters.declined[reason] += len(q)
        if q:
            self._gpu.free([c.gpu_id for c in reversed(q)])
