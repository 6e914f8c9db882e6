"""This rank's host pool: its CPU-tier rows, mapped from the segment the scheduler sent.

The segment holds one block of rows per region of the rank's layout, where
:func:`kvshm.layout.host_pool_plan` put them (``Ready.host_offsets``, ``Ready.host_bytes``):
region ``r`` is ``num_cpu_blocks`` contiguous rows of ``layout.regions[r].bytes_per_block``
bytes. CPU block id ``b`` is row ``b`` of every region.

On a machine with CUDA the whole mapping is page-locked in place with
``cudaHostRegister`` (no copy and no power-of-two rounding, unlike torch's pinned host
allocator) and unregistered by :meth:`HostPool.close`.

Lifetime: the region tensors keep the mapping alive (the memory stays valid for as long
as any of them, or a view of them, lives); :meth:`close` unpins and drops the pool's own
references. Close the copy engines that use the pool first: unpinning under an in-flight
CUDA copy is undefined.
"""

from __future__ import annotations

import os
from typing import Any, Final, Self

import torch

from kvshm.errors import ConfigError
from kvshm.ipc.protocol import PROTOCOL_VERSION, LayoutSpec, Ready
from kvshm.layout import KVLayout, host_pool_plan
from kvshm.shm import map_segment

__all__ = ["HostPool"]

#: cudaHostRegisterDefault.
_CUDA_HOST_REGISTER_DEFAULT: Final = 0


#: ``torch.cuda`` as Any: ``cudart()`` is untyped in torch's stubs.
_cuda: Any = torch.cuda


def _cudart() -> Any:
    """torch's CUDA runtime bindings."""
    return _cuda.cudart()


def _cuda_pin(ptr: int, size: int) -> None:
    rc = _cudart().cudaHostRegister(ptr, size, _CUDA_HOST_REGISTER_DEFAULT)
    if int(rc) != 0:
        raise ConfigError(f"cudaHostRegister of the {size}-byte host pool failed "
                          f"(cudaError {int(rc)})")


def _cuda_unpin(ptr: int) -> None:
    _cudart().cudaHostUnregister(ptr)


def _check_plan(ready: Ready) -> None:
    """Every region must lie inside ``host_bytes`` and regions must not overlap."""
    spec = ready.layout
    if ready.num_cpu_blocks <= 0:
        raise ConfigError(f"Ready.num_cpu_blocks must be positive, got {ready.num_cpu_blocks}")
    if len(ready.host_offsets) != len(spec.regions):
        raise ConfigError(f"Ready has {len(ready.host_offsets)} host offsets for "
                          f"{len(spec.regions)} regions")
    spans = sorted((off, off + ready.num_cpu_blocks * r.bytes_per_block)
                   for off, r in zip(ready.host_offsets, spec.regions))
    prev_end = 0
    for start, end in spans:
        if start < prev_end or end > ready.host_bytes or start < 0:
            raise ConfigError(f"host pool plan out of bounds or overlapping: offsets "
                              f"{ready.host_offsets}, {ready.host_bytes} bytes")
        prev_end = end


class HostPool:
    """``num_cpu_blocks`` rows per region in shared memory, as uint8 tensors.

    Invariants: ``regions[r]`` is a contiguous uint8 tensor ``[num_cpu_blocks,
    layout.regions[r].bytes_per_block]``; ``pinned`` is True iff the mapping is
    registered with CUDA (until :meth:`close`).
    """

    __slots__ = ("_closed", "_flat", "num_cpu_blocks", "pinned", "regions", "spec")

    def __init__(self, flat: torch.Tensor, ready: Ready, *, pin: bool) -> None:
        self._flat = flat
        self.spec: LayoutSpec = ready.layout
        self.num_cpu_blocks: int = ready.num_cpu_blocks
        #: Per-region uint8 ``[num_cpu_blocks, bytes_per_block]`` views into the mapping.
        self.regions: tuple[torch.Tensor, ...] = tuple(
            flat[off:off + ready.num_cpu_blocks * r.bytes_per_block]
            .view(ready.num_cpu_blocks, r.bytes_per_block)
            for off, r in zip(ready.host_offsets, ready.layout.regions))
        self.pinned = False
        self._closed = False
        if pin:
            _cuda_pin(flat.data_ptr(), flat.numel())
            self.pinned = True

    @classmethod
    def from_fd(cls, fd: int, ready: Ready, *, pin: bool | None = None) -> HostPool:
        """Map the host-pool segment ``fd`` laid out as ``ready`` says. Takes ownership of ``fd``.

        The fd is closed before returning (also on error); the mapping stays. ``pin``:
        register with CUDA (default: iff CUDA is available). Raises :class:`ConfigError`
        for a plan that does not fit ``host_bytes`` or a segment smaller than that.
        """
        try:
            _check_plan(ready)
        except BaseException:
            os.close(fd)
            raise
        seg = map_segment(fd, ready.host_bytes)
        # frombuffer on a memoryview: the view holds the mmap's export, so the mapping
        # lives as long as any tensor made from it (closing the mmap cannot unmap it).
        flat = torch.frombuffer(memoryview(seg.buf), dtype=torch.uint8, count=ready.host_bytes)
        seg.close()  # closes the fd; the mapping stays exported by ``flat``
        return cls(flat, ready, pin=torch.cuda.is_available() if pin is None else pin)

    @classmethod
    def for_tests(cls, layout: KVLayout | LayoutSpec, num_cpu_blocks: int, *,
                  rank: int = 0, pin: bool | None = None) -> HostPool:
        """A pool backed by an anonymous memfd (nothing named in /dev/shm), zero-filled."""
        spec = layout.to_spec() if isinstance(layout, KVLayout) else layout
        offsets, total = host_pool_plan(spec, num_cpu_blocks)
        fd = os.memfd_create("kvshm-test-host-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, total)
        except BaseException:
            os.close(fd)
            raise
        ready = Ready(PROTOCOL_VERSION, rank, spec, num_cpu_blocks, 0, 0, offsets, total)
        return cls.from_fd(fd, ready, pin=pin)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one CPU block id covers across every region."""
        return self.spec.bytes_per_block

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Unpin (CUDA) and drop the pool's references (idempotent).

        The mapping itself goes when the last region tensor (or view) is gone.
        """
        if self._closed:
            return
        self._closed = True
        if self.pinned:
            self.pinned = False
            _cuda_unpin(self._flat.data_ptr())
        self.regions = ()
        self._flat = torch.empty(0, dtype=torch.uint8)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("pinned" if self.pinned else "pageable")
        return (f"HostPool({len(self.spec.regions)} regions x {self.num_cpu_blocks} blocks, "
                f"{self.bytes_per_block} B/block, {state})")
