"""The driver's batched memcpy (``cuMemcpyBatchAsync``, CUDA >= 12.8) through ctypes.

One driver call enqueues every piece of a job on a stream: for a layout of many small
per-layer regions (vLLM keeps one tensor per layer: 64 regions x 32 KiB for Llama-3-8B)
that is one call instead of thousands of ``cudaMemcpyAsync`` (measured on an H100 with
``tools/bench_copy.py``: the README's table).

* The symbol is resolved with ``cuGetProcAddress(..., 12080)``, which pins the CUDA 12.8
  ABI (nine arguments, with the ``failIdx`` out-parameter that CUDA 13's own prototype
  dropped); newer drivers keep serving it. Without a driver that has it,
  :func:`load_batch_memcpy` returns ``None`` and the engine falls back to indexed copies.
* Every descriptor gets one attribute: source access in stream order (a store must not
  read a block before the compute that writes it - the fence - has run; a load's host
  rows are stable, but stream order costs nothing measurable and keeps one rule), and
  location hints for device and host (used by the driver only for managed memory).
* Addresses are computed with torch on int64 tensors (one broadcast per group of
  regions), so building a job's descriptors costs a few tensor ops, not a Python loop
  over pieces. The arrays are read by the driver during the call; the caller keeps them
  alive until the job's event completes anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable, Sequence
from typing import Final

import torch

from kvshm.errors import CopyError

__all__ = ["MAX_DESCRIPTORS", "BatchMemcpy", "RegionGroup", "load_batch_memcpy"]

_CUDA_VERSION_12_8: Final = 12080
_SRC_ACCESS_ORDER_STREAM: Final = 1
_LOCATION_DEVICE: Final = 1
_LOCATION_HOST: Final = 2
#: Descriptors per driver call (ROCm's equivalent rejects more than 8192; keep the same bound).
MAX_DESCRIPTORS: Final = 8192


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_hint", _MemLocation),
                ("dst_loc_hint", _MemLocation), ("flags", ctypes.c_uint)]


_BATCH_PROTO = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
    ctypes.c_size_t,  # count
    ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t),  # attrs, attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.POINTER(ctypes.c_size_t),  # failIdx (12.8 ABI)
    ctypes.c_void_p)  # hStream


class BatchMemcpy:
    """``cuMemcpyBatchAsync`` bound to one device; :meth:`__call__` enqueues a batch."""

    def __init__(self, libcuda: ctypes.CDLL, fn: Callable[..., int], device_index: int) -> None:
        self._lib = libcuda
        self._fn = fn
        self._idx = (ctypes.c_size_t * 1)(0)
        self._fail = ctypes.c_size_t(0)
        loc_dev = _MemLocation(_LOCATION_DEVICE, device_index)
        loc_host = _MemLocation(_LOCATION_HOST, 0)
        self._attr = {
            True: _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, loc_dev, loc_host, 0),  # D2H
            False: _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, loc_host, loc_dev, 0),  # H2D
        }

    def __call__(self, store: bool, dsts: torch.Tensor, srcs: torch.Tensor,
                 sizes: torch.Tensor, stream: int) -> None:
        """Enqueue ``len(sizes)`` copies on ``stream`` (chunks of :data:`MAX_DESCRIPTORS`);
        the tensors are contiguous int64 on the CPU. Raises :class:`CopyError` on failure."""
        n = int(sizes.numel())
        attr = ctypes.byref(self._attr[store])
        for lo in range(0, n, MAX_DESCRIPTORS):
            k = min(MAX_DESCRIPTORS, n - lo)
            rc = self._fn(dsts.data_ptr() + 8 * lo, srcs.data_ptr() + 8 * lo,
                          sizes.data_ptr() + 8 * lo, k, attr, self._idx, 1,
                          ctypes.byref(self._fail), stream)
            if rc:
                at = (f"copy {lo + self._fail.value} of {n}" if self._fail.value < k
                      else f"{n} copies")  # failIdx is SIZE_MAX when no copy is to blame
                raise CopyError(f"cuMemcpyBatchAsync failed: {self._error_name(rc)} ({at})")

    def _error_name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return name.value.decode()
        return f"CUresult {rc}"


def load_batch_memcpy(device_index: int) -> BatchMemcpy | None:
    """The driver's batched memcpy, or ``None`` where the driver (or libcuda) lacks it."""
    path = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        lib = ctypes.CDLL(path)
        get_proc = lib.cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    get_proc.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                         ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    get_proc.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorName.restype = ctypes.c_int
    pfn, status = ctypes.c_void_p(), ctypes.c_int(-1)
    rc = get_proc(b"cuMemcpyBatchAsync", ctypes.byref(pfn), _CUDA_VERSION_12_8, 0,
                  ctypes.byref(status))
    if rc != 0 or status.value != 0 or not pfn.value:
        return None
    return BatchMemcpy(lib, _BATCH_PROTO(pfn.value), device_index)


class RegionGroup:
    """Regions copied alike (all dense, or all padded): per-region base addresses, row
    strides and row bytes of both sides as int64 tensors, so a job's descriptors for every
    region of the group come from one broadcast."""

    __slots__ = ("dev_base", "dev_stride", "host_base", "host_stride", "row_bytes")

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        def col(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64)[:, None]

        self.dev_base = col([d.data_ptr() for d, _ in pairs])
        self.dev_stride = col([d.stride(0) * d.element_size() for d, _ in pairs])
        self.host_base = col([h.data_ptr() for _, h in pairs])
        self.host_stride = col([h.stride(0) * h.element_size() for _, h in pairs])
        self.row_bytes = col([d.shape[1] * d.element_size() for d, _ in pairs])

    def descriptors(self, store: bool, pieces: torch.Tensor,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dsts, srcs, sizes)`` for ``pieces`` (int64 ``[P, 3]`` rows of src start,
        dst start, length in blocks) in every region of the group, region-major."""
        s, d, k = pieces[:, 0][None, :], pieces[:, 1][None, :], pieces[:, 2][None, :]
        if store:
            src_base, src_stride = self.dev_base, self.dev_stride
            dst_base, dst_stride = self.host_base, self.host_stride
        else:
            src_base, src_stride = self.host_base, self.host_stride
            dst_base, dst_stride = self.dev_base, self.dev_stride
        return ((dst_base + d * dst_stride).reshape(-1), (src_base + s * src_stride).reshape(-1),
                (self.row_bytes * k).reshape(-1))
