"""vLLM's own ``SimpleCPUOffloadConnector`` on vLLM CPU, for ``tools.bench_vllm --chat``.

Its scheduler side (``SimpleCPUOffloadScheduler``: vLLM's ``BlockPool`` LRU over the CPU
tier, its store and load decisions) runs unchanged. Its worker needs CUDA (streams,
``cuMemcpyBatchAsync``, events), so :class:`SimpleCPUShimConnector` swaps the worker's
copy path for a synchronous one: the worker's own ``register_kv_caches`` finds the
block-strided regions (with a stand-in for ``torch.cuda.Stream``), the CPU tier is plain
tensors of the same rows, and each load or store is one ``index_select`` /
``index_copy_`` per region, done when issued (its event reports done at once). Loaded by
``kv_connector_module_path="tools.simplecpu_shim"``; used by the benchmark only.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import (
    SimpleCPUOffloadConnector,
)
from vllm.v1.simple_kv_offload.worker import SimpleCPUOffloadWorker

__all__ = ["SimpleCPUShimConnector"]


class _Done:
    """An event that has already happened."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _Stream:
    """Stand-in for ``torch.cuda.Stream`` while the worker registers its caches."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)


class _SyncCopy:
    """Copies whole block rows between the engine's regions and the CPU tier."""

    def __init__(self, gpu: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> None:
        self.gpu = gpu
        self.cpu = cpu

    def launch_copy(self, src_blocks: list[int], dst_blocks: list[int], is_store: bool,
                    event_idx: int, events_list: list[tuple[int, Any]],
                    wait_event: Any = None) -> None:
        src = torch.tensor(src_blocks, dtype=torch.long)
        dst = torch.tensor(dst_blocks, dtype=torch.long)
        for name, g in self.gpu.items():
            c = self.cpu[name]
            if is_store:
                c.index_copy_(0, dst, g.index_select(0, src))
            else:
                g.index_copy_(0, dst, c.index_select(0, src))
        events_list.append((event_idx, _Done()))

    def shutdown(self) -> None:
        return None


class _ShimWorker(SimpleCPUOffloadWorker):
    """vLLM's worker with the copy path of :class:`_SyncCopy`."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        real = torch.cuda.Stream
        torch.cuda.Stream = _Stream  # type: ignore[misc,assignment]
        try:
            super().register_kv_caches(kv_caches)
        finally:
            torch.cuda.Stream = real  # type: ignore[misc]

    def _init_cpu_mode(self, unique_gpu_caches: dict[str, torch.Tensor],
                       total_bytes_per_block: int, device: torch.device) -> None:
        self.cpu_kv_caches = {
            name: torch.zeros((self.num_cpu_blocks, *t.shape[1:]), dtype=t.dtype)
            for name, t in unique_gpu_caches.items()}
        self._backend = _SyncCopy(unique_gpu_caches, self.cpu_kv_caches)  # type: ignore[assignment]

    def wait_for_save(self) -> None:
        md = self._connector_metadata
        if md is not None and md.store_gpu_blocks:
            assert self._backend is not None
            self._backend.launch_copy(md.store_gpu_blocks, md.store_cpu_blocks,
                                      is_store=True, event_idx=md.store_event,
                                      events_list=self._store_events)


class SimpleCPUShimConnector(SimpleCPUOffloadConnector):
    """``SimpleCPUOffloadConnector`` whose worker copies synchronously on the CPU."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        w = self.worker_handler
        if w is not None:
            w.__class__ = _ShimWorker
