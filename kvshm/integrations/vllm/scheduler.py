"""Scheduler side of kvshm's vLLM connector (vLLM's engine-core process, its thread).

Duck-typed over vLLM's ``Request``, ``KVCacheBlocks`` and ``SchedulerOutput`` (no vLLM
import), around a kvshm :class:`~kvshm.engine.SyncClient`, which is created in
:meth:`SchedulerSide.bind` (vLLM's ``bind_gpu_block_pool``) over vLLM's pool wrapped as
``GpuBlocks``. Hook by hook:

* ``get_num_new_matched_tokens`` -> :meth:`lookup`: ``(hit, True)`` for a hit (an
  async load), ``(0, False)`` on a miss or when the request skips reading the prefix
  cache (vLLM asserts a positive count for async loads), ``(None, False)`` to be asked
  again (another request is loading part of this prefix right now).
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
that started before the workers connected are still stored.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshm.config import EngineConfig
from kvshm.engine import EngineState, SyncClient
from kvshm.engine.lifecycle import LIVE
from kvshm.errors import ConfigError, InvalidRequest, StateError
from kvshm.integrations.vllm.blocks import VllmGpuBlocks
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.ipc.protocol import unpack_ids
from kvshm.types import (
    GroupKind,
    RequestView,
    ScheduledRequest,
    StepInput,
    StepPlan,
    no_new_blocks,
)

__all__ = ["SchedulerCounters", "SchedulerSide", "StepMeta"]

log = logging.getLogger("kvshm.vllm")

Tables = tuple[tuple[int, ...], ...]


@dataclass
class StepMeta:
    """What one step tells every worker rank (pickled to worker processes).

    ``load_jobs``: every load job not yet acked by every rank -> its request ids (a rank
    reports them finished when it sees the job's ``Done``, ok or not). ``load_dsts``:
    load jobs planned this step -> their destination GPU block ids (a rank that sees
    such a job fail reports these as load errors). ``failed_loads``: loads that failed
    on the scheduler side and reach no worker -> destination ids (every rank reports
    them in the step it receives them). ``flush``: job ids to finish before compute.
    """

    step: int
    load_jobs: dict[int, tuple[str, ...]] = field(default_factory=dict)
    load_dsts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    failed_loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    flush: tuple[int, ...] = ()


@dataclass
class SchedulerCounters:
    """The connector's own counters (the engine keeps its own); monotonic."""

    lookups: int = 0
    lookups_skipped: int = 0  # skip_reading_prefix_cache (e.g. prompt logprobs)
    lookups_asked_again: int = 0
    lookup_hit_tokens: int = 0
    loads_ok: int = 0
    loaded_tokens: int = 0  # tokens of successful loads (a hit offered again is not counted)
    loads_failed: int = 0
    requests_announced_late: int = 0
    requests_preempted: int = 0
    requests_resumed: int = 0
    requests_unknown: int = 0
    lookups_after_failed_load: int = 0  # answered 0: that request recomputes instead
    requests_refused: int = 0  # calls kvshm refused (InvalidRequest): that request goes without
    steps: int = 0


def _tables(block_ids: Sequence[Sequence[int]]) -> Tables:
    return tuple(tuple(g) for g in block_ids)


class SchedulerSide:
    """See the module docstring. ``meta_cls`` builds the step metadata (vLLM's
    ``KVConnectorMetadata`` subclass of :class:`StepMeta`)."""

    def __init__(self, cfg: ConnectorConfig,
                 meta_cls: Callable[..., StepMeta] = StepMeta) -> None:
        self.cfg = cfg
        self._meta_cls = meta_cls
        self._client: SyncClient | None = None
        self._requests: dict[str, Any] = {}
        self._announced: set[str] = set()
        self._load_failed: set[str] = set()
        self._refused: set[str] = set()
        self._logged: set[tuple[str, str]] = set()
        self._no_new = no_new_blocks(len(cfg.groups))
        # loads vLLM expects but kvshm refused in phase B -> destinations to recompute
        self._refused_loads: dict[str, tuple[int, ...]] = {}
        self._sw = any(g.kind is GroupKind.SLIDING_WINDOW for g in cfg.groups)
        self._step = 0
        self._closed = False
        self.counters = SchedulerCounters()

    # -- lifecycle -----------------------------------------------------------------------
    @property
    def client(self) -> SyncClient:
        """The kvshm client (StateError before ``bind``)."""
        if self._client is None:
            raise StateError("kvshm's scheduler side has no GPU block pool bound yet")
        return self._client

    def bind(self, gpu_block_pool: Any) -> None:
        """Create the client around vLLM's pool (once; vLLM's ``bind_gpu_block_pool``)."""
        if self._client is not None:
            raise StateError("bind_gpu_block_pool called twice")
        c = self.cfg
        hash_bs = getattr(gpu_block_pool, "hash_block_size", c.block_size)
        if hash_bs != c.block_size:
            raise ConfigError(f"vLLM's block pool hashes blocks of {hash_bs} tokens, kvshm "
                              f"needs the block size ({c.block_size})")
        if not getattr(gpu_block_pool, "enable_caching", True):
            raise ConfigError("vLLM's block pool has prefix caching off; kvshm needs it")
        econf = EngineConfig(block_size=c.block_size, name=c.name, tp=c.tp, pp=c.pp,
                             groups=c.groups, mode=c.mode, num_cpu_blocks=c.num_cpu_blocks,
                             cpu_bytes_per_rank=c.cpu_bytes_per_rank,
                             hang_timeout_s=c.hang_timeout_s)
        self._client = SyncClient(econf, gpu_blocks=VllmGpuBlocks(gpu_block_pool))
        log.info("kvshm: scheduler side listening as %r for %d rank(s), %s mode",
                 c.name, c.world_size, c.mode.value)

    def shutdown(self) -> None:
        """Let jobs in flight finish (up to ``shutdown_timeout_s``), write the final
        statistics to ``stats_path``, close the client (idempotent)."""
        if self._closed or self._client is None:
            self._closed = True
            return
        self._closed = True
        client = self._client
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while time.monotonic() < deadline and client.state is EngineState.READY:
            client.poll()
            if not client.has_pending_work():
                break
            time.sleep(0.002)
        self._absorb(client.poll() if client.state in LIVE else [])
        client.close()
        stats = self.statistics()
        if self.cfg.stats_path:
            _write_json(self.cfg.stats_path, stats)
        log.info("kvshm: scheduler side closed (%s)", stats.get("state"))

    def statistics(self) -> dict[str, Any]:
        """The engine's statistics plus the connector's counters, JSON-able."""
        out = self.client.statistics().as_dict()
        out["connector"] = dict(vars(self.counters))
        return out

    # -- phase A / B ---------------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        """Remember the live request (its hashes and counts grow in place)."""
        self._requests[request.request_id] = request

    def lookup(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: see the module docstring."""
        self._requests[request.request_id] = request
        self.counters.lookups += 1
        if getattr(request, "skip_reading_prefix_cache", False):
            self.counters.lookups_skipped += 1
            return 0, False
        if request.request_id in self._load_failed:
            self.counters.lookups_after_failed_load += 1
            return 0, False
        if request.request_id in self._refused:
            return 0, False
        view = RequestView(request.request_id, request.block_hashes, request.num_tokens,
                           request.kv_transfer_params)
        try:
            hit = self.client.lookup(view, num_computed_tokens)
        except InvalidRequest as exc:
            self._refuse(request.request_id, exc)
            return 0, False
        if hit is None:
            self.counters.lookups_asked_again += 1
            return None, False
        if hit > 0:
            self.counters.lookup_hit_tokens += hit
            return hit, True
        return 0, False

    def allocated(self, request: Any, block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """``update_state_after_alloc``: the request's whole per-group tables."""
        rid = request.request_id
        try:
            self.client.allocated(rid, block_ids, num_external_tokens)
        except InvalidRequest as exc:
            self._refuse(rid, exc)
            self.client.allocated(rid, self._no_new, 0)  # releases the lookup's pin
            if num_external_tokens:  # vLLM waits for those tokens: fail the load instead
                self._refused_loads[rid] = self._expected_dsts(
                    request, block_ids, num_external_tokens)

    def _expected_dsts(self, request: Any, block_ids: Sequence[Sequence[int]],
                       n_ext: int) -> tuple[int, ...]:
        """The GPU blocks vLLM expects a refused load to fill (it recomputes them):
        after the local hit, ``cdiv(n_ext, block_size)`` per group, ints only."""
        bs = self.cfg.block_size
        start = int(getattr(request, "num_computed_tokens", 0)) // bs
        end = start + -(-n_ext // bs)
        out = [b for t in block_ids for b in list(t)[start:end]
               if isinstance(b, int) and not isinstance(b, bool) and b >= 0]
        return tuple(dict.fromkeys(out))

    def _refuse(self, rid: str, exc: InvalidRequest) -> None:
        """kvshm refused a call for ``rid``: count it, log it once per kind, and leave
        the request out of offload from now on (see the module docstring)."""
        self.counters.requests_refused += 1
        self._refused.add(rid)
        kind = (exc.call, exc.field.split("[", 1)[0])
        if kind not in self._logged:
            self._logged.add(kind)
            log.error("kvshm refused %s for request %s (%s); that request goes without "
                      "offload (further refusals of this kind are only counted)",
                      exc.call, rid, exc)

    # -- the step ------------------------------------------------------------------------
    def build(self, so: Any) -> StepMeta:
        """``build_connector_meta``: plan this step; never blocks."""
        client = self.client
        self._absorb(client.poll())
        self._step += 1
        self.counters.steps += 1
        for rid in getattr(so, "finished_req_ids", ()) or ():
            self._forget(rid)
        ready = client.state is EngineState.READY
        reqs, alloc = self._listing(so) if ready else ([], set())
        plan = self._plan(reqs, alloc)
        load_dsts: dict[int, tuple[int, ...]] = {}
        if plan.load is not None:
            load_dsts[plan.load.job_id] = tuple(unpack_ids(plan.load.dst_ids))
        failed = dict(plan.failed_loads)
        if self._refused_loads:
            failed.update(self._refused_loads)
            self._refused_loads.clear()
        return self._meta_cls(self._step, dict(plan.load_jobs), load_dsts, failed,
                              tuple(plan.flush))

    def _plan(self, reqs: list[ScheduledRequest], alloc: set[int]) -> StepPlan:
        """``SyncClient.step`` over the listing without the refused requests; a listing
        refused for one request is retried without it (a step refused as a whole
        raises)."""
        refused = self._refused
        if refused:
            reqs = [r for r in reqs if r.req_id not in refused]
        while True:
            try:
                return self.client.step(StepInput(self._step, reqs, (), alloc))
            except InvalidRequest as exc:
                rid = exc.req_id
                if rid is None or rid in refused:
                    raise
                self._refuse(rid, exc)
                reqs = [r for r in reqs if r.req_id != rid]

    def _listing(self, so: Any) -> tuple[list[ScheduledRequest], set[int]]:
        """Every scheduled request (decode steps list every running one) and, with
        sliding-window groups, the GPU ids allocated this step.

        Runs once per step over every running request: an announced request that is not
        resumed (nearly all of them in decode) takes the inlined path - one set probe,
        one dict probe and one ScheduledRequest - and the set of listed ids is built
        only when the step preempted someone."""
        out: list[ScheduledRequest] = []
        alloc: set[int] = set()
        for nr in so.scheduled_new_reqs:
            self._add(out, nr.req_id, _tables(nr.block_ids), True, nr.num_computed_tokens,
                      alloc)
        cached = so.scheduled_cached_reqs
        self._list_cached(cached, out, alloc, getattr(so, "kv_connector_block_state", None))
        preempted = getattr(so, "preempted_req_ids", None)
        if preempted:
            listed = {nr.req_id for nr in so.scheduled_new_reqs}
            listed.update(cached.req_ids)
            for rid in preempted:
                if rid in self._announced and rid not in listed:
                    self.counters.requests_preempted += 1
                    self._add(out, rid, self._no_new, False, 0, alloc, preempted=True)
        return out, alloc

    def _list_cached(self, cached: Any, out: list[ScheduledRequest], alloc: set[int],
                     state: Any) -> None:
        resumed = cached.resumed_req_ids
        announced, get, no_new, sw = self._announced, self._requests.get, self._no_new, self._sw
        append, unknown = out.append, 0
        for rid, nb, computed in zip(cached.req_ids, cached.new_block_ids,
                                     cached.num_computed_tokens):
            if rid in announced and (nb is None or rid not in resumed):
                r = get(rid)
                if r is None:
                    unknown += 1
                    continue
                if nb is None:
                    table = no_new
                else:
                    table = _tables(nb)
                    if sw:
                        alloc.update(b for g in nb for b in g)
                append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, False,
                                        r.num_computed_tokens - r.num_output_placeholders,
                                        False, r.kv_transfer_params))
            elif rid in resumed and nb is not None:
                self.counters.requests_resumed += 1
                self._add(out, rid, _tables(nb), True, computed, alloc)
            else:  # listed before: never announced (the workers were not ready yet)
                full = state.get_block_ids(rid) if state is not None else None
                if full is None:
                    continue
                self.counters.requests_announced_late += 1
                self._add(out, rid, _tables(full), True, computed, alloc)
        self.counters.requests_unknown += unknown

    def _add(self, out: list[ScheduledRequest], rid: str, table: Tables, full: bool,
             num_computed: int, alloc: set[int], *, preempted: bool = False) -> None:
        r = self._requests.get(rid)
        if r is None:
            self.counters.requests_unknown += 1
            return
        self._announced.add(rid)
        if full and self._sw:
            first = num_computed // self.cfg.block_size
            alloc.update(b for g in table for b in g[first:])
        confirmed = r.num_computed_tokens - r.num_output_placeholders
        out.append(ScheduledRequest(rid, r.block_hashes, r.num_tokens, table, full,
                                    confirmed, preempted, r.kv_transfer_params))

    # -- completions, finish, reset ------------------------------------------------------
    def update_output(self) -> None:
        """``update_connector_output``: collect the client's load results."""
        self._absorb(self.client.poll())

    def _absorb(self, results: Sequence[Any]) -> None:
        for res in results:
            if res.ok:
                self.counters.loads_ok += 1
                self.counters.loaded_tokens += res.num_tokens
            else:
                self.counters.loads_failed += 1
                if res.req_id in self._requests:
                    self._load_failed.add(res.req_id)
                log.warning("kvshm: load for %s failed (%s); vLLM recomputes %d block(s)",
                            res.req_id, res.cause.value if res.cause else "?",
                            len(res.failed_block_ids))

    def finished(self, request: Any, block_ids: Sequence[Sequence[int]]) -> tuple[bool, None]:
        """``request_finished_all_groups``: final confirmed count and tables."""
        rid = request.request_id
        confirmed = request.num_computed_tokens - request.num_output_placeholders
        try:
            self.client.finished(rid, confirmed, block_ids)
        except InvalidRequest as exc:
            self._refuse(rid, exc)
            self.client.finished(rid, 0, self._no_new)  # forgets it, stores nothing
        self._forget(rid)
        return False, None

    def _forget(self, rid: str) -> None:
        self._requests.pop(rid, None)
        self._announced.discard(rid)
        self._load_failed.discard(rid)
        self._refused.discard(rid)

    def has_pending_work(self) -> bool:
        """``has_pending_push_work``: jobs not yet acked by every rank."""
        if self._client is None or self._closed:
            return False
        return self._client.has_pending_work()

    def reset(self) -> bool:
        """``reset_cache``: drop the CPU index; False while transfers are in flight."""
        return self.client.reset()


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (a temporary file renamed over it)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)
