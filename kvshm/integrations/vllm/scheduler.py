"""Scheduler side of kvshm's vLLM connector (vLLM's engine-core process, its thread).

Duck-typed over vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` (no vLLM
import), around a kvshm :class:`~kvshm.engine.SyncClient`, which is created in
:meth:`SchedulerSide.bind` (vLLM's ``bind_gpu_block_pool``) over vLLM's pool wrapped as
``GpuBlocks``. Hook by hook:

* ``get_num_new_matched_tokens`` -> :meth:`lookup`: ``(hit, True)`` for a hit (an
  async load) -- ``(hit, False)``, a synchronous load, with ``cfg.sync_loads`` (a CPU
  device, one KV cache group; not for a P/D hand-off, ``do_remote_prefill``): vLLM
  then computes the request in the step that loads it, and the worker copies the load
  before that step's forward, so a hit costs no engine step of its own (the requests
  go out in the step's ``StepMeta.sync_reqs``) --, ``(0, False)`` on a miss or when
  the request skips reading the prefix cache (vLLM asserts a positive count for async
  loads), ``(None, False)`` to be asked
  again (another request is loading part of this prefix right now, or the disk tier
  reads it). Before answering "ask again" it pumps the client once and asks again: a
  disk read whose Done the worker published since the step's last pump (a worker's
  mover publisher sends it the moment the read ends) is a CPU hit at once, so a disk
  hit costs one engine step, not two. With a disk tier, the lookup that first answers
  "ask again" for a disk hit has posted its READ (``SyncClient.lookup``), and the
  worker's mover publisher starts it on arrival; a request that waits for a read while
  every other live request waits likewise (the step would run nothing) sleeps and pumps
  for the read's Done, bounded, before it answers -- from its first lookup on
  (:mod:`~kvshm.integrations.vllm.read_wait`, an object the side holds).
* ``update_state_after_alloc`` -> :meth:`allocated` (whole tables, local hit first).
* ``build_connector_meta`` -> :meth:`build`: the step's ``StepInput`` from the
  ``SchedulerOutput``, then ``SyncClient.step``; the metadata carries only the step,
  the unacked load jobs' request ids, new load jobs' destinations, scheduler-side
  load failures and flush ids. The transfers themselves travel over kvshm's rings.
* ``request_finished[_all_groups]`` -> :meth:`finished` with ``num_computed_tokens -
  num_output_placeholders``; always ``(False, None)`` (pins, not delayed frees).
* A request whose load failed is never offered a CPU hit again: vLLM recomputes it
  (after a failed load that leaves no valid token, vLLM frees the request's blocks and
  looks it up again; answering with the same hit would retry a failing copy forever).
* ``has_pending_push_work`` -> ``has_pending_work`` (vLLM keeps stepping until the last
  stores are acked); ``reset_cache`` -> ``reset``; ``update_connector_output`` drains
  the client's load results (counted).

Refused input: kvshm refuses a call whose input breaks its contract
(``InvalidRequest``, nothing changed). The side maps that to what vLLM can live with
wherever there is a safe answer, and marks the request *refused* (logged once per kind,
counted): no CPU hit is offered to it again and it is not listed again (a refused listing
is retried without it), and its finish only forgets it. A refused lookup is a miss; a
refused phase B releases the lookup's pin; if vLLM expected tokens from it, the request
goes out in the next metadata's ``failed_loads`` with the blocks vLLM expected filled, so
vLLM recomputes them rather than waiting for a load kvshm never planned. Only a step
refused as a whole raises.

Requests and readiness: until every worker rank has connected, ``lookup`` returns 0 and
no request is listed in a ``StepInput``. The first step at which the client is READY
lists every scheduled request not yet *announced* with its full current tables
(``new_or_resumed``), from ``scheduler_output.kv_connector_block_state``, so requests
that started before the workers connected are still stored. The listing itself, which
lists only the requests that changed (O(changed) per step: a running request that does
not complete a block costs a dict probe): :mod:`~kvshm.integrations.vllm.listing`; the
block pool's cached plain hashes: :mod:`~kvshm.integrations.vllm.blocks`; the metadata and
counters records:
:mod:`~kvshm.integrations.vllm.records`.

Threads: every hook runs under one lock (:class:`~kvshm.integrations.vllm.service.HookGuard`),
and a service thread started in :meth:`SchedulerSide.bind` pumps the client under that
lock while vLLM is idle, so ``kvshm stats --name`` answers an idle engine within about
20 ms (:mod:`~kvshm.integrations.vllm.service` states the invariant). :meth:`shutdown`
stops and joins it before anything else (bind, the thread, shutdown and statistics: the
side's lifecycle, ``side.life``, :mod:`~kvshm.integrations.vllm.side_lifecycle`; the
side's methods of the same names hand over to it in one line). The file written to
``stats_path``: :mod:`~kvshm.integrations.vllm.final_stats`.

Ordering within ``build``: the client's load results are absorbed first
(``SyncClient.poll``: the build's one pump of the rings and the rendezvous), finished
requests are forgotten, then the listing is built and ``SyncClient.step`` runs without
pumping again (``service=False``); loads kvshm refused in phase B join the metadata's
``failed_loads`` exactly once. A step pumps twice: ``update_connector_output`` (the done
rings only, ``SyncClient.poll(rendezvous=False)``) and ``build`` (the rendezvous too;
plus once per lookup that would answer "ask again").
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvshm.engine import EngineState, SyncClient
from kvshm.errors import InvalidRequest
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.listing import Listing
from kvshm.integrations.vllm.read_wait import ReadWait
from kvshm.integrations.vllm.records import SchedulerCounters, StepMeta
from kvshm.integrations.vllm.refusals import Refusals
from kvshm.integrations.vllm.service import HookGuard, ServiceThread, guarded
from kvshm.integrations.vllm.side_lifecycle import SideLifecycle
from kvshm.integrations.vllm.start_wait import StartWait
from kvshm.integrations.vllm.tails import request_tail_hash
from kvshm.ipc.protocol import unpack_ids
from kvshm.offload.pd.manifest import remote_decode, remote_prefill
from kvshm.types import RequestView, ScheduledRequest, StepInput, StepPlan, no_new_blocks

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvshm.vllm")

class SchedulerSide:
    """See the module docstring. ``meta_cls`` builds the step metadata (vLLM's
    ``KVConnectorMetadata`` subclass of :class:`StepMeta`)."""

    def __init__(self, cfg: ConnectorConfig,
                 meta_cls: Callable[..., StepMeta] = StepMeta) -> None:
        self.cfg = cfg
        self._meta_cls = meta_cls
        self._requests: dict[str, Any] = {}
        self._announced: set[str] = set()
        self._load_failed: set[str] = set()
        self._no_new = no_new_blocks(len(cfg.groups))
        self._step = 0
        self._resetting = False  # a reset_cache returned False: the next one polls it
        # synchronous loads accepted in phase B since the last build -> the blocks vLLM
        # expects them to fill
        self._sync_now: dict[str, tuple[int, ...]] = {}
        # the requests of the last step's synchronous loads: one that ends takes its
        # load's outcome first (the copy ran before the forward; its Done is waiting)
        self._sync_last: frozenset[str] = frozenset()
        # request -> the local (vLLM prefix cache) hit its last positive lookup was given:
        # where the blocks kvshm's load fills start (vLLM calls update_state_after_alloc
        # before it sets the request's num_computed_tokens, which reads 0 there)
        self._local_hit: dict[str, int] = {}
        self.counters = SchedulerCounters()
        self._refusals = Refusals(self.counters)
        # a lookup's bounded wait for its disk read or remote answer
        self._reads = ReadWait(disk=bool(cfg.disk_path), block_size=cfg.block_size,
                               live=self._requests, counters=self.counters,
                               remote=cfg.remote_url is not None)
        # the first lookups ask again while the ranks connect, if a lower tier may hit
        self._start: StartWait | None = (StartWait() if cfg.disk_path or cfg.remote_url
                                         else None)
        self._lister = Listing(cfg, self._requests, self._announced, self.counters,
                               self._no_new)
        self.guard = HookGuard()
        self.life = SideLifecycle(cfg, self.guard, self.counters, self._requests,
                                  self._absorb)

    # -- lifecycle (self.life) -------------------------------------------------------------
    @property
    def client(self) -> SyncClient:
        """The kvshm client (StateError before ``bind``)."""
        return self.life.client

    @property
    def bound(self) -> bool:
        """True once ``bind`` created the client."""
        return self.life.bound_client is not None

    @property
    def service_thread(self) -> ServiceThread | None:
        """The idle-time service thread (None before ``bind``)."""
        return self.life.service_thread

    def bind(self, gpu_block_pool: Any) -> None:
        """``bind_gpu_block_pool``: create the client, start the service thread."""
        self.life.bind(gpu_block_pool)

    def report(self) -> dict[str, Any] | None:
        """``get_kv_connector_stats``: a statistics report when one is due."""
        return self.life.report()

    def mark_shipped(self) -> None:
        """vLLM shipped a report to its front end: the front end logs the final line."""
        self.life.mark_shipped()

    def shutdown(self) -> None:
        """Stop the service thread, drain, close, write ``stats_path`` (idempotent)."""
        self.life.shutdown()

    def statistics(self) -> dict[str, Any]:
        """The engine's statistics plus the connector's counters, JSON-able."""
        return self.life.statistics()

    # -- phase A / B ---------------------------------------------------------------------
    @guarded
    def on_new_request(self, request: Any) -> None:
        """Remember the live request (its hashes and counts grow in place)."""
        self._requests[request.request_id] = request

    @guarded
    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: see the module docstring."""
        rid = request.request_id
        self._requests[rid] = request
        counters = self.counters
        counters.lookups += 1
        if getattr(request, "skip_reading_prefix_cache", False):
            counters.lookups_skipped += 1  # vLLM answers 0 for it whatever kvshm says
            self._skipped(request)
            return 0, False
        if rid in self._load_failed:
            counters.lookups_after_failed_load += 1
            return 0, False
        if rid in self._refusals.ids:
            counters.lookups_after_refusal += 1
            return 0, False
        params = request.kv_transfer_params
        tail = (request_tail_hash(request, request.num_tokens, self.cfg.block_size)
                if remote_prefill(params) else None)
        view = RequestView(rid, request.block_hashes, request.num_tokens, params, tail)
        client = self.life.bound_client or self.client  # the property raises before bind
        start = self._start
        if start is not None:
            if start.asks_again(client.state, client.disk_warming):
                counters.lookups_before_ready += 1
                return None, False
            self._start = None
        try:
            hit = client.lookup(view, num_computed_tokens)
            if hit is None:  # a Done since the step's last pump may answer it: pump, ask again
                self._absorb(client.poll())
                hit = client.lookup(view, num_computed_tokens)
                if hit is not None:
                    counters.lookups_answered_after_pump += 1
                elif self._reads.may_wait(rid):
                    hit = self._reads.wait(client, view, num_computed_tokens, self._absorb)
        except InvalidRequest as exc:
            self._refusals.refuse(rid, exc)
            return 0, False
        if hit is None:
            counters.lookups_asked_again += 1
            self._reads.asked_again(rid)
            return None, False
        self._reads.answered(rid)
        if hit > 0:
            counters.lookup_hit_tokens += hit
            self._local_hit[rid] = num_computed_tokens
            log.debug("kvshm: request %s: %d token(s) from the CPU tier", rid, hit)
            if self._is_sync(params):
                counters.lookups_sync += 1
                return hit, False
            return hit, True
        return 0, False

    def _skipped(self, request: Any) -> None:
        """A lookup vLLM overrides with 0: a P/D decode request still reads its
        hand-off's manifest, so that its end collects it (``lookup_skipped``; called
        again at its end, a no-op for a read begun, which a request skipped before the
        engine was READY never had: its read then goes as an orphan)."""
        params = request.kv_transfer_params
        if not remote_prefill(params):
            return
        view = RequestView(request.request_id, request.block_hashes, request.num_tokens,
                           params, None)
        try:
            (self.life.bound_client or self.client).lookup_skipped(view)
        except InvalidRequest as exc:
            self._refusals.refuse(request.request_id, exc)

    def _is_sync(self, params: Any) -> bool:
        """A hit of this request is answered as a synchronous load (the module
        docstring): ``cfg.sync_loads`` and not a P/D hand-off."""
        return self.cfg.sync_loads and not remote_prefill(params)

    @guarded
    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """``update_state_after_alloc``: the request's whole per-group tables."""
        rid = request.request_id
        if num_external_tokens and self._is_sync(request.kv_transfer_params):
            self._sync_now[rid] = self._expected_dsts(request, block_ids, num_external_tokens)
        try:
            client = self.life.bound_client or self.client
            client.allocated(rid, block_ids, num_external_tokens)
        except InvalidRequest as exc:
            self._refusals.refuse(rid, exc)
            self.client.allocated(rid, self._no_new, 0)  # releases the lookup's pin
            if num_external_tokens:  # vLLM waits for those tokens: fail the load instead
                self._refusals.refuse_load(rid, self._expected_dsts(
                    request, block_ids, num_external_tokens))

    def _expected_dsts(self, request: Any, block_ids: Sequence[Sequence[int]],
                       n_ext: int) -> tuple[int, ...]:
        """The GPU blocks vLLM expects a refused load to fill (it recomputes them):
        after the local hit the lookup was given (not ``request.num_computed_tokens``:
        still 0 when vLLM allocates, so the local hit's own blocks -- maybe shared with
        a running request -- would be reported, and the unloaded ones counted computed),
        ``cdiv(n_ext, block_size)`` per group, ints only."""
        bs = self.cfg.block_size
        local = self._local_hit.get(request.request_id)
        if local is None:
            local = int(getattr(request, "num_computed_tokens", 0))
        start = local // bs
        end = start + -(-n_ext // bs)
        out = [b for t in block_ids for b in list(t)[start:end]
               if isinstance(b, int) and not isinstance(b, bool) and b >= 0]
        return tuple(dict.fromkeys(out))

    # -- the step ------------------------------------------------------------------------
    @guarded
    def build(self, so: Any) -> StepMeta:
        """``build_connector_meta``: plan this step; never blocks."""
        client = self.client
        self._absorb(client.poll())
        self._step += 1
        self.counters.steps += 1
        requests, refused = self._requests, self._refusals.ids
        for rid in getattr(so, "finished_req_ids", ()) or ():
            if rid in requests or rid in refused:  # else ``finished`` forgot it already
                self._forget(rid)
        if client.state is EngineState.READY:
            reqs, alloc = self._listing(so)
        else:  # nothing is planned; the listing lets go of what it kept for the next
            self._lister.skip()
            reqs, alloc = [], set()
        plan = self._plan(reqs, alloc)
        load_dsts: dict[int, tuple[int, ...]] = {}
        if plan.load is not None:
            load_dsts[plan.load.job_id] = tuple(unpack_ids(plan.load.dst_ids))
        failed = dict(plan.failed_loads)
        refused_loads = self._refusals.take_loads()
        if refused_loads:
            failed.update(refused_loads)
        sync: tuple[str, ...] = ()
        if self._sync_now:
            sync = self._sync_reqs(plan, failed)
            self._sync_last = frozenset(sync)
        elif self._sync_last:
            self._sync_last = frozenset()
        return self._meta_cls(self._step, dict(plan.load_jobs), load_dsts, failed,
                              tuple(plan.flush), sync)

    def _sync_reqs(self, plan: StepPlan, failed: dict[str, tuple[int, ...]]
                   ) -> tuple[str, ...]:
        """This step's synchronous loads (``StepMeta.sync_reqs``). vLLM computes them in
        this step's forward, so each must be in this step's load job or in ``failed``
        (vLLM then recomputes its blocks): one that is in neither (the manager planned
        no load: a failed engine) is failed here with the blocks vLLM expects
        (counted ``sync_loads_unplanned``), never left for the forward to read."""
        planned = set(plan.load_jobs.get(plan.load.job_id, ())) if plan.load else set()
        out = tuple(self._sync_now)
        for rid, dsts in self._sync_now.items():
            if rid not in planned and rid not in failed:
                self.counters.sync_loads_unplanned += 1
                failed[rid] = dsts
        self._sync_now.clear()
        return out

    def _plan(self, reqs: list[ScheduledRequest], alloc: set[int]) -> StepPlan:
        """``SyncClient.step`` over the listing without the refused requests; a listing
        refused for one request is retried with that request listed as preempted instead
        (a step refused as a whole raises).

        Why preempted: a refused request is left out of every later listing, its
        preemption's too, so the manager would go on walking its last table -- a walk
        that had stalled (the CPU tier full) then stores blocks vLLM has since given to
        other requests, under this request's hashes. A preemption listing forgets the
        table and stops its stores; a load the request waits for is left as it was (its
        outcome still reaches vLLM), and ``finished`` forgets the rest."""
        refused = self._refusals.ids
        if refused:
            reqs = [r for r in reqs if r.req_id not in refused]
        while True:
            try:
                # build's poll pumped the client a moment ago: no second pump
                return self.client.step(StepInput(self._step, reqs, (), alloc),
                                        service=False)
            except InvalidRequest as exc:
                rid = exc.req_id
                if rid is None or rid in refused:
                    raise
                self._refusals.refuse(rid, exc)
                reqs = [r for r in reqs if r.req_id != rid]
                reqs.append(ScheduledRequest(rid, (), 0, self._no_new, preempted=True))

    def _listing(self, so: Any) -> tuple[list[ScheduledRequest], set[int]]:
        """This step's requests and sliding-window allocations
        (:class:`~kvshm.integrations.vllm.listing.Listing`)."""
        return self._lister.build(so)

    # -- completions, finish, reset ------------------------------------------------------
    @guarded
    def update_output(self) -> None:
        """``update_connector_output``: collect the client's load results (the done
        rings only: the step's ``build`` and the service thread read the rendezvous)."""
        self._absorb(self.client.poll(rendezvous=False))

    def _absorb(self, results: Sequence[Any]) -> None:
        for res in results:
            if res.ok:
                self.counters.loads_ok += 1
                self.counters.loaded_tokens += res.num_tokens
            else:
                self.counters.loads_failed += 1
                if res.req_id in self._requests:
                    self._load_failed.add(res.req_id)
                first = self.counters.loads_failed == 1
                log.log(logging.WARNING if first else logging.DEBUG,
                        "kvshm: load for %s failed (%s); vLLM recomputes %d block(s)%s",
                        res.req_id, res.cause.value if res.cause else "?",
                        len(res.failed_block_ids),
                        " (further failed loads: DEBUG lines, counted in "
                        "connector.loads_failed)" if first else "")

    @guarded
    def finished(self, request: Any, block_ids: Sequence[Sequence[int]]
                 ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished_all_groups``: final confirmed count and tables. Never
        delays the free (pins keep the blocks); a P/D prefill request
        (``do_remote_decode``) on an engine with a remote tier returns its hand-off's
        ``kv_transfer_params`` (the manifest), which vLLM puts on the request's output
        for the proxy to pass to the decode engine."""
        rid = request.request_id
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        client = self.life.bound_client or self.client
        if rid in self._refusals.ids:  # it goes without offload: forgotten, nothing stored
            client.finished(rid, 0, self._no_new)
            self._forget(rid)
            if self.cfg.remote_url is not None:  # an empty hand-off's params: collected
                client.transfer_params(rid)  # (else kept until newer ones push them out)
            return False, None
        if getattr(request, "skip_reading_prefix_cache", False):
            self._skipped(request)  # one skipped while the engine started reads it now
        if rid in self._sync_last:
            # its synchronous load was copied before the forward that ended it: take the
            # outcome now (counted ok), or the end supersedes the load and it is counted
            # as never reported (an observability probe: loads_ok 0 for 2 used loads)
            self._absorb(client.poll(rendezvous=False))
        try:
            params = request.kv_transfer_params
            tail = (request_tail_hash(request, confirmed, self.cfg.block_size)
                    if remote_decode(params) else None)
            client.finished(rid, confirmed, block_ids, tail_hash=tail)
        except InvalidRequest as exc:
            self._refusals.refuse(rid, exc)
            self.client.finished(rid, 0, self._no_new)  # forgets it, stores nothing
        self._forget(rid)
        if self.cfg.remote_url is None:  # no remote tier: no hand-off, nothing to ask
            return False, None
        return False, client.transfer_params(rid)

    def _forget(self, rid: str) -> None:
        """Drop every trace of ``rid``. Invariant (``build`` skips a finished id that
        is in neither ``_requests`` nor the refusals): the announced, load-failed and
        next-look entries exist only for a request in ``_requests`` (the listing, the
        lookup and ``_absorb`` add them only for a known request); an unknown id left in
        the listing's mirror only makes the next listing take its walk (exact)."""
        self._lister.forget(rid)
        self._reads.forget(rid)
        self._sync_now.pop(rid, None)
        self._local_hit.pop(rid, None)
        self._requests.pop(rid, None)
        self._announced.discard(rid)
        self._load_failed.discard(rid)
        self._refusals.forget(rid)

    @guarded
    def has_pending_work(self) -> bool:
        """``has_pending_push_work``: jobs not yet acked by every rank."""
        client = self.life.bound_client
        if client is None or self.life.closed:
            return False
        return client.has_pending_work()

    @guarded
    def reset(self) -> bool:
        """``reset_cache``: drop the CPU index; False while the transfers it abandoned are
        in flight. A call while the last reset still drains polls it (``reset_done``)
        instead of starting another: vLLM's callers retry ``reset_prefix_cache`` until
        True, and under traffic each retry, a new reset, abandoned the stores planned
        since the last one ended and might never see the end. (Nothing is planned while
        a reset drains, so no block cached since the first call is missed.)"""
        client = self.client
        done = client.reset_done() if self._resetting else client.reset()
        self._resetting = not done
        return done

