"""Stores outside the eager walk of :mod:`kvshm.offload.stores`: the lazy scan (``LAZY``
mode: blocks about to leave the GPU's free queue) and a P/D hand-off's partial tail
block. Functions over a :class:`~kvshm.offload.stores.StorePlanner`: they classify, mark
and queue through it, under its rules (its module docstring), and own nothing."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from kvshm.hashing import BlockHash
from kvshm.offload.counters import DeclineReason
from kvshm.offload.jobs import Cand, Selection
from kvshm.offload.stores import StorePlanner

__all__ = ["lazy_scan", "pin_tail"]

_NO_IDS: frozenset[int] = frozenset()


def lazy_scan(plan: StorePlanner, avail: int, sel: Selection) -> None:
    """Offload hashed, uncached blocks among the next ``lazy_window`` GPU blocks to
    be evicted (single group only). Touches after iterating."""
    picks: list[Cand] = []
    seen: set[bytes] = set()
    cached = plan.cpu.is_cached
    # blocks already picked are skipped, the eager walk's of this step included: one it
    # took under a block's second hash was picked again under its first (one GPU block
    # twice in the job, the ack an AssertionError)
    inflight = plan.marks.gpu
    for b in islice(plan.gpu.iter_free_from_lru(), plan.lazy_window):
        gh = plan.gpu.block_hashes(b)
        if not gh or b in inflight:
            continue
        key = gh[0]
        if key in plan.marks.keys or key in seen or cached(key):
            continue
        if len(picks) >= avail:
            plan.counters.declined[DeclineReason.CPU_FULL] += 1
            break
        picks.append(Cand(b, 0, key))
        seen.add(key)
    for c in picks:
        plan.marks.mark(c)
        sel.add(c)
        sel.to_touch.append(c.gpu_id)
    sel.n_lazy = len(picks)


def pin_tail(plan: StorePlanner, tables: Sequence[Sequence[int]], p: int,
             tail: BlockHash) -> list[bytes] | None:
    """Finish-time, P/D only: queue the partial last block (position ``p``) of every
    group for a store under ``tail``'s keys -- it has no engine hash; its KV is the
    request's own. Returns the keys a hand-off may name (queued here, in flight or
    cached already), or None with nothing queued when some group's block cannot be
    stored: no full block before it (``p == 0``: the tail has no parent, the
    hand-off publishes nothing), a sliding-window group (not handed off partially), a
    table too short, a pending load writing it, or a GPU block the pool says holds
    another hash."""
    if p == 0 or plan.gs.sw or any(len(t) <= p for t in tables):
        return None
    picks: list[Cand] = []
    keys: list[bytes] = []
    for g in range(plan.gs.n):
        b = tables[g][p]
        if b in plan.load_dst or any(c.gpu_id == b for c in picks):
            return None  # (two groups naming one block: bad input, nothing queued)
        reason, key = plan.classify(b, tail, g, _NO_IDS)
        if reason is DeclineReason.IN_FLIGHT and b not in plan.marks.gpu:
            key = plan.gs.key(tail, g)  # another request stores the same tail
        elif reason is DeclineReason.ALREADY_CACHED:
            key = plan.gs.key(tail, g)
        elif reason is not None:
            return None
        else:
            picks.append(Cand(b, g, key, p))
        keys.append(key)
    for c in picks:
        plan.marks.mark(c)
    plan.finished.queue(picks)
    return keys
