"""Scheduler-side provisioning: the shared resources each worker rank receives in ``Ready``.

Once every rank has said ``Hello``, :func:`provision` decides the CPU tier's size for
all ranks (:func:`kvshm.layout.reconcile`: the minimum over ranks) and creates, per
rank:

* a ring segment (control block + ``cmd`` ring + ``done`` ring), formatted here;
* a host-pool segment laid out by :func:`kvshm.layout.host_pool_plan`;
* two eventfds (``cmd`` doorbell, ``done`` doorbell);
* for standalone workers, the device caches the serving process made: CPU ones with
  :func:`kvshm.shm.shared_tensor` go as their segment's fd, CUDA ones as a CUDA IPC
  handle (:mod:`kvshm.cuda_ipc`); shapes and dtypes travel as ``TensorSpec``. A
  standalone rank's ``Hello.device`` (its ``--device``) must match where its caches
  live: a mismatch fails the start before any Ready, naming the rank and the fix.

Where a rank's KV layout comes from: an embedded worker sends it in ``Hello.layout``
(it owns the device caches); a standalone worker sends none and gets the caches the
scheduler holds for it. Standalone device caches are always read with blocks as dim 0
(one region per tensor, no K/V-outer split), on both sides.

Ownership (the rendezvous server never closes fds): :meth:`Provisioned.ready_plan`
returns *duplicates* for SCM_RIGHTS, which the caller closes once the rendezvous has
sent them (:meth:`Provisioned.close_sent_fds`). The originals stay here until
:meth:`RankResources.channel` hands the eventfds to a :class:`SchedulerChannel`. The
host-pool segment is closed on the scheduler side after the send: the scheduler never
touches CPU block bytes, and the memory goes with the last worker mapping.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import torch

from kvshm.cuda_ipc import export_tensor
from kvshm.errors import ConfigError
from kvshm.ipc.doorbell import create_eventfd
from kvshm.ipc.fdpass import MAX_FDS
from kvshm.ipc.protocol import (
    PROTOCOL_VERSION,
    READY_FIXED_FDS,
    DiskSetup,
    Hello,
    LayoutSpec,
    Ready,
    RemoteSetup,
    TensorSpec,
)
from kvshm.ipc.ring import DEFAULT_CAPACITY, min_capacity
from kvshm.ipc.ring_pair import RingPair, segment_size
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.layout import KVLayout, host_pool_plan, reconcile
from kvshm.remote.fingerprint import RemoteTarget
from kvshm.shm import Segment, create_segment, dtype_name, segment_of
from kvshm.shm_budget import available_shm_bytes
from kvshm.types import DeviceKind, GpuBlocks

__all__ = ["MAX_CPU_CACHES", "Provisioned", "RankResources", "cache_device", "check_caches",
           "device_layout", "pool_size", "provision"]


def device_layout(tensors: Sequence[torch.Tensor]) -> LayoutSpec:
    """The layout a standalone worker will build from ``tensors`` (blocks as dim 0)."""
    return KVLayout.from_tensors(tensors).to_spec()


@dataclass
class RankResources:
    """What one rank receives; the scheduler keeps the rings and its eventfd ends."""

    rank: int
    ready: Ready
    ring_seg: Segment
    host_seg: Segment | None
    cmd_efd: int
    done_efd: int
    device_fds: list[int]
    rings: RingPair | None = None
    _sent: list[int] = field(default_factory=list)

    def ready_fds(self) -> list[int]:
        """Duplicated fds in READY_FIXED_FDS order; closed by :meth:`close_sent`. All or
        nothing: a dup that fails (EMFILE) closes the ones made before it."""
        assert self.host_seg is not None, "ready_fds after the host segment was released"
        originals = [self.ring_seg.fd, self.host_seg.fd, self.cmd_efd, self.done_efd,
                     *self.device_fds]
        sent: list[int] = []
        try:
            for fd in originals:
                sent.append(os.dup(fd))
        except OSError as e:
            for fd in sent:
                os.close(fd)
            raise ConfigError(f"cannot pass a rank its {len(originals)} fds: "
                              f"{e.strerror or e} (this process is out of file "
                              "descriptors? raise `ulimit -n`)") from e
        self._sent = sent
        return list(sent)

    def close_sent(self) -> None:
        """Close the duplicates sent in Ready, the host segment and the device-cache fds."""
        for fd in self._sent:
            os.close(fd)
        self._sent = []
        for fd in self.device_fds:
            os.close(fd)
        self.device_fds = []
        if self.host_seg is not None:
            self.host_seg.close()
            self.host_seg = None

    def make_channel(self) -> SchedulerChannel:
        """The scheduler end of this rank's rings; it owns the rings and eventfds from now.

        The ring segment stays here: close the channel first, then :meth:`close`.
        """
        assert self.rings is not None, "make_channel called twice"
        chan = SchedulerChannel(self.rank, self.rings, self.cmd_efd, self.done_efd)
        self.rings, self.cmd_efd, self.done_efd = None, -1, -1
        return chan

    def close(self) -> None:
        """Release everything still held here (idempotent)."""
        self.close_sent()
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        for fd in (self.cmd_efd, self.done_efd):
            if fd >= 0:
                os.close(fd)
        self.cmd_efd = self.done_efd = -1
        self.ring_seg.close()


@dataclass
class Provisioned:
    """Every rank's resources plus the reconciled CPU tier size."""

    num_cpu_blocks: int
    ranks: dict[int, RankResources]
    remote: RemoteSetup | None = None

    def ready_plan(self) -> dict[int, tuple[Ready, list[int]]]:
        """The value a rendezvous ``make_ready`` returns."""
        return {r: (res.ready, res.ready_fds()) for r, res in self.ranks.items()}

    def close_sent_fds(self) -> None:
        """After ALL_READY / READY_FAILED: drop the fds only the workers need now."""
        for res in self.ranks.values():
            res.close_sent()

    def close(self) -> None:
        """Release every resource still held (idempotent)."""
        for res in self.ranks.values():
            res.close()


def _rank_layouts(hellos: Mapping[int, Hello],
                  device_caches: Sequence[Sequence[torch.Tensor]] | None) -> dict[int, LayoutSpec]:
    layouts: dict[int, LayoutSpec] = {}
    for rank, hello in sorted(hellos.items()):
        caches = None if device_caches is None else device_caches[rank]
        if hello.layout is not None:
            if caches:
                raise ConfigError(f"rank {rank} brought its own KV layout (embedded worker) "
                                  "but device_caches were also given for it")
            layouts[rank] = hello.layout
        elif caches:
            _check_worker_device(rank, hello, caches)
            layouts[rank] = device_layout(caches)
        else:
            raise ConfigError(f"rank {rank} is a standalone worker (no layout in Hello) and "
                              "no device_caches were given for it")
    return layouts


def cache_device(caches: Sequence[torch.Tensor]) -> DeviceKind:
    """Where one rank's (checked, non-empty) device caches live."""
    return DeviceKind.CUDA if caches[0].device.type == DeviceKind.CUDA.value else DeviceKind.CPU


def _check_worker_device(rank: int, hello: Hello, caches: Sequence[torch.Tensor]) -> None:
    """A standalone rank's ``--device`` (``Hello.device``; "" from an older worker means
    cpu) must be where its caches live. ConfigError naming the fix."""
    have = caches[0].device
    want = cache_device(caches)
    said = hello.device or DeviceKind.CPU.value
    if said != want.value:
        raise ConfigError(f"rank {rank} (pid {hello.pid}) is a standalone worker started with "
                          f"--device {said}, but its device caches are on {have}: start "
                          f"kvshm-workers with --device {want.value}")


def check_block_counts(layouts: Mapping[int, LayoutSpec], num_gpu_blocks: int | None) -> None:
    """Every region of every rank must have at least the GPU pool's block count, and
    every rank the same count: a job names one GPU block id for all ranks, so a row
    missing on one rank would fail every job that touches it -- refuse at launch.
    ConfigError naming the rank, the region and both counts."""
    first: tuple[int, int] | None = None
    for rank, spec in sorted(layouts.items()):
        for i, region in enumerate(spec.regions):
            if num_gpu_blocks is not None and region.num_blocks < num_gpu_blocks:
                raise ConfigError(f"rank {rank} region {i}: device cache has "
                                  f"{region.num_blocks} blocks, but the GPU pool has "
                                  f"{num_gpu_blocks} (every block id must exist on "
                                  "every rank)")
            if first is None:
                first = (rank, region.num_blocks)
            elif region.num_blocks != first[1]:
                raise ConfigError(f"rank {rank} region {i}: {region.num_blocks} device "
                                  f"blocks, rank {first[0]} has {first[1]} (every rank "
                                  "must have the same block count)")


_POOL_CALLS = ("touch", "free", "block_hashes", "iter_free_from_lru")


def check_gpu_pool(gpu: object) -> None:
    """ConfigError unless ``gpu`` is a GPU block pool kvshm can use
    (:class:`~kvshm.types.GpuBlocks`: ``num_blocks`` an int >= 1 and its four calls):
    checked when the engine is built, before anything starts -- a pool that is not one
    failed only at READY, the ranks already up."""
    n = getattr(gpu, "num_blocks", None)
    missing = [c for c in _POOL_CALLS if not callable(getattr(gpu, c, None))]
    if type(n) is not int or n < 1 or missing:
        raise ConfigError(
            f"gpu_blocks must be the engine's GPU block pool (a kvshm.BlockPool, or an "
            f"object with num_blocks >= 1 and {', '.join(_POOL_CALLS)}), got "
            f"{type(gpu).__name__}" + (f" without {', '.join(missing)}" if missing else ""))


def pool_size(gpu: GpuBlocks) -> int | None:
    """The GPU pool's block count where the pool tells it (kvshm's BlockPool does)."""
    n = getattr(gpu, "num_blocks", None)
    return n if isinstance(n, int) else None


#: Where a user is told to look for the device-cache contract.
_CACHE_HINT = ("allocate each rank's caches with kvshm.shared_tensor(shape, dtype): "
               "device_caches=[[k0, v0, ...], [k1, v1, ...]], one list per rank (README, API)")


def _check_tensor(where: str, t: object) -> None:
    """One device-cache tensor a kvshm worker process can open: a contiguous CUDA tensor
    (shared over CUDA IPC), or a torch.Tensor on the CPU, backed by
    :func:`kvshm.shm.shared_tensor` memory, starting at the segment's first byte and
    contiguous (the worker maps the segment from byte 0 with the shape and dtype alone: a
    view with an offset or other strides would be different bytes there), of a dtype the
    worker can rebuild by name."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{where}: expected a torch.Tensor, got {type(t).__name__}; "
                          + _CACHE_HINT)
    desc = f"shape {tuple(t.shape)}, {dtype_name(t.dtype)}, device {t.device}"
    if t.device.type == DeviceKind.CUDA.value:
        if not t.is_contiguous() or t.is_quantized or t.is_complex():
            raise ConfigError(f"{where} ({desc}, strides {t.stride()}): a CUDA device "
                              "cache must be a whole contiguous tensor of a real dtype (the "
                              "worker views it with its shape and dtype alone)")
        return
    if t.device.type != DeviceKind.CPU.value:
        raise ConfigError(f"{where} ({desc}): kvshm's worker processes copy CPU shared-memory "
                          "caches or CUDA tensors (shared over CUDA IPC), not "
                          f"{t.device.type} ones")
    try:
        seg = segment_of(t)
    except ConfigError:
        raise ConfigError(f"{where} ({desc}) is ordinary process memory (e.g. torch.zeros): "
                          "kvshm's worker processes cannot see it; " + _CACHE_HINT) from None
    if t.storage_offset() != 0 or not t.is_contiguous():
        raise ConfigError(f"{where} ({desc}, offset {t.storage_offset()}, strides "
                          f"{t.stride()}) is a view: pass whole contiguous tensors made by "
                          "kvshm.shared_tensor (a view's bytes are elsewhere in the worker)")
    if t.is_quantized or t.is_complex() or t.nbytes > seg.size:
        raise ConfigError(f"{where} ({desc}): unsupported tensor (quantized, complex or "
                          "larger than its segment); " + _CACHE_HINT)


#: The CPU device-cache tensors one rank may have: its Ready carries an fd for each.
MAX_CPU_CACHES: Final = MAX_FDS - READY_FIXED_FDS


def _check_rank_entry(rank: int, entry: object, spawned: bool) -> None:
    """One rank's list of tensors (a bare tensor is the usual slip: ``[k0, k1]``)."""
    if isinstance(entry, torch.Tensor) or not isinstance(entry, Sequence) \
            or isinstance(entry, str):
        raise ConfigError(f"device_caches[{rank}] must be a list of tensors (one list per "
                          f"rank), got {type(entry).__name__}; write [[k0], [k1]], not "
                          "[k0, k1]")
    if spawned and not entry:
        raise ConfigError(f"device_caches[{rank}] is empty: a worker kvshm spawns needs "
                          "its rank's caches; " + _CACHE_HINT)
    for i, t in enumerate(entry):
        _check_tensor(f"device_caches[{rank}][{i}]", t)
    on_cpu = sum(1 for t in entry if t.device.type != DeviceKind.CUDA.value)
    if on_cpu > MAX_CPU_CACHES:
        raise ConfigError(
            f"device_caches[{rank}] has {on_cpu} CPU tensors, at most {MAX_CPU_CACHES}: "
            f"the rank's Ready passes one fd per CPU tensor beside {READY_FIXED_FDS} of "
            f"its own, {MAX_FDS} at most in one message; stack layers (or K and V) into "
            "fewer tensors, blocks as dim 0")


def check_caches(caches: Sequence[Sequence[torch.Tensor]], world_size: int,
                 num_gpu_blocks: int | None, *, spawned: bool = False) -> None:
    """Refuse bad ``device_caches`` before anything is spawned or listened on
    (ConfigError, naming ``device_caches[rank][i]`` and what to do). Checked, in order:
    one entry per rank, each a list (with ``spawned``: a non-empty one) of CPU tensors
    made by :func:`kvshm.shm.shared_tensor`, whole and contiguous
    (:func:`_check_tensor`); each rank's tensors form a KV layout (blocks as dim 0);
    every rank's block counts as :func:`check_block_counts` wants them (at least the GPU
    pool's, the same on every rank). Empty entries (without ``spawned``) are ranks whose
    embedded workers bring their own layout."""
    if isinstance(caches, torch.Tensor) or not isinstance(caches, Sequence):
        raise ConfigError(f"device_caches must be a list with one list of tensors per "
                          f"rank, got {type(caches).__name__}")
    if len(caches) != world_size:
        raise ConfigError(f"device_caches has {len(caches)} entries, "
                          f"world_size is {world_size} (one list of tensors per rank)")
    for rank, entry in enumerate(caches):
        _check_rank_entry(rank, entry, spawned)
    layouts: dict[int, LayoutSpec] = {}
    for rank, ts in enumerate(caches):
        if ts:
            try:
                layouts[rank] = device_layout(ts)
            except ConfigError as e:
                raise ConfigError(f"device_caches[{rank}]: {e}") from None
    check_block_counts(layouts, num_gpu_blocks)


def _tensor_specs(tensors: Sequence[torch.Tensor]) -> tuple[tuple[TensorSpec, ...], list[int]]:
    """One TensorSpec per tensor, and an fd per CPU one (CUDA ones carry an IPC handle).
    All or nothing: on an error the duplicates made so far are closed."""
    specs: list[TensorSpec] = []
    fds: list[int] = []
    try:
        for t in tensors:
            shape, dtype = tuple(int(s) for s in t.shape), dtype_name(t.dtype)
            if t.device.type == DeviceKind.CUDA.value:
                specs.append(TensorSpec(shape, dtype, export_tensor(t)))
                continue
            seg = segment_of(t)
            if t.storage_offset() != 0 or not t.is_contiguous():
                raise ConfigError("device caches for standalone workers must be whole "
                                  "contiguous tensors made by kvshm.shm.shared_tensor, not views")
            specs.append(TensorSpec(shape, dtype))
            fds.append(os.dup(seg.fd))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return tuple(specs), fds


def ring_capacity(configured: int | None, num_gpu_blocks: int) -> int:
    """The ``cmd``/``done`` capacity: the configured one (checked) or the default."""
    need = min_capacity(num_gpu_blocks)
    if configured is None:
        return max(DEFAULT_CAPACITY, need)
    if configured < need:
        raise ConfigError(f"ring_capacity={configured} is below the minimum {need} for "
                          f"{num_gpu_blocks} GPU blocks (2 x the largest Transfer)")
    return configured


def provision(hellos: Mapping[int, Hello], *, world_size: int,
              device_caches: Sequence[Sequence[torch.Tensor]] | None,
              num_cpu_blocks: int | None, cpu_bytes_per_rank: int | None,
              capacity: int | None = None, num_gpu_blocks: int | None = None,
              remote: RemoteTarget | None = None,
              disk: Callable[[Mapping[int, LayoutSpec]], Mapping[int, DiskSetup]] | None = None
              ) -> Provisioned:
    """Create every rank's resources (all or nothing: on error nothing is left open).

    ``remote``: the engine's remote tier; every Ready then names it with the layout
    fingerprint of all ranks (``Provisioned.remote``). ``disk``: each rank's disk tier
    from every rank's layout (:meth:`kvshm.engine.disk_link.DiskLink.make_setups`), in
    its Ready.

    ``capacity``: the configured ring capacity (checked against the largest rank's
    block count), or None for the default. ``num_gpu_blocks``: the engine's GPU pool
    size, checked against every rank's device blocks (:func:`check_block_counts`).
    """
    if sorted(hellos) != list(range(world_size)):
        raise ConfigError(f"expected ranks 0..{world_size - 1}, got {sorted(hellos)}")
    if device_caches is not None and len(device_caches) != world_size:
        raise ConfigError(f"device_caches has {len(device_caches)} entries for "
                          f"{world_size} ranks")
    layouts = _rank_layouts(hellos, device_caches)
    check_block_counts(layouts, num_gpu_blocks)
    capacity = ring_capacity(capacity, max(s.num_blocks for s in layouts.values()))
    seg_bytes = segment_size(capacity, capacity)
    budget = available_shm_bytes() - world_size * seg_bytes
    n = reconcile(list(layouts.values()), cpu_bytes_per_rank, num_cpu_blocks, budget)
    setup = None if remote is None else remote.setup(layouts)
    disks = {} if disk is None else disk(layouts)
    done: dict[int, RankResources] = {}
    try:
        for rank, spec in layouts.items():
            caches = () if hellos[rank].layout is not None or device_caches is None \
                else device_caches[rank]
            done[rank] = _one_rank(rank, spec, n, capacity, caches, setup, disks.get(rank))
    except BaseException:
        Provisioned(n, done).close()
        raise
    return Provisioned(n, done, setup)


def _one_rank(rank: int, spec: LayoutSpec, n: int, capacity: int,
              caches: Sequence[torch.Tensor], remote: RemoteSetup | None,
              disk: DiskSetup | None = None) -> RankResources:
    offsets, host_bytes = host_pool_plan(spec, n)
    ring_seg = create_segment(segment_size(capacity, capacity), purpose=f"rings-r{rank}")
    opened: list[int] = []
    try:
        host_seg = create_segment(host_bytes, purpose=f"host-pool-r{rank}")
        try:
            opened = [create_eventfd(), create_eventfd()]
            specs, dev_fds = _tensor_specs(caches)
        except BaseException:
            host_seg.close()
            raise
    except BaseException:
        for fd in opened:
            os.close(fd)
        ring_seg.close()
        raise
    rings = RingPair.init(ring_seg.buf, capacity, capacity)
    ready = Ready(PROTOCOL_VERSION, rank, spec, n, capacity, capacity, offsets, host_bytes,
                  specs, remote, disk)
    return RankResources(rank, ready, ring_seg, host_seg, opened[0], opened[1], dev_fds, rings)
