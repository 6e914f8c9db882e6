"""A do-nothing vLLM KV connector that records every hook call (tests and fact-finding only).

Loaded by vLLM through ``kv_connector_module_path="tests.vllm.null_connector"``: in
multi-process mode the EngineCore process (scheduler role) and the Worker process
(worker role) import this module themselves, so the repository root must be on
``PYTHONPATH`` in the environment before ``LLM()`` is built.

Each call appends one JSON line to ``kv_connector_extra_config["log_path"]``:
``{"pid", "role", "hook", ...summary}``. Lines are written with a single ``write`` on an
``O_APPEND`` descriptor, so the processes of one engine can share the file; a line is
never split across writes. The connector never loads or stores anything: every
``get_num_new_matched_tokens`` answers ``(0, False)``, so vLLM's outputs are exactly
those of an engine without a connector.

``NullConnector`` declares ``SupportsHMA``, so vLLM calls ``request_finished_all_groups``
instead of ``request_finished`` (whatever the platform's hybrid-allocator setting);
``NullConnectorNoHMA`` does not, so vLLM calls ``request_finished``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class NullMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """Per-step metadata: the scheduler's step counter (pickled to workers)."""

    step: int
    new_req_ids: list[str] = field(default_factory=list)


def _request_state(request: Request) -> dict[str, Any]:
    """The Request fields a real connector reads, as plain JSON."""
    return {
        "req": request.request_id,
        "num_tokens": request.num_tokens,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "num_output_placeholders": request.num_output_placeholders,
        "num_in_flight_tokens": request.num_in_flight_tokens,
        "num_block_hashes": len(request.block_hashes),
        "block_hash_type": type(request.block_hashes[0]).__name__
        if request.block_hashes
        else None,
        "block_hash_len": len(request.block_hashes[0]) if request.block_hashes else None,
        "kv_transfer_params": request.kv_transfer_params,
        "skip_reading_prefix_cache": request.skip_reading_prefix_cache,
        "status": str(request.status),
    }


def _tensor_facts(name: str, t: torch.Tensor) -> dict[str, Any]:
    storage = t.untyped_storage()
    return {
        "name": name,
        "shape": list(t.shape),
        "dtype": str(t.dtype),
        "stride": list(t.stride()),
        "device": str(t.device),
        "contiguous": t.is_contiguous(),
        "data_ptr": t.data_ptr(),
        "storage_ptr": storage.data_ptr(),
        "storage_nbytes": storage.nbytes(),
        "offset_in_storage": t.data_ptr() - storage.data_ptr(),
        "pinned": t.is_pinned() if t.device.type == "cpu" else None,
    }


class NullConnectorNoHMA(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """Records hook calls; never transfers KV. Without ``SupportsHMA``: vLLM calls
    ``request_finished``. See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg = vllm_config.kv_transfer_config
        assert cfg is not None
        self._log_path = str(cfg.kv_connector_extra_config["log_path"])
        self._step = 0
        self._requests: dict[str, Request] = {}
        # Steps for which has_pending_push_work() answers True after a request finishes
        # (to observe whether vLLM keeps stepping an idle engine for a connector).
        self._push_steps = int(cfg.kv_connector_extra_config.get("push_work_steps", 0))
        self._pending_push = 0
        self._log(
            "__init__",
            engine_id=cfg.engine_id,
            torch_threads=torch.get_num_threads(),
            omp_num_threads=os.environ.get("OMP_NUM_THREADS"),
            kv_load_failure_policy=cfg.kv_load_failure_policy,
            async_scheduling=vllm_config.scheduler_config.async_scheduling,
            disable_hma=vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            block_size=vllm_config.cache_config.block_size,
            num_blocks=kv_cache_config.num_blocks,
            kv_cache_layout=kv_cache_config.kv_cache_layout,
            kv_cache_tensors=[
                {
                    "size": t.size,
                    "layers": t.layers,
                    "layer_stride": t.layer_stride,
                    "block_stride": t.block_stride,
                    "offset": t.offset,
                }
                for t in kv_cache_config.kv_cache_tensors
            ],
            kv_cache_groups=[
                {
                    "layers": g.layer_names,
                    "spec": type(g.kv_cache_spec).__name__,
                    "block_size": g.kv_cache_spec.block_size,
                }
                for g in kv_cache_config.kv_cache_groups
            ],
        )

    # -- helpers ------------------------------------------------------------------
    def _log(self, hook: str, **fields: Any) -> None:
        line = {"pid": os.getpid(), "role": self.role.name, "hook": hook, **fields}
        data = (json.dumps(line, default=str) + "\n").encode()
        fd = os.open(self._log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    # -- class hooks ----------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None

    # -- scheduler side ---------------------------------------------------------------
    def bind_gpu_block_pool(self, gpu_block_pool: BlockPool) -> None:
        self._log(
            "bind_gpu_block_pool",
            pool_type=f"{type(gpu_block_pool).__module__}.{type(gpu_block_pool).__qualname__}",
            num_gpu_blocks=gpu_block_pool.num_gpu_blocks,
            num_free=gpu_block_pool.get_num_free_blocks(),
            enable_caching=gpu_block_pool.enable_caching,
            hash_block_size=gpu_block_pool.hash_block_size,
        )

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self._log("on_new_request", **_request_state(request))

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        self._log(
            "get_num_new_matched_tokens",
            num_computed_arg=num_computed_tokens,
            **_request_state(request),
        )
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._log(
            "update_state_after_alloc",
            req=request.request_id,
            block_ids=[list(g) for g in blocks.get_block_ids()],
            num_external_tokens=num_external_tokens,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._step += 1
        self._pending_push = max(0, self._pending_push - 1)
        cached = scheduler_output.scheduled_cached_reqs
        listed = [r.req_id for r in scheduler_output.scheduled_new_reqs] + list(cached.req_ids)
        self._log(
            "build_connector_meta",
            step=self._step,
            new=[
                {
                    "req": r.req_id,
                    "block_ids": [list(g) for g in r.block_ids],
                    "num_computed_tokens": r.num_computed_tokens,
                }
                for r in scheduler_output.scheduled_new_reqs
            ],
            cached={
                "req_ids": list(cached.req_ids),
                "resumed": sorted(cached.resumed_req_ids),
                "new_block_ids": [
                    None if b is None else [list(g) for g in b] for b in cached.new_block_ids
                ],
                "num_computed_tokens": list(cached.num_computed_tokens),
            },
            num_scheduled_tokens=dict(scheduler_output.num_scheduled_tokens),
            finished_req_ids=sorted(scheduler_output.finished_req_ids),
            preempted_req_ids=None
            if scheduler_output.preempted_req_ids is None
            else sorted(scheduler_output.preempted_req_ids),
            has_sync_kv_loads=scheduler_output.has_sync_kv_loads,
            total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
            requests=[_request_state(self._requests[r]) for r in listed if r in self._requests],
        )
        return NullMetadata(
            step=self._step, new_req_ids=[r.req_id for r in scheduler_output.scheduled_new_reqs]
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._log(
            "update_connector_output",
            finished_sending=sorted(connector_output.finished_sending or ()),
            finished_recving=sorted(connector_output.finished_recving or ()),
            invalid_block_ids=sorted(connector_output.invalid_block_ids),
            failed_recving=sorted(connector_output.failed_recving),
            worker_meta=type(connector_output.kv_connector_worker_meta).__name__,
            expected_finished_count=connector_output.expected_finished_count,
        )

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._finish(request)
        self._log("request_finished", block_ids=list(block_ids), **_request_state(request))
        return False, None

    def take_events(self) -> tuple[()]:
        self._log("take_events")
        return ()

    def has_pending_push_work(self) -> bool:
        self._log("has_pending_push_work", pending=self._pending_push)
        return self._pending_push > 0

    def _finish(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        self._pending_push = self._push_steps

    def reset_cache(self) -> bool | None:
        self._log("reset_cache")
        return True

    # -- worker side ------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = [_tensor_facts(name, t) for name, t in kv_caches.items()]
        self._log("register_kv_caches", tensors=tensors)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        self._log("set_host_xfer_buffer_ops")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, NullMetadata)
        self._log("handle_preemptions", step=kv_connector_metadata.step)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, NullMetadata)
        self._log("bind_connector_metadata", step=connector_metadata.step)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._log("start_load_kv", step=self._meta_step())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", layer=layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._log("save_kv_layer", layer=layer_name, data_ptr=kv_layer.data_ptr())

    def wait_for_save(self) -> None:
        self._log("wait_for_save", step=self._meta_step())

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        self._log("get_finished", step=self._meta_step(), finished=sorted(finished_req_ids))
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._log("get_block_ids_with_load_errors", step=self._meta_step())
        return set()

    def build_connector_worker_meta(self) -> None:
        self._log("build_connector_worker_meta", step=self._meta_step())
        return None

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata", step=self._meta_step())
        super().clear_connector_metadata()

    def shutdown(self) -> None:
        self._log("shutdown")

    def _meta_step(self) -> int | None:
        meta = self._connector_metadata
        return meta.step if isinstance(meta, NullMetadata) else None


class NullConnector(NullConnectorNoHMA, SupportsHMA):  # type: ignore[misc, unused-ignore]
    """The recorder with ``SupportsHMA``: vLLM calls ``request_finished_all_groups``."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._finish(request)
        self._log(
            "request_finished_all_groups",
            block_ids=[list(g) for g in block_ids],
            **_request_state(request),
        )
        return False, None
