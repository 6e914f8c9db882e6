"""Spawn and supervise the worker processes of SPAWN mode.

Invariants:
* kvshm signals only processes it started here (never an embedded worker's host).
* Every spawned process is watched through a pidfd (``os.pidfd_open``): the fd turns
  readable the moment the process exits, so death is noticed in about a millisecond
  through the event loop, without polling.
* ``stop`` is idempotent and escalates: wait ``grace_s`` for a clean exit (the engine has
  already sent ``Shutdown`` and closed the lifelines), then SIGTERM, then SIGKILL; every
  child is reaped before it returns, so no zombie or orphan is left.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshm.errors import ConfigError
from kvshm.types import DeviceKind
from kvshm.worker_cli import ENGINE_PID_ENV, rank_argv

#: Errors of a Popen that mean the process is out of something (typed, with a hint).
_OUT_OF = frozenset({errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM})


@dataclass
class SpawnedWorker:
    """One worker process started by kvshm (one rank)."""

    rank: int
    proc: subprocess.Popen[bytes]
    pidfd: int
    exitcode: int | None = field(default=None)

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def reap_nowait(self) -> int | None:
        """The exit code if the process has exited (reaping it), else None."""
        if self.exitcode is None:
            self.exitcode = self.proc.poll()
        return self.exitcode


def worker_command(name: str, rank: int, world_size: int,
                   device: DeviceKind = DeviceKind.CPU) -> list[str]:
    """The command line of one spawned rank (the standalone worker, per-rank form, with
    the parser's defaults and the rank's ``--device``): :func:`kvshm.worker_cli.rank_argv`,
    the definition the workers' parser is built from. Looked up at each start (tests
    replace it)."""
    return rank_argv(name, rank, world_size, device=device.value)


class Launcher:
    """Starts ``world_size`` worker processes for one engine and tears them down.
    ``devices``: each rank's ``--device`` (where its caches live; default all CPU)."""

    def __init__(self, name: str, world_size: int,
                 devices: Sequence[DeviceKind] | None = None) -> None:
        self._name = name
        self._world_size = world_size
        self._devices = list(devices) if devices is not None else [DeviceKind.CPU] * world_size
        self.workers: list[SpawnedWorker] = []
        self._stopped = False

    def start(self) -> list[SpawnedWorker]:
        """Start every rank; each connects to the engine's rendezvous by itself."""
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env[ENGINE_PID_ENV] = str(os.getpid())  # a rank gives up if we die before Ready
        for rank in range(self._world_size):
            try:
                proc = subprocess.Popen(
                    worker_command(self._name, rank, self._world_size, self._devices[rank]),
                    env=env, stdin=subprocess.DEVNULL, close_fds=True)
            except BaseException as exc:
                self.stop(0.0)  # the ranks already started: nothing may outlive us
                if isinstance(exc, OSError) and exc.errno in _OUT_OF:  # out of fds or
                    raise ConfigError(f"cannot start worker rank {rank}: "  # processes
                                      f"{exc.strerror or exc} (out of file descriptors or "
                                      "processes? see `ulimit -n` / `ulimit -u`)") from exc
                raise
            try:
                pidfd = os.pidfd_open(proc.pid)
            except BaseException:
                proc.kill()
                proc.wait()
                self.stop(0.0)
                raise
            self.workers.append(SpawnedWorker(rank, proc, pidfd))
        return self.workers

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank`` (a verdict: it must stop touching blocks now); its pidfd
        turns readable once it has exited. No-op once it has exited or been stopped."""
        w = self.workers[rank]
        if not self._stopped and w.reap_nowait() is None:
            self._signal(w, signal.SIGKILL)

    def dead(self) -> list[SpawnedWorker]:
        """Workers that have exited (reaped), in rank order."""
        return [w for w in self.workers if w.reap_nowait() is not None]

    def stop(self, grace_s: float) -> None:
        """Wait ``grace_s`` for clean exits, then SIGTERM, then SIGKILL; reap all."""
        if self._stopped:
            return
        self._stopped = True
        self._wait_all(grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            alive = [w for w in self.workers if w.reap_nowait() is None]
            if not alive:
                break
            for w in alive:
                self._signal(w, sig)
            self._wait_all(grace_s if sig == signal.SIGTERM else 5.0)
        for w in self.workers:
            os.close(w.pidfd)

    def reaped(self) -> list[int]:
        """The ranks whose process has exited and been reaped (after :meth:`stop`: every
        rank but one stuck in the kernel past the SIGKILL wait)."""
        return [w.rank for w in self.workers if w.exitcode is not None]

    def _wait_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for w in self.workers:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                w.exitcode = w.proc.wait(remaining)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def _signal(w: SpawnedWorker, sig: signal.Signals) -> None:
        try:
            signal.pidfd_send_signal(w.pidfd, sig)
        except ProcessLookupError:
            pass
