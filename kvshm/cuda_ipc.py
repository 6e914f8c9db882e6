"""CUDA device caches shared with a standalone worker process (CUDA IPC).

The contract (``Engine.launch(..., device_caches=...)`` in SPAWN or ATTACH mode with
caches on a GPU; the README's "Standalone workers on a GPU"):

* **Who allocates**: the serving process, with torch, one whole contiguous tensor per
  region on the rank's GPU (``torch.zeros(shape, dtype=..., device="cuda:R")``), blocks
  as dim 0, and it keeps them alive for as long as the engine runs. Its model writes and
  reads them; kvshm never allocates or frees device memory.
* **Hand-over**: at ``Ready`` the scheduler exports every tensor (:func:`export_tensor`):
  the ``cudaIpcMemHandle`` of the CUDA allocation holding it, where its bytes sit in that
  allocation, and the GPU's UUID -- not its index, because a worker started with another
  ``CUDA_VISIBLE_DEVICES`` numbers the GPUs differently. The record travels inside
  ``Ready.device_caches`` (:class:`~kvshm.ipc.protocol.CudaIpc`); no fd is sent for it.
* **Opening**: the worker (``kvshm-workers --device cuda``) finds the GPU by UUID among
  the ones it can see (one it cannot see is a :class:`~kvshm.errors.ConfigError` naming
  the UUID), opens the handle (``cudaIpcOpenMemHandle``, through torch, which also waits
  on the exporter's event so earlier writes are visible) and views the tensor. A rank
  whose ``--device`` differs from its caches' device is refused by the scheduler before
  ``Ready`` (:func:`kvshm.engine.provision.provision`) and, were a Ready to arrive
  anyway, by the worker.
* **Closing**: the mapping lives as long as a tensor on it; the worker drops them when it
  detaches (``Session.close``), which closes the handle and returns torch's IPC reference
  count to the exporter. Until every opener returned it, torch keeps the exporter's
  allocation alive even if the serving process drops its tensor
  (``torch.cuda.ipc_collect()`` frees it afterwards).

Ordering across the two processes: no CUDA event crosses them, so the serving process
calls the engine's step for a step only once the kernels that wrote that step's blocks
have finished (``torch.cuda.current_stream().synchronize()`` after the forward; on the
CPU the forward is synchronous anyway), and runs a forward that reads loaded blocks only
after their load completed (as on the CPU). The worker's own copies are ordered by its
CUDA copy engine's events, and a store's GPU block stays pinned until every rank acked.

torch offers this through ``UntypedStorage._share_cuda_`` / ``_new_shared_cuda`` (what
``torch.multiprocessing`` uses to send CUDA tensors); both are reached here only, typed
as ``Any``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import CudaIpc, TensorSpec
from kvshm.shm import dtype_from_name, dtype_name

__all__ = ["device_uuid", "export_tensor", "local_device", "open_tensor"]

_cuda: Any = torch.cuda


def device_uuid(index: int) -> str:
    """The UUID of visible GPU ``index`` (stable across processes and CUDA_VISIBLE_DEVICES)."""
    return str(_cuda.get_device_properties(index).uuid)


def local_device(uuid: str) -> int:
    """This process's index of the GPU named ``uuid``; ConfigError where it cannot see it."""
    if not torch.cuda.is_available():
        raise ConfigError(f"the device caches are on GPU {uuid}, but this process sees no "
                          "CUDA device (torch.cuda.is_available() is False)")
    seen = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise ConfigError(f"the device caches are on GPU {uuid}, which this process cannot "
                          f"see (it sees {seen}; check CUDA_VISIBLE_DEVICES)")
    return seen.index(uuid)


def export_tensor(t: torch.Tensor) -> CudaIpc:
    """The IPC record of one whole contiguous CUDA tensor (exporter side; see the module
    docstring). ConfigError for a tensor that is not on a GPU or not contiguous."""
    if t.device.type != "cuda" or not t.is_contiguous():
        raise ConfigError(f"a CUDA device cache must be a contiguous tensor on a GPU, got "
                          f"device {t.device}, strides {t.stride()}")
    storage: Any = t.untyped_storage()
    (dev, handle, size, offset, rc_handle, rc_offset, ev_handle,
     ev_sync) = storage._share_cuda_()
    return CudaIpc(device_uuid(int(dev)), bytes(handle), int(size), int(offset),
                   int(t.storage_offset()), bytes(rc_handle), int(rc_offset),
                   None if ev_handle is None else bytes(ev_handle), bool(ev_sync))


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(int(n), 1)
    return tuple(reversed(strides))


def open_tensor(spec: TensorSpec) -> torch.Tensor:
    """The exporter's tensor, mapped into this process (opener side). ConfigError for a
    GPU this process cannot see, a bad dtype name, or a shape that does not fit the
    exported storage, or a spec of no CUDA tensor (nothing is opened then)."""
    ipc = spec.cuda
    if ipc is None:  # the peer exported a host tensor: no CUDA handle to open
        raise ConfigError(f"tensor spec {spec.dtype}{list(spec.shape)} names no CUDA tensor "
                          "(the exporter is on another device)")
    dtype = dtype_from_name(spec.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in spec.shape:
        numel *= int(n)
    if min(spec.shape, default=1) < 0 or \
            (ipc.tensor_offset + numel) * itemsize > ipc.storage_bytes:
        raise ConfigError(f"CUDA device cache {tuple(spec.shape)} {dtype_name(dtype)} at "
                          f"element {ipc.tensor_offset} does not fit the exported "
                          f"{ipc.storage_bytes}-byte storage")
    index = local_device(ipc.device_uuid)
    _cuda.init()
    storage = _new_shared(index, ipc)
    out = torch.empty(0, dtype=dtype, device=torch.device("cuda", index))
    out.set_(storage, ipc.tensor_offset, tuple(spec.shape), _contiguous_strides(spec.shape))
    return out


def _new_shared(index: int, ipc: CudaIpc) -> Any:
    """Open the exporter's allocation on GPU ``index`` (torch caches one mapping per
    handle, so two tensors in one allocation share it)."""
    storage_cls: Any = torch.UntypedStorage
    return storage_cls._new_shared_cuda(index, ipc.handle, ipc.storage_bytes,
                                        ipc.storage_offset_bytes, ipc.ref_counter_handle,
                                        ipc.ref_counter_offset, ipc.event_handle,
                                        ipc.event_sync_required)
