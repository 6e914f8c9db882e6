"""``KvshmConnector``: kvshm as a vLLM v1 KV connector (imports vLLM; load it through
:mod:`kvshm.integrations.vllm`, which is importable without vLLM).

vLLM builds the class twice: role SCHEDULER in the engine-core process (a
:class:`~kvshm.integrations.vllm.scheduler.SchedulerSide`) and role WORKER in every worker
process (a :class:`~kvshm.integrations.vllm.worker.WorkerSide`). Both validate the
configuration in ``__init__`` (:func:`~kvshm.integrations.vllm.config.parse_config`), so
a bad setting fails vLLM's start-up with a :class:`~kvshm.errors.ConfigError`.

Statistics: the scheduler side reports kvshm's counters through vLLM's KV-connector
stats (``get_kv_connector_stats``, ``build_kv_connector_stats``) and registers
``kvshm_*`` Prometheus series (``build_prom_metrics``):
:mod:`~kvshm.integrations.vllm.metrics`. Logging: ``__init__`` routes the ``kvshm``
loggers through vLLM's handler (:mod:`~kvshm.integrations.vllm.logs`).

It declares ``SupportsHMA``: vLLM calls ``request_finished_all_groups`` with one table
per KV group (full and sliding-window groups of one block size are supported).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvshm.errors import StateError
from kvshm.integrations.vllm.config import (
    ConnectorConfig,
    GroupInfo,
    GroupKindName,
    adopt_failure_policy,
    check_budget,
    check_extra_config,
    parse_config,
    resolve_size,
    unshared_hashes,
)
from kvshm.integrations.vllm.logs import route_kvshm_logs
from kvshm.integrations.vllm.metrics import (
    KvshmConnectorStats,
    KvshmPromMetrics,
    StatsReporter,
)
from kvshm.integrations.vllm.records import StepMeta
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.integrations.vllm.worker import WorkerSide
from kvshm.shm_budget import available_shm_bytes, memory_available_bytes

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvshmConnector", "KvshmMetadata", "connector_config"]

log = logging.getLogger("kvshm.vllm")

# Spec classes that are full attention for kvshm: KV for every token, kept in place.
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_SLIDING_SPECS = ("SlidingWindowSpec",)


class KvshmMetadata(StepMeta, KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's metadata for every worker rank (fields: :class:`StepMeta`)."""


def _group_info(spec: Any) -> GroupInfo:
    name = type(spec).__name__
    bs = int(spec.block_size)
    if isinstance(spec, MambaSpec):
        return GroupInfo(GroupKindName.RECURRENT, bs, None, name)
    if isinstance(spec, SlidingWindowSpec) and name in _SLIDING_SPECS:
        return GroupInfo(GroupKindName.SLIDING_WINDOW, bs, int(spec.sliding_window), name)
    if isinstance(spec, FullAttentionSpec) and name in _FULL_SPECS:
        return GroupInfo(GroupKindName.FULL, bs, None, name)
    return GroupInfo(GroupKindName.OTHER, bs, None, name)


def connector_config(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> ConnectorConfig:
    """The validated configuration (ConfigError for anything kvshm cannot serve)."""
    infos = [_group_info(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    hash_bs = getattr(kv_cache_config, "hash_block_size", None)
    return parse_config(vllm_config, infos, hash_bs)


def _bytes_per_block(kv_cache_config: KVCacheConfig) -> int:
    n = int(kv_cache_config.num_blocks)
    return sum(int(t.size) // n for t in kv_cache_config.kv_cache_tensors) if n > 0 else 0


def _scheduler_config(cfg: ConnectorConfig, vllm_config: VllmConfig,
                      kv_cache_config: KVCacheConfig) -> ConnectorConfig:
    """The scheduler side's part of start-up, in order: the failure policy set before
    vLLM's scheduler reads it, the default size resolved (this side alone sizes the
    tier), the budget checked against this host."""
    old = adopt_failure_policy(vllm_config.kv_transfer_config)
    if old is not None:
        log.info("kvshm: set kv_transfer_config.kv_load_failure_policy='recompute' (was "
                 "%r): a block kvshm fails to load is recomputed, never an aborted "
                 "request", old)
    shm = available_shm_bytes()  # one reading: the default fits what the check sees
    cfg = resolve_size(cfg, memory_available_bytes(), shm)
    check_budget(cfg, _bytes_per_block(kv_cache_config), shm)
    return cfg


def _rank(vllm_config: VllmConfig) -> int:
    """This worker's rank among the engine's TP x PP workers (pp-major)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp = vllm_config.parallel_config.tensor_parallel_size
    return int(get_pp_group().rank_in_group) * int(tp) + int(get_tp_group().rank_in_group)


def _drop_this_process_worker_side() -> None:
    """A refused scheduler side (a budget, a disk path, a name in use) fails vLLM's engine
    build. vLLM built the worker-side connectors first; where one runs in this process
    (in-process mode, or the EngineCore's own worker) it stays in vLLM's process-global
    slot, and the next ``LLM()`` in the process -- with kvshm or without any connector --
    picks it up and fails with "register_kv_caches called twice". Shut it down and
    empty the slot (only when the slot holds a kvshm connector)."""
    from vllm.distributed.kv_transfer import (
        ensure_kv_transfer_shutdown,
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    if has_kv_transfer_group() and isinstance(get_kv_transfer_group(), KvshmConnector):
        try:
            ensure_kv_transfer_shutdown()
        except Exception:  # (the refusal is what the caller must see)
            log.exception("kvshm: shutting down this process's worker-side connector "
                          "after the refusal failed")


class KvshmConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """kvshm's vLLM connector (module docstring; hooks in vllm_sched / vllm_worker)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        route_kvshm_logs()
        self._cfg = connector_config(vllm_config, kv_cache_config)
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._reporter = StatsReporter()
        if role == KVConnectorRole.SCHEDULER:
            try:
                self._cfg = _scheduler_config(self._cfg, vllm_config, kv_cache_config)
                why = unshared_hashes(vllm_config, disk=self._cfg.disk_path is not None,
                                      remote=self._cfg.remote_url is not None)
                if why is not None:
                    log.warning(why)
                self._sched = SchedulerSide(self._cfg, KvshmMetadata)
            except BaseException:
                _drop_this_process_worker_side()
                raise
        else:
            self._worker = WorkerSide(self._cfg)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """False: kvshm has no per-layer work a CUDA graph would skip.

        vLLM calls this while it builds its config (with full CUDA graphs on, the default
        on CUDA; never on vLLM's CPU platform), before any engine process starts: the
        earliest moment kvshm sees its extra config, so it is checked here too
        (ConfigError, one line, for an unknown key or two size keys). vLLM's config is a
        pydantic dataclass: it re-raises the ValueError as a 3-line ValidationError whose
        second line is kvshm's.
        """
        check_extra_config(extra_config or {})
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped store is only a later miss."""
        return False

    @property
    def kvshm_config(self) -> ConnectorConfig:
        """The validated configuration."""
        return self._cfg

    @property
    def scheduler_side(self) -> SchedulerSide:
        """StateError on the worker-side connector (a scheduler hook called there)."""
        if self._sched is None:
            raise StateError("a scheduler-side hook was called on kvshm's worker-side "
                             "connector")
        return self._sched

    @property
    def worker_side(self) -> WorkerSide:
        """StateError on the scheduler-side connector (a worker hook called there)."""
        if self._worker is None:
            raise StateError("a worker-side hook was called on kvshm's scheduler-side "
                             "connector")
        return self._worker

    # -- scheduler side ------------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self.scheduler_side.bind(gpu_block_pool)

    def on_new_request(self, request: Request) -> None:
        self.scheduler_side.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler_side.allocated(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self.scheduler_side.build(scheduler_output)
        assert isinstance(meta, KvshmMetadata)  # the scheduler side builds this class
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_output()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.finished(request, (block_ids,))

    def request_finished_all_groups(
            self, request: Request,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.finished(request, block_ids)

    def take_events(self) -> Iterable[Any]:
        return ()

    def has_pending_push_work(self) -> bool:
        return self._sched is not None and self._sched.has_pending_work()

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset()

    # -- statistics (scheduler side reports; vLLM aggregates, logs and exports) ----------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """kvshm's report when one is due (kvshm.integrations.vllm.reports: at most
        once a second while busy, once on going idle); None on the worker side and
        before bind."""
        sched = self._sched
        if sched is None or not sched.bound:
            return None
        return self._reporter.report(sched)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return KvshmConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KvshmPromMetrics:
        return KvshmPromMetrics(vllm_config, metric_types, labelnames,
                                per_engine_labelvalues)

    # -- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register(kv_caches, self._kv_cache_config, _rank(self._vllm_config))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        if not isinstance(connector_metadata, StepMeta):  # another connector's: refused
            raise StateError(f"kvshm's worker was bound {type(connector_metadata).__name__}, "
                             "not the metadata kvshm's scheduler side builds")
        super().bind_connector_metadata(connector_metadata)
        self.worker_side.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        self.worker_side.submit_stores()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        return None, self.worker_side.finished_loads()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # Ordering: get_finished first, so a failure found in this poll is reported in
        # the same snapshot as its request id (vLLM intersects the two).
        _, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_recving=set(recving or ()),
            failed_recving=self.worker_side.reports.take_failed_requests())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.reports.take_errors()

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear()

    # -- both ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._sched is not None:
            self._sched.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
