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
  tells an idle embedded worker from a hung one by it), checks the lifeline, drains the
  ``cmd`` ring into per-direction queues, collects finished copies and sends their
  ``Done``s (a full ``done`` ring keeps them in an outbox, retried on every call).
* A Transfer runs only once its step has begun: ``submit_*(step)`` submits the queued
  jobs of that direction with ``job.step <= min(step, last begun step)``, in arrival
  order (async scheduling may put step N+1's jobs in the ring during step N).
* ``Flush(step, ids)`` (from the ring, or ``flush_ids``): at ``begin_step(step)`` those
  jobs are finished (copy engine ``wait``) before the call returns.
* A ``Remote`` job (CPU rows <-> the remote tier) runs on arrival, on the session's
  :class:`~workers.remote_mover.RemoteMover`; its Done takes the same path as a copy's.
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

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Final

import torch

from kvshm.errors import (
    ConfigError,
    KvshmError,
    PeerDied,
    ProtocolError,
    RankRevoked,
    TransportError,
)
from kvshm.ipc.fdpass import socket_address
from kvshm.ipc.protocol import Direction, Done, Transfer
from kvshm.ipc.rendezvous_client import RendezvousClient
from kvshm.layout import KVLayout
from kvshm.types import DeviceKind
from workers.copy_engine import CopyJob, Fence, describe_error
from workers.cpu_copy import FaultInjection
from workers.done_book import DoneBook
from workers.phases import LINKED, DetachReason, Phase
from workers.revocation import RevocationGate, close_lifeline_when_idle
from workers.session import Connector, Session, SessionOptions
from workers.step_queue import StepQueue

__all__ = ["DetachReason", "Phase", "Worker"]

#: Default bound of a Flush wait in begin_step.
FLUSH_TIMEOUT_S: Final = 60.0
#: The longest :meth:`Worker.wait_for_work` parks while copies run on an engine that has no
#: completion fd to wake it (CUDA: its events are polled), in seconds (poll()'s 1 ms tick).
COPY_POLL_S: Final = 0.001


class Worker:
    """One rank's worker; build it with :meth:`attach`. Single-threaded: every method
    must be called from one thread (the host engine's, or the standalone loop)."""

    def __init__(self, name: str, rank: int, world_size: int, layout: KVLayout | None,
                 opts: SessionOptions, flush_timeout_s: float) -> None:
        self.name, self.rank, self.world_size = name, rank, world_size
        self._flush_timeout = flush_timeout_s
        self._phase = Phase.NEW
        self.detach_reason: DetachReason | None = None
        self.last_error: KvshmError | None = None
        self._client: RendezvousClient | None = None
        self._session: Session | None = None
        self._connector = Connector(name, rank, world_size, layout, opts)
        self._step = -1
        self._queue = StepQueue()
        self._counts: Counter[str] = Counter()
        self._dones = DoneBook(self._counts)
        self._gate: RevocationGate | None = None

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int,
               regions: Sequence[torch.Tensor] | None, *, kv_outer: bool | Sequence[bool] = False,
               fault: FaultInjection | None = None, spin_us: float = 50.0,
               copy_threads: int = 1, flush_timeout_s: float = FLUSH_TIMEOUT_S,
               device: DeviceKind = DeviceKind.CPU) -> Worker:
        """A worker for rank ``rank`` of the scheduler named ``name``; no I/O, never blocks.

        ``regions``: this rank's KV tensors (embedded; blocks as dim 0, or K/V as dim 0
        with ``kv_outer``), or None (standalone: the device caches come in ``Ready``, and
        must live on ``device``: shared memory for CPU, CUDA IPC for CUDA).
        ConfigError for a bad name, rank, world size or region.
        """
        socket_address(name)
        if isinstance(world_size, bool) or world_size < 1:
            raise ConfigError(f"world_size must be >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank!r} out of range [0, {world_size})")
        if spin_us < 0 or copy_threads < 1 or flush_timeout_s <= 0:
            raise ConfigError("spin_us must be >= 0, copy_threads >= 1, flush_timeout_s > 0")
        layout = None if regions is None else KVLayout.from_tensors(regions, kv_outer=kv_outer)
        opts = SessionOptions(spin_us, copy_threads, fault,
                              device if regions is None else None)
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

    def queued_steps(self) -> list[int]:
        """Distinct steps of the Transfers waiting to be submitted, ascending."""
        return self._queue.steps()

    def statistics(self) -> dict[str, Any]:
        """Plain-data snapshot: phase, counters, and the channel's and copy engine's."""
        out: dict[str, Any] = {
            "rank": self.rank, "phase": self._phase.value, "step": self._step,
            "detach_reason": self.detach_reason.value if self.detach_reason else None,
            "last_error": str(self.last_error) if self.last_error else None,
            "queued": len(self._queue), "inflight": len(self._dones.inflight),
            "outbox": len(self._dones.outbox),
            "counters": dict(self._counts, connect_retries=self._connector.attempts)}
        if self._session is not None:
            chan = self._session.channel_stats()
            out["channel"] = chan.as_dict() if chan is not None else None
            out["copy"] = self._session.engine.stats()
            if self._session.remote is not None or self._session.remote_error:
                out["remote"] = (self._session.remote.statistics() if self._session.remote
                                 else {"error": self._session.remote_error})
        return out

    # ------------------------------------------------------------------ per step

    def service(self) -> None:
        """Progress without waiting: connect / poll for Ready / pump the link."""
        if self._phase in (Phase.NEW, Phase.CONNECTING):
            self._connect_step()
        if self._phase in LINKED:
            self._pump()
        elif self._phase is Phase.DETACHED and self._session is not None:
            self._collect()
            close_lifeline_when_idle(self._client, self._dones.inflight)

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

    def submit_loads(self, step: int, after: Fence | None = None) -> None:
        """Submit the queued loads of ``step`` (and earlier), ordered after ``after``."""
        self._submit(Direction.LOAD, step, after)

    def submit_stores(self, step: int, after: Fence | None = None) -> None:
        """Submit the queued stores of ``step`` (and earlier), ordered after ``after``."""
        self._submit(Direction.STORE, step, after)

    def poll(self) -> list[Done]:
        """Dones of finished jobs not yet returned (each once); already sent over the ring."""
        self.service()
        if self._phase is Phase.DRAINING:
            self._maybe_drained()
        return self._dones.take_local()

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until the named jobs already submitted have finished (or ``timeout``);
        their Dones (each once: :meth:`poll` will not return them again). Ids of jobs not
        submitted yet (queued for a later step) or unknown are ignored."""
        self.service()
        ids = set(job_ids)
        out = self._dones.take_local(ids)
        pending = ids & self._dones.inflight
        if pending and self._session is not None:
            out += self._report(self._session.engine.wait(pending, timeout), local=False)
        return out

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

    def watch(self, fd: int) -> None:
        """Also wake :meth:`wait_for_work` when ``fd`` is readable (READY only)."""
        if self._session is not None and self._session.channel is not None:
            self._session.channel.watch(fd)

    def close(self) -> None:
        """Stop (idempotent): running copies finish, queued ones fail; the link closes.
        Dones not yet returned are dropped (counted). A linked worker closed by its host
        (not detached by a fault) says ``Goodbye`` once its copies are done, just before
        its EOF: the scheduler takes that as a clean departure, not a death."""
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

    # ------------------------------------------------------------------ connecting

    def _connect_step(self) -> None:
        try:
            self._session = self._connector.poll()
        except (KvshmError, OSError) as exc:
            self._client = self._connector.client  # closed by _detach: the scheduler sees EOF
            err = exc if isinstance(exc, KvshmError) else ConfigError(f"{exc}")
            self._detach(DetachReason.REFUSED if isinstance(exc, PeerDied)
                         else DetachReason.SETUP_FAILED, err)
            return
        self._client = self._connector.client
        if self._session is not None:
            self._gate = RevocationGate(self._session)
            self._session.engine.set_gate(self._gate.may_copy)
            self._phase = Phase.READY
        elif self._client is not None:
            self._phase = Phase.CONNECTING

    # ------------------------------------------------------------------ the link

    def _pump(self) -> None:
        session, client = self._session, self._client
        assert session is not None and session.channel is not None and client is not None
        chan = session.channel
        if self._check_revoked():
            return
        try:
            chan.beat()
            alive = client.check_alive()
            self._handle(client.take_messages())
            self._handle(chan.receive_nowait())
        except TransportError as exc:
            self._lost(exc)
            return
        self._run_remote()
        self._collect()
        if not alive:
            self._lost(PeerDied(f"kvshm scheduler {self.name!r} closed the connection"))

    def _handle(self, msgs: Iterable[object]) -> None:
        """Commands into the step queue; a Shutdown turns READY into DRAINING."""
        if self._queue.intake(msgs, self._counts) and self._phase is Phase.READY:
            self._phase = Phase.DRAINING

    def _lost(self, exc: TransportError) -> None:
        """The link broke. Lifeline EOF after the engine's Shutdown (read from the ring
        first: the engine posts it, then closes) is the engine closing -- SHUTDOWN; EOF
        without one is the engine dying -- PEER_DIED."""
        if isinstance(exc, PeerDied):
            if self._phase is Phase.READY:
                self._drain_ring_quietly()
            closed = self._phase is Phase.DRAINING
            self._detach(DetachReason.SHUTDOWN if closed else DetachReason.PEER_DIED,
                         None if closed else exc)
        else:
            self._counts["protocol_errors"] += 1
            chan = self._session.channel if self._session is not None else None
            if chan is not None:
                try:  # the good records around an undecodable one: fail them locally too
                    self._handle(chan.receive_nowait())
                except TransportError:
                    pass
            self._detach(DetachReason.PROTOCOL_ERROR, exc)

    def _drain_ring_quietly(self) -> None:
        """Take what the ring still holds (a Shutdown the engine posted before closing)."""
        chan = self._session.channel if self._session is not None else None
        if chan is None:
            return
        try:
            self._handle(chan.receive_nowait())
        except TransportError:
            pass

    def _collect(self) -> None:
        """Finished copies and remote jobs -> the book; send."""
        assert self._session is not None
        mover = self._session.remote
        self._report(self._session.engine.poll() + (mover.poll() if mover else []))

    def _run_remote(self) -> None:
        """Remote jobs run on arrival (:mod:`workers.remote_mover`); without a remote
        tier in Ready, or once revoked, each fails at once."""
        assert self._session is not None
        mover = self._session.remote
        for job in self._queue.take_remote():
            if mover is None or self._check_revoked():
                self._counts["remote_jobs_refused"] += 1
                why = "no remote tier" if mover is None else f"rank {self.rank} revoked"
                self._record([Done(job.job_id, self.rank, False, f"RemoteError: {why}")])
                continue
            self._dones.started(job.job_id)
            mover.submit(job)

    def _record(self, dones: list[Done], *, local: bool = True) -> list[Done]:
        """Into the book (outbox only while linked); see :mod:`workers.done_book`."""
        return self._dones.record(dones, linked=self._phase in LINKED, local=local)

    def _report(self, dones: list[Done], *, local: bool = True) -> list[Done]:
        """Record, then send: how the poll path and the wait paths both report Dones."""
        if dones:
            self._record(dones, local=local)
        self._send()
        return dones

    def _send(self) -> None:
        """The outbox over the ring, unless the rank is revoked (read first, every time)."""
        chan = self._session.channel if self._session is not None else None
        if not self._dones.outbox or chan is None or self._check_revoked():
            return
        try:
            self._dones.send(chan)
        except TransportError as exc:
            self._lost(exc)

    # ------------------------------------------------------------------ jobs

    def _submit(self, direction: Direction, step: int, after: Fence | None) -> None:
        self.service()
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
        self._detach(DetachReason.SHUTDOWN, None)

    def _fail_queued(self, why: str) -> None:
        ids = [t.job_id for t in self._queue.take_all()]
        ids += [r.job_id for r in self._queue.take_remote()]
        failed = [Done(i, self.rank, False, f"CopyError: rank {self.rank} {why}") for i in ids]
        if failed:
            self._counts["jobs_failed_unrun"] += len(failed)
            self._record(failed)

    def _check_revoked(self) -> bool:
        """Read the revocation word; if set, detach (REVOKED) and return True."""
        why = self._gate.word() if self._gate is not None else None
        if why is None:
            return self._phase is Phase.DETACHED \
                and self.detach_reason is DetachReason.REVOKED
        self._counts["revocations_seen"] += 1
        assert self._session is not None
        self._session.engine.cancel_queued()
        self._detach(DetachReason.REVOKED, RankRevoked(
            f"kvshm scheduler {self.name!r} declared rank {self.rank} dead "
            f"({why.name.lower()}); this rank does no more work for it"))
        return True

    def _detach(self, reason: DetachReason, error: KvshmError | None) -> None:
        """Leave the link for good: fail what never ran, close the channel; the socket
        closes now, or once the copies still running have finished."""
        if self._phase in (Phase.DETACHED, Phase.CLOSED):
            return
        self.detach_reason, self.last_error = reason, error
        if reason is DetachReason.REVOKED and self._gate is not None:
            self._gate.shut()  # before close_link releases the views the gate reads
        self._counts[f"detached_{reason.value}"] += 1
        self._phase = Phase.DETACHED  # from here on nothing goes over the ring
        self._dones.drop_outbox()
        self._fail_queued(f"detached ({reason.value}): {error}" if error
                          else f"detached ({reason.value})")
        if self._session is not None:
            self._session.close_link()
            self._collect()
        close_lifeline_when_idle(self._client, self._dones.inflight)
