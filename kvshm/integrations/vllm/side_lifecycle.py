"""The vLLM scheduler side's lifecycle: bind, the idle-time service thread, shutdown and
statistics.

:class:`SideLifecycle` is a component the vLLM scheduler side
(:class:`~kvshm.integrations.vllm.scheduler.SchedulerSide`) holds as ``side.life``. It owns
the kvshm client (None before ``bind``), the service thread, the closed flag, the
service thread's READY snapshots and the statistics reports' clock and builder. It is
handed the side's hook lock and connector counters (shared, the side's), a read-only view
of the requests the side knows of (to tell when the side is idle) and the side's
``absorb`` (what to do with the client's load results; always called under the lock).

Ordering and invariants:

* ``bind`` creates the client and starts the service thread under the hooks' lock, once;
  until then every hook that needs the client raises ``StateError`` (``client``);
  ``bound_client`` is None until then, then the client for good (the side's hooks read
  it directly: one attribute read, no call).
* The service thread pumps only under the lock and only while the hooks are idle
  (:mod:`~kvshm.integrations.vllm.service`); it keeps the latest READY statistics and the
  ones from before the pump that saw READY end, so a shutdown after the workers left
  still writes what the engine did.
* ``report`` (vLLM's ``get_kv_connector_stats``, under the lock) builds a statistics
  report when :class:`~kvshm.integrations.vllm.reports.ReportClock` says one is due --
  at most once a second while busy, once when the side goes idle (no request it knows
  of, no kvshm work pending) or is idle after a lookup since the last report -- and
  rewrites ``stats_path`` with the same snapshot
  (``live``), so a SIGKILLed engine core leaves its last report's statistics there.
* ``shutdown`` stops and joins the service thread first, then (under the lock) drains
  the jobs in flight for at most ``shutdown_timeout_s``, takes the snapshot the file
  carries (:mod:`~kvshm.integrations.vllm.final_stats`), closes the client and writes
  ``stats_path``; it logs the final-statistics line unless its reports were shipped to
  vLLM's front end in another process (``mark_shipped``; that process, which outlives
  this one, logs it: ``final_stats.FinalLines``), then the ``closed`` line; a second
  call does nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from kvshm.config import EngineConfig
from kvshm.engine import EngineState, SyncClient
from kvshm.engine.lifecycle import LIVE
from kvshm.errors import ConfigError, StateError
from kvshm.integrations.vllm.blocks import VllmGpuBlocks
from kvshm.integrations.vllm.config import ConnectorConfig, lower_tiers_text, tier_text
from kvshm.integrations.vllm.final_stats import (
    DETACH_WINDOW_S,
    FINAL_LINES,
    SnapshotSource,
    final_statistics,
    live_statistics,
    write_json,
)
from kvshm.integrations.vllm.records import SchedulerCounters
from kvshm.integrations.vllm.reports import ReportBuilder, ReportClock
from kvshm.integrations.vllm.service import HookGuard, ServiceThread

__all__ = ["PUMP_SETTLE_EVENTS", "SNAPSHOT_MAX_AGE_S", "SideLifecycle"]

log = logging.getLogger("kvshm.vllm")

#: The oldest READY snapshot the service thread keeps (seconds): while requests are
#: served it is refreshed no more often (``SideLifecycle._idle_pump``).
SNAPSHOT_MAX_AGE_S: Final = 1.0
#: The most eviction-simulation events one pump of the service thread applies
#: (``SyncClient.settle(limit)``, about 1 ms of CPU at 30-36 us an event). The pump holds
#: the hook guard, so the next hook -- often the next request's lookup -- waits for
#: the whole settle, and on a loaded 2-core machine the service thread is preempted
#: inside it: whole-log settles gave kvshm's arm 16-20 TTFT spikes of 10 ms or more
#: per 128 rag requests at half capacity where the oracle arm (no simulations) had 6-11,
#: and a mean 0.93-0.98 of vLLM's connector (``tools.bench_e2e``, load 2-4); with 32 a
#: pump, 3-7 against 8-11 and 1.00 (two rag-only runs), then 8, 8 and 13 against 13, 10
#: and 5 and 0.97-1.00 (three full runs, docs/benchmarks.md): fewer, not gone -- the
#: pump's poll and snapshot still hold the guard. A pump every 20 ms of idleness applies
#: up to 1,600 events a second, several times what traffic logs (rag: 2,913 events in
#: the arm's 9 s of serving); what is left waits for the next pump, or for the order's
#: own full settle before a decision (as everything did before when no pump ran).
PUMP_SETTLE_EVENTS: Final = 32


class SideLifecycle:
    """See the module docstring. ``requests``: the side's live requests (read only
    here); ``absorb``: the side's handling of the client's load results."""

    def __init__(self, cfg: ConnectorConfig, guard: HookGuard, counters: SchedulerCounters,
                 requests: Mapping[str, Any],
                 absorb: Callable[[Sequence[Any]], None]) -> None:
        self.cfg = cfg
        self.guard = guard
        self.counters = counters
        self._requests = requests
        self._absorb = absorb
        self.bound_client: SyncClient | None = None
        self.closed = False
        self._service: ServiceThread | None = None
        # (when taken, statistics) of the service thread: the latest while READY, and
        # the one from before the pump that saw READY end
        self._ready_snap: tuple[float, dict[str, Any]] | None = None
        self._left_ready: tuple[float, dict[str, Any]] | None = None
        # statistics reports to vLLM and whether they reach vLLM's front end (then it
        # logs the final-statistics line)
        self._reports = ReportBuilder()
        self._clock = ReportClock()
        self._shipped = False

    @property
    def client(self) -> SyncClient:
        """The kvshm client (StateError before ``bind``)."""
        if self.bound_client is None:
            raise StateError("kvshm's scheduler side has no GPU block pool bound yet")
        return self.bound_client

    def bind(self, gpu_block_pool: Any) -> None:
        """Create the client around vLLM's pool (once; vLLM's ``bind_gpu_block_pool``)."""
        if self.bound_client is not None:
            raise StateError("bind_gpu_block_pool called twice")
        c = self.cfg
        hash_bs = getattr(gpu_block_pool, "hash_block_size", c.block_size)
        if hash_bs != c.block_size:
            raise ConfigError(f"vLLM's block pool hashes blocks of {hash_bs} tokens, kvshm "
                              f"needs the block size ({c.block_size})")
        if not getattr(gpu_block_pool, "enable_caching", True):
            raise ConfigError("vLLM's block pool has prefix caching off; kvshm needs it")
        econf = EngineConfig(block_size=c.block_size, name=c.name, tp=c.tp, pp=c.pp,
                             groups=c.groups, mode=c.mode, num_cpu_blocks=c.num_cpu_blocks,
                             cpu_bytes_per_rank=c.cpu_bytes_per_rank,
                             hang_timeout_s=c.hang_timeout_s, eviction=c.eviction,
                             remote_url=c.remote_url, remote_mode=c.remote_mode,
                             model_id=c.model_id, disk_path=c.disk_path,
                             disk_bytes_per_rank=c.disk_bytes_per_rank, disk_io=c.disk_io,
                             disk_mode=c.disk_mode, disk_keep=c.disk_keep,
                             disk_stamp=c.disk_stamp)
        with self.guard:
            self.bound_client = SyncClient(econf, gpu_blocks=VllmGpuBlocks(gpu_block_pool))
            self._service = ServiceThread(self.guard, self._idle_pump, c.name)
            self._service.start()
        log.info("kvshm: engine %r is waiting for %d worker rank(s) (%s mode, %s%s); "
                 "query it with: kvshm stats --name %s", c.name, c.world_size,
                 c.mode.value, tier_text(c), lower_tiers_text(c), c.name)

    @property
    def bound(self) -> bool:
        """True once ``bind`` created the client."""
        return self.bound_client is not None

    @property
    def service_thread(self) -> ServiceThread | None:
        """The idle-time service thread (None before ``bind``)."""
        return self._service

    def _idle_pump(self) -> None:
        """The service thread's pump (under the guard): ``poll`` and absorb, then
        ``settle`` at most :data:`PUMP_SETTLE_EVENTS` events (the CPU tier's eviction
        bookkeeping the hooks deferred, oldest first: the pump runs
        while the forward does or the engine idles, so it is off every request's path
        to its first token); remembers
        the READY statistics from before a pump that saw the engine leave READY. They
        are refreshed when older than :data:`SNAPSHOT_MAX_AGE_S`, and when a hook ran
        since and the side knows of no request (as every pump after a hook did before:
        the engine's last hooks, stores acked and pins released included, are in the
        snapshot a shutdown after the workers left writes). Not while requests are
        served: the thread pumps every 20 ms during each forward (about ten pumps in a
        250 ms prefill), and a snapshot costs about 0.3 ms of CPU (it sorts every
        rank's latency window): refreshed at each, it cost 3-6 ms of CPU a request
        beside the forward (``tools.bench_e2e``, a 3000-token prompt). A rank lost
        mid-serving leaves statistics at most ``SNAPSHOT_MAX_AGE_S`` old."""
        client = self.bound_client
        if client is None or self.closed or client.state not in LIVE:
            return
        ready = client.state is EngineState.READY
        now = time.monotonic()
        snap, last = self._ready_snap, self.guard.last_exit
        if ready and (snap is None or now - snap[0] > SNAPSHOT_MAX_AGE_S
                      or (last >= snap[0] and not self._requests)):
            self._ready_snap = (now, self.statistics())
        self._absorb(client.poll())
        client.settle(PUMP_SETTLE_EVENTS)  # the order's simulations, a few a pump
        if ready and client.state is not EngineState.READY and self._ready_snap is not None:
            self._left_ready = (time.monotonic(), self._ready_snap[1])

    def report(self) -> dict[str, Any] | None:
        """``get_kv_connector_stats``: a report's data when one is due (module
        docstring), else None; None before ``bind`` and after ``shutdown``."""
        with self.guard:
            client = self.bound_client
            if client is None or self.closed or client.owner_pid is not None:
                return None  # (a forked child: nothing of the parent's is written here)
            now = time.monotonic()
            # the acks drained, not the rendezvous: the step's build read it
            idle = not self._requests and not client.has_pending_work(rendezvous=False)
            activity = self.counters.lookups
            if not self._clock.should_report(now, idle, activity):
                return None
            stats = self.statistics()
            data = self._reports.build(stats)
            self._clock.reported(now, idle, activity)
            if self.cfg.stats_path:
                self._write_live(self.cfg.stats_path, stats)
            return data

    def _write_live(self, path: str, stats: dict[str, Any]) -> None:
        """Rewrite ``stats_path`` with a report's snapshot; a failure (a missing folder,
        a full disk) is counted and logged once, never raised into vLLM's step."""
        try:
            write_json(path, live_statistics(stats))
        except OSError as exc:
            self.counters.stats_writes_failed += 1
            if self.counters.stats_writes_failed == 1:
                log.warning("kvshm: cannot write stats_path %s (%s); serving goes on "
                            "(further failures are only counted)", path, exc)

    def mark_shipped(self) -> None:
        """vLLM shipped a report to its front end: the front end logs the final line."""
        self._shipped = True

    def shutdown(self) -> None:
        """Stop the service thread, let jobs in flight finish (up to
        ``shutdown_timeout_s``), close the client, write ``stats_path``, log the final
        line (unless the front end logs it) and the ``closed`` line (idempotent). The
        statistics written are taken before anything is torn down
        (:mod:`~kvshm.integrations.vllm.final_stats`)."""
        if self._service is not None:
            self._service.stop()
        with self.guard:
            client = self.bound_client
            if self.closed or client is None or client.owner_pid is not None:
                self.closed = True  # (a forked child: the engine and its stats_path
                return  # are its parent's, nothing here to write or close)
            self.closed = True
            snap, source = self._drain_and_snapshot(client)
            client.close()
            stats = final_statistics(snap, source, self.statistics())
        where = "not written; set stats_path"
        if self.cfg.stats_path:
            try:
                write_json(self.cfg.stats_path, stats)
                where = self.cfg.stats_path
            except OSError as exc:  # never raised into vLLM's shutdown (it has more to do)
                self.counters.stats_writes_failed += 1
                where = f"not written to {self.cfg.stats_path}: {exc.strerror or exc}"
                log.warning("kvshm: cannot write the final statistics to stats_path %s "
                            "(%s)", self.cfg.stats_path, exc)
        FINAL_LINES.at_close(self.cfg.name, stats, self._shipped)
        log.info("kvshm: engine %r closed (statistics: %s)", self.cfg.name, where)

    def _drain_and_snapshot(self, client: SyncClient
                            ) -> tuple[dict[str, Any] | None, SnapshotSource]:
        """Drain in-flight work, then the READY snapshot the file carries (see
        final_stats' rules), taken before ``close``."""
        snap: dict[str, Any] | None = None
        source = SnapshotSource.AFTER_CLOSE
        if client.state is EngineState.READY:
            snap, source = self.statistics(), SnapshotSource.ON_SHUTDOWN
        deadline = time.monotonic() + self.cfg.shutdown_timeout_s
        while time.monotonic() < deadline and client.state is EngineState.READY:
            self._absorb(client.poll())
            if not client.has_pending_work():
                break
            time.sleep(0.002)
        self._absorb(client.poll() if client.state in LIVE else [])
        if client.state is EngineState.READY:
            return self.statistics(), SnapshotSource.BEFORE_CLOSE
        left = self._left_ready
        if snap is None and left is not None and self._detached_at_shutdown(left[0]):
            return left[1], SnapshotSource.BEFORE_WORKERS_DETACHED
        return snap, source

    def _detached_at_shutdown(self, left_at: float) -> bool:
        """Whether the engine left READY as part of vLLM's shutdown (its workers closing
        ahead of the scheduler): within :data:`DETACH_WINDOW_S`, and no hook ran since.
        A hook after the loss means vLLM served on without offload: the READY snapshot
        from before it (taken with that moment's loads in flight and their pins) no
        longer describes the engine; the file then shows the engine as it ended."""
        return (time.monotonic() - left_at <= DETACH_WINDOW_S
                and self.guard.last_exit <= left_at)

    def statistics(self) -> dict[str, Any]:
        """The engine's statistics plus the connector's counters, JSON-able. Under the
        guard's lock, not through the guard: a read is no hook -- through it, the service
        thread's own idle snapshot stamped ``last_exit`` and looked like a hook that had
        just run, so every idle pump took another (about 50 a second, 0.3 ms each)."""
        with self.guard.lock:
            out = self.client.statistics().as_dict()
            out["connector"] = dict(vars(self.counters))
            return out
