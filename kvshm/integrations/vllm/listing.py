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
block that was confirmed when it was last listed), so a decode step costs it one dict
probe and a compare -- or, where it sits where it sat in the last step's list, one
identity test and a compare (positional hints: :meth:`Listing._list_cached`) -- and no
``Request`` field is read. Everything else is listed: new,
resumed and preempted requests, new block ids, a boundary reached (the manager walks
its store cursor only then), a request without a next look. A store the manager had to
defer is retried by the manager itself (:mod:`kvshm.offload.requests`, *stalled*), not
by listing the request again. Counted: ``requests_unchanged`` (cached requests passed
over). Invariant: a request has a next look only while it is announced (forgetting or
preempting it drops both).

Duck-typed over vLLM's objects (no vLLM import). The listing reads the scheduler
side's live requests and adds to its announced set; it changes nothing else there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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
    "no new blocks" table of every group."""

    def __init__(self, cfg: ConnectorConfig, requests: Mapping[str, Any],
                 announced: set[str], counters: SchedulerCounters, no_new: Tables) -> None:
        self._block_size = cfg.block_size
        self._sw = any(g.kind is GroupKind.SLIDING_WINDOW for g in cfg.groups)
        self._requests = requests
        self._announced = announced
        self._counters = counters
        self._no_new = no_new
        #: request id -> the computed-token count at which it is next listed
        self.next_look: dict[str, int] = {}
        # the last step's cached request ids and their next looks after it (positional
        # hints, see _list_cached), and the ids forgotten or preempted since
        self._prev_ids: list[str] = []
        self._prev_looks: list[int] = []
        self._gone: set[str] = set()

    def forget(self, rid: str) -> None:
        """The request is gone (finished): drop its next look."""
        self.next_look.pop(rid, None)
        self._gone.add(rid)

    def build(self, so: Any) -> tuple[list[ScheduledRequest], set[int]]:
        """The scheduled requests that changed (module docstring) and, with
        sliding-window groups, the GPU ids allocated this step.

        Runs once per step over the SchedulerOutput's lists: an unchanged running
        request costs one dict probe (or a positional hint) and a compare; a changed
        announced request that is
        not resumed takes the inlined path (one set probe, one dict probe, one
        ScheduledRequest); the set of listed ids is built only when the step preempted
        someone."""
        out: list[ScheduledRequest] = []
        alloc: set[int] = set()
        for nr in so.scheduled_new_reqs:
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

    def _list_cached(self, cached: Any, out: list[ScheduledRequest], alloc: set[int],
                     state: Any) -> None:
        """The cached requests (see :meth:`build`). A request's next look comes from
        the last step's list where the request sits where it sat then (``is`` on the id
        object: no string hash, no dict probe -- at 16k running requests, the misses
        those cost were most of the step), past the ids forgotten or preempted since;
        elsewhere from :attr:`next_look` (after a few misses in a row the rest of the
        list skips the hints). Exact: a hint is the request's next look at the end of the
        last listing, and between listings only ``forget`` and preemption change one,
        of requests that leave the running list (their ids are skipped, never matched:
        vLLM lists a request again only after it resumed, with new block ids, and then
        its next look is not read)."""
        resumed = cached.resumed_req_ids
        announced, get, no_new, sw = self._announced, self._requests.get, self._no_new, self._sw
        look = self.next_look
        at = look.get
        bs = self._block_size
        append, unknown, looked = out.append, 0, 0
        req_ids = cached.req_ids
        prev_ids, prev_looks, gone = self._prev_ids, self._prev_looks, self._gone
        n_prev = len(prev_ids)
        looks: list[int] = []
        keep = looks.append
        j = misses = 0
        for rid, nb, computed in zip(req_ids, cached.new_block_ids,
                                     cached.num_computed_tokens):
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
                    w = at(rid, 0)
                    misses += 1
                    if misses > 8:
                        j = n_prev  # the order changed: no more hints this step
            if nb is None and computed < w:  # no next look: 0, never passed over
                keep(w)
                continue
            looked += 1
            if rid in announced and (nb is None or rid not in resumed):
                r = get(rid)
                if r is None:
                    unknown += 1
                    keep(w)
                    continue
                if nb is None:
                    table = no_new
                else:
                    table = (tuple(nb[0]),) if len(nb) == 1 else tables(nb)
                    if sw:
                        alloc.update(b for g in nb for b in g)
                confirmed = r.num_computed_tokens - r.num_output_placeholders
                w = look[rid] = (confirmed // bs + 1) * bs
                keep(w)
                append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, False,
                                        confirmed, False, r.kv_transfer_params))
                continue
            if rid in resumed and nb is not None:
                self._counters.requests_resumed += 1
                self._add(out, rid, tables(nb), True, computed, alloc)
            else:  # listed before: never announced (the workers were not ready yet)
                full = state.get_block_ids(rid) if state is not None else None
                if full is not None:
                    self._counters.requests_announced_late += 1
                    self._add(out, rid, tables(full), True, computed, alloc)
            keep(at(rid, 0))
        ids = list(req_ids)
        if len(ids) != len(looks):  # zip stopped at a shorter list
            del ids[len(looks):]
        self._prev_ids = ids
        self._prev_looks = looks
        gone.clear()
        self._counters.requests_unknown += unknown
        self._counters.requests_unchanged += len(req_ids) - looked

    def _add(self, out: list[ScheduledRequest], rid: str, table: Tables, full: bool,
             num_computed: int, alloc: set[int], *, preempted: bool = False) -> None:
        r = self._requests.get(rid)
        if r is None:
            self._counters.requests_unknown += 1
            return
        self._announced.add(rid)
        if full and self._sw:
            first = num_computed // self._block_size
            alloc.update(b for g in table for b in g[first:])
        confirmed = r.num_computed_tokens - r.num_output_placeholders
        if not preempted:
            self.next_look[rid] = (confirmed // self._block_size + 1) * self._block_size
        out.append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, full,
                                    confirmed, preempted, r.kv_transfer_params))
