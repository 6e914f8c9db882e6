"""CPU-tier hit search (phase A) and the phase-B assignment for the manager.

Pure functions over the CPU pool's index: nothing here pins or changes a block (the
manager pins a :class:`Hit`'s ``pinned`` ids and releases them). Index keys are
group-qualified hashes (:meth:`kvshm.offload.groups.GroupSet.key`).

Hybrid hit rule: a hit may end at position ``E`` (exclusive) when every full-attention
group holds every position ``[s, E)`` and every sliding-window group holds the
``cdiv(window - 1, block_size)`` positions before ``E`` (those at or after ``s``; the
engine's own GPU hit covers the rest). The longest such ``E`` wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.offload.groups import GroupSet
from kvshm.offload.pool import BlockPool
from kvshm.types import LoadFailure

__all__ = ["Assignment", "Hit", "assign", "find_hit", "guess_dests", "refresh_prefix"]


@dataclass(slots=True, eq=False)
class Hit:
    """A phase-A result. ``cpu[g][i]``: CPU block of position ``start + i`` in group
    ``g`` (None where a sliding-window group needs nothing). ``pinned``: every CPU id
    touched for it, position-major prefix order. ``hashes[i]``: the hash of position
    ``start + i``, copied when the lookup checked it (phase B never reads the engine's
    live sequence). A tombstone (``cause`` set) holds no pins: they were dropped by
    ``reset`` or a rank's death before phase B."""

    start: int
    end: int
    cpu: list[list[int | None]]
    pinned: list[int]
    hashes: Sequence[BlockHash]
    cause: LoadFailure | None = None
    offered: int = 0
    """The tokens ``lookup`` answered for it (a hand-off's may end inside a block)."""


def find_hit(cpu: BlockPool, gs: GroupSet, hashes: Sequence[BlockHash], start: int,
             max_blocks: int) -> Hit | None:
    """Longest hit from position ``start`` of at most ``max_blocks`` blocks (no pins)."""
    n = min(len(hashes) - start, max_blocks)
    if n <= 0:
        return None
    if gs.single:  # one full-attention group: the keys are the hashes themselves
        run = cpu.index.cached_run(hashes, start, start + n)
        if not run:
            return None
        end = start + len(run)
        # one list is both the group's row and the pins: neither is ever mutated
        return Hit(start, end, [run], run, _seen(hashes, start, end))  # type: ignore[list-item]
    get = cpu.index.get_cached
    key = gs.key
    full_rows: list[list[int]] = []
    end = start + n
    if gs.full:
        for i in range(n):
            h = hashes[start + i]
            row: list[int] = []
            for g in gs.full:
                b = get(key(h, g))
                if b is None:
                    break
                row.append(b)
            if len(row) < len(gs.full):
                break
            full_rows.append(row)
        end = start + len(full_rows)
    sw_ids = {g: [get(key(hashes[p], g)) for p in range(start, end)] for g, _ in gs.sw}
    end = _shrink_for_windows(gs, sw_ids, start, end)
    if end <= start:
        return None
    k = end - start
    per_group: list[list[int | None]] = [[] for _ in range(gs.n)]
    for j, g in enumerate(gs.full):
        per_group[g] = [row[j] for row in full_rows[:k]]
    for g, nsw in gs.sw:
        lo = max(0, k - nsw)
        window: list[int | None] = [None] * lo
        window.extend(sw_ids[g][lo:k])
        per_group[g] = window
    pinned = [b for i in range(k) for g in range(gs.n) if (b := per_group[g][i]) is not None]
    return Hit(start, end, per_group, pinned, _seen(hashes, start, end))


def _seen(hashes: Sequence[BlockHash], start: int, end: int) -> Sequence[BlockHash]:
    """A copy of ``hashes[start:end]`` (phase B never reads the live sequence)."""
    if type(hashes) is list or type(hashes) is tuple:
        return hashes[start:end]  # a slice of a list or tuple is a copy already
    return tuple(hashes[p] for p in range(start, end))


def _shrink_for_windows(gs: GroupSet, sw_ids: dict[int, list[int | None]], start: int,
                        end: int) -> int:
    """Largest ``E <= end`` whose sliding windows are all cached (``start`` if none)."""
    if not gs.sw:
        return end
    runs: list[tuple[list[int], int]] = []
    for g, nsw in gs.sw:
        run: list[int] = []
        r = 0
        for b in sw_ids[g]:
            r = r + 1 if b is not None else 0
            run.append(r)
        runs.append((run, nsw))
    e = end
    while e > start:
        i = e - start
        if all(run[i - 1] >= min(nsw, i) for run, nsw in runs):
            return e
        e -= 1
    return start


@dataclass(slots=True, eq=False)
class Assignment:
    """Phase B's pairing: ``cpu_ids[i] -> gpu_ids[i]`` (position-major), the CPU ids
    found in the index beyond the phase-A pins (``extra``, not yet touched), and the
    destinations nothing could source (``failed``)."""

    cpu_ids: list[int]
    gpu_ids: list[int]
    failed: list[int]


def assign(cpu: BlockPool, gs: GroupSet, hit: Hit, tables: Sequence[Sequence[int]],
           k: int) -> Assignment:
    """Pair the first ``k`` hit positions with their GPU destinations.

    Full-attention groups take every position; a sliding-window group takes the window
    before the accepted end, looking a position up again when the phase-A window (for a
    longer hit) did not cover it. Raises ConfigError when a table is too short (the
    manager checks that first, as InvalidRequest).
    """
    end = hit.start + k
    if gs.single:  # every position of the one full group has its CPU block
        t = tables[0]
        if len(t) < end:
            raise ConfigError(f"group 0 table has {len(t)} blocks, phase B needs {end}")
        row = hit.cpu[0]
        return Assignment(row[:k] if k < len(row) else list(row),  # type: ignore[arg-type]
                          list(t[hit.start:end]), [])
    for g in range(gs.n):
        if len(tables[g]) < end:
            raise ConfigError(
                f"group {g} table has {len(tables[g])} blocks, phase B needs {end}")
    out = Assignment([], [], [])
    for i in range(k):
        p = hit.start + i
        for g in range(gs.n):
            dst = tables[g][p]
            if gs.is_sw[g]:
                if p < end - gs.window_blocks[g]:
                    continue
                src = hit.cpu[g][i]
                if src is None:
                    src = cpu.get_cached(gs.key(hit.hashes[i], g))
            else:
                src = hit.cpu[g][i]
            if src is None:
                out.failed.append(dst)
            else:
                out.cpu_ids.append(src)
                out.gpu_ids.append(dst)
    return out


def refresh_prefix(cpu: BlockPool, gs: GroupSet, hashes: Sequence[BlockHash], s: int) -> None:
    """The engine's own prefix hit ``[0, s)`` reused these blocks: refresh their CPU
    copies, tail first (the head ends up evicted last). O(s)."""
    get = cpu.index.get_cached
    key = gs.key
    ids: list[int] = []
    for p in range(min(s, len(hashes)) - 1, -1, -1):
        for g in range(gs.n):
            b = get(key(hashes[p], g))
            if b is not None:
                ids.append(b)
    if ids:
        cpu.refresh(ids)


def guess_dests(hit: Hit | None, tables: Sequence[Sequence[int]], n_ext: int,
                block_size: int) -> list[int]:
    """Destinations of a load that cannot happen: the hit's range when known, else every
    id of the tables (the engine then recomputes from the first)."""
    if hit is not None:
        end = hit.start - (-n_ext // block_size)
        return [t[p] for p in range(hit.start, end) for t in tables if p < len(t)]
    return list(dict.fromkeys(b for t in tables for b in t))
