"""Runtime: the scheduler side shared by ``Engine`` (asyncio) and ``SyncClient``.

It owns the rendezvous server, the provisioned per-rank resources, one
:class:`~kvshm.ipc.sched_channel.SchedulerChannel` per rank, the CPU :class:`~kvshm.offload.pool.BlockPool`
and the :class:`~kvshm.offload.manager.OffloadManager`. It does no waiting of its own: events
come in through :meth:`pump` (the sync client, at the start of every call) or through
loop callbacks (:meth:`attach_loop`). Every method runs on one thread.

Lifecycle (:class:`EngineState`)::

    NEW --open--> STARTING --every rank Ready--> READY --begin_close--> CLOSING --close--> CLOSED
                     |                             |
                     +-- make_ready failed,        +-- a rank died / hung / broke its ring
                         a rank lost --> FAILED <--+

Rules kept here:

* Before READY there is no manager: ``lookup`` returns 0 and ``step`` plans nothing.
  Requests listed in a step before READY are remembered and kept away from the manager
  afterwards (it never saw them arrive, so it cannot track their tables); they finish
  without offload.
* A plan's transfers are posted to every live rank in plan order (store, then load),
  so a rank sees jobs in job-id order. A full ring queues (``post``), never blocks.
* Each batch of ``Done``s goes to ``OffloadManager.on_done``; the load outcomes it
  decides stay in the manager's queue until :meth:`take_load_results`.
* A rank is declared dead on lifeline EOF, pidfd exit (spawned), a broken ring, or a
  hang: Transfers outstanding and no Done from it for ``hang_timeout_s`` -- for an
  embedded rank only ticks in which its heartbeat advanced count (its host engine was
  calling it). Then ``manager.rank_failed`` runs and the engine is FAILED: serving goes
  on without offload; nothing waits on the dead rank.
* **A block that a rank may still touch is never handed out again until that rank is
  fenced.** Declared dead is not fenced: the verdict sets the rank's revocation word
  (so a rank that resumes starts nothing and publishes nothing) and fails its jobs, but
  their pins stay (quarantined, ``quarantined_*_blocks`` in the statistics) until a
  proof that nothing of the rank runs any more: its process exited (spawned ranks are
  SIGKILLed at the verdict and watched by pidfd; every rank's process by a pidfd
  opened at its Hello) or its lifeline closed -- kvshm's worker closes its socket only
  once none of its copies runs (``Worker.close`` waits for them; a detached or revoked
  worker keeps the socket until they finish). A rank that stays hung gives neither:
  for an embedded rank inside a live host process its quarantine then lasts for the
  engine's life (:meth:`rank_died`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from enum import Enum
from functools import partial
from typing import Any

import torch

from kvshm.ipc import protocol
from kvshm.config import EngineConfig
from kvshm.engine.supervision import CoreCounters, RankWatch, build_stats
from kvshm.errors import ConfigError, InvalidRequest, StateError, TransportError, WorkerDied
from kvshm.offload.manager import OffloadManager
from kvshm.offload.pool import BlockPool
from kvshm.ipc.protocol import Direction, Hello
from kvshm.engine.provision import Provisioned, check_block_counts, device_layout, provision
from kvshm.ipc.rendezvous import EventKind, RendezvousEvent, RendezvousServer
from kvshm.ipc.ring_pair import RevokeReason
from kvshm.ipc.sched_channel import SchedulerChannel
from kvshm.stats import EngineStats
from kvshm.types import GpuBlocks, LoadResult, RequestView, StepInput, StepPlan

__all__ = ["Runtime", "EngineState"]

_log = logging.getLogger("kvshm.engine.runtime")


def _ranges(ranks: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    out: list[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


def _check_id(call: str, req_id: object) -> None:
    """A request id must be a str (InvalidRequest otherwise) before it meets a set."""
    if not isinstance(req_id, str):
        raise InvalidRequest(call, None, "req_id", f"must be a str, got {req_id!r}")


def _pool_size(gpu: GpuBlocks) -> int | None:
    """The GPU pool's block count where the pool tells it (kvshm's BlockPool does)."""
    n = getattr(gpu, "num_blocks", None)
    return n if isinstance(n, int) else None


def _check_caches(caches: Sequence[Sequence[torch.Tensor]], world_size: int,
                  num_gpu_blocks: int | None) -> None:
    """Refuse bad ``device_caches`` before anything is spawned (ConfigError)."""
    if len(caches) != world_size:
        raise ConfigError(f"device_caches has {len(caches)} entries, "
                          f"world_size is {world_size}")
    layouts = {r: device_layout(ts) for r, ts in enumerate(caches) if ts}
    check_block_counts(layouts, num_gpu_blocks)


class EngineState(Enum):
    """Lifecycle of an engine (see the module docstring)."""

    NEW = "new"
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"
    CLOSING = "closing"
    CLOSED = "closed"


_LIVE = (EngineState.STARTING, EngineState.READY, EngineState.FAILED)


class Runtime:
    """See the module docstring. ``spawned``: kvshm started the workers (pidfds)."""

    def __init__(self, config: EngineConfig, *, gpu_blocks: GpuBlocks,
                 device_caches: Sequence[Sequence[torch.Tensor]] | None = None,
                 spawned: bool = False) -> None:
        if device_caches is not None:
            _check_caches(device_caches, config.world_size, _pool_size(gpu_blocks))
        self.config = config
        self._gpu = gpu_blocks
        self._caches = device_caches
        self._spawned = spawned
        self._state = EngineState.NEW
        self._server: RendezvousServer | None = None
        self._prov: Provisioned | None = None
        self._channels: dict[int, SchedulerChannel] = {}
        self._watch: dict[int, RankWatch] = {r: RankWatch(r) for r in range(config.world_size)}
        self.manager: OffloadManager | None = None
        self._cpu: BlockPool | None = None
        self._bytes_per_block = 0
        self._pre_ready: set[str] = set()
        self._start_error: BaseException | None = None
        self._started: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_change: Callable[[], None] | None = None
        self._posted: dict[int, tuple[float, int]] = {}
        self._kill: Callable[[int], None] | None = None
        self._logged: set[str] = set()
        self.counters = CoreCounters()

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def state(self) -> EngineState:
        """The lifecycle state."""
        return self._state

    def open(self) -> None:
        """Listen on the rendezvous (NameInUse if taken): NEW -> STARTING."""
        if self._state is not EngineState.NEW:
            raise StateError(f"engine {self.config.name!r} is {self._state.name}, not NEW")
        self._server = RendezvousServer(self.config.name, self.config.world_size,
                                        make_ready=self._make_ready, stats=self._stats_data)
        self._state = EngineState.STARTING

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

    def start_timeout_error(self, timeout_s: float) -> TimeoutError:
        """What a start that ran out of time says: which ranks said Hello, which never
        did (listed compactly), and what to run for them."""
        said = set(self._server.hellos()) if self._server is not None else set()
        ws = self.config.world_size
        missing = [r for r in range(ws) if r not in said]
        return TimeoutError(
            f"kvshm engine {self.config.name!r}: {len(said)} of {ws} ranks said Hello "
            f"within {timeout_s:g}s; never heard from rank(s) {_ranges(missing)}. "
            f"Standalone workers: kvshm-workers --name {self.config.name} --world-size {ws}"
            "; embedded ones attach from the serving engine's worker processes.")

    def raise_if_start_failed(self) -> None:
        """Re-raise what stopped the start (make_ready error, a rank lost while starting)."""
        if self._start_error is not None:
            raise self._start_error

    def begin_close(self) -> None:
        """READY/FAILED/STARTING -> CLOSING: Shutdown to every live rank."""
        if self._state not in _LIVE and self._state is not EngineState.NEW:
            return
        self._state = EngineState.CLOSING
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
        for watch in self._watch.values():
            watch.close()
        self._state = EngineState.CLOSED
        if self._started is not None:
            self._started.set()

    # -- event intake ------------------------------------------------------------------
    def pump(self) -> None:
        """Sync mode: service the rendezvous, drain every done ring, check for hangs."""
        if self._server is not None and self._state in _LIVE:
            events = self._server.service()
            if events:
                self._on_events(events, notify=False)
        for rank, chan in list(self._channels.items()):
            if chan.closed:
                continue
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
        self.tick(time.monotonic())

    def _notify(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def _on_events(self, events: list[RendezvousEvent], notify: bool = True) -> None:
        for ev in events:
            if ev.kind is EventKind.HELLO:
                self._watch[ev.rank].hello(ev.pid, self._hello_of(ev.rank))
            elif ev.kind is EventKind.ALL_READY:
                self._all_ready()
            elif ev.kind is EventKind.READY_FAILED:
                self._start_failed(ev.error or ConfigError(ev.reason))
            elif ev.kind is EventKind.RANK_LOST:
                # the worker's own close is a fence (it closes only after its last
                # copy); a close by the server is not: the rank may still be copying
                self.rank_died(ev.rank, None, why=f"lifeline lost: {ev.reason}",
                               fenced=ev.peer_closed, notify=False)
            else:
                self.counters.refused += 1
        if notify:
            self._notify()

    def _hello_of(self, rank: int) -> Hello | None:
        assert self._server is not None
        return self._server.hellos().get(rank)

    def _make_ready(self, hellos: Mapping[int, Hello]) -> dict[int, tuple[protocol.Ready,
                                                                          list[int]]]:
        cfg = self.config
        self._prov = provision(hellos, world_size=cfg.world_size, device_caches=self._caches,
                               num_cpu_blocks=cfg.num_cpu_blocks,
                               cpu_bytes_per_rank=cfg.cpu_bytes_per_rank,
                               capacity=cfg.ring_capacity,
                               num_gpu_blocks=_pool_size(self._gpu))
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
            self._watch[rank].ready(chan)
            if self._loop is not None:
                self._attach_channel(rank, chan)
        cfg = self.config
        self._bytes_per_block = sum(r.ready.layout.bytes_per_block for r in prov.ranks.values())
        self._cpu = BlockPool(prov.num_cpu_blocks)
        self.manager = OffloadManager(self._cpu, self._gpu, block_size=cfg.block_size,
                                      groups=cfg.groups, world_size=cfg.world_size,
                                      mode=cfg.mode)
        self._state = EngineState.READY
        if self._started is not None:
            self._started.set()

    def _start_failed(self, error: BaseException) -> None:
        if self._prov is not None:
            self._prov.close()
        self._start_error = error
        self._state = EngineState.FAILED
        if self._started is not None:
            self._started.set()

    def _attach_channel(self, rank: int, chan: SchedulerChannel) -> None:
        assert self._loop is not None
        chan.attach(self._loop, partial(self._on_dones, rank),
                    partial(self._on_channel_error, rank))

    def _on_dones(self, rank: int, dones: list[protocol.Done], notify: bool = True) -> None:
        """Apply a batch of Dones from ``rank``. An exception while applying one fails
        that job only (counted in ``done_errors``, logged once per kind); every other
        Done of the batch is still applied and the load outcomes of the whole batch are
        collected in the same pass."""
        now = time.monotonic()
        watch = self._watch[rank]
        manager = self.manager
        for d in dones:
            try:
                watch.acked(now, d.ok, self._ack_latency(d.job_id, now))
                if manager is not None:
                    manager.on_done(d.job_id, rank, d.ok)
            except Exception as exc:  # noqa: BLE001 - one bad Done must not lose the rest
                self._done_failed(rank, d, exc)
        chan = self._channels.get(rank)
        if chan is not None and not chan.closed and chan.overflow_depth:
            chan.flush_overflow()
        if notify:
            self._notify()

    def _done_failed(self, rank: int, done: protocol.Done, exc: Exception) -> None:
        """Applying ``done`` raised: count and log it, and fail its job (best effort:
        a second failure is only counted)."""
        self.counters.done_errors += 1
        key = type(exc).__name__
        if key not in self._logged:
            self._logged.add(key)
            _log.error("kvshm %s: applying Done(job %d) from rank %d failed; that job is "
                       "failed, the rest of the batch goes on", self.config.name,
                       done.job_id, rank, exc_info=exc)
        if self.manager is not None and done.ok:
            try:
                self.manager.on_done(done.job_id, rank, False)
            except Exception:  # noqa: BLE001 - counted above; the job may be gone
                self.counters.done_errors += 1

    def _ack_latency(self, job_id: int, now: float) -> float | None:
        entry = self._posted.get(job_id)
        if entry is None:
            return None
        posted, left = entry
        if left <= 1:
            del self._posted[job_id]
        else:
            self._posted[job_id] = (posted, left - 1)
        return now - posted

    def _on_channel_error(self, rank: int, exc: TransportError, notify: bool = True) -> None:
        self.counters.protocol_errors += 1
        self.rank_died(rank, None, why=f"broken ring: {exc}", revoke=RevokeReason.BROKEN_RING,
                       notify=notify)

    # -- failure handling --------------------------------------------------------------
    def set_killer(self, kill: Callable[[int], None]) -> None:
        """``kill(rank)``: SIGKILL a rank this engine spawned (SPAWN mode); its pidfd then
        reports the exit, which fences the rank (:meth:`rank_died` with ``fenced``)."""
        self._kill = kill

    def rank_died(self, rank: int, exitcode: int | None, *, why: str = "process exited",
                  fenced: bool = False, revoke: RevokeReason = RevokeReason.DIED,
                  notify: bool = True) -> None:
        """``rank`` is gone or must be treated so: the verdict, then maybe the fence.

        Verdict (once): the revocation word is set and the channel closed, its jobs fail
        (loads: recompute), the engine is FAILED. The blocks of its unacked jobs stay
        pinned (quarantined) until it is *fenced* -- ``fenced=True``: its process exited
        (pidfd; :meth:`tick` also checks the pidfd opened at every rank's Hello), or its
        lifeline closed (kvshm's worker closes it only after its last copy finished). A
        spawned rank is SIGKILLed at the verdict, so its fence follows in milliseconds;
        a rank that stays hung in a live process (embedded, or standalone that kvshm may
        not signal) stays quarantined.
        """
        if self._state in (EngineState.CLOSING, EngineState.CLOSED):
            return
        watch = self._watch[rank]
        if watch.alive:
            self._verdict(rank, exitcode, why, revoke)
            if not fenced and self._spawned and self._kill is not None:
                self._kill(rank)
        if fenced and not watch.fenced:
            watch.fenced = True
            if self.manager is not None:
                self.manager.rank_fenced(rank)
        if notify:
            self._notify()

    def _verdict(self, rank: int, exitcode: int | None, why: str,
                 revoke: RevokeReason) -> None:
        self._watch[rank].died(exitcode, why)
        self.counters.ranks_failed += 1
        chan = self._channels.get(rank)
        if chan is not None:
            chan.revoke(revoke)
            chan.close()
        if self._state is EngineState.STARTING:
            self._start_failed(WorkerDied(rank, exitcode))
        elif self.manager is not None:
            self.manager.rank_failed(rank)
            self._posted.clear()
            self._state = EngineState.FAILED

    def tick(self, now: float) -> None:
        """Hang check, and the fence of quarantined ranks whose process has exited since;
        call a few times a second (the engine's timer, or every pump)."""
        if self._state is EngineState.FAILED:
            self._fence_exited()
        if self._state is not EngineState.READY:
            return
        for rank, watch in self._watch.items():
            if watch.alive and watch.stalled_for(now) >= self.config.hang_timeout_s:
                self.counters.hangs += 1
                self.rank_died(rank, None, why=f"hung: no job completed for "
                               f"{self.config.hang_timeout_s}s with jobs pending",
                               revoke=RevokeReason.HUNG, notify=False)

    def _fence_exited(self) -> None:
        for rank, watch in self._watch.items():
            if not watch.alive and not watch.fenced and watch.process_exited():
                self.rank_died(rank, None, fenced=True, notify=False)

    # -- scheduler calls ---------------------------------------------------------------
    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """Phase A; 0 until READY, once FAILED, and for a request listed in a step
        before READY (the manager does not track it, so ``allocated`` ignores it: a hit
        here would be a pin nobody releases and a load nobody reports)."""
        _check_id("lookup", req.req_id)
        if (self.manager is None or self._state is not EngineState.READY
                or req.req_id in self._pre_ready):
            self.counters.lookups_not_ready += 1
            return 0
        return self.manager.lookup(req, num_local_tokens)

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """Phase B (ignored before READY: every lookup then returned 0)."""
        _check_id("allocated", req_id)
        if self.manager is None or req_id in self._pre_ready:
            return
        self.manager.allocated(req_id, gpu_block_ids, num_external_tokens)

    def step(self, inp: StepInput) -> StepPlan:
        """Build this step's plan and post its transfers to every live rank."""
        manager = self.manager
        pre = self._pre_ready
        if manager is None or pre:  # the ids go into a set first: check them first
            for rid in (*(r.req_id for r in inp.requests), *inp.finished):
                _check_id("build_step", rid)
        if manager is None:
            pre.update(r.req_id for r in inp.requests)
            pre.difference_update(inp.finished)
            return StepPlan(inp.step)
        if pre:
            plan = manager.build_step(replace(
                inp, requests=[r for r in inp.requests if r.req_id not in pre],
                finished=[f for f in inp.finished if f not in pre]))
            pre.difference_update(inp.finished)  # only once the call went through
        else:
            plan = manager.build_step(inp)
        for t in (plan.store, plan.load):
            if t is not None:
                self._post(t)
        return plan

    def _post(self, t: protocol.Transfer) -> None:
        live = [r for r, c in self._channels.items() if not c.closed]
        now = time.monotonic()
        self._posted[t.job_id] = (now, len(live))
        for rank in live:
            self._channels[rank].post(t)
            self._watch[rank].posted(now)
        if t.direction is Direction.STORE:
            self.counters.store_jobs += 1
        else:
            self.counters.load_jobs += 1

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]]) -> bool:
        """The request is done; always False (pins, not delayed frees)."""
        _check_id("finished", req_id)
        if req_id in self._pre_ready:
            self._pre_ready.discard(req_id)
            return False
        if self.manager is None:
            return False
        out = self.manager.finished(req_id, num_confirmed_tokens, gpu_block_ids)
        return out

    def reset(self) -> bool:
        """Drop the CPU index; True once nothing is in flight."""
        if self.manager is None:
            return True
        done = self.manager.reset()
        return done

    def has_pending_work(self) -> bool:
        """True while any job is queued, in flight or not yet acked by every live rank."""
        return self.manager is not None and self.manager.has_pending_work()

    def jobs_in_flight(self) -> int:
        """Jobs posted and not yet acked by every live rank."""
        return 0 if self.manager is None else self.manager.num_jobs_in_flight

    def take_load_results(self) -> list[LoadResult]:
        """Load outcomes decided since the last call, each exactly once: the manager's
        queue is the only one (nothing is copied on the way)."""
        return [] if self.manager is None else self.manager.take_load_results()

    # -- statistics --------------------------------------------------------------------
    def statistics(self) -> EngineStats:
        """A snapshot (valid in every state)."""
        return build_stats(self.config, self._state.value, self.manager, self._cpu,
                           self._bytes_per_block, self._watch, self.counters)

    def _stats_data(self) -> dict[str, Any]:
        return self.statistics().as_dict()
