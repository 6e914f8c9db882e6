"""The kvshm worker of one rank: embedded in a serving engine's worker, or standalone.

Lifecycle (:class:`Phase`; :class:`DetachReason` says why it detached)::

    NEW --connect + Hello--> CONNECTING --Ready--> READY --Shutdown--> DRAINING --drained--+
    (retried while nobody      | refused,           | lifeline EOF,       |                |
     listens on the name)      | bad Ready          | bad record          v                v
                               +--------------------+-------------> DETACHED    close(): CLOSED

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
* Every ``Done`` goes over the ``done`` ring *and* is returned once locally by
  :meth:`poll` (or by :meth:`wait` for the jobs it names).
* ``Shutdown``: DRAINING; a :meth:`poll` that finds nothing running and nothing queued
  for a begun step fails the jobs of steps never begun, then detaches (SHUTDOWN).
* Revocation (:meth:`kvshm.ipc.ring.RingPair.revoke`): the scheduler declared this rank dead
  (a hang verdict, a broken ring). The word is read before each job starts and before
  each batch of Dones is published; once set, the worker starts nothing more (queued
  jobs and those waiting in the copy engine fail locally), publishes no Done and
  detaches (REVOKED).
* The lifeline closes only once no copy this worker submitted is still running: the
  scheduler takes a standalone rank's EOF as proof that nothing of it can still write,
  and only then hands that rank's blocks out again. A detached worker with copies
  running keeps the socket open until they finish (:meth:`poll` / :meth:`service` /
  :meth:`close`).
* Lifeline EOF or a ``ProtocolError``: every queued job fails locally
  (``Done(ok=False)`` returned by :meth:`poll`; the scheduler is gone or broken, so
  nothing more goes over the ring), the link is closed, copies already running still
  report through :meth:`poll`. Nothing is raised and the host process is never
  signalled; later calls do nothing and return ``[]``.

Every declined or failed outcome is counted in :meth:`statistics`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from enum import Enum
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
from kvshm.layout import KVLayout
from kvshm.ipc.protocol import Direction, Done, Flush, Shutdown, Transfer, unpack_ids
from kvshm.ipc.rendezvous_client import RendezvousClient
from workers.copy_engine import CopyJob, Fence, describe_error
from workers.cpu_copy import FaultInjection
from workers.session import Connector, Session, SessionOptions
from workers.step_queue import StepQueue

__all__ = ["DetachReason", "Phase", "Worker"]

#: Default bound of a Flush wait in begin_step.
FLUSH_TIMEOUT_S: Final = 60.0


class Phase(Enum):
    """Lifecycle of a :class:`Worker` (see the module docstring)."""

    NEW = "new"
    CONNECTING = "connecting"
    READY = "ready"
    DRAINING = "draining"
    DETACHED = "detached"
    CLOSED = "closed"


class DetachReason(Enum):
    """Why a worker left READY (``Worker.detach_reason``)."""

    SHUTDOWN = "shutdown"  # the scheduler asked; queued work finished first
    PEER_DIED = "peer_died"  # lifeline EOF after Ready: the scheduler is gone
    REFUSED = "refused"  # the scheduler closed the connection before Ready
    SETUP_FAILED = "setup_failed"  # a bad Ready: version, layout, fds, segments
    PROTOCOL_ERROR = "protocol_error"  # an undecodable record or message after Ready
    REVOKED = "revoked"  # the scheduler declared this rank dead (hang, broken ring)
    CLOSED = "closed"  # close() was called first


_LINKED = (Phase.READY, Phase.DRAINING)


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
        self._inflight: set[int] = set()
        self._outbox: list[Done] = []
        self._local: list[Done] = []
        self._counts: Counter[str] = Counter()

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int,
               regions: Sequence[torch.Tensor] | None, *, kv_outer: bool | Sequence[bool] = False,
               fault: FaultInjection | None = None, spin_us: float = 50.0,
               copy_threads: int = 1, flush_timeout_s: float = FLUSH_TIMEOUT_S) -> Worker:
        """A worker for rank ``rank`` of the scheduler named ``name``; no I/O, never blocks.

        ``regions``: this rank's KV tensors (embedded; blocks as dim 0, or K/V as dim 0
        with ``kv_outer``), or None (standalone: the device caches come in ``Ready``).
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
        return cls(name, rank, world_size, layout,
                   SessionOptions(spin_us, copy_threads, fault), flush_timeout_s)

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
            "queued": len(self._queue), "inflight": len(self._inflight),
            "outbox": len(self._outbox),
            "counters": dict(self._counts, connect_retries=self._connector.attempts)}
        if self._session is not None:
            chan = self._session.channel_stats()
            out["channel"] = chan.as_dict() if chan is not None else None
            out["copy"] = self._session.engine.stats()
        return out

    # ------------------------------------------------------------------ per step

    def service(self) -> None:
        """Progress without waiting: connect / poll for Ready / pump the link."""
        if self._phase in (Phase.NEW, Phase.CONNECTING):
            self._connect_step()
        if self._phase in _LINKED:
            self._pump()
        elif self._phase is Phase.DETACHED and self._session is not None:
            self._collect()
            self._close_lifeline_when_idle()

    def begin_step(self, step: int, flush_ids: Iterable[int] = ()) -> None:
        """Step ``step`` begins; its Flush'ed jobs (ring and ``flush_ids``) finish first."""
        self.service()
        if step < self._step:
            self._counts["steps_regressed"] += 1
        else:
            self._step = step
        self._counts["steps"] += 1
        ids = self._queue.take_flush(self._step) | set(flush_ids)
        if ids and self._phase in _LINKED:
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
        out, self._local = self._local, []
        return out

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> list[Done]:
        """Block until the named jobs already submitted have finished (or ``timeout``);
        their Dones (each once: :meth:`poll` will not return them again). Ids of jobs not
        submitted yet (queued for a later step) or unknown are ignored."""
        self.service()
        ids = set(job_ids)
        out = [d for d in self._local if d.job_id in ids]
        if out:
            self._local = [d for d in self._local if d.job_id not in ids]
        pending = ids & self._inflight
        if pending and self._session is not None:
            out += self._finished(self._session.engine.wait(pending, timeout), local=False)
            self._send()
        return out

    def wait_for_work(self, timeout: float) -> None:
        """Standalone loops: block until a command, a finished copy, a lifeline message or
        a watched fd (:meth:`watch`), or ``timeout`` s; then service. Spins ``spin_us``
        first; never busy-waits longer. Submit :meth:`queued_steps` first: Transfers
        already drained into the queue do not wake it."""
        chan = self._session.channel if self._session is not None else None
        if self._phase not in _LINKED or chan is None:
            return
        if self._outbox:  # the done ring was full: retry soon
            timeout = min(timeout, 0.001)
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
        Dones not yet returned are dropped (counted)."""
        if self._phase is Phase.CLOSED:
            return
        if self.detach_reason is None:
            self.detach_reason = DetachReason.CLOSED
        self._counts["dones_dropped_at_close"] += len(self._local) + len(self._queue)
        self._local, self._outbox = [], []
        self._queue.take_all()
        if self._session is not None:
            self._session.close()
        if self._client is not None:
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
            self._session.engine.set_gate(self._may_copy)
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
        self._collect()
        if not alive:
            self._lost(PeerDied(f"kvshm scheduler {self.name!r} closed the connection"))

    def _handle(self, msgs: Iterable[object]) -> None:
        for msg in msgs:
            if isinstance(msg, Transfer):
                self._counts["transfers"] += 1
                self._queue.add(msg)
            elif isinstance(msg, Flush):
                self._counts["flushes"] += 1
                self._queue.add_flush(msg.step, unpack_ids(msg.job_ids))
            elif isinstance(msg, Shutdown):
                self._counts["shutdowns"] += 1
                if self._phase is Phase.READY:
                    self._phase = Phase.DRAINING
            else:
                self._counts["ignored_messages"] += 1

    def _lost(self, exc: TransportError) -> None:
        if isinstance(exc, PeerDied):
            self._detach(DetachReason.PEER_DIED, exc)
        else:
            self._counts["protocol_errors"] += 1
            chan = self._session.channel if self._session is not None else None
            if chan is not None:
                try:  # the good records around an undecodable one: fail them locally too
                    self._handle(chan.receive_nowait())
                except TransportError:
                    pass
            self._detach(DetachReason.PROTOCOL_ERROR, exc)

    def _collect(self) -> None:
        """Finished copies -> outbox (while linked) and the local list; send."""
        assert self._session is not None
        dones = self._session.engine.poll()
        if dones:
            self._finished(dones, local=True)
        self._send()

    def _finished(self, dones: list[Done], *, local: bool) -> list[Done]:
        for d in dones:
            self._inflight.discard(d.job_id)
            self._counts["jobs_ok" if d.ok else "jobs_failed"] += 1
        if self._phase in _LINKED:
            self._outbox += dones
        if local:
            self._local += dones
        return dones

    def _send(self) -> None:
        chan = self._session.channel if self._session is not None else None
        if not self._outbox or chan is None or self._check_revoked():
            return
        try:
            sent = chan.send_available(self._outbox)
        except TransportError as exc:
            self._lost(exc)
            return
        self._counts["dones_sent"] += sent
        if sent < len(self._outbox):
            self._counts["done_ring_full"] += 1
        del self._outbox[:sent]

    # ------------------------------------------------------------------ jobs

    def _submit(self, direction: Direction, step: int, after: Fence | None) -> None:
        self.service()
        if self._phase not in _LINKED:
            self._counts["submits_not_ready" if self._phase in (Phase.NEW, Phase.CONNECTING)
                         else "submits_detached"] += 1
            return
        if step > self._step:
            self._counts["submits_before_begin"] += 1
        for t in self._queue.take(direction, min(step, self._step)):
            self._run(t, after)

    def _run(self, t: Transfer, after: Fence | None) -> None:
        assert self._session is not None
        if self._phase not in _LINKED or self._check_revoked():
            self._counts["jobs_refused_revoked"] += 1
            self._finished([Done(t.job_id, self.rank, False,
                                 f"CopyError: rank {self.rank} revoked")], local=True)
            return
        try:
            job = CopyJob.from_transfer(t)
        except ProtocolError as exc:
            self._counts["bad_transfers"] += 1
            self._finished([Done(t.job_id, self.rank, False, describe_error(exc))], local=True)
            return
        self._inflight.add(t.job_id)
        self._counts["jobs_submitted"] += 1
        self._session.engine.submit(job, after)

    def _flush_wait(self, ids: set[int]) -> None:
        """Finish ``ids`` now: queued ones of begun steps are submitted first (no fence)."""
        assert self._session is not None
        self._counts["flush_waits"] += 1
        forced = self._queue.take_ids(ids, self._step)
        self._counts["flush_forced_submits"] += len(forced)
        for t in forced:
            self._run(t, None)
        pending = ids & self._inflight
        if pending:
            self._finished(self._session.engine.wait(pending, self._flush_timeout), local=True)
            if ids & self._inflight:
                self._counts["flush_timeouts"] += 1
        self._send()

    def _maybe_drained(self) -> None:
        """DRAINING -> DETACHED once nothing runs or waits for a begun step."""
        if self._inflight or self._outbox:
            return
        if self._queue.any_upto(self._step):
            return
        self._fail_queued("shut down before its step began")
        self._send()
        self._detach(DetachReason.SHUTDOWN, None)

    def _fail_queued(self, why: str) -> None:
        failed = [Done(t.job_id, self.rank, False, f"CopyError: rank {self.rank} {why}")
                  for t in self._queue.take_all()]
        if failed:
            self._counts["jobs_failed_unrun"] += len(failed)
            self._finished(failed, local=True)

    def _check_revoked(self) -> bool:
        """Read the revocation word; if set, detach (REVOKED) and return True."""
        chan = self._session.channel if self._session is not None else None
        why = chan.rings.revoked if chan is not None else None
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

    def _may_copy(self) -> bool:
        """The copy engine's gate (any thread): False once revoked. Reads the shared
        revocation word itself, so a copy that waited on its fence while the rank was
        declared dead never starts, even before the host's thread next looks. (A worker
        detached for another reason still finishes what it submitted.)"""
        if self._revoked_detach():
            return False
        session = self._session
        chan = session.channel if session is not None else None
        if chan is None:
            return True
        try:
            return chan.rings.revoked is None
        except ValueError:  # the link closed meanwhile (views released): ask again
            return not self._revoked_detach()

    def _revoked_detach(self) -> bool:
        return self.detach_reason is DetachReason.REVOKED

    def _close_lifeline_when_idle(self) -> None:
        """Close the rendezvous socket once detached and no copy runs (see module doc)."""
        if self._client is not None and not self._inflight:
            self._client.close()

    def _detach(self, reason: DetachReason, error: KvshmError | None) -> None:
        """Leave the link for good: fail what never ran, close the channel; the socket
        closes now, or once the copies still running have finished."""
        if self._phase in (Phase.DETACHED, Phase.CLOSED):
            return
        self.detach_reason, self.last_error = reason, error
        self._counts[f"detached_{reason.value}"] += 1
        self._phase = Phase.DETACHED  # from here on nothing goes over the ring
        self._counts["dones_unsent"] += len(self._outbox)
        self._outbox = []
        self._fail_queued(f"detached ({reason.value}): {error}" if error
                          else f"detached ({reason.value})")
        if self._session is not None:
            self._session.close_link()
            self._collect()
        self._close_lifeline_when_idle()
