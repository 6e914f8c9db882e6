"""The per-step listing: vLLM's ``SchedulerOutput`` as kvshm's ``ScheduledRequest`` list.

:class:`Listing` builds, once per step, the requests of the step's ``StepInput``, in
this order: new requests, then the cached (running or resumed) ones that changed, in
vLLM's order, then the preempted requests that were announced and are not listed
otherwise. With sliding-window groups it also collects the GPU block ids allocated this
step.

A request is *announced* once it has been listed with its full tables
(``new_or_resumed``): a new or resumed request, or -- at its first step once kvshm is
READY -- a running request that started before the workers connected (its tables come
from ``scheduler_output.kv_connector_block_state``). An announced request that is not
resumed is listed with only its new block ids. A request the side never saw
(``on_new_request`` / lookup) is skipped and counted (``requests_unknown``).

O(changed) per step: a listed request gets a *next look* in tokens, the next block
boundary past its confirmed tokens (``(confirmed // block_size + 1) * block_size``). A
cached request with no new block ids whose ``num_computed_tokens`` in the
SchedulerOutput is still below its next look is not listed: nothing of it changed that
kvshm reads (its confirmed tokens, at most its computed ones, are still inside the
block that was confirmed when it was last listed), and no ``Request`` field is read.
Everything else is listed: new, resumed and preempted requests, new block ids, a
boundary reached (the manager walks its store cursor only then), a request without a
next look. A store the manager had to defer is retried by the manager itself
(:mod:`kvshm.offload.requests`, *stalled*), not by listing the request again. Counted:
``requests_unchanged`` (cached requests passed over). Invariant: a request has a next
look only while it is announced (forgetting or preempting it drops both).

How the unchanged requests are passed over (:meth:`Listing._list_cached`): the listing
keeps the last step's cached ids with their next looks side by side (*the mirror*).
vLLM's running order is stable: a step's cached ids are usually the last step's, less
the requests that left (finished, preempted: their positions are found by binary search
over per-position sequence numbers), plus the requests that were new last step at the
end. When the mirror, so updated, equals this step's ids (one list compare, by identity
first: no request id is hashed or even read), the boundary test runs over the whole
batch at once in C (``map`` over the computed counts and the mirrored next looks, and
over the new block ids), and only the positions it flags are visited in Python. Any
other order (a request left out by the token budget, a reorder, a resumption in the
middle) takes the per-request walk, which matches ids to the mirror by position (``is``)
and falls back to a dict probe, then rebuilds the mirror. Both are exact: a mirrored
next look is the request's next look (it is updated wherever a next look changes, and
a request whose next look changed elsewhere leaves the mirror), so both list exactly
what asking :attr:`Listing.next_look` for every request would list.

The fast path: a flagged request that was announced, is not resumed and is known (and
has no ids appended on an engine with sliding-window groups) goes straight to
:meth:`Listing._known`, which builds its record, as :meth:`Listing._changed` does after
its guards (~140 such requests a step at 1k running when every request is listed);
every other case goes to ``_changed``. The reference listing (``mirror=False``) always
calls ``_changed``.

Duck-typed over vLLM's objects (no vLLM import). The listing reads the scheduler
side's live requests and adds to its announced set; it changes nothing else there.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import ge, is_not
from typing import Any

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.types import GroupKind, ScheduledRequest

__all__ = ["Listing", "Tables", "tables"]

Tables = tuple[tuple[int, ...], ...]


def tables(block_ids: Sequence[Sequence[int]]) -> Tables:
    """vLLM's per-group block id lists as kvshm's table tuple."""
    if len(block_ids) == 1:
        return (tuple(block_ids[0]),)
    return tuple(map(tuple, block_ids))


class Listing:
    """See the module docstring. ``requests`` and ``announced`` are the scheduler side's
    own (request id -> vLLM ``Request``, and the announced ids); ``no_new`` is the
    "no new blocks" table of every group. ``mirror``: False asks :attr:`next_look` for
    every cached request (the reference the tests compare against)."""

    def __init__(self, cfg: ConnectorConfig, requests: Mapping[str, Any],
                 announced: set[str], counters: SchedulerCounters, no_new: Tables, *,
                 mirror: bool = True) -> None:
        self._block_size = cfg.block_size
        self._sw = any(g.kind is GroupKind.SLIDING_WINDOW for g in cfg.groups)
        self._requests = requests
        self._announced = announced
        self._counters = counters
        self._no_new = no_new
        self._mirror = mirror
        #: request id -> the computed-token count at which it is next listed
        self.next_look: dict[str, int] = {}
        # the mirror (module docstring): the last step's cached ids, their next looks,
        # increasing sequence numbers, and id -> its sequence number
        self._ids: list[str] = []
        self._looks: list[int] = []
        self._seq: array[int] = array("q")
        self._seq_of: dict[str, int] = {}
        self._sequenced = False  # the mirror has its sequence numbers: aligning may work
        self._next_seq = 0
        self._gone: set[str] = set()  # left the running list since the last listing
        self._ints: dict[int, int] = {}  # one int object per next-look value (cache-warm)
        self._positions: list[int] = []  # 0, 1, 2, ...: compress's data (no int per step)

    def forget(self, rid: str) -> None:
        """The request is gone (finished): drop its next look."""
        self.next_look.pop(rid, None)
        self._gone.add(rid)

    def skip(self) -> None:
        """A step with no listing (the engine is not READY: starting, or FAILED for
        good). The mirror cannot follow the running list past it, so it goes, and with
        it the ids that left (kept only to cut them out of the mirror); the next
        listing, if any, takes the walk and rebuilds the mirror. Without this a failed
        engine kept the id of every request that ended from then on, for the life of
        the server (``forget`` adds it, only a listing cleared them)."""
        if self._gone or self._ids:
            self._gone.clear()
            self._remirror((), [], False)

    def build(self, so: Any) -> tuple[list[ScheduledRequest], set[int]]:
        """The scheduled requests that changed (module docstring) and, with
        sliding-window groups, the GPU ids allocated this step. The set of listed ids
        is built only when the step preempted someone."""
        out: list[ScheduledRequest] = []
        alloc: set[int] = set()
        seq_of = self._seq_of
        for nr in so.scheduled_new_reqs:
            if not self._sequenced or nr.req_id in seq_of:
                self._gone.add(nr.req_id)  # its next look changes outside the mirror
            self._add(out, nr.req_id, tables(nr.block_ids), True, nr.num_computed_tokens,
                      alloc)
        cached = so.scheduled_cached_reqs
        self._list_cached(cached, out, alloc, getattr(so, "kv_connector_block_state", None))
        preempted = getattr(so, "preempted_req_ids", None)
        if preempted:
            listed = {nr.req_id for nr in so.scheduled_new_reqs}
            listed.update(cached.req_ids)
            for rid in preempted:
                if rid in self._announced and rid not in listed:
                    self._counters.requests_preempted += 1
                    self._add(out, rid, self._no_new, False, 0, alloc, preempted=True)
                    self.next_look.pop(rid, None)  # listed again when it resumes
                    self._gone.add(rid)
        return out, alloc

    # -- the cached requests -------------------------------------------------------------
    def _list_cached(self, cached: Any, out: list[ScheduledRequest], alloc: set[int],
                     state: Any) -> None:
        """The cached requests that changed, in vLLM's order (see the module docstring:
        the batch test over the mirror, else the per-request walk)."""
        ids, nbs, comps = cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        resumed = cached.resumed_req_ids
        if self._mirror and self._aligned(ids, nbs, comps):
            looks = self._looks
            flagged = self._flagged(nbs, comps)
            # _changed's common case without its call (module docstring, "the fast path")
            announced, requests, sw = self._announced, self._requests, self._sw
            for i in flagged:
                rid, nb = ids[i], nbs[i]
                r = (requests.get(rid) if rid in announced
                     and (nb is None or rid not in resumed) else None)
                if r is None or (sw and nb is not None):
                    looks[i] = self._changed(rid, nb, comps[i], looks[i], out, alloc,
                                             state, resumed)
                else:
                    looks[i] = self._known(rid, r, nb, out)
            looked = len(flagged)
        else:
            looked = self._walk(ids, nbs, comps, out, alloc, state, resumed)
        self._gone.clear()
        self._counters.requests_unchanged += len(ids) - looked

    def _flagged(self, nbs: Sequence[Any], comps: Sequence[int]) -> list[int]:
        """The positions the batch test flags, in order: a boundary reached
        (``computed >= next look``, one C ``map`` over the mirrored next looks) or new
        block ids (``nbs.count(None)`` first: usually none or a few; their positions by
        truthiness, and by ``is not None`` where that disagrees: an empty table)."""
        n = len(comps)
        pos = self._positions
        if len(pos) < n:
            pos.extend(range(len(pos), n))
        flagged = list(compress(pos, map(ge, comps, self._looks)))
        k = n - nbs.count(None)
        if k:
            grown = list(compress(pos, nbs))
            if len(grown) != k:
                grown = list(compress(pos, map(is_not, nbs, repeat(None))))
            flagged = sorted(set(flagged).union(grown)) if flagged else grown
        return flagged

    def _aligned(self, ids: Any, nbs: Sequence[Any], comps: Sequence[int]) -> bool:
        """Update the mirror (drop the requests that left, append this step's ids past
        its end) and say whether it now equals ``ids``, position by position."""
        if not self._sequenced:
            return False
        mids, looks, seq, seq_of = self._ids, self._looks, self._seq, self._seq_of
        if self._gone and seq_of:
            at: list[int] = []
            for rid in self._gone:
                s = seq_of.pop(rid, None)
                if s is not None:
                    p = bisect_left(seq, s)
                    if p == len(seq) or seq[p] != s:
                        return False  # never expected: the walk rebuilds the mirror
                    at.append(p)
            at.sort()
            while at:  # runs of adjacent positions, last first: one memmove each
                hi = at.pop()
                lo = hi
                while at and at[-1] == lo - 1:
                    lo = at.pop()
                del mids[lo:hi + 1], looks[lo:hi + 1], seq[lo:hi + 1]
        m, n = len(mids), len(ids)
        if n < m or len(nbs) != n or len(comps) != n:
            return False
        if n > m:
            tail = ids[m:]
            first = self._next_seq
            self._next_seq += len(tail)
            for s, rid in enumerate(tail, first):
                if seq_of.setdefault(rid, s) != s:
                    return False  # listed twice: the walk rebuilds the mirror
            at_look = self.next_look.get
            mids.extend(tail)
            looks.extend(at_look(rid, 0) for rid in tail)
            seq.extend(range(first, first + len(tail)))
        return bool(mids == ids)

    def _walk(self, ids: Sequence[str], nbs: Sequence[Any], comps: Sequence[int],
              out: list[ScheduledRequest], alloc: set[int], state: Any,
              resumed: Any) -> int:
        """The per-request walk (the mirror did not match): a request's next look comes
        from the mirror where the request sits where the mirror has it (``is`` on the id
        object: no string hash, no dict probe), else from :attr:`next_look` (after a few
        misses in a row the rest of the list skips the mirror); then the mirror is
        rebuilt from this step's ids. Ids that left since the last listing are skipped,
        never matched (vLLM lists a request again only after it resumed, with new block
        ids, and then its next look is not read). Returns how many requests were
        visited."""
        at = self.next_look.get
        prev_ids, prev_looks = self._ids, self._looks
        n_prev = len(prev_ids) if self._mirror else 0
        looks: list[int] = []
        keep = looks.append
        gone = self._gone
        j = misses = looked = 0
        hinted = len(ids)  # less one per dict probe below
        fast = self._mirror  # the reference (no mirror) asks _changed for every request
        announced, requests, sw = self._announced, self._requests, self._sw
        for rid, nb, computed in zip(ids, nbs, comps):
            if j < n_prev and prev_ids[j] is rid:
                w = prev_looks[j]
                j += 1
            else:
                while j < n_prev and prev_ids[j] in gone:
                    j += 1
                if j < n_prev and prev_ids[j] is rid:
                    w = prev_looks[j]
                    j += 1
                    misses = 0
                else:
                    hinted -= 1
                    w = at(rid, 0)
                    misses += 1
                    if misses > 8:
                        j = n_prev  # the order changed: no more hints this step
            if nb is None and computed < w:  # no next look: 0, never passed over
                keep(w)
                continue
            looked += 1
            r = (requests.get(rid) if fast and rid in announced
                 and (nb is None or rid not in resumed) else None)
            if r is None or (sw and nb is not None):
                keep(self._changed(rid, nb, computed, w, out, alloc, state, resumed))
            else:  # _changed's common case, without its guards (module docstring)
                keep(self._known(rid, r, nb, out))
        if self._mirror:
            self._remirror(ids, looks, 2 * hinted >= len(ids))
        return looked

    def _remirror(self, ids: Sequence[str], looks: list[int], sequence: bool) -> None:
        """The mirror from this step's ids (cut where ``zip`` stopped) and next looks;
        with sequence numbers only when ``sequence`` (most of this step's ids sat where
        the last mirror had them: the next step may align), else it only serves the
        next walk's positional hints (a step that lists only some of the running
        requests aligns with nothing: no dict of sequence numbers is built for it)."""
        mids = list(ids)
        del mids[len(looks):]
        self._ids, self._looks = mids, looks
        self._sequenced = sequence
        if not sequence:
            self._seq, self._seq_of = array("q"), {}
            return
        first = self._next_seq
        self._next_seq += len(mids)
        self._seq = array("q", range(first, first + len(mids)))
        self._seq_of = dict(zip(mids, range(first, first + len(mids))))
        if len(self._seq_of) != len(mids):  # an id listed twice: no mirror next step
            self._ids, self._looks, self._seq = [], [], array("q")
            self._seq_of.clear()
            self._sequenced = False

    def _changed(self, rid: str, nb: Any, computed: int, w: int,
                 out: list[ScheduledRequest], alloc: set[int], state: Any,
                 resumed: Any) -> int:
        """One cached request the boundary test flagged (``w``: its next look): list it
        if it changed; returns its next look after this step."""
        if rid in self._announced and (nb is None or rid not in resumed):
            if nb is not None and self._sw:  # (an unknown request's too: reallocated)
                alloc.update(b for g in nb for b in g)
            r = self._requests.get(rid)
            if r is None:
                self._counters.requests_unknown += 1
                return w
            return self._known(rid, r, nb, out)
        if rid in resumed and nb is not None:
            self._counters.requests_resumed += 1
            self._add(out, rid, tables(nb), True, computed, alloc)
        else:  # listed before: never announced (the workers were not ready yet)
            full = state.get_block_ids(rid) if state is not None else None
            if full is not None:
                self._counters.requests_announced_late += 1
                self._add(out, rid, tables(full), True, computed, alloc)
        return self.next_look.get(rid, 0)

    def _known(self, rid: str, r: Any, nb: Any, out: list[ScheduledRequest]) -> int:
        """List announced, known request ``r`` (not resumed) with the ids ``nb``
        appended (None: none); returns and records its next look. The one place such a
        record is built (the fast paths and :meth:`_changed` call it)."""
        table = (self._no_new if nb is None
                 else (tuple(nb[0]),) if len(nb) == 1 else tables(nb))
        confirmed = r.num_computed_tokens - r.num_output_placeholders
        bs = self._block_size
        w = (confirmed // bs + 1) * bs
        w = self.next_look[rid] = self._ints.setdefault(w, w)  # _int, inlined
        out.append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, False,
                                    confirmed, False, r.kv_transfer_params))
        return w

    def _int(self, w: int) -> int:
        """The one int object for next look ``w`` (the batch test reads every mirrored
        next look each step: shared objects stay in cache)."""
        return self._ints.setdefault(w, w)

    def _add(self, out: list[ScheduledRequest], rid: str, table: Tables, full: bool,
             num_computed: int, alloc: set[int], *, preempted: bool = False) -> None:
        if full and self._sw:  # (an unknown request's too: reallocated)
            first = num_computed // self._block_size
            alloc.update(b for g in table for b in g[first:])
        r = self._requests.get(rid)
        if r is None:
            self._counters.requests_unknown += 1
            return
        self._announced.add(rid)
        confirmed = r.num_computed_tokens - r.num_output_placeholders
        if not preempted:
            self.next_look[rid] = self._int(
                (confirmed // self._block_size + 1) * self._block_size)
        out.append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, full,
                                    confirmed, preempted, r.kv_transfer_params))
