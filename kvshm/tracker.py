"""Per-request store tracking for the manager: tables, cursors and the per-step scan.

Every step lists every running request; the scan must cost an unchanged request next to
nothing. The only per-request state it reads is ``watch[req_id]``: the number of
confirmed *blocks* at which the request next needs a look (its cursor + 1; a huge value
when nothing is tracked). Keeping it in its own dict of (mostly small, interpreter-
cached) ints means an unchanged request touches its own ``ScheduledRequest``, one dict
probe and no other object. The full :class:`ReqState` is read only for requests that
changed (new ids, a crossed block boundary, admission, preemption).

A request gets a ``watch`` entry at its first listing; ``lookup`` may create its
``ReqState`` earlier (to remember where a restarted cursor begins).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from kvshm.errors import ConfigError
from kvshm.lookup import GroupSet
from kvshm.store_plan import ReqState, Selection, StorePlanner
from kvshm.types import BlockHash, ScheduledRequest, no_new_blocks

__all__ = ["NEVER", "RequestTracker", "is_remote"]

NEVER = 1 << 62
"""Watch value of a request with nothing to store (never reached)."""


def is_remote(params: Mapping[str, Any] | None) -> bool:
    """True for a P/D prefill request whose whole KV must reach the CPU tier."""
    return bool(params) and bool(params.get("do_remote_decode"))  # type: ignore[union-attr]


class RequestTracker:
    """Requests' GPU tables and store cursors (see the module docstring)."""

    def __init__(self, gs: GroupSet, block_size: int, eager: bool, plan: StorePlanner) -> None:
        self.gs = gs
        self.bs = block_size
        self.eager = eager
        self.plan = plan
        self.reqs: dict[str, ReqState] = {}
        self.watch: dict[str, int] = {}
        self._no_new = no_new_blocks(gs.n)

    def state(self, req_id: str) -> ReqState:
        st = self.reqs.get(req_id)
        if st is None:
            st = self.reqs[req_id] = ReqState(req_id, self.gs.n)
        return st

    def forget(self, req_id: str) -> ReqState | None:
        self.watch.pop(req_id, None)
        return self.reqs.pop(req_id, None)

    # ---- the per-step scan ---------------------------------------------------------

    def scan(self, requests: Sequence[ScheduledRequest]) -> list[ScheduledRequest]:
        """Track this step's listing; returns the requests with blocks to consider."""
        dirty: list[ScheduledRequest] = []
        get = self.watch.get
        no_new = self._no_new
        bs = self.bs
        for r in requests:
            w = get(r.req_id)
            if w is None or r.new_or_resumed or r.preempted:
                self._admit(r, dirty)
                continue
            nb = r.new_block_ids
            if nb is not no_new and nb != no_new:
                self._extend(r)
            if r.num_confirmed_tokens // bs >= w:
                dirty.append(r)
        return dirty

    def _extend(self, r: ScheduledRequest) -> None:
        st = self.reqs[r.req_id]
        if not st.tracked:
            return
        nb = r.new_block_ids
        if len(nb) != self.gs.n:
            raise ConfigError(f"{r.req_id}: {len(nb)} block id groups, expected {self.gs.n}")
        for table, ids in zip(st.tables, nb):
            table.extend(ids)
        st.hashes = r.block_hashes

    def _admit(self, r: ScheduledRequest, dirty: list[ScheduledRequest]) -> None:
        """First listing, resumption (full table) or preemption (table forgotten)."""
        if len(r.new_block_ids) != self.gs.n:
            raise ConfigError(
                f"{r.req_id}: {len(r.new_block_ids)} block id groups, expected {self.gs.n}")
        st = self.state(r.req_id)
        st.remote = st.remote or is_remote(r.kv_transfer_params)
        st.tracked = self.eager or st.remote
        st.cursor = 0 if st.remote else st.start
        if r.preempted and not r.new_or_resumed:
            st.tables = [[] for _ in range(self.gs.n)]
            self.watch[r.req_id] = NEVER
            return
        if st.tracked:
            st.tables = [list(ids) for ids in r.new_block_ids]
        st.hashes = r.block_hashes
        w = self.watch[r.req_id] = st.cursor + 1 if st.tracked else NEVER
        if r.num_confirmed_tokens // self.bs >= w:
            dirty.append(r)

    # ---- selection -------------------------------------------------------------------

    def select(self, dirty: list[ScheduledRequest], alloc: Collection[int], avail: int,
               sel: Selection) -> int:
        """Walk each changed request's confirmed blocks into ``sel``; returns what is
        left of ``avail`` CPU blocks."""
        bs = self.bs
        for r in dirty:
            st = self.reqs[r.req_id]
            st.hashes = r.block_hashes
            ready = min(r.num_confirmed_tokens // bs, min(len(t) for t in st.tables))
            avail = self.plan.walk(st, ready, avail, alloc, sel)
            self.watch[r.req_id] = st.cursor + 1
        return avail

    def finish(self, st: ReqState, num_confirmed_tokens: int,
               tables: Sequence[Sequence[int]], hashes: Sequence[BlockHash] | None) -> None:
        """Finish-time: pin the request's unstored full blocks for the next store."""
        if not st.tracked:
            return
        st.tables = [list(t) for t in tables]
        if hashes is not None:
            st.hashes = hashes
        ready = min(num_confirmed_tokens // self.bs, min(len(t) for t in st.tables))
        self.plan.pin_finished(st, ready)
