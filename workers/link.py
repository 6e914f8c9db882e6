"""A worker's state and its link to the scheduler: connecting, pumping, detaching.

:class:`WorkerLink` is the base of :class:`~workers.worker.Worker` (whose module
docstring states the rules every call follows); it holds the worker's state and the
methods that service the link, so the public per-step API stays in one short module.

State (single-threaded, like the Worker): ``_phase`` (:class:`~workers.phases.Phase`),
``_session`` (None until Ready), ``_client`` (the rendezvous socket: the lifeline),
``_queue`` (Transfers per direction, Flushes, Remote and Disk jobs), ``_dones`` (every Done passes
through it once: :mod:`workers.done_book`), ``_gate`` (the revocation word, read before
any copy starts and before any Done is published).

Threads: the state is the host thread's, with one exception. An embedded worker (its
host hands it the KV regions) with a remote or disk tier runs a
:class:`~workers.mover_publisher.MoverPublisher` from Ready on: its thread publishes the
movers' Dones as soon as a job finishes (:meth:`WorkerLink._publish_movers`), not at
the host's next call. A remote mover's own thread publishes first
(:meth:`WorkerLink._publish_from_mover`, right after the job: no thread wake-up on the
way, each of which may wait up to the switch interval for the GIL in a busy vLLM
process); the publisher takes what it could not. ``_lock`` (re-entrant) serialises
them: every public method of the Worker and every flush hold it, so the ``done`` ring
keeps one producer at a time and the book is never touched by two threads at once.

Ordering of one pump (:meth:`WorkerLink._pump`): revocation word first (nothing more
happens once set), then the heartbeat, the lifeline, the ring's commands, the Disk and
then the Remote jobs that arrived (they run on arrival), then the Dones of finished work,
then an EOF seen on the lifeline (so the commands that came before it are handled
first). Disk before Remote: the row fence a GET asks (:meth:`DiskMover.wait_rows
<workers.disk_mover.DiskMover.wait_rows>`) sees only WRITEs already submitted, and the
scheduler posts a GET's victims' WRITEs before the GET; handed over the other way, the
remote mover's thread could start the GET before the WRITE is registered, overwrite
the row, and the WRITE would put the GET's bytes on disk under the victim's hash.
"""

from __future__ import annotations

import functools
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Concatenate, ParamSpec, TypeVar

from kvshm.errors import (
    ConfigError,
    KvshmError,
    PeerDied,
    RankRevoked,
    TransportError,
)
from kvshm.ipc.protocol import Done
from kvshm.ipc.rendezvous_client import RendezvousClient
from kvshm.layout import KVLayout
from workers.done_book import DoneBook
from workers.mover_publisher import Armed, CommandWatch, MoverPublisher
from workers.phases import LINKED, DetachReason, Phase
from workers.revocation import RevocationGate, close_lifeline_when_idle
from workers.session import Connector, Session, SessionOptions
from workers.step_queue import StepQueue

__all__ = ["WorkerLink", "locked"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_L = TypeVar("_L", bound="WorkerLink")


def locked(method: Callable[Concatenate[_L, _P], _R]) -> Callable[Concatenate[_L, _P], _R]:
    """Run a Worker method under the worker's lock (see the module docstring)."""

    @functools.wraps(method)
    def wrapper(self: _L, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class WorkerLink:
    """The worker's state and link servicing (see the module docstring)."""

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
        self._lock = threading.RLock()
        self._embedded = layout is not None
        self._publisher: MoverPublisher | None = None
        #: jobs the host gave up on before they started (:meth:`Worker.cancel_unstarted`):
        #: failed unrun when their Transfer is taken, never copied
        self._cancelled: set[int] = set()

    # ------------------------------------------------------------------ connecting

    def _connect_step(self) -> None:
        try:
            self._session = self._connector.poll()
        except Exception as exc:  # noqa: BLE001 - any setup failure detaches, never raises
            # into the host: a bug or an unexpected error (a thread that cannot start, a
            # bad path) fails the rank as a refused setup would; the Ready is consumed, so
            # staying CONNECTING would leave it stuck and its jobs pending for good
            self._client = self._connector.client  # closed by _detach: the scheduler sees EOF
            err = exc if isinstance(exc, KvshmError) else ConfigError(
                f"{type(exc).__name__}: {exc}")
            if self._client is not None and not isinstance(exc, PeerDied):
                self._client.send_setup_failed(self.rank, str(err))  # the engine's line
            self._detach(DetachReason.REFUSED if isinstance(exc, PeerDied)
                         else DetachReason.SETUP_FAILED, err)
            return
        self._client = self._connector.client
        if self._session is not None:
            self._gate = RevocationGate(self._session)
            self._session.engine.set_gate(self._gate.may_copy)
            if self._session.disk is not None:
                self._session.disk.set_gate(self._gate.may_copy)
            self._phase = Phase.READY
            try:
                self._start_publisher()
            except Exception as exc:  # noqa: BLE001 - as above: a publisher thread that
                # cannot start fails the rank's setup, never raises into the host
                self._detach(DetachReason.SETUP_FAILED, ConfigError(
                    f"the mover publisher could not start: {type(exc).__name__}: {exc}"))
        elif self._client is not None:
            self._phase = Phase.CONNECTING

    def _start_publisher(self) -> None:
        """Embedded, with a remote or disk mover: publish their Dones on finish."""
        session = self._session
        assert session is not None
        fds = [m.notify_fd() for m in (session.remote, session.disk) if m is not None]
        if self._embedded and fds:
            commands = None
            if session.disk is not None and session.channel is not None:
                commands = CommandWatch(os.dup(session.channel.watch_fd()),
                                        self._arm_commands, self._take_commands)
            try:
                self._publisher = MoverPublisher(fds, self._publish_movers,
                                                 commands=commands,
                                                 name=f"kvshm-publish-r{self.rank}")
            except BaseException:
                if commands is not None:  # not the publisher's: it never started
                    os.close(commands.fd)
                raise
            if session.remote is not None:
                session.remote.on_finish(self._publish_from_mover)

    def _publish_from_mover(self) -> bool:
        """The remote mover's thread, right after a job finished: publish its Done now
        (:meth:`_publish_movers`) if the lock is free. Never waits for the lock: the host
        may hold it while closing the mover, which joins that thread; a Done left is the
        publisher's (its eventfd is readable) or the host's next call's. True when it
        published."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            return self._publish_movers()
        finally:
            self._lock.release()

    def _stop_publisher(self) -> None:
        """Stop the publisher thread (never with ``_lock`` held: it may wait for it)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.stop()
            self._counts.update({f"publisher_{k}": v for k, v in publisher.counts.items()})

    def _publish_movers(self) -> bool:
        """A flush (the publisher thread's, or a remote mover's): the movers' finished
        jobs -> the book -> the ``done`` ring, under the lock; nothing once the worker
        left READY/DRAINING (the host's calls then collect them locally). True when it
        took any Done."""
        with self._lock:
            session = self._session
            if self._phase not in LINKED or session is None:
                return False
            mover, disk = session.remote, session.disk
            dones = (mover.poll() if mover else []) + (disk.poll() if disk else [])
            if dones:
                self._counts["dones_published_on_finish"] += len(dones)
                self._report(dones)
            return bool(dones)

    def _arm_commands(self) -> Armed:
        """The publisher thread, before it waits: arm the ``cmd`` ring's doorbell
        (OFF once the worker left READY/DRAINING: the channel is closed or closing)."""
        with self._lock:
            chan = self._session.channel if self._session is not None else None
            if self._phase not in LINKED or chan is None:
                return Armed.OFF
            return Armed.PENDING if chan.arm() else Armed.ARMED

    def _take_commands(self) -> None:
        """The publisher thread, after the ``cmd`` ring rang: queue its commands (in
        ring order, as the host's pump would) and start their Disk and Remote jobs now
        (copies wait for the host's hooks); the revocation word is read first, as in
        :meth:`_pump`."""
        with self._lock:
            chan = self._session.channel if self._session is not None else None
            if self._phase not in LINKED or chan is None:
                return
            chan.disarm()
            if self._check_revoked():
                return
            try:
                self._handle(chan.receive_nowait())
            except TransportError as exc:
                self._lost(exc)
                return
            n = len(self._queue.disk) + len(self._queue.remote)
            if n:
                self._counts["jobs_taken_on_arrival"] += n
                self._run_disk()  # WRITEs registered before a GET can ask the fence
                self._run_remote()
                self._send()  # a job refused at once is a failed Done

    # ------------------------------------------------------------------ the link

    def _pump(self, *, lifeline: bool = True) -> None:
        """One pump (the module docstring's order). Without ``lifeline`` the rendezvous
        socket is not read (no Shutdown, Stats or EOF from it this time): the step's
        calls after ``begin_step`` (:meth:`~workers.worker.Worker.submit_loads` and the
        rest, ``Worker._tend``) read it once a step, not once a call -- each read is a
        syscall that hands the GIL to the copy threads, which a busy host then waits
        for."""
        session, client = self._session, self._client
        assert session is not None and session.channel is not None and client is not None
        chan = session.channel
        if self._check_revoked():
            return
        alive = True
        try:
            chan.beat()
            if lifeline:
                alive, msgs = client.take_lifeline()
                self._handle(msgs)
            self._handle(chan.receive_nowait())
        except TransportError as exc:
            self._lost(exc)
            return
        self._run_disk()  # WRITEs registered before a GET can ask the fence
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
            self._drain_ring_quietly()  # the good records around the bad one fail locally
            self._detach(DetachReason.PROTOCOL_ERROR, exc)

    def _drain_ring_quietly(self) -> None:
        """Take what the ring still holds (a Shutdown the engine posted before closing,
        the good records around an undecodable one). When that read raises too (another
        bad record arrived meanwhile), the good records the channel kept back are taken
        instead: none is dropped because a neighbour was bad. A bad Flush among them
        raises only after the rest are queued (``StepQueue.intake``)."""
        chan = self._session.channel if self._session is not None else None
        if chan is None:
            return
        try:
            self._handle(chan.receive_nowait())
            return
        except TransportError:
            pass
        try:
            self._handle(chan.take_salvaged())
        except TransportError:
            pass

    def _collect(self) -> None:
        """Finished copies, remote and disk jobs -> the book; send."""
        assert self._session is not None
        mover, disk = self._session.remote, self._session.disk
        self._report(self._session.engine.poll() + (mover.poll() if mover else [])
                     + (disk.poll() if disk else []))

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

    def _run_disk(self) -> None:
        """Disk jobs run on arrival (:mod:`workers.disk_mover`); without a disk tier in
        Ready, with a slab that did not open here, or once revoked, each fails at once."""
        assert self._session is not None
        disk = self._session.disk
        for job in self._queue.take_disk():
            if disk is None or self._check_revoked():
                self._counts["disk_jobs_refused"] += 1
                why = (f"rank {self.rank} revoked" if disk is not None
                       else self._session.disk_error or "no disk tier")
                self._record([Done(job.job_id, self.rank, False, f"DiskError: {why}")])
                continue
            self._dones.started(job.job_id)
            disk.submit(job)

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

    def _fail_queued(self, why: str) -> None:
        ids = [t.job_id for t in self._queue.take_all()]
        ids += [r.job_id for r in self._queue.take_remote()]
        ids += [d.job_id for d in self._queue.take_disk()]
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
        if self._session.remote is not None:
            self._session.remote.cancel_queued("rank revoked")
        if self._session.disk is not None:
            self._session.disk.cancel_queued("rank revoked")
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
