"""Per-request store tracking for the manager: tables, cursors and the per-step scan.

A step lists the requests that changed: new or resumed ones, preempted ones, ones with
new block ids, and ones whose confirmed tokens reached their next block. Listing an
unchanged running request is allowed and costs next to nothing: the only per-request
state the scan reads is ``watch[req_id]``: the number of confirmed *blocks* at which the
request next needs a look (its cursor + 1; a huge value when nothing is tracked).
Keeping it in its own dict of (mostly small, interpreter-cached) ints means an unchanged
request touches its own ``ScheduledRequest``, one dict probe and no other object. The
full :class:`ReqState` is read only for requests that changed (new ids, a crossed block
boundary, admission, preemption).

*Stalled* requests: a walk that stops short of the confirmed blocks (the CPU pool could
not supply a position, or a pending load's destination) leaves ``watch <= confirmed
blocks``. The tracker keeps such a request's last listing in :attr:`RequestTracker.stalled`
and walks it again every step until it catches up, whether or not it is listed (its
hashes are the engine's live sequence, already checked up to the confirmed blocks; its
confirmed count can only have grown, and a preemption or resumption re-admits it, which
drops the entry first). So an engine need not list a request only to retry its store.

A request gets a ``watch`` entry at its first listing; ``lookup`` may create its
``ReqState`` earlier (to remember where a restarted cursor begins).

A step's listing is taken in two passes so that a bad listing changes nothing:
:meth:`RequestTracker.prepare` reads and checks it (:mod:`kvshm.offload.inputs`, by the
rules of :mod:`kvshm.offload.validate`) and changes no state; :meth:`RequestTracker.apply`
then applies the changed requests only, from the values ``prepare`` checked. The hot loop
over unchanged requests stays in ``prepare``.

Stores: the tracker hands the store planner (:mod:`kvshm.offload.stores`) each changed
request's :class:`ReqState` to walk; the planner moves its ``cursor`` and nothing else.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from kvshm.hashing import BlockHash
from kvshm.offload.groups import GroupSet
from kvshm.offload.inputs import CallCheck
from kvshm.offload.jobs import Selection
from kvshm.offload.pd.manifest import remote_decode
from kvshm.offload.stores import StorePlanner
from kvshm.offload.window_reuse import WindowReuse, still_stale
from kvshm.types import ScheduledRequest, no_new_blocks

__all__ = ["ADMIT", "DIRTY", "EXTEND", "NEVER", "Change", "ReqState", "RequestTracker"]

NEVER = 1 << 62
"""Watch value of a request with nothing to store (never reached)."""

ADMIT, EXTEND, DIRTY = 1, 2, 4
"""What a step does to a changed request: (re)admit it (first listing, resumption,
preemption), append ids to its tables, walk its newly confirmed blocks."""

Change = tuple[ScheduledRequest, int]
"""A changed listed request (as checked: the request itself, or its normalized copy) and
what the step does to it."""


class ReqState:
    """Store tracking of one request. ``tables[g]``: its GPU ids per group as known;
    ``cursor``: next position to consider; ``start``: where a restarted cursor begins
    (after the GPU hit and loaded blocks; ``do_remote_decode`` ignores it and starts at
    0); ``tracked``: its blocks are stored eagerly; ``admitted``: phase B (``allocated``)
    has run for it once (a later phase B is a re-admission, e.g. after a preemption:
    its hit is counted apart); ``refreshed``: the engine's own prefix blocks whose CPU
    copies its lookups since its last phase B have refreshed (a request that waits is
    looked up every step: its prefix is refreshed once a wait, again only when it grew);
    ``phase_b_tables``: the whole tables of a phase B that came after its last
    admission listing (None: none did) -- ``tables`` may then predate a preemption the
    steps have not listed yet, so ``finished`` checks its tables against these; kept
    apart from ``tables``, which a stalled walk still reads. The store planner walks it
    as a :class:`~kvshm.offload.stores.Cursor`. ``stale``: sliding-window positions
    ``(group, position)`` whose block a later step allocated again before their store
    (:mod:`kvshm.offload.window_reuse`; None: none), never stored."""

    __slots__ = ("admitted", "cursor", "hashes", "phase_b_tables", "refreshed", "remote",
                 "req_id", "stale", "start", "tables", "tracked")

    def __init__(self, req_id: str, ngroups: int) -> None:
        self.req_id = req_id
        self.tables: list[list[int]] = [[]] if ngroups == 1 else [[] for _ in range(ngroups)]
        self.cursor = 0
        self.hashes: Sequence[BlockHash] = ()
        self.start = 0
        self.remote = False
        self.tracked = False
        self.admitted = False
        self.phase_b_tables: list[list[int]] | None = None
        self.refreshed = 0
        self.stale: set[tuple[int, int]] | None = None


class RequestTracker:
    """Requests' GPU tables and store cursors (see the module docstring)."""

    def __init__(self, gs: GroupSet, block_size: int, eager: bool, plan: StorePlanner) -> None:
        self.gs = gs
        self.bs = block_size
        self.eager = eager
        self.plan = plan
        self.reqs: dict[str, ReqState] = {}
        self.watch: dict[str, int] = {}
        #: requests whose last walk stopped short (module docstring), by id: their
        #: last listing, walked again every step until they catch up
        self.stalled: dict[str, ScheduledRequest] = {}
        self._no_new = no_new_blocks(gs.n)
        #: the window positions awaiting their store, by GPU id (None: no window group)
        self.reuse = WindowReuse([g for g, _ in gs.sw]) if gs.sw else None
        self._tracking = True  # the pass's ``tracking`` (:meth:`prepare`)

    def reallocated(self, ids: Collection[int]) -> None:
        """The step allocated ``ids``: window positions still naming one are stale
        (before this step's listings are applied: a new owner's own ids are not)."""
        if self.reuse is not None and ids:
            self.reuse.reallocated(ids)

    def state(self, req_id: str) -> ReqState:
        st = self.reqs.get(req_id)
        if st is None:
            st = self.reqs[req_id] = ReqState(req_id, self.gs.n)
        return st

    def forget(self, req_id: str) -> ReqState | None:
        self.watch.pop(req_id, None)
        self.stalled.pop(req_id, None)
        st = self.reqs.pop(req_id, None)
        if st is not None and self.reuse is not None:
            self.reuse.forget(st)
        return st

    # ---- the per-step scan: check (no change), then apply ----------------------------

    def prepare(self, requests: Iterable[Any], gone: Collection[str],
                check: CallCheck, *, tracking: bool = True) -> list[Change]:
        """Check this step's listing and say what the step does to each request that
        carries a change (listing order); changes nothing (InvalidRequest if the
        listing is bad). ``gone``: the step's finished ids, which the listing may not
        name (refused: a request reused an id whose end this step reports, so its
        lookup and phase B were taken as the ended request's, and the end would drop
        them). Their watch entries are set aside for the pass, which sends every listed
        one to the admission check that refuses it, and put back after it.
        ``tracking``: the changes will be applied (False once the manager failed: it
        then tracks no request, so one it never admitted is not refused for listing
        only its new ids, as it is otherwise)."""
        watch = self.watch
        hidden = {rid: watch.pop(rid) for rid in gone if rid in watch}
        self._tracking = tracking
        try:
            return self._classify(requests, gone, check)
        finally:
            watch.update(hidden)

    def _classify(self, requests: Iterable[Any], gone: Collection[str],
                  check: CallCheck) -> list[Change]:
        """The hot loop: an unchanged request costs one dict probe, two identity tests
        and a few compares (see :mod:`kvshm.offload.validate` for what that leaves unchecked)."""
        out: list[Change] = []
        seen: set[str] = set()
        get = self.watch.get
        no_new = self._no_new
        bs = self.bs
        r: Any = None
        try:
            for r in requests:
                w = get(r.req_id)
                if w is None or r.new_or_resumed is not False or r.preempted is not False:
                    out.append(self._check_admit(check.listed(r), gone, check, seen))
                    continue
                nb = r.new_block_ids
                q = r.num_confirmed_tokens // bs
                if q >= w or q < 0 or nb is not no_new and nb != no_new:
                    kind = self._decode_step(r, nb, q, w, seen, check)
                    out.append((r, kind) if kind else
                               self._check_change(check.listed(r), w, check, seen))
        except (TypeError, AttributeError) as exc:
            raise check.malformed(requests, r, exc) from exc
        return out

    @staticmethod
    def _once(rid: str, seen: set[str], check: CallCheck) -> None:
        """A request may carry a change once per step (a second listing would be
        applied against state the first one changed)."""
        if rid in seen:
            raise check.refuse("build_step", rid, "requests",
                               "listed twice in one step with a change")
        seen.add(rid)

    def _check_admit(self, r: ScheduledRequest, gone: Collection[str], check: CallCheck,
                     seen: set[str]) -> Change:
        """A (re)admission: check the hashes its first walk may read."""
        rid = r.req_id
        if rid in gone:
            raise check.refuse("build_step", rid, "finished",
                               "listed in the step that reports its end: report a "
                               "request's end (finished()) before its id is used again "
                               "(its lookup and phase B were taken as the ended one's)")
        self._once(rid, seen, check)
        untracked = self._tracking and rid not in self.watch
        if r.preempted and not r.new_or_resumed:
            # a preemption forgets a table: of a request not tracked there is none, and
            # no record is made for it (it would take a later listing of only new ids)
            return r, (0 if untracked else ADMIT)
        if not r.new_or_resumed and untracked:
            # its ids are the ones appended this step, not a table from position 0 (a
            # finished request still listed: its new block would be stored as block 0)
            raise check.refuse("build_step", rid, "new_or_resumed",
                               "listed with only its new block ids, but the manager "
                               "knows no table of it: a request's first listing, and "
                               "its first after its id was reported finished, has "
                               "new_or_resumed=True and its whole tables")
        st = self.reqs.get(rid)
        params = r.kv_transfer_params
        remote = (st is not None and st.remote) or (params is not None and remote_decode(params))
        if self.eager or remote:
            cursor = 0 if remote or st is None else st.start
            nb, hashes = r.new_block_ids, r.block_hashes
            shortest = len(nb[0]) if len(nb) == 1 else min(map(len, nb))
            ready = min(r.num_confirmed_tokens // self.bs, shortest, len(hashes))
            if ready > cursor:
                check.hashes("build_step", rid, "block_hashes", hashes, cursor, ready)
        return r, ADMIT

    def _decode_step(self, r: Any, nb: Any, q: int, w: int, seen: set[str],
                     check: CallCheck) -> int:
        """The change of a decode step, checked in one pass: a plain ``ScheduledRequest``
        of one KV group with one id appended or none (``nb`` is the shared "no new
        blocks" table), and either no block newly confirmed (``q < w``, an id appended:
        ``EXTEND``) or the next one (``q == w``, a tracked request whose walk reads one
        hash: ``DIRTY``, with ``EXTEND`` if an id was appended). Returns 0 for any other
        shape or value: the caller then runs the full checks (:meth:`CallCheck.listed`,
        :meth:`_check_change`), so this never refuses and never accepts what they would
        refuse -- every test :meth:`CallCheck.listed` makes of such a request is made
        here (``q >= 0`` is ``confirmed >= 0``; ``len(hashes) * bs <= num_tokens``
        implies ``num_tokens >= 0``; both flags are known to be exactly False)."""
        if q > w or type(r) is not ScheduledRequest or check.n_groups != 1:
            return 0
        b: Any = 0
        grow = nb is not self._no_new
        if grow:
            if type(nb) is not tuple or len(nb) != 1:
                return 0
            t = nb[0]
            if type(t) is not tuple or len(t) != 1:
                return 0
            b = t[0]
            if b == check.null_refused[0]:  # the slow path refuses it (InputCheck)
                return 0
        rid, hashes, num_tokens, params = (r.req_id, r.block_hashes, r.num_tokens,
                                           r.kv_transfer_params)
        if not (type(rid) is str and type(num_tokens) is int
                and type(r.num_confirmed_tokens) is int and q >= 0
                and (type(hashes) is list or type(hashes) is tuple)
                and (params is None or type(params) is dict)
                and len(hashes) * self.bs <= num_tokens
                and type(b) is int and 0 <= b < check.num_gpu_blocks and rid not in seen):
            return 0
        if q < w:  # an id appended, no block confirmed
            if not grow:
                return 0
            seen.add(rid)
            return EXTEND
        st = self.reqs[rid]
        lo = st.cursor
        if not st.tracked or len(st.tables) != 1:
            return 0
        hi = min(q, len(st.tables[0]) + grow, len(hashes))
        if hi - lo != 1:
            return 0
        h = hashes[lo]
        if type(h) is not bytes or not check.hash_min <= len(h) <= check.hash_max:
            return 0
        seen.add(rid)
        return EXTEND | DIRTY if grow else DIRTY

    def _check_change(self, r: ScheduledRequest, w: int, check: CallCheck,
                      seen: set[str]) -> Change:
        """A known request with ids appended and/or a new block confirmed: check the
        hashes this step's walk may read. (In a decode step about one listed request in
        ``block_size`` comes here: kept to a few operations.)"""
        rid = r.req_id
        if rid in seen:
            self._once(rid, seen, check)
        seen.add(rid)
        nb = r.new_block_ids
        kind = EXTEND if nb is not self._no_new and any(nb) else 0
        q = r.num_confirmed_tokens // self.bs
        if q < w:
            return r, kind
        st = self.reqs[rid]
        grow = kind and st.tracked
        tables = st.tables
        if len(tables) == 1:
            ready = len(tables[0]) + (len(nb[0]) if grow else 0)
        else:
            ready = min(len(t) + (len(ids) if grow else 0) for t, ids in zip(tables, nb))
        hashes = r.block_hashes
        hi = min(q, ready, len(hashes))
        lo = st.cursor
        if hi - lo == 1:  # the usual case: one more block confirmed
            h = hashes[lo]
            if type(h) is bytes and check.hash_min <= len(h) <= check.hash_max:
                return r, kind | DIRTY
        check.hashes("build_step", rid, "block_hashes", hashes, lo, hi)
        return r, kind | DIRTY

    def apply(self, changes: list[Change]) -> list[ScheduledRequest]:
        """Apply :meth:`prepare`'s changes; returns the requests with blocks to walk: the
        listed ones that need it, then the stalled ones not listed this step (a
        (re)admitted request leaves the stalled set first)."""
        dirty: list[ScheduledRequest] = []
        stalled = self.stalled
        reqs = self.reqs
        for r, kind in changes:
            if kind & ADMIT:
                stalled.pop(r.req_id, None)
                self._admit(r, dirty)
                continue
            if kind & EXTEND:  # ids appended (a tracked request keeps its tables)
                st = reqs[r.req_id]
                if st.tracked:
                    tables, nb = st.tables, r.new_block_ids
                    if len(tables) == 1:
                        tables[0].extend(nb[0])
                    else:
                        reuse = self.reuse
                        start = ([len(tables[g]) for g in reuse.windowed]
                                 if reuse is not None else None)
                        for table, ids in zip(tables, nb):
                            table.extend(ids)
                        if reuse is not None and start is not None:
                            reuse.listed(st, start)
                    st.hashes = r.block_hashes
            if kind & DIRTY:
                dirty.append(r)
        if stalled:
            walked = {r.req_id for r in dirty}
            dirty.extend(r for rid, r in stalled.items() if rid not in walked)
        return dirty

    def _admit(self, r: ScheduledRequest, dirty: list[ScheduledRequest]) -> None:
        """First listing, resumption (full table) or preemption (table forgotten)."""
        rid = r.req_id
        st = self.state(rid)
        st.remote = st.remote or remote_decode(r.kv_transfer_params)
        st.tracked = self.eager or st.remote
        st.phase_b_tables = None
        st.cursor = 0 if st.remote else st.start
        stale, st.stale = st.stale, None
        if r.preempted and not r.new_or_resumed:
            st.tables = [[] for _ in range(self.gs.n)]
            self.watch[rid] = NEVER
            return
        if st.tracked:
            old, st.tables = st.tables, list(map(list, r.new_block_ids))
            if stale:
                st.stale = still_stale(stale, old, st.tables)
            if self.reuse is not None:
                self.reuse.listed(st, [0] * len(self.reuse.windowed))
        st.hashes = r.block_hashes
        w = self.watch[rid] = st.cursor + 1 if st.tracked else NEVER
        if r.num_confirmed_tokens // self.bs >= w:
            dirty.append(r)

    # ---- selection -------------------------------------------------------------------

    def select(self, dirty: list[ScheduledRequest], alloc: Collection[int], avail: int,
               sel: Selection) -> int:
        """Walk each changed request's confirmed blocks into ``sel``, in order; returns
        what is left of ``avail`` CPU blocks. A run of requests in a row that each have
        exactly one position to walk (a decode step's usual change, one full-attention
        group) is offered to :meth:`StorePlanner.pick_run
        <kvshm.offload.stores.StorePlanner.pick_run>` first, which selects the whole run
        at once when every walk would pick its block; else the run is walked request by
        request. Either way the same blocks are picked in the same order."""
        bs = self.bs
        reqs, walk = self.reqs, self.plan.walk
        single = self.gs.single
        run: list[tuple[ScheduledRequest, ReqState, int]] = []
        for r in dirty:
            st = reqs[r.req_id]
            st.hashes = hashes = r.block_hashes
            tables = st.tables
            shortest = len(tables[0]) if len(tables) == 1 else min(map(len, tables))
            ready = r.num_confirmed_tokens // bs
            if shortest < ready:
                ready = shortest
            p = st.cursor
            if single and ready == p + 1 and p < len(hashes):
                run.append((r, st, ready))
                continue
            if run:
                avail = self._select_run(run, alloc, avail, sel)
                run = []
            avail = walk(st, ready, avail, alloc, sel)
            self._walked(r, st, ready)
        if run:
            avail = self._select_run(run, alloc, avail, sel)
        return avail

    def _select_run(self, run: list[tuple[ScheduledRequest, ReqState, int]],
                    alloc: Collection[int], avail: int, sel: Selection) -> int:
        """:meth:`select` for ``run``: requests with one position to walk each (its
        cursor, ``ready - 1``), all at once where the planner takes them, else one by
        one."""
        n = len(run)
        if n > 1 and avail >= n:
            blocks = [st.tables[0][st.cursor] for _, st, _ in run]
            keys = [st.hashes[st.cursor] for _, st, _ in run]
            depths = [st.cursor for _, st, _ in run]
            if self.plan.pick_run(blocks, keys, depths, sel):
                watch, stalled = self.watch, self.stalled
                for r, st, ready in run:
                    st.cursor = ready
                    watch[r.req_id] = ready + 1
                    if stalled:
                        stalled.pop(r.req_id, None)
                return avail - n
        walk = self.plan.walk
        for r, st, ready in run:
            avail = walk(st, ready, avail, alloc, sel)
            self._walked(r, st, ready)
        return avail

    def _walked(self, r: ScheduledRequest, st: ReqState, ready: int) -> None:
        """After ``r``'s walk: its next watched block; stalled while it stopped short."""
        rid = r.req_id
        w = self.watch[rid] = st.cursor + 1
        if w <= ready:  # stopped short of what it could store: walk it again
            self.stalled[rid] = r
        elif self.stalled:
            self.stalled.pop(rid, None)

    def check_finish(self, st: ReqState, num_confirmed_tokens: int,
                     tables: Sequence[Sequence[int]], hashes: Sequence[BlockHash] | None,
                     check: CallCheck) -> None:
        """Before :meth:`finish`: check the tables and hashes its finish-time store may
        read."""
        if not st.tracked:
            return
        self._check_listed_ids(st, tables, num_confirmed_tokens, check)
        seq = hashes if hashes is not None else st.hashes
        shortest = len(tables[0]) if len(tables) == 1 else min(len(t) for t in tables)
        hi = min(num_confirmed_tokens // self.bs, shortest, len(seq))
        if hi > st.cursor:
            check.hashes("finished", st.req_id, "block_hashes", seq, st.cursor, hi)
            if hashes is not None and hashes is not st.hashes:
                self._check_listed_hashes(st, hashes, hi, check)

    @staticmethod
    def _check_listed_hashes(st: ReqState, hashes: Sequence[BlockHash], hi: int,
                             check: CallCheck) -> None:
        """A finish's own ``block_hashes`` may add the hashes the engine's sequence still
        lacked, never rename what the steps listed: the unstored positions
        ``[cursor, hi)`` that the sequence seen so far holds must hold the same hashes
        (another would label this request's bytes as another prefix's, served to every
        later hit of that prefix)."""
        have = st.hashes
        for p in range(st.cursor, min(hi, len(have))):
            listed = have[p]  # (past the confirmed blocks a listing's entries are unchecked:
            if type(listed) is bytes and hashes[p] != listed:  # a non-hash is one it lacked)
                raise check.refuse("finished", st.req_id, f"block_hashes[{p}]",
                                   f"{hashes[p].hex()[:16]}... where the steps listed "
                                   f"{listed.hex()[:16]}...: a finish may add hashes, "
                                   "not change them")

    def _check_listed_ids(self, st: ReqState, tables: Sequence[Sequence[int]],
                          num_confirmed_tokens: int, check: CallCheck) -> None:
        """The finish-time store reads positions from the cursor up to the confirmed
        blocks (a P/D prefill request's partial tail block too); where the steps listed
        an id, ``tables`` must name the same one (a sliding-window group may name the
        null block instead: the engine freed that block). Another block there would be
        stored under this request's hash, its bytes served to every later hit. After a
        phase B the steps have not listed yet (a re-admission), its tables are the ones
        compared (``phase_b_tables``). Positions past the listed ones are the engine's
        word, as every listed id is: vLLM names blocks at a finish that no step listed
        (those its last step allocated; ``tools.bench_vs_vllm``'s lockstep rig shows
        it), and they are stored. O(the unstored listed positions): at a finish usually
        none or one a group."""
        listed = st.tables if st.phase_b_tables is None else st.phase_b_tables
        lo, ready = st.cursor, num_confirmed_tokens // self.bs
        if st.remote and num_confirmed_tokens % self.bs:
            ready += 1  # the tail block (``pin_tail``)
        for g, t in enumerate(tables):
            have = listed[g]
            hi = min(len(t), ready, len(have))
            if hi <= lo:
                continue
            for p in range(lo, hi):
                if t[p] != have[p]:
                    self._unlisted(st, t, have, g, p, check)

    @staticmethod
    def _unlisted(st: ReqState, t: Sequence[int], have: Sequence[int], g: int, p: int,
                  check: CallCheck) -> None:
        """Position ``p`` of group ``g`` names another block than was listed there:
        refused, unless it is the null block in a group that may hold it."""
        null = check.fields.null_block_id if check.null_refused[g] is None else None
        if null is None or t[p] != null:
            source = "the steps" if st.phase_b_tables is None else "its last phase B"
            raise check.refuse("finished", st.req_id, f"gpu_block_ids[{g}][{p}]",
                               f"block {t[p]} where {source} listed {have[p]}: its "
                               "unstored blocks are stored from the tables listed")

    def finish(self, st: ReqState, num_confirmed_tokens: int,
               tables: Sequence[Sequence[int]], hashes: Sequence[BlockHash] | None) -> None:
        """Finish-time: pin the request's unstored full blocks for the next store."""
        if not st.tracked:
            return
        st.tables = [list(t) for t in tables]
        if hashes is not None:
            st.hashes = hashes
        ready = min(num_confirmed_tokens // self.bs, min(map(len, tables)))
        if ready > st.cursor:
            self.plan.pin_finished(st, ready)

