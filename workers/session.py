"""One rank's attachment to a scheduler: the handshake, and what ``Ready`` turns into.

:class:`Connector` connects and says hello without waiting (retrying while nobody
listens on the name), then polls for ``Ready``; the first poll that finds it returns the
:class:`Session`. Between connect and Hello the listener's uid is checked
(:meth:`~kvshm.ipc.rendezvous_client.RendezvousClient.connect_nowait`): a name held by a
process of another uid raises :class:`~kvshm.errors.UntrustedPeer` (the worker detaches
with it as its error), so neither the Hello nor, later, any of this rank's fds reach it.

:func:`open_session` maps, in this order, the rank's device caches (standalone workers
only: ``Ready.device_caches``, shared-memory segments by fd, or CUDA tensors opened over
CUDA IPC by :mod:`kvshm.cuda_ipc`; each must be on the device the worker was started
for, ``SessionOptions.device``), checks the layout against ``Ready.layout``, maps the ring
segment, the host pool, builds the :class:`~kvshm.ipc.worker_channel.WorkerChannel` (lifeline = the
rendezvous socket) and the copy engine (CUDA for a CUDA layout, else CPU), whose
completion eventfd the channel watches, so a finished copy wakes a parked receive; then
the remote-tier and disk-tier movers where Ready names those tiers (a tier that cannot be
opened here is no mover plus the reason: its jobs fail, the session stands).

fd ownership: every fd of the ``Ready`` is owned by the session from the call on. Each is
either consumed by exactly one object (segment, host pool, channel, device tensor) or
closed before :func:`open_session` returns or raises; nothing leaks on any error path.

Teardown is two-staged: :meth:`Session.close_link` drops the scheduler link (channel,
eventfds, ring segment) while the copy engine and host pool stay, so copies already
running still finish and report; :meth:`Session.close` then stops the engine (running
copies finish, queued ones fail) and releases the host pool.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import torch

from kvshm.cuda_ipc import open_tensor
from kvshm.errors import ConfigError, KvshmError, PeerDied, ProtocolError, WouldBlock
from kvshm.ipc.channel import ChannelStats
from kvshm.ipc.protocol import PROTOCOL_VERSION, READY_FIXED_FDS, Hello, Ready
from kvshm.ipc.rendezvous_client import RendezvousClient
from kvshm.ipc.ring_pair import RingPair, segment_size
from kvshm.ipc.worker_channel import WorkerChannel
from kvshm.layout import KVLayout
from kvshm.shm import Segment, map_segment, tensor_from_fd
from kvshm.types import DeviceKind
from workers.copy_engine import CopyEngine
from workers.cpu_copy import CpuCopyEngine, FaultInjection
from workers.disk_mover import FENCE_TIMEOUT_S, DiskMover
from workers.host_pool import HostPool
from workers.remote_mover import RemoteMover

__all__ = ["CONNECT_RETRY_S", "Connector", "Session", "SessionOptions", "open_session"]

_log = logging.getLogger(__name__)

#: Seconds between connection attempts while nobody listens on the name.
CONNECT_RETRY_S = 0.05


@dataclass(frozen=True)
class SessionOptions:
    """Worker-side knobs that shape a session (see ``Worker.attach``)."""

    spin_us: float = 50.0
    copy_threads: int = 1
    fault: FaultInjection | None = None
    #: A standalone worker's ``--device`` (where the engine's caches must live); None for
    #: an embedded worker, which brings its own layout.
    device: DeviceKind | None = None
    #: The CPU copy engine copies unfenced jobs in the caller (``CpuCopyEngine``).
    inline: bool = False
    #: Offered in Hello (``Hello.fence_by_kill``): set only by a process of its own
    #: that runs nothing else (``kvshm-workers``' rank processes).
    fence_by_kill: bool = False


@dataclass
class Session:
    """A live attachment. ``channel`` is None once :meth:`close_link` ran."""

    ready: Ready
    layout: KVLayout
    host: HostPool
    engine: CopyEngine
    notify_fd: int | None
    channel: WorkerChannel | None
    ring_seg: Segment | None
    last_channel_stats: ChannelStats | None = field(default=None)
    #: The remote-tier mover, where Ready names a remote tier (and kvshm[remote] is here).
    remote: RemoteMover | None = None
    #: Why Ready named a remote tier but there is no mover (every remote job fails).
    remote_error: str | None = None
    #: The disk-tier mover (this rank's slab file), where Ready names a disk tier.
    disk: DiskMover | None = None
    #: Why Ready named a disk tier but there is no mover (every Disk job fails).
    disk_error: str | None = None

    def close_link(self) -> None:
        """Close the channel (worker state STOPPED, eventfds) and the ring segment."""
        if self.channel is not None:
            self.last_channel_stats = self.channel.statistics()
            self.channel.close()
            self.channel = None
        if self.ring_seg is not None:
            self.ring_seg.close()
            self.ring_seg = None

    def close(self) -> None:
        """Everything: link, copy engine (running copies finish), host pool. Idempotent.
        A standalone worker's CUDA device caches are unmapped once the last reference to
        them goes (the copy engine's and this session's layout), which returns torch's
        IPC reference to the exporter: call it on detach."""
        self.close_link()
        if self.disk is not None:  # first: a GET waiting on its row fence goes on at once
            self.disk.close()  # its running slots end first; then the slab closes
        if self.remote is not None:
            self.remote.close()  # likewise its running job: no thread touches a row
        self.engine.close()
        self.notify_fd = None
        self.host.close()
        if self.remote is not None:
            self.remote.release()
        if self.disk is not None:
            self.disk.release()

    def channel_stats(self) -> ChannelStats | None:
        """The channel's counters (the last snapshot once the link is closed)."""
        return self.channel.statistics() if self.channel is not None else self.last_channel_stats


class _Fds:
    """The Ready's fds: each is taken once (ownership moves) or closed by :meth:`close_rest`."""

    def __init__(self, fds: Sequence[int]) -> None:
        self._fds: list[int | None] = list(fds)

    def take(self, i: int) -> int:
        fd = self._fds[i]
        assert fd is not None, f"Ready fd {i} taken twice"
        self._fds[i] = None
        return fd

    def close_rest(self) -> None:
        for i, fd in enumerate(self._fds):
            if fd is not None:
                self._fds[i] = None
                os.close(fd)


def _device_layout(ready: Ready, fds: _Fds, layout: KVLayout | None,
                   device: DeviceKind | None) -> KVLayout:
    """The embedded layout checked against Ready, or the standalone one opened from the
    Ready's device caches (fds for CPU ones, CUDA IPC handles for CUDA ones)."""
    if layout is not None:
        if ready.device_caches:
            raise ConfigError(f"rank {ready.rank}: Ready carries device caches, but this "
                              "worker owns its KV regions (embedded)")
        layout.check_spec(ready.layout)
        if layout.num_blocks != ready.layout.num_blocks:
            raise ConfigError(f"rank {ready.rank}: {layout.num_blocks} device blocks here, "
                              f"Ready says {ready.layout.num_blocks}")
        return layout
    if not ready.device_caches:
        raise ConfigError(f"rank {ready.rank}: a standalone worker needs device caches in "
                          "Ready (the serving process allocates them with shared_tensor)")
    tensors = _open_caches(ready, fds, device or DeviceKind.CPU)
    mapped = KVLayout.from_tensors(tensors)
    if mapped.to_spec() != ready.layout:
        raise ConfigError(f"rank {ready.rank}: device caches map to {mapped.to_spec()}, "
                          f"Ready says {ready.layout}")
    return mapped


def _open_caches(ready: Ready, fds: _Fds, device: DeviceKind) -> list[torch.Tensor]:
    """Every device cache of the Ready, refusing any not on ``device`` (before opening)."""
    for i, spec in enumerate(ready.device_caches):
        on = DeviceKind.CPU if spec.cuda is None else DeviceKind.CUDA
        if on is not device:
            raise ConfigError(f"rank {ready.rank}: the engine's device cache {i} is a "
                              f"{on.value} tensor, but this worker runs --device "
                              f"{device.value}: start kvshm-workers with --device {on.value}")
    tensors: list[torch.Tensor] = []
    fd_index = READY_FIXED_FDS
    for spec in ready.device_caches:
        if spec.cuda is not None:
            tensors.append(open_tensor(spec))
            continue
        tensors.append(tensor_from_fd(fds.take(fd_index), spec.shape, spec.dtype))
        fd_index += 1
    return tensors


def ready_fd_count(ready: Ready) -> int:
    """The fds a Ready must carry: the fixed ones and one per CPU device cache."""
    return READY_FIXED_FDS + sum(1 for spec in ready.device_caches if spec.cuda is None)


def _make_engine(rank: int, layout: KVLayout, host: HostPool, opts: SessionOptions,
                 rings: RingPair) -> tuple[CopyEngine, int | None]:
    """The rank's copy engine; a CPU one marks the rank's progress stamp during long
    copies (the scheduler's hang check counts that as progress)."""
    if layout.device.type == "cuda":
        from workers.cuda_copy import CudaCopyEngine

        return CudaCopyEngine(rank, layout, host), None
    engine = CpuCopyEngine(rank, layout, host, num_threads=opts.copy_threads, fault=opts.fault,
                           inline=opts.inline, progress=rings.mark_progress)
    return engine, engine.notify_fd()


def open_session(ready: Ready, fds: Sequence[int], *, layout: KVLayout | None,
                 lifeline_fd: int, opts: SessionOptions, world_size: int = 1) -> Session:
    """Build the session for ``ready`` (see the module docstring for order and ownership).

    ``layout``: the embedded worker's own layout, or None (standalone: mapped from the
    Ready's device-cache fds). Raises ProtocolError for a wrong fd count or a bad ring
    segment, ConfigError for a layout or host-pool mismatch.
    """
    owned = _Fds(fds)
    seg: Segment | None = None
    host: HostPool | None = None
    channel: WorkerChannel | None = None
    disk: DiskMover | None = None
    engine: CopyEngine | None = None
    mover: RemoteMover | None = None
    try:
        want = ready_fd_count(ready)
        if len(fds) != want:
            raise ProtocolError(f"Ready for rank {ready.rank} carries {len(fds)} fds, "
                                f"expected {want}", ring="rendezvous", offset=0)
        dev = _device_layout(ready, owned, layout, opts.device)
        seg = map_segment(owned.take(0), segment_size(ready.cmd_capacity, ready.done_capacity))
        rings = RingPair.attach(seg.buf)
        on_cuda = dev.device.type == DeviceKind.CUDA.value
        if on_cuda and layout is None:  # standalone: pin the host pool for the caches' GPU
            torch.cuda.set_device(dev.device)
        host = HostPool.from_fd(owned.take(1), ready, pin=on_cuda)
        cmd_efd, done_efd = owned.take(2), owned.take(3)
        try:
            channel = WorkerChannel(ready.rank, rings, cmd_efd, done_efd, lifeline_fd,
                                    spin_us=opts.spin_us, full_wait_s=0.0)
        except BaseException:
            rings.close()
            os.close(cmd_efd)
            os.close(done_efd)
            raise
        engine, notify_fd = _make_engine(ready.rank, dev, host, opts, rings)
        if notify_fd is not None:  # a finished copy wakes a parked wait_for_work
            channel.watch(notify_fd)
        mover, remote_error = _make_mover(ready, host, world_size)
        if mover is not None:
            channel.watch(mover.notify_fd())
        disk, disk_error = _make_disk(ready, host, world_size)
        if disk is not None:
            channel.watch(disk.notify_fd())
            if mover is not None:  # a GET into rows a victim's WRITE still reads waits
                mover.fence_rows(partial(disk.wait_rows, timeout=FENCE_TIMEOUT_S))
    except BaseException:  # everything built so far goes, in Session.close's order
        owned.close_rest()
        if disk is not None:
            disk.close()
            disk.release()
        if mover is not None:
            mover.close()
            mover.release()
        if engine is not None:
            engine.close()
        if channel is not None:
            channel.close()
        if host is not None:
            host.close()
        if seg is not None:
            seg.close()
        raise
    return Session(ready, dev, host, engine, notify_fd, channel, seg, remote=mover,
                   remote_error=remote_error, disk=disk, disk_error=disk_error)


def _make_mover(ready: Ready, host: HostPool,
                world_size: int) -> tuple[RemoteMover | None, str | None]:
    """The remote-tier mover if Ready names a tier, else (None, None). Where the tier
    cannot be used here (kvshm[remote] not installed, a bad URL) there is none and the
    reason is returned: every remote job then fails (failure = miss = recompute)."""
    if ready.remote is None:
        return None, None
    try:
        from kvshm.remote.tier import RemoteSpec
        from kvshm.remote.valkey import ValkeyBlockStore

        store = ValkeyBlockStore(RemoteSpec.parse(ready.remote.url))
    except (ImportError, KvshmError) as exc:
        return None, f"{type(exc).__name__}: {exc}"
    return RemoteMover(ready.rank, world_size, ready.remote, host, store), None


def _make_disk(ready: Ready, host: HostPool,
               world_size: int) -> tuple[DiskMover | None, str | None]:
    """The disk-tier mover if Ready names a disk tier, else (None, None). Where its slab
    cannot be opened here (no space, O_DIRECT refused, a file another user could write)
    there is none and the reason is returned: every Disk job then fails (failure =
    miss). A slab whose lock another process still holds is opened later by the mover
    (:mod:`workers.slab_opener`)."""
    if ready.disk is None:
        return None, None
    try:
        return DiskMover(ready.rank, world_size, ready.disk, host), None
    except (KvshmError, OSError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        # one line where the operator looks: the reason used to live only in the Done
        # errors and the rank's statistics, and the tier was off without a word (a
        # hostile probe: another user's file where the slab goes)
        _log.warning("kvshm disk tier, rank %d: no slab (%s); every disk job of this "
                     "rank fails (a miss) for the engine's life", ready.rank, why)
        return None, why


class Connector:
    """The handshake of one rank, one non-blocking step per :meth:`poll`.

    ``client`` is None until a connection took and Hello went out; it is the lifeline
    from then on (the caller closes it). ``attempts`` counts failed connection tries.
    """

    def __init__(self, name: str, rank: int, world_size: int, layout: KVLayout | None,
                 opts: SessionOptions) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self._layout, self._opts = layout, opts
        self.client: RendezvousClient | None = None
        self.attempts = 0
        self._next_try = 0.0

    def poll(self) -> Session | None:
        """Connect + Hello (at most every CONNECT_RETRY_S), or look for Ready; never waits.

        The session once Ready is in, else None. UntrustedPeer: the name is held by a
        process of another uid (nothing was sent); PeerDied: the scheduler
        closed the connection before Ready (refused this rank, or failed); ConfigError /
        ProtocolError / OSError: the Ready does not fit this worker (its fds are closed).
        """
        if self.client is None:
            self._try_connect()
            return None
        got = self.client.poll_ready()
        if got is None:
            return None
        ready, fds = got
        return open_session(ready, fds, layout=self._layout, lifeline_fd=self.client.fileno(),
                            opts=self._opts, world_size=self.world_size)

    def _try_connect(self) -> None:
        now = time.monotonic()
        if now < self._next_try:
            return
        self._next_try = now + CONNECT_RETRY_S
        client = RendezvousClient(self.name)
        spec = None if self._layout is None else self._layout.to_spec()
        try:
            client.connect_nowait()
            device = "" if self._opts.device is None else self._opts.device.value
            client.send_hello(Hello(PROTOCOL_VERSION, self.rank, self.world_size, os.getpid(),
                                    spec, device, self._opts.fence_by_kill))
        except (PeerDied, WouldBlock):  # nobody listens yet, or its backlog is full
            client.close()
            self.attempts += 1
            return
        except BaseException:  # UntrustedPeer (checked before Hello), or worse: give up
            client.close()
            raise
        self.client = client
