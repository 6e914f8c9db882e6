"""The lockstep rig of :mod:`tools.bench_vs_vllm`: one vLLM ``KVCacheManager`` and both
contenders' scheduler sides over its ``BlockPool``.

* vLLM: ``SimpleCPUOffloadScheduler`` (eager), built over a stand-in ``VllmConfig`` that
  carries only the fields its constructor reads; its worker is simulated
  (:meth:`Rig.complete_vllm`: every store and load event of a step is reported done
  by the one rank in the next ``update_connector_output``).
* kvshm: :class:`~kvshm.integrations.vllm.scheduler.SchedulerSide` bound to the same
  pool (a real ``SyncClient``, EAGER mode, same CPU capacity), with one embedded
  ``Worker`` over a small KV region in this process (:meth:`Rig.complete_kvshm` runs its
  step and waits for its Dones: untimed).

Every hook of a contender is called through :meth:`Rig.timed`, which adds its wall time
to that contender's clock for the current step, per hook (``update_output``,
``finished``, ``lookup`` -- kvshm's ``on_new_request`` included --, ``allocated``,
``build``). Request arrivals and growth go through the ``KVCacheManager`` exactly once,
between the two contenders' hooks.

kvshm's service thread (:mod:`kvshm.integrations.vllm.service`: it pumps the client
after 20 ms without a hook) runs during the step's untimed work (the harness, the
worker): its CPU time is charged to kvshm, as the hook ``service``, read from the
thread's own CPU clock (``pthread_getcpuclockid``) at every :meth:`Rig.take_clock`. It
never runs inside a timed hook: :meth:`Rig.timed` holds the side's hook lock around
either contender's hook (taken before the clock starts), so the thread, which only
tries the lock, skips rather than stealing the GIL from a timed vLLM hook, and a kvshm
hook never waits for a pump on its own clock.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace as NS
from typing import Any, TypeVar

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler
from vllm.v1.simple_kv_offload.metadata import SimpleCPUOffloadWorkerMetadata

from kvshm.engine import EngineState
from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.types import KVGroup, StoreMode
from workers.worker import Worker

__all__ = ["BS", "HOOKS", "Rig", "SameWorkError"]

BS = 16  # tokens per block (both contenders and vLLM's pool)
ROW = 64  # bytes of one block in the kvshm worker's KV region (copies are not timed)
PAGE = 2 * 1 * 8 * 2  # K+V x 1 head x head size 8 x fp16: the spec's page bytes
T = TypeVar("T")
_names = itertools.count()
#: The per-hook clocks of a step, both contenders (``service``: kvshm's thread only)
HOOKS = ("update_output", "finished", "lookup", "allocated", "build", "service")


class SameWorkError(AssertionError):
    """The contenders did different work on the same trace."""


def _spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)


def _vllm_config(max_model_len: int) -> Any:
    """The fields ``SimpleCPUOffloadScheduler.__init__`` reads, nothing else."""
    return NS(kv_events_config=None,
              parallel_config=NS(decode_context_parallel_size=1, world_size=1),
              model_config=NS(max_model_len=max_model_len), max_in_flight_tokens=None,
              speculative_config=None, scheduler_config=NS(max_num_batched_tokens=8192),
              num_prefill_lookahead_tokens=0)


class Rig:
    """See the module docstring. ``gpu_blocks`` / ``cpu_blocks``: usable blocks of the
    GPU pool and of each contender's CPU tier. ``clock``: what a hook is timed with
    (wall time by default; ``time.thread_time`` counts only this thread's CPU time, which
    other work on a loaded machine does not inflate)."""

    def __init__(self, gpu_blocks: int, cpu_blocks: int, max_model_len: int = 4096,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BS, sha256)
        n = gpu_blocks + 1  # vLLM's null block
        kcc = KVCacheConfig(num_blocks=n,
                            kv_cache_tensors=[KVCacheTensor(size=n * PAGE, layers=["l0"],
                                                            layer_stride=n * PAGE,
                                                            block_stride=PAGE)],
                            kv_cache_groups=[KVCacheGroupSpec(["l0"], _spec())])
        self.kvm = KVCacheManager(kcc, max_model_len=max_model_len, scheduler_block_size=BS,
                                  hash_block_size=BS)
        self.pool = self.kvm.block_pool
        # vLLM's CPU pool has a null block too: cpu_blocks + 1 pages give cpu_blocks usable
        self.vllm = SimpleCPUOffloadScheduler(_vllm_config(max_model_len), kcc,
                                              (cpu_blocks + 1) * PAGE, BS, BS)
        self.vllm.bind_gpu_block_pool(self.pool)
        assert self.vllm.cpu_block_pool.get_num_free_blocks() == cpu_blocks
        name = f"vsvllm-{os.getpid()}-{next(_names)}"
        cfg = ConnectorConfig(name, 1, 1, BS, (KVGroup.full(),), StoreMode.EAGER, None,
                              cpu_blocks, None, 30.0, 5.0, 0)
        self.side = SchedulerSide(cfg)
        self.side.bind(self.pool)
        # spin_us=0: the rank shares this process (and its GIL) with the timed hooks
        self.worker = Worker.attach(name, 0, 1, [torch.zeros((n, ROW), dtype=torch.uint8)],
                                    spin_us=0.0)
        deadline = time.monotonic() + 30
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the kvshm worker did not connect in 30 s")
            self.worker.service()
            self.side.update_output()
            time.sleep(0.001)
        self._lock = self.side.guard.lock
        self._now = clock
        self._service_clock = _thread_clock(f"kvshm-service-{name}")
        self._service_last = 0.0
        self._service_cpu = self._service_time()
        self.clock = _zero_clock()
        self.work = {c: {"stored": 0, "loaded": 0, "hit_tokens": 0} for c in self.clock}
        self._vllm_out = KVConnectorOutput()
        self._kvshm_step = 0

    def close(self) -> None:
        self.side.shutdown()
        self.worker.close()

    # ---- timing ---------------------------------------------------------------------
    def timed(self, who: str, hook: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on ``who``'s clock for ``hook``, the side's hook lock held
        around it (taken before the clock starts: see the module docstring)."""
        now = self._now
        with self._lock:
            t = now()
            out = fn(*args)
            dt = now() - t
        self.clock[who][hook] += dt
        return out

    def _service_time(self) -> float:
        """The service thread's CPU seconds so far (the last reading once it ended)."""
        if self._service_clock is not None:
            try:
                self._service_last = time.clock_gettime(self._service_clock)
            except OSError:  # the thread ended (shutdown): its clock went with it
                self._service_clock = None
        return self._service_last

    def take_clock(self) -> dict[str, dict[str, float]]:
        """The step's clocks (contender -> hook -> seconds), kvshm's service thread's
        CPU time since the last call charged as its ``service``; the clocks restart."""
        now = self._service_time()
        out, self.clock = self.clock, _zero_clock()
        out["kvshm"]["service"] += now - self._service_cpu
        self._service_cpu = now
        return out

    def service_pumps(self) -> int:
        """Pumps kvshm's service thread made so far."""
        svc = self.side.service_thread
        return 0 if svc is None else svc.pumps

    # ---- requests -------------------------------------------------------------------
    def request(self, rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=1 << 20), None,
                       block_hasher=self.hasher)

    def lookup(self, r: Request, order: tuple[str, ...]) -> tuple[int, int]:
        """The local hit, then the contenders' lookups; the CPU hit (the same for all)."""
        blocks, local, _ = self.kvm.get_computed_blocks(r)
        hits: dict[str, int] = {}
        for who in order:
            if who == "kvshm":
                self.timed(who, "lookup", self.side.on_new_request, r)
                hit, _ = self.timed(who, "lookup", self.side.lookup, r, local)
            else:
                hit, _ = self.timed(who, "lookup", self.vllm.get_num_new_matched_tokens, r,
                                    local)
            hits[who] = hit or 0
        if len(set(hits.values())) != 1:
            raise SameWorkError(f"request {r.request_id}: CPU hits {hits} (local hit "
                                f"{local})")
        for who in order:
            self.work[who]["hit_tokens"] += hits[who]
        self._computed = blocks
        return local, hits[order[0]]

    def admit(self, r: Request, local: int, ext: int, order: tuple[str, ...]) -> None:
        """Allocate after :meth:`lookup` and tell both (phase B). With ``ext`` the request
        waits for its load (``num_computed_tokens`` = local + ext)."""
        n_new = 0 if ext else r.num_tokens - local
        got = self.kvm.allocate_slots(r, n_new, local, self._computed,
                                      num_external_computed_tokens=ext,
                                      delay_cache_blocks=bool(ext))
        assert got is not None, "GPU pool exhausted"
        blocks = self.kvm.get_blocks(r.request_id)
        for who in order:
            if who == "kvshm":
                # KvshmConnector.update_state_after_alloc's body, as vLLM calls it
                self.timed(who, "allocated",
                           lambda: self.side.allocated(r, blocks.get_block_ids(), ext))
            else:
                self.timed(who, "allocated", self.vllm.update_state_after_alloc, r, blocks,
                           ext)
        r.num_computed_tokens = local + ext

    def finish(self, r: Request, order: tuple[str, ...]) -> None:
        ids = self.kvm.get_block_ids(r.request_id)
        for who in order:
            if who == "kvshm":
                self.timed(who, "finished", self.side.finished, r, ids)
            else:
                self.timed(who, "finished", self.vllm.request_finished_all_groups, r, ids)
        self.kvm.free(r)

    # ---- the step -------------------------------------------------------------------
    @staticmethod
    def output(new: list[NewRequestData], cached: list[tuple[Request, Any]],
               finished: set[str], scheduled: dict[str, int]) -> SchedulerOutput:
        """A SchedulerOutput: ``new`` requests, ``cached`` (request, new block ids or None)
        and the token counts scheduled."""
        cd = CachedRequestData(
            req_ids=[r.request_id for r, _ in cached], resumed_req_ids=set(),
            new_token_ids=[[] for _ in cached], all_token_ids={},
            new_block_ids=[nb for _, nb in cached],
            num_computed_tokens=[r.num_computed_tokens for r, _ in cached],
            num_output_tokens=[r.num_output_tokens for r, _ in cached])
        return SchedulerOutput(scheduled_new_reqs=new, scheduled_cached_reqs=cd,
                               num_scheduled_tokens=scheduled,
                               total_num_scheduled_tokens=sum(scheduled.values()),
                               scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                               finished_req_ids=finished, free_encoder_mm_hashes=[],
                               preempted_req_ids=set())

    def build(self, so: SchedulerOutput, order: tuple[str, ...]) -> set[str]:
        """Both ``build_connector_meta``; runs both workers; returns the requests whose
        loads finished (both agree, else SameWorkError)."""
        metas: dict[str, Any] = {}
        for who in order:
            if who == "kvshm":
                metas[who] = self.timed(who, "build", self.side.build, so)
            else:
                metas[who] = self.timed(who, "build", self.vllm.build_connector_meta, so)
        loaded: dict[str, set[str]] = {}
        vm = metas.get("vllm")
        if vm is not None:
            self.work["vllm"]["stored"] += len(vm.store_gpu_blocks)
            self.work["vllm"]["loaded"] += len(vm.load_gpu_blocks)
            loaded["vllm"] = (set(vm.load_event_to_reqs.get(vm.load_event, ()))
                              if vm.load_event >= 0 else set())
            events = {vm.store_event: 1} if vm.store_event >= 0 else {}
            self._vllm_out = KVConnectorOutput(
                finished_recving=loaded["vllm"],
                kv_connector_worker_meta=SimpleCPUOffloadWorkerMetadata(events))
        if "kvshm" in metas:
            loaded["kvshm"] = self._run_worker(metas["kvshm"])
        if len({frozenset(v) for v in loaded.values()}) != 1:
            raise SameWorkError(f"loads finished this step: {loaded}")
        return loaded[order[0]]

    def _run_worker(self, meta: Any) -> set[str]:
        """The kvshm rank's step (untimed): submit, then wait until every Done is on
        the ring (the scheduler reads them in the next hook, as in vLLM)."""
        w = self.worker
        w.service()
        for step in w.queued_steps():
            w.begin_step(step)
            w.submit_loads(step)
            w.submit_stores(step)
        loaded: set[str] = set()
        deadline = time.monotonic() + 30
        while True:
            for done in w.poll():
                loaded.update(meta.load_jobs.get(done.job_id, ()))
            if not (len(w._queue) or w._dones.inflight or w._dones.outbox):
                time.sleep(0.001)  # let the copy thread park before the next timed hook
                return loaded
            if time.monotonic() > deadline:
                raise RuntimeError("the kvshm worker did not finish a step in 30 s")
            time.sleep(0.0001)

    def _ready(self) -> bool:
        with self.side.guard:
            return self.side.client.state is EngineState.READY

    def complete(self, order: tuple[str, ...]) -> None:
        """Both ``update_connector_output`` (the previous step's completions)."""
        for who in order:
            if who == "kvshm":
                self.timed(who, "update_output", self.side.update_output)
            else:
                self.timed(who, "update_output", self.vllm.update_connector_output,
                           self._vllm_out)
        self._vllm_out = KVConnectorOutput()

    def kvshm_totals(self) -> None:
        """kvshm's stored / loaded blocks from its engine's counters."""
        with self.side.guard:
            m = self.side.client._core.manager
        assert m is not None
        c = m.counters
        self.work["kvshm"]["stored"] = c.stores_planned_blocks
        self.work["kvshm"]["loaded"] = c.loaded_blocks


def _zero_clock() -> dict[str, dict[str, float]]:
    return {who: dict.fromkeys(HOOKS, 0.0) for who in ("kvshm", "vllm")}


def _thread_clock(name: str) -> int | None:
    """The CPU clock id of the live thread called ``name`` (None: no such thread)."""
    for t in threading.enumerate():
        if t.name == name and t.ident is not None:
            return time.pthread_getcpuclockid(t.ident)
    return None
