"""The kvshm worker of one rank: embedded in a serving engine's worker, or standalone.

Lifecycle: :class:`~workers.phases.Phase` (NEW, CONNECTING, READY, DRAINING, DETACHED,
CLOSED; the diagram is in :mod:`workers.phases`); :class:`~workers.phases.DetachReason`
says why it detached.

**No call blocks** except :meth:`Worker.wait` and :meth:`Worker.wait_for_work` (and a
``Flush`` wait in :meth:`Worker.begin_step`, bounded by ``flush_timeout_s``, which only
waits for copies this worker already runs). :meth:`Worker.attach` does no I/O; the first
call (:meth:`begin_step` or :meth:`service`) connects and says hello; later calls poll
for ``Ready`` and, once it is in, map everything (:mod:`workers.session`).

Per engine step: ``begin_step(step, flush_ids)``, ``submit_loads(step, after)``,
``submit_stores(step, after)``, ``poll()``. Rules:

* Every call first services the link without waiting: beats the heartbeat (the scheduler
  tells an idle embedded worker from a hung one by it), drains the ``cmd`` ring into
  per-direction queues, collects finished copies and sends their ``Done``s (a full
  ``done`` ring keeps them in an outbox, retried on every call). :meth:`begin_step`,
  :meth:`service` and :meth:`wait_for_work` also read the lifeline (the rendezvous
  socket: Shutdown, Stats, EOF); the step's other calls do not (one socket read a
  step: each is a syscall that can hand the GIL to the copy threads).
* A Transfer runs only once its step has begun: ``submit_*(step)`` submits the queued
  jobs of that direction with ``job.step <= min(step, last begun step)``, in arrival
  order (async scheduling may put step N+1's jobs in the ring during step N).
* ``Flush(step, ids)`` (from the ring, or ``flush_ids``): at ``begin_step(step)`` those
  jobs are finished (copy engine ``wait``) before the call returns.
* A ``Remote`` job (CPU rows <-> the remote tier) runs on arrival, on the session's
  :class:`~workers.remote_mover.RemoteMover`; its Done takes the same path as a copy's.
  A ``Disk`` job (CPU rows <-> this rank's slab file) likewise, on the session's
  :class:`~workers.disk_mover.DiskMover`.
* Every ``Done`` goes over the ``done`` ring *and* is returned once locally by
  :meth:`poll` (or by :meth:`wait` for the jobs it names): :mod:`workers.done_book`.
* ``Shutdown``: DRAINING; a :meth:`poll` that finds nothing running and nothing queued
  for a begun step fails the jobs of steps never begun, then detaches (SHUTDOWN).
* Revocation (the scheduler declared this rank dead) and the lifeline: no copy starts
  once the word is set -- queued jobs and those waiting in the copy engine fail
  locally, no Done is published, the worker detaches (REVOKED) -- and the socket closes
  only once no copy runs (:mod:`workers.revocation`; :meth:`poll` / :meth:`service` /
  :meth:`close` close it when the last copy of a detached worker has finished).
* Lifeline EOF or a ``ProtocolError``: every queued job fails locally (an EOF after the
  engine's ``Shutdown`` detaches as SHUTDOWN: the engine closed; without one as
  PEER_DIED: the engine died)
  (``Done(ok=False)`` returned by :meth:`poll`; the scheduler is gone or broken, so
  nothing more goes over the ring), the link is closed, copies already running still
  report through :meth:`poll`. Nothing is raised and the host process is never
  signalled; later calls do nothing and return ``[]``.

Every declined or failed outcome is counted in :meth:`statistics`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final

import torch

from kvshm.errors import (
    ConfigError,
    ProtocolError,
    TransportError,
)
from kvshm.ipc.fdpass import socket_address
from kvshm.ipc.protocol import Direction, Done, Transfer
from kvshm.layout import KVLayout
from kvshm.types import DeviceKind
from workers.copy_engine import CopyJob, Fence, describe_error
from workers.cpu_copy import FaultInjection
from workers.disk_mover import FENCE_TIMEOUT_S
from workers.link import WorkerLink, locked
from workers.phases import LINKED, DetachReason, Phase
from workers.revocation import close_lifeline_when_idle
from workers.session import SessionOptions

__all__ = ["DetachReason", "Phase", "Worker"]

#: Default bound of a Flush wait in begin_step.
FLUSH_TIMEOUT_S: Final = 60.0
#: The longest :meth:`Worker.wait_for_work` parks while copies run on an engine that has no
#: completion fd to wake it (CUDA: its events are polled), in seconds (poll()'s 1 ms tick).
COPY_POLL_S: Final = 0.001


class Worker(WorkerLink):
    """One rank's worker; build it with :meth:`attach`. Every method must be called from
    one thread (the host engine's, or the standalone loop); each holds the worker's lock,
    which it shares only with the mover publisher of an embedded worker
    (:mod:`workers.link`). Its state and the link's servicing are
    :class:`~workers.link.WorkerLink`'s."""

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int,
               regions: Sequence[torch.Tensor] | None, *, kv_outer: bool | Sequence[bool] = False,
               fault: FaultInjection | None = None, spin_us: float = 50.0,
               copy_threads: int = 1, flush_timeout_s: float = FLUSH_TIMEOUT_S,
               device: DeviceKind = DeviceKind.CPU, inline: bool = False,
               fence_by_kill: bool = False,
               meaning: tuple[Sequence[str], Sequence[tuple[int, ...]]] | None = None
               ) -> Worker:
        """A worker for rank ``rank`` of the scheduler named ``name``; no I/O, never blocks.

        ``regions``: this rank's KV tensors (embedded; blocks as dim 0, or K/V as dim 0
        with ``kv_outer``), or None (standalone: the device caches come in ``Ready``, and
        must live on ``device``: shared memory for CPU, CUDA IPC for CUDA).
        ``inline``: a CPU copy engine copies unfenced jobs (loads and stores) in the
        thread that submits them (:mod:`workers.cpu_copy`); no effect on a CUDA engine.
        ``fence_by_kill``: offer the engine to SIGKILL this process after a hang verdict
        (``Hello.fence_by_kill``; only a process that runs nothing but this worker).
        ``meaning``: each region's dtype and shape where ``regions`` are byte rows (vLLM's:
        :func:`kvshm.integrations.vllm.blocks.kv_layout`), so that the layout, and its
        fingerprint, tell other KV apart. ConfigError for a bad name, rank, world size
        or region.
        """
        socket_address(name)
        if isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank!r} out of range [0, {world_size})")
        if spin_us < 0 or copy_threads < 1 or flush_timeout_s <= 0:
            raise ConfigError("spin_us must be >= 0, copy_threads >= 1, flush_timeout_s > 0")
        layout = None if regions is None else KVLayout.from_tensors(regions, kv_outer=kv_outer)
        if layout is not None and meaning is not None:
            layout = KVLayout(layout.regions, *meaning)
        opts = SessionOptions(spin_us, copy_threads, fault,
                              device if regions is None else None, inline, fence_by_kill)
        return cls(name, rank, world_size, layout, opts, flush_timeout_s)

    # ------------------------------------------------------------------ queries

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def step(self) -> int:
        """The last step begun (-1 before the first)."""
        return self._step

    def lifeline_fd(self) -> int | None:
        """The rendezvous socket (readable on a message or EOF), once connected."""
        return self._client.fileno() if self._client is not None and self._client.connected \
            else None

    @locked
    def queued_steps(self) -> list[int]:
        """Distinct steps of the Transfers waiting to be submitted, ascending."""
        return self._queue.steps()

    @locked
    def statistics(self) -> dict[str, Any]:
        """Plain-data snapshot: phase, counters, and the channel's and copy engine's."""
        out: dict[str, Any] = {
            "rank": self.rank, "phase": self._phase.value, "step": self._step,
            "detach_reason": self.detach_reason.value if self.detach_reason else None,
            "last_error": str(self.last_error) if self.last_error else None,
            "queued": len(self._queue), "inflight": len(self._dones.inflight),
            "outbox": len(self._dones.outbox),
            "counters": dict(self._counts, connect_retries=self._connector.attempts)}
        if self._publisher is not None:
            out["counters"].update((f"publisher_{k}", v)
                                   for k, v in self._publisher.counts.items())
        if self._session is not None:
            chan = self._session.channel_stats()
            out["channel"] = chan.as_dict() if chan is not None else None
            out["copy"] = self._session.engine.stats()
            if self._session.remote is not None or self._session.remote_error:
                out["remote"] = (self._session.remote.statistics() if self._session.remote
                                 else {"error": self._session.remote_error})
            if self._session.disk is not None or self._session.disk_error:
                out["disk"] = (self._session.disk.statistics() if self._session.disk
                               else {"error": self._session.disk_error})
        return out

    # ------------------------------------------------------------------ per step

    @locked
    def service(self) -> None:
        """Progress without waiting: connect / poll for Ready / pump the link."""
        if self._phase in (Phase.NEW, Phase.CONNECTING):
            self._connect_step()
        if self._phase in LINKED:
            self._pump()
        elif self._phase is Phase.DETACHED and self._session is not None:
            self._collect()
            close_lifeline_when_idle(self._client, self._dones.inflight)

    def _tend(self) -> None:
        """The service of the step's calls after :meth:`begin_step` (``submit_*``,
        :meth:`poll`, :meth:`wait`): linked, a pump without the lifeline
        (:meth:`~workers.link.WorkerLink._pump`; :meth:`begin_step` and :meth:`service`
        read it), so an engine step reads the rendezvous socket once, not four times;
        otherwise the full :meth:`service` (connecting, a detached worker's collect)."""
        if self._phase in LINKED:
            self._pump(lifeline=False)
        else:
            self.service()

    @locked
    def begin_step(self, step: int, flush_ids: Iterable[int] = ()) -> None:
        """Step ``step`` begins; its Flush'ed jobs (ring and ``flush_ids``) finish first."""
        self.service()
        if step < self._step:
            self._counts["steps_regressed"] += 1
        else:
            self._step = step
        self._counts["steps"] += 1
        ids = self._queue.take_flush(self._step) | set(flush_ids)
        if ids and self._phase in LINKED:
            self._flush_wait(ids)

    @locked
    def submit_loads(self, step: int, after: Fence | None = None) -> None:
        """Submit the queued loads of ``step`` (and earlier), ordered after ``after``."""
        self._submit(Direction.LOAD, step, after)

    @locked
    def submit_stores(self, step: int, after: Fence | None = None) -> None:
        """Submit the queued stores of ``step`` (and earlier), ordered after ``after``."""
        self._submit(Direction.STORE, step, after)

    @locked
    def poll(self) -> list[Done]:
        """Dones of finished jobs not yet returned (each once); already sent over the ring."""
        self._tend()
        if self._phase is Phase.DRAINING:
            self._maybe_drained()
        return self._dones.take_local()

    @locked
    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until the named jobs already submitted have finished (or ``timeout``);
        their Dones (each once: :meth:`poll` will not return them again). Ids of jobs not
        submitted yet (queued for a later step) or unknown are ignored."""
        self._tend()
        ids = set(job_ids)
        out = self._dones.take_local(ids)
        pending = ids & self._dones.inflight
        if pending and self._session is not None:
            out += self._report(self._session.engine.wait(pending, timeout), local=False)
        return out

    @locked
    def cancel_unstarted(self, job_ids: Collection[int]) -> set[int]:
        """The host gives up waiting for ``job_ids``: those not started yet (queued, or
        whose Transfer has not arrived) will never be copied -- each fails unrun when
        taken (its Done, failed, goes to the scheduler as usual). Returns them; the
        others are running (or done) and must be waited for: a copy under way may still
        write its destinations. (A job whose Done the host already took is not known
        here any more: the host names only jobs it has no Done for.)"""
        ids = set(job_ids) - self._dones.inflight - self._dones.local_ids()
        self._cancelled |= ids
        return ids

    @locked
    def wait_for_work(self, timeout: float) -> None:
        """Standalone loops: block until a command, a finished copy, a lifeline message or
        a watched fd (:meth:`watch`), or ``timeout`` s; then service. Spins ``spin_us``
        first; never busy-waits longer. Submit :meth:`queued_steps` first: Transfers
        already drained into the queue do not wake it."""
        chan = self._session.channel if self._session is not None else None
        if self._phase not in LINKED or chan is None:
            return
        if self._dones.outbox:  # the done ring was full: retry soon
            timeout = min(timeout, 0.001)
        elif self._dones.inflight and self._session is not None \
                and self._session.notify_fd is None:  # CUDA events do not wake poll()
            timeout = min(timeout, COPY_POLL_S)
        try:
            self._handle(chan.receive(timeout))
        except TransportError as exc:
            self._lost(exc)
            return
        self.service()

    @locked
    def watch(self, fd: int) -> None:
        """Also wake :meth:`wait_for_work` when ``fd`` is readable (READY only)."""
        if self._session is not None and self._session.channel is not None:
            self._session.channel.watch(fd)

    def close(self) -> None:
        """Stop (idempotent): running copies finish, queued ones fail; the link closes.
        Dones not yet returned are dropped (counted). A linked worker closed by its host
        (not detached by a fault) says ``Goodbye`` once its copies are done, just before
        its EOF: the scheduler takes that as a clean departure, not a death."""
        self._stop_publisher()  # before the lock: its thread may be waiting for it
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._phase is Phase.CLOSED:
            return
        farewell = self.detach_reason is None and self._phase in LINKED
        if self.detach_reason is None:
            self.detach_reason = DetachReason.CLOSED
        self._counts["dones_dropped_at_close"] += self._dones.drop_all() + len(self._queue)
        self._queue.take_all()
        if self._session is not None:
            self._session.close()
        if self._client is not None:
            if farewell and self._client.send_goodbye(self.rank, "closed by its own process"):
                self._counts["goodbyes_sent"] += 1
            self._client.close()
        self._phase = Phase.CLOSED

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ jobs

    def _submit(self, direction: Direction, step: int, after: Fence | None) -> None:
        self._tend()
        if self._phase not in LINKED:
            self._counts["submits_not_ready" if self._phase in (Phase.NEW, Phase.CONNECTING)
                         else "submits_detached"] += 1
            return
        if step > self._step:
            self._counts["submits_before_begin"] += 1
        for t in self._queue.take(direction, min(step, self._step)):
            self._run(t, after)

    def _run(self, t: Transfer, after: Fence | None) -> None:
        assert self._session is not None
        if t.job_id in self._cancelled:
            self._cancelled.discard(t.job_id)
            self._counts["jobs_cancelled_unrun"] += 1
            self._record([Done(t.job_id, self.rank, False,
                               f"CopyError: rank {self.rank}: cancelled before it started")])
            return
        if self._phase not in LINKED or self._check_revoked():
            self._counts["jobs_refused_revoked"] += 1
            self._record([Done(t.job_id, self.rank, False, f"CopyError: rank {self.rank} revoked")])
            return
        try:
            job = CopyJob.from_transfer(t)
        except ProtocolError as exc:
            self._counts["bad_transfers"] += 1
            self._record([Done(t.job_id, self.rank, False, describe_error(exc))])
            return
        disk = self._session.disk
        if (disk is not None and job.direction is Direction.STORE
                and not disk.wait_rows(job.dst_ids.tolist(), FENCE_TIMEOUT_S)):
            self._counts["stores_fence_timed_out"] += 1
            self._record([Done(t.job_id, self.rank, False,
                               f"CopyError: rank {self.rank}: a disk WRITE still reads "
                               f"the store's CPU rows after {FENCE_TIMEOUT_S:g} s")])
            return
        self._dones.started(t.job_id)
        self._session.engine.submit(job, after)

    def _flush_wait(self, ids: set[int]) -> None:
        """Finish ``ids`` now: queued ones of begun steps are submitted first (no fence)."""
        assert self._session is not None
        self._counts["flush_waits"] += 1
        forced = self._queue.take_ids(ids, self._step)
        self._counts["flush_forced_submits"] += len(forced)
        for t in forced:
            self._run(t, None)
        pending = ids & self._dones.inflight
        if pending:
            self._record(self._session.engine.wait(pending, self._flush_timeout))
            if ids & self._dones.inflight:
                self._counts["flush_timeouts"] += 1
        self._send()

    def _maybe_drained(self) -> None:
        """DRAINING -> DETACHED once nothing runs or waits for a begun step."""
        if self._dones.inflight or self._dones.outbox:
            return
        if self._queue.any_upto(self._step):
            return
        self._fail_queued("shut down before its step began")
        self._send()
        if self._dones.outbox:  # those failures wait for ring space: a later poll
            return  # detaches once they are sent (one Done per job, never dropped)
        self._detach(DetachReason.SHUTDOWN, None)
