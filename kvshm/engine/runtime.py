"""Runtime: the scheduler side shared by ``Engine`` (asyncio) and ``SyncClient``.

It owns the rendezvous server, the provisioned per-rank resources, one
:class:`~kvshm.ipc.sched_channel.SchedulerChannel` per rank, the CPU
:class:`~kvshm.offload.pool.BlockPool` and the :class:`~kvshm.offload.manager.OffloadManager`,
and two helpers: a :class:`~kvshm.engine.dispatch.Dispatcher` (Transfers out, Dones
back) and a :class:`~kvshm.engine.supervision.Supervisor` (each rank's verdict, fence
and hang check). It does no waiting of its own: events come in through :meth:`pump`
(the sync client, at the start of every call) or through loop callbacks
(:meth:`attach_loop`). Every method runs on one thread.

Lifecycle: :class:`~kvshm.engine.lifecycle.EngineState` (the diagram is drawn there);
this class makes every transition.

One idea, kept whole: the runtime is the scheduler side of one engine -- its lifecycle,
its events and the scheduler's calls (``lookup``, ``allocated``, ``step``, ``finished``
and the queries beside them) -- because every call is gated by the state the lifecycle
moves (no manager before READY, nothing planned once FAILED, requests admitted before
READY kept out) and every event feeds the manager the calls plan with. Split in two, the
calls would read the lifecycle's records without owning them, or pay a call per request
on the hot path to ask; so the class is as long as that idea needs. Its parts that are
ideas of their own are objects it holds: the rendezvous server, the channels, the
dispatcher, the supervisor, the admission of early requests, the manager.

Rules kept here:

* Before READY there is no manager: ``lookup`` answers 0, ``allocated`` and
  ``finished`` do nothing, ``step`` plans nothing and records the listed requests, which
  the manager never sees for life (:mod:`~kvshm.engine.admission`).
* ``step`` posts the plan's store before its load, to every live rank, in that order
  (job ids increase on every rank), then its remote and disk jobs; a remote or disk
  message no rank could take fails at once
  (``on_done(.., False)``), which releases its pins.
* A request id that is not a ``str`` is refused with ``InvalidRequest`` before anything
  changes.
* Events are applied in arrival order; in attached mode ``on_change`` runs once after
  each batch (rendezvous events, a ring's Dones, a verdict), never in the middle of one.
* Each batch of ``Done`` goes to ``OffloadManager.on_done`` through the dispatcher; the
  load outcomes it decides stay in the manager's queue until :meth:`take_load_results`.
* A verdict (:meth:`rank_died`; rules in :mod:`~kvshm.engine.supervision`) revokes and
  closes the rank's channel, then fails the start (WorkerDied) while STARTING, or runs
  ``manager.rank_failed`` and makes the engine FAILED: serving goes on without offload
  and nothing waits on the dead rank. Only the rank's fence runs
  ``manager.rank_fenced``, which ends its quarantine.
* A rank whose worker said ``Goodbye`` before its EOF left (its host closed it): its jobs
  end as at a verdict, but the engine becomes STOPPED, not FAILED, and ``ranks_left``
  counts it (:meth:`Supervisor.rank_left <kvshm.engine.supervision.Supervisor.rank_left>`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from kvshm.config import EngineConfig
from kvshm.engine import forks, startup
from kvshm.engine.admission import Admission, check_id
from kvshm.engine.disk_link import DiskLink, open_disk
from kvshm.engine.dispatch import Dispatcher
from kvshm.engine.lifecycle import ENDED, LIVE, EngineState
from kvshm.engine.provision import Provisioned, check_caches, check_gpu_pool, pool_size, provision
from kvshm.engine.remote_link import RemoteLink, open_remote
from kvshm.engine.snapshot import CoreCounters, build_stats
from kvshm.engine.startup import Refusals, StartTimeout, log, start_timeout_error
from kvshm.engine.supervision import Supervisor
from kvshm.errors import ConfigError, InvalidRequest, StateError, TransportError, WorkerDied
from kvshm.ipc import protocol
from kvshm.ipc.protocol import Disk, Hello, Remote
from kvshm.ipc.rendezvous import RendezvousServer
from kvshm.ipc.rendezvous_events import EventKind, RendezvousEvent
from kvshm.ipc.ring_pair import RevokeReason
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.remote.fingerprint import RemoteTarget
from kvshm.stats import EngineStats
from kvshm.types import GpuBlocks, LoadResult, RequestView, StepInput, StepPlan

__all__ = ["Runtime"]

_READY = EngineState.READY
_DEBUG = logging.DEBUG



def _request_id(req: RequestView) -> str:
    """A lookup's request id: InvalidRequest (nothing changed) for anything but a
    RequestView whose id is a str (or a str subclass)."""
    try:
        rid = req.req_id
    except AttributeError:
        raise InvalidRequest("lookup", None, "req",
                             f"a RequestView expected, got {type(req).__name__}") from None
    if type(rid) is not str:
        check_id("lookup", rid)
    return rid

class Runtime:
    """See the module docstring. ``spawned``: kvshm started the workers (pidfds)."""

    def __init__(self, config: EngineConfig, *, gpu_blocks: GpuBlocks,
                 device_caches: Sequence[Sequence[torch.Tensor]] | None = None,
                 spawned: bool = False) -> None:
        if not isinstance(config, EngineConfig):
            raise ConfigError(f"config must be a kvshm.EngineConfig, got "
                              f"{type(config).__name__}")
        check_gpu_pool(gpu_blocks)
        if device_caches is not None:
            check_caches(device_caches, config.world_size, pool_size(gpu_blocks),
                         spawned=spawned)
        elif spawned:  # before anything is spawned: a spawned rank has no other source
            raise ConfigError("SPAWN mode needs device_caches: one list per rank of the "
                              "rank's KV cache tensors, each made with "
                              "kvshm.shared_tensor(shape, dtype) (README, API)")
        self.config = config
        self._gpu = gpu_blocks
        self._caches = device_caches
        self._state = EngineState.NEW
        self._server: RendezvousServer | None = None
        self._prov: Provisioned | None = None
        self._channels: dict[int, SchedulerChannel] = {}
        self.manager: OffloadManager | None = None
        self._cpu: BlockPool | None = None
        self._bytes_per_block = 0
        self._admission = Admission()
        self._start_error: BaseException | None = None
        self._started: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: Callable[[], None] | None = None
        self.counters = CoreCounters()
        self._refusals = Refusals(config.name)
        self._opened: float | None = None
        self._ranks = Supervisor(config.world_size, config.hang_timeout_s, self.counters,
                                 spawned=spawned, on_verdict=self._on_verdict,
                                 on_fence=self._on_fence)
        self._jobs = Dispatcher(config.name, self._channels, self._ranks.watch, self.counters)
        self._remote = RemoteLink.none()
        self._disk = DiskLink.none()
        #: the process this runtime belongs to, where that is not this one (a forked
        #: child: :meth:`disown`); None in the process that opened it
        self.owner_pid: int | None = None

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        """The lifecycle state."""
        return self._state

    def open(self) -> None:
        """Listen on the rendezvous (NameInUse if taken): NEW -> STARTING."""
        if self._state is not EngineState.NEW:
            raise StateError(f"engine {self.config.name!r} is {self._state.name}, not NEW")
        self._disk = open_disk(self.config)  # ConfigError: before anything listens
        self._remote = open_remote(self.config)
        try:
            self._server = RendezvousServer(self.config.name, self.config.world_size,
                                            make_ready=self._make_ready,
                                            stats=self._stats_data)
        except BaseException:  # NameInUse: the remote index's thread does not outlive it
            self._remote.close()
            raise
        self._state = EngineState.STARTING
        self._opened = time.monotonic()
        forks.track(self)
        startup.log_opened(self.config)

    def disown(self, owner_pid: int) -> None:
        """This process is a fork of ``owner_pid``, which owns this runtime: CLOSED here,
        touching nothing shared (:mod:`~kvshm.engine.forks`)."""
        self.owner_pid = owner_pid
        self._state = EngineState.CLOSED
        for chan in self._channels.values():
            chan.disown()
        if self._server is not None:
            self._server.disown()
        loop, self._loop, self._on_change = self._loop, None, None
        forks.own_selector(loop)  # last: the rest holds whatever it meets

    def attach_loop(self, loop: asyncio.AbstractEventLoop, on_change: Callable[[], None]) -> None:
        """Drive everything from ``loop``; ``on_change`` runs after each batch of events."""
        assert self._server is not None, "attach_loop before open"
        self._loop, self._on_change = loop, on_change
        self._started = asyncio.Event()
        if self._state is not EngineState.STARTING:
            self._started.set()
        self._server.attach(loop, self._on_events)
        for rank, chan in self._channels.items():
            self._attach_channel(rank, chan)

    def detach_loop(self) -> None:
        """Stop loop callbacks (idempotent); :meth:`pump` still works."""
        if self._loop is None:
            return
        if self._server is not None:
            self._server.detach()
        self._loop = self._on_change = None

    async def wait_started(self) -> None:
        """Until READY or a start failure (attached mode)."""
        assert self._started is not None, "wait_started needs attach_loop"
        await self._started.wait()

    def start_timeout_error(self, timeout_s: float) -> StartTimeout:
        """What a start that ran out of time says (:mod:`~kvshm.engine.startup`): which
        ranks connected, which are missing, what to run, the refusals seen."""
        said = set(self._server.hellos()) if self._server is not None else set()
        return start_timeout_error(self.config, said, self._refusals, timeout_s)

    def raise_if_start_failed(self) -> None:
        """Re-raise what stopped the start (make_ready error, a rank lost while starting)."""
        if self._start_error is not None:
            raise self._start_error

    def begin_close(self) -> None:
        """NEW/STARTING/READY/FAILED -> CLOSING: Shutdown to every live rank."""
        if self._state not in LIVE and self._state is not EngineState.NEW:
            return
        self._state = EngineState.CLOSING
        self._ranks.detach_all("the engine closed")
        for chan in self._channels.values():
            if not chan.closed:
                chan.post(protocol.Shutdown())

    def close(self) -> None:
        """Close channels, segments and the rendezvous (workers see EOF); idempotent."""
        if self._state is EngineState.CLOSED:
            return
        self._state = EngineState.CLOSING
        self.detach_loop()
        for chan in self._channels.values():
            chan.close()
        if self._prov is not None:
            self._prov.close()
        if self._server is not None:
            self._server.close()
        self._remote.close()
        self._ranks.close()
        self._disk.close()
        self._release_unheld()
        self._state = EngineState.CLOSED
        startup.log_closed(self.statistics())
        if self._started is not None:
            self._started.set()

    # -- the scheduler's calls -----------------------------------------------------------
    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """Phase A; 0 until READY, once FAILED, and for a request kept out of the manager
        (:mod:`~kvshm.engine.admission`: ``allocated`` ignores it too)."""
        rid = _request_id(req)
        manager = self.manager
        pre = self._admission.pre_ready  # kept_out, inlined (a call per lookup)
        if manager is None or self._state is not _READY or (pre and rid in pre):
            self.counters.lookups_not_ready += 1
            return 0
        if self._disk.scan is not None:  # a scan that ended counts from this lookup on
            self._apply_warm_scan()
        hit = manager.lookup(req, num_local_tokens)
        if hit is None:
            if manager.disk is not None:
                self._post_reads(manager.plan_reads())
        else:
            counters = self.counters
            more = req.num_tokens - num_local_tokens
            if more > 0:
                counters.lookup_tokens += more
            if hit > 0:
                counters.lookups_hit += 1
        if log.isEnabledFor(_DEBUG):
            log.debug("kvshm engine %r: lookup %r: %s CPU hit token(s) beyond %d local",
                      self.config.name, rid, hit, num_local_tokens)
        return hit

    def lookup_skipped(self, req: RequestView) -> None:
        """Phase A for a request the engine recomputes whatever the tiers hold
        (``OffloadManager.lookup_skipped``); nothing until READY or for a request kept
        out of the manager."""
        rid = _request_id(req)
        manager = self.manager
        pre = self._admission.pre_ready
        if manager is not None and self._state is _READY and not (pre and rid in pre):
            manager.lookup_skipped(req)

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """Phase B (ignored before READY: every lookup then returned 0)."""
        if type(req_id) is not str:
            check_id("allocated", req_id)
        manager = self.manager
        pre = self._admission.pre_ready
        if manager is None or (pre and req_id in pre):
            return
        manager.allocated(req_id, gpu_block_ids, num_external_tokens)

    def step(self, inp: StepInput) -> StepPlan:
        """Build this step's plan and post its transfers to every live rank."""
        manager = self.manager
        if manager is None:
            self._admission.before_ready(inp)
            return StepPlan(inp.step)
        if self._disk.scan is not None:
            self._apply_warm_scan()
        plan = manager.build_step(self._admission.admitted(inp))
        self._admission.stepped(inp)
        self._post_reads(plan.disk)  # before the store: WRITEs of the rows it reuses
        for t in (plan.store, plan.load):
            if t is not None:
                self._jobs.post(t)
        self._post_reads(plan.remote)
        return plan

    @property
    def disk_warming(self) -> bool:
        """The disk tier's start scan has not been applied yet (the tier serves nothing):
        a host that waits for a restart's warm slots asks again meanwhile."""
        return self._disk.scan is not None

    def _release_unheld(self) -> None:
        """The close's release of what no rank holds (queued loads, finish-time stores,
        hits: :meth:`OffloadManager.close`), after every resource is closed: a bug
        raised here must not leave segments or the rendezvous behind (logged)."""
        if self.manager is None:
            return
        try:
            self.manager.close()
        except Exception:  # noqa: BLE001 - the close must end; the pins stay put
            log.exception("kvshm engine %r: releasing pins at close failed", self.config.name)

    def ranks_stopped(self, ranks: Iterable[int]) -> None:
        """After the close: ``ranks`` are proven stopped (their processes reaped), so
        the pins of the jobs they had not acked go (:meth:`OffloadManager.close`)."""
        if self.manager is not None:
            self.manager.close(ranks)

    def _apply_warm_scan(self) -> None:
        """The disk tier warms (:mod:`kvshm.engine.warm_scan`): its scan's result, once
        it has ended, from the scheduler's own thread (each step, pump, tick and
        lookup)."""
        manager = self.manager
        self._disk.poll(None if manager is None else manager.disk)

    def _post_reads(self, msgs: Sequence[Remote | Disk]) -> None:
        """Post remote and disk jobs to every live rank (a step's, or a lookup's READs:
        with a disk tier a lookup that answers "ask again" for a disk hit posts its READ
        at once, and a worker that watches its ring starts it before the next step)."""
        manager = self.manager
        assert manager is not None
        for msg in msgs:
            for rank in self._jobs.post_remote(msg):
                manager.on_done(msg.job_id, rank, False)  # never sent: fails, unpins

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]], *,
                 tail_hash: bytes | None = None) -> bool:
        """The request is done; always False (pins, not delayed frees)."""
        if type(req_id) is not str:
            check_id("finished", req_id)
        if (self._admission.pre_ready and self._admission.finish(req_id)
                or self.manager is None):
            return False
        return self.manager.finished(req_id, num_confirmed_tokens, gpu_block_ids,
                                     tail_hash=tail_hash)

    def transfer_params(self, req_id: str) -> dict[str, Any] | None:
        """A finished P/D prefill request's ``kv_transfer_params`` (once), else None."""
        if type(req_id) is not str:
            check_id("transfer_params", req_id)
        return None if self.manager is None else self.manager.transfer_params(req_id)

    def reset(self) -> bool:
        """Drop the CPU index, abandon the jobs in flight; True once they are done."""
        return self.manager is None or self.manager.reset()

    def remove_orphan_slabs(self) -> int:
        """The disk slabs of a generated name that no process holds any more (ranks that
        died, or were killed at close, before removing their own); call it again once
        the ranks are stopped (:meth:`DiskLink.close`; never raises)."""
        return self._disk.close()

    def reset_done(self) -> bool:
        """True once the jobs the last :meth:`reset` abandoned are done."""
        return self.manager is None or self.manager.reset_done()

    def fetch_to_plan(self) -> bool:
        """A lower tier's fetch waits for the next plan (``OffloadManager.fetch_to_plan``)."""
        return self.manager is not None and self.manager.fetch_to_plan()

    def has_pending_work(self) -> bool:
        """True while any job is queued, in flight or not yet acked by every live rank."""
        return self.manager is not None and self.manager.has_pending_work()

    def settle(self, limit: int = 0) -> bool:
        """The CPU tier's deferred eviction bookkeeping, now, at most ``limit`` items
        (``OffloadManager.settle``; True while some is left)."""
        return self.manager is not None and self.manager.settle(limit)

    def jobs_in_flight(self) -> int:
        """Jobs posted and not yet acked by every live rank."""
        return 0 if self.manager is None else self.manager.num_jobs_in_flight

    def take_load_results(self) -> list[LoadResult]:
        """Load outcomes decided since the last call, each exactly once: the manager's
        queue is the only one (nothing is copied on the way)."""
        return [] if self.manager is None else self.manager.take_load_results()

    # -- event intake ------------------------------------------------------------------
    def pump(self, *, rendezvous: bool = True) -> None:
        """Sync mode: service the rendezvous, drain every done ring, check for hangs.
        A channel's overflow is flushed before its receive only when it has one (the
        flush does nothing else); while READY the hang check runs without :meth:`tick`'s
        other tests (they act only outside READY). ``rendezvous=False`` while READY
        leaves the rendezvous (its sockets: a rank's EOF or Goodbye, a stats query) to
        the next pump that services it: a host that pumps several times a step reads
        them once (``SyncClient.poll``); in any other state (the handshake, a drain) it
        is serviced regardless."""
        state = self._state
        if self._server is not None and (rendezvous if state is _READY else state in LIVE):
            events = self._server.service()
            if events:
                self._on_events(events, notify=False)
        self._receive_all()
        if self._state is _READY:
            self._ranks.check_hangs(time.monotonic())
            if self._disk.scan is not None:
                self._apply_warm_scan()
        else:
            self.tick(time.monotonic())

    def _receive_all(self) -> None:
        """Drain every open done ring (its overflow flushed first, where it has one),
        without waiting; no ``on_change`` (the caller publishes)."""
        for rank, chan in list(self._channels.items()):
            if chan.closed:
                continue
            if chan.overflow_depth:
                chan.flush_overflow()
            try:
                dones = chan.receive_nowait()
            except TransportError as exc:
                good = chan.take_salvaged()
                if good:
                    self._on_dones(rank, good, notify=False)
                self._on_channel_error(rank, exc, notify=False)
                continue
            if dones:
                self._on_dones(rank, dones, notify=False)

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _on_events(self, events: list[RendezvousEvent], notify: bool = True) -> None:
        for ev in events:
            if ev.kind is EventKind.HELLO:
                self._ranks.watch[ev.rank].hello(ev.pid, self._hello_of(ev.rank))
            elif ev.kind is EventKind.ALL_READY:
                try:
                    self._all_ready()
                except Exception as exc:  # noqa: BLE001 - the start fails now, with the
                    self._start_failed(exc)  # cause (in a loop callback it was swallowed
                    # and the launch waited its whole connect timeout, blaming the ranks)
            elif ev.kind is EventKind.READY_FAILED:
                self._start_failed(ev.error or ConfigError(ev.reason))
            elif ev.kind is EventKind.RANK_LOST and ev.farewell \
                    and self._state in (EngineState.READY, EngineState.STOPPED,
                                        EngineState.FAILED):
                self._ranks.rank_left(ev.rank, ev.farewell)  # a departure, not a death
            elif ev.kind is EventKind.RANK_LOST:
                # the worker's own close is a fence (it closes only after its last
                # copy); a close by the server is not: the rank may still be copying
                self.rank_died(ev.rank, None, why=f"lifeline lost: {ev.reason}",
                               fenced=ev.peer_closed, notify=False)
            else:
                self.counters.refused += 1
                self._refusals.record(ev.reason, ev.counter.value if ev.counter else "refused")
        if notify:
            self._notify()

    def _hello_of(self, rank: int) -> Hello | None:
        assert self._server is not None
        return self._server.hellos().get(rank)

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[protocol.Ready,
                                                                          list[int]]]:
        cfg = self.config
        target = None if cfg.remote_url is None else RemoteTarget(
            cfg.remote_url, cfg.model_id, cfg.block_size, cfg.groups, (cfg.tp, cfg.pp))
        self._prov = provision(hellos, world_size=cfg.world_size, device_caches=self._caches,
                               num_cpu_blocks=cfg.num_cpu_blocks,
                               cpu_bytes_per_rank=cfg.cpu_bytes_per_rank,
                               capacity=cfg.ring_capacity,
                               num_gpu_blocks=pool_size(self._gpu), remote=target,
                               disk=self._disk.make_setups if cfg.disk_path else None)
        return self._prov.ready_plan()

    def _all_ready(self) -> None:
        prov = self._prov
        assert prov is not None
        prov.close_sent_fds()
        if self._state is not EngineState.STARTING:
            return  # a rank was lost meanwhile: FAILED already
        for rank, res in prov.ranks.items():
            chan = res.make_channel()
            self._channels[rank] = chan
            self._ranks.watch[rank].ready(chan)
            if self._loop is not None:
                self._attach_channel(rank, chan)
        cfg = self.config
        self._bytes_per_block = sum(r.ready.layout.bytes_per_block for r in prov.ranks.values())
        # block_tokens: the adaptive order weighs a block by its tokens' prefill compute
        self._cpu = BlockPool(prov.num_cpu_blocks, eviction=cfg.eviction,
                              block_tokens=cfg.block_size)
        record = min(c.max_record for c in self._channels.values())
        self.manager = OffloadManager(self._cpu, self._gpu, block_size=cfg.block_size,
                                      groups=cfg.groups, world_size=cfg.world_size,
                                      mode=cfg.mode,
                                      remote=self._remote.book_factory(prov.remote, record),
                                      disk=self._disk.book_factory(record))
        self._state = EngineState.READY
        startup.log_ready(cfg, prov.num_cpu_blocks, self._bytes_per_block)
        if self._started is not None:
            self._started.set()

    def _start_failed(self, error: BaseException) -> None:
        if self._prov is not None:
            self._prov.close()
        self._start_error = error
        self._state = EngineState.FAILED
        log.error("kvshm engine %r: start FAILED: %s", self.config.name, error)
        if self._started is not None:
            self._started.set()

    def _attach_channel(self, rank: int, chan: SchedulerChannel) -> None:
        assert self._loop is not None
        chan.attach(self._loop, partial(self._on_dones, rank),
                    partial(self._on_channel_error, rank))

    def _on_dones(self, rank: int, dones: list[protocol.Done], notify: bool = True) -> None:
        """Apply a batch of Dones from ``rank`` (:meth:`Dispatcher.apply
        <kvshm.engine.dispatch.Dispatcher.apply>`: one bad Done fails only its job)."""
        self._jobs.apply(rank, dones, self.manager)
        if notify:
            self._notify()

    def _on_channel_error(self, rank: int, exc: TransportError, notify: bool = True) -> None:
        self.counters.protocol_errors += 1
        self.rank_died(rank, None, why=f"broken ring: {exc}", revoke=RevokeReason.BROKEN_RING,
                       notify=notify)

    # -- failure handling --------------------------------------------------------------
    def set_killer(self, kill: Callable[[int], None]) -> None:
        """``kill(rank)``: SIGKILL a rank this engine spawned (SPAWN mode); its pidfd then
        reports the exit, which fences the rank (:meth:`rank_died` with ``fenced``)."""
        self._ranks.set_killer(kill)

    def rank_died(self, rank: int, exitcode: int | None, *, why: str = "process exited",
                  fenced: bool = False, revoke: RevokeReason = RevokeReason.DIED,
                  notify: bool = True) -> None:
        """``rank`` is gone or must be treated so: the verdict (once), then the fence if
        ``fenced`` (its process exited, or it closed its lifeline itself); until then
        its unacked jobs' blocks stay quarantined. Ignored once closing. Rules and
        ordering: :mod:`~kvshm.engine.supervision`."""
        if self._state in ENDED:
            return
        self._ranks.rank_died(rank, exitcode, why=why, fenced=fenced, revoke=revoke)
        if notify:
            self._notify()

    def _on_verdict(self, rank: int, exitcode: int | None, revoke: RevokeReason) -> None:
        """The verdict's consequences: the rank's ring is revoked and its channel closed,
        then the start fails (STARTING) or its jobs fail and the engine is FAILED."""
        chan = self._channels.get(rank)
        if chan is not None:
            chan.revoke(revoke)
            chan.close()
        if self._state is EngineState.STARTING:
            self._start_failed(WorkerDied(rank, exitcode))
        elif self.manager is not None:
            self.manager.rank_failed(rank)
            self._jobs.forget_posted()
            why = self._ranks.watch[rank].why
            if revoke is RevokeReason.LEFT:
                if self._state is EngineState.READY:
                    self._state = EngineState.STOPPED
                    log.info("kvshm engine %r STOPPED: rank %d %s; serving goes on without "
                             "offload", self.config.name, rank, why)
                return
            first = self._state is not EngineState.FAILED
            self._state = EngineState.FAILED
            if first:
                log.error("kvshm engine %r FAILED: rank %d %s; serving goes on without "
                          "offload", self.config.name, rank, why)

    def _on_fence(self, rank: int) -> None:
        """The fence's consequence: the rank's quarantined pins are released."""
        if self.manager is not None:
            self.manager.rank_fenced(rank)

    def tick(self, now: float) -> None:
        """Hang check (after draining the done rings: a Done already there is no hang),
        and the fence of quarantined ranks whose process has exited since; call a few
        times a second (the engine's timer, or every pump)."""
        if self._state in (EngineState.FAILED, EngineState.STOPPED):
            self._ranks.fence_exited()
        if self._state is not EngineState.READY:
            return
        # what the ranks answered first: after a stall of the scheduler's own loop the
        # tick may run before the doorbells' callbacks, with every Done unread in the
        # rings, and healthy ranks were judged hung and killed
        self._receive_all()
        if self._state is EngineState.READY:
            self._ranks.check_hangs(now)
            if self._disk.scan is not None:
                self._apply_warm_scan()

    # -- statistics --------------------------------------------------------------------
    def statistics(self) -> EngineStats:
        """A snapshot (valid in every state)."""
        up = time.monotonic() - self._opened if self._opened is not None else 0.0
        return build_stats(self.config, self._state.value, self.manager, self._cpu,
                           self._bytes_per_block, self._ranks.snapshots(), self.counters,
                           uptime_s=up)

    def _stats_data(self) -> dict[str, Any]:
        return self.statistics().as_dict()
