"""``kvshm-workers``: standalone worker processes, one per TP x PP rank.

Two forms of one command line:

* parent: ``kvshm-workers --name NAME --tp 2 [--pp 1] [--device cpu]`` says at once what
  it starts and how long the ranks wait, starts one child per rank (the per-rank form
  below), forwards SIGTERM/SIGINT to them, and exits once all have: 0 if every rank
  exited 0, else the first failing rank's code (128 + signal for a rank killed by a
  signal). Children get ``PR_SET_PDEATHSIG`` = SIGTERM, so they stop if the parent is
  killed. The ranks are one group: once any rank has exited, the others get
  :data:`SIBLING_GRACE_S` to follow (at an engine's Shutdown they all exit at once), then
  SIGTERM, then SIGKILL after :data:`SIBLING_KILL_S` more -- a group missing a rank
  cannot serve, and a rank still waiting for an engine that already gave up on the group
  would wait out its whole ``--connect-timeout``. (A rank still busy 25 s after its
  sibling's clean exit is killed and reported so: at Shutdown ranks exit within a second.)
* per rank: ``python -m workers --name NAME --rank R --world-size W [--device cuda]``
  (what :class:`kvshm.engine.launcher.Launcher` spawns) runs one standalone
  :class:`~workers.worker.Worker` (``regions=None``: the device caches arrive in Ready:
  shared-memory segments with ``--device cpu``, CUDA IPC handles with ``--device cuda``,
  see :mod:`kvshm.cuda_ipc`; a rank started for the other device is refused).

A rank connects (retrying while nobody listens on the name) and waits for Ready up to
``--connect-timeout`` seconds (a rank the engine spawned: once connected, as long as the
engine lives and keeps the connection) -- saying at once what it waits for when nobody
listens yet, and every :data:`PROGRESS_S` seconds how long it has waited -- then loops: drain
commands, begin every step it has seen in ascending order and submit its loads and
stores at once (no fences: the serving process plans stores only for blocks whose
compute has finished), send Dones as copies finish.
Idle, it spins ``--spin-us`` then parks in poll() on the cmd doorbell, the lifeline, the
copy engine's completion eventfd and a signal wake-up pipe -- no busy waiting.

Each rank prints, on stderr: ``waiting for kvshm engine 'NAME' (timeout ...)`` if nobody
listens at its first try, then ``still waiting ...`` every 10 s until ``connected to kvshm
engine 'NAME'``, ``ready``, and at the end ``detached (the engine closed)`` / ``detached
(signal SIGTERM)`` or ``error: ...`` (``no kvshm engine named 'NAME' appeared within ...``
when the wait timed out).

Exit codes: 0 after the engine's Shutdown (it closed) or SIGTERM/SIGINT; 1 when the
engine died (lifeline EOF without a Shutdown: SIGKILL, a crash) or for a runtime error
(refused, no Ready in time, bad resources, protocol error), with one clear line on
stderr; 2 for bad usage (``--device cuda`` where no CUDA device is visible, too).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Final

from kvshm.config import MAX_WORLD_SIZE, check_name
from kvshm.errors import ConfigError, PeerDied
from kvshm.ipc.fdpass import socket_address
from kvshm.types import DeviceKind
from kvshm.worker_cli import ENGINE_PID_ENV, Flag, add_arguments, rank_argv
from workers.phases import LINKED, DetachReason, Phase
from workers.stop_signals import STOP_SIGNALS, EarlyStop

if TYPE_CHECKING:  # torch is imported only by a rank, never by the parent or --help
    from workers.worker import Worker

__all__ = ["PROGRESS_S", "WaitProgress", "cli_main", "exit_at_once", "run_parent", "run_rank"]

PROG: Final = "kvshm-workers"
#: Longest park between services (the copy thread, doorbells and signals wake it sooner).
PARK_S: Final = 1.0
#: Seconds between two "still waiting" lines of a rank waiting for its engine's Ready.
PROGRESS_S: Final = 10.0
#: ``--connect-timeout`` at most: a day (beyond it, as good as waiting for ever).
MAX_CONNECT_TIMEOUT_S: Final = 86400.0
#: ``--spin-us`` at most: a second of busy-wait (beyond it the rank never parks).
MAX_SPIN_US: Final = 1e6
#: Seconds the other ranks get to exit on their own once one rank has exited.
SIBLING_GRACE_S: Final = 5.0
#: Seconds after that SIGTERM before a rank still running is SIGKILLed.
SIBLING_KILL_S: Final = 20.0
#: The parent's poll interval while it waits for its ranks.
_REAP_POLL_S: Final = 0.1
_PR_SET_PDEATHSIG: Final = 1


class UsageError(Exception):
    """Bad command line (exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    """The parser of both forms; its options are :func:`kvshm.worker_cli.add_arguments`,
    the same flags :func:`kvshm.worker_cli.rank_argv` writes."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Run kvshm's standalone worker processes (one per TP x PP rank) for "
                    "the kvshm engine named NAME. Without --rank: start every rank as a child "
                    "process and wait for them. With --rank: run that one rank.",
        epilog="Exit codes: 0 after the engine's Shutdown or SIGTERM/SIGINT; 1 when the "
               "engine died (no Shutdown) or on a runtime error; 2 on bad usage. Device "
               "caches are the tensors the serving process hands to its kvshm engine: "
               "shared-memory ones (--device cpu) or CUDA ones (--device cuda, CUDA IPC).")
    add_arguments(p)
    return p


def _world_size(args: argparse.Namespace) -> int:
    if args.tp is not None and (args.tp < 1 or args.pp < 1):
        raise UsageError("--tp and --pp must be >= 1")
    from_tp = None if args.tp is None else args.tp * args.pp
    world: int | None = args.world_size
    if world is not None and from_tp is not None and world != from_tp:
        raise UsageError(f"--world-size {world} contradicts --tp {args.tp} x --pp {args.pp}")
    world = world if world is not None else from_tp
    if world is None:
        raise UsageError("give --tp [--pp] (or --world-size)")
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    if world > MAX_WORLD_SIZE:  # one process a rank: a typo must not fork until EAGAIN
        raise UsageError(f"{world} ranks: an engine has at most {MAX_WORLD_SIZE}")
    if args.rank is not None and not 0 <= args.rank < world:
        raise UsageError(f"--rank {args.rank} out of range [0, {world})")
    if not 0 < args.connect_timeout <= MAX_CONNECT_TIMEOUT_S:  # (nan and inf too)
        raise UsageError(f"--connect-timeout must be > 0 and <= {MAX_CONNECT_TIMEOUT_S:g} "
                         f"seconds, got {args.connect_timeout}")
    if not 0 <= args.spin_us <= MAX_SPIN_US:
        raise UsageError(f"--spin-us must be >= 0 and <= {MAX_SPIN_US:g}, "
                         f"got {args.spin_us}")
    try:  # a name no engine can have: refused now, not after --connect-timeout
        check_name(args.name)
        socket_address(args.name)
    except ConfigError as exc:
        raise UsageError(f"--name: {exc}") from None
    return world


def cli_main(argv: Sequence[str] | None = None, *, exit_rank_at_once: bool = False) -> int:
    """Entry point of ``kvshm-workers`` and ``python -m workers``; returns the exit code.
    ``exit_rank_at_once`` (the console script's, never an in-process caller's): a rank's
    process ends through :func:`exit_at_once` after its clean close."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        world = _world_size(args)
        device = _device(args.device)
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        _line(f"{PROG}: error: {exc}")
        return 2
    if exit_rank_at_once:  # a process of its own: no stop signal is fatal from here on
        EarlyStop.install()  # (the console script did already, before its imports)
    if args.rank is None:
        code = run_parent(args.name, world, connect_timeout=args.connect_timeout,
                          spin_us=args.spin_us, device=device)
    else:
        # a rank's own process (the console script) offers to be killed to fence it
        code = run_rank(args.name, args.rank, world, connect_timeout=args.connect_timeout,
                        spin_us=args.spin_us, device=device, fence_by_kill=exit_rank_at_once)
    if exit_rank_at_once:
        EarlyStop.ignore()  # the interpreter's teardown resets a handler to the default
        if args.rank is not None:
            exit_at_once(code)
    return code


def exit_at_once(code: int) -> None:
    """End a rank's process now with ``code``, skipping the interpreter's teardown (1.3 -
    1.5 s on an idle 2-core machine, 2.3 - 2.9 s at load 9: unloading torch's and its
    dependencies' modules; measured by timestamps: docs/operations.md, exit codes), or return
    (the caller exits normally) where that is not safe.

    Called only after :func:`run_rank` returned, so every resource a rank holds is
    released in order first: the worker closed (queued copies failed, running ones
    finished and their threads joined; the remote mover's thread joined and its Valkey
    clients closed; ``Goodbye`` sent and the link's socket closed), the signal handlers
    and wake-up pipe restored and closed. A rank owns no shared-memory name (the engine
    creates and unlinks every segment), so nothing on disk or in /dev/shm outlives it.
    What is left is done here: the ``atexit`` handlers run (``logging``'s flush among
    them), then stdout and stderr are flushed. Not safe, so a normal exit: another
    non-daemon thread still alive (the interpreter would wait for it)."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (closed at the start: nothing to flush)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or a broken pipe: nothing more to say
            pass
    os._exit(code)


def _device(name: str) -> DeviceKind:
    """``--device``; UsageError for cuda where this process sees no CUDA device (checked
    once, before any rank starts: torch is imported for it only then)."""
    device = DeviceKind(name)
    if device is DeviceKind.CUDA:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible here "
                             "(torch.cuda.is_available() is False; check the driver and "
                             "CUDA_VISIBLE_DEVICES)")
    return device


# ---------------------------------------------------------------------------- parent


def _death_signal(parent: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:  # runs in the child between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def run_parent(name: str, world: int, *, connect_timeout: float, spin_us: float,
               device: DeviceKind = DeviceKind.CPU) -> int:
    """Start ``world`` ranks, forward SIGTERM/SIGINT, wait for all; see module doc."""
    procs: list[subprocess.Popen[bytes]] = []
    stop = EarlyStop.signum  # one that came before the handler below: every rank gets it

    def forward(signum: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = signum
        for p in procs:
            if p.returncode is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:  # pragma: no cover - exited meanwhile
                    pass

    _line(f"{PROG}: starting {world} rank(s) for kvshm engine {name!r}; each waits up to "
          f"{connect_timeout:g} s for it (start the engine first, or pass "
          f"{Flag.CONNECT_TIMEOUT.value} SECONDS)")
    old = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    preexec = _death_signal(os.getpid())
    try:
        for rank in range(world):
            cmd = rank_argv(name, rank, world, connect_timeout=connect_timeout,
                            spin_us=spin_us, device=device.value)
            with EarlyStop.blocked():  # the rank unblocks them once it records them
                procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                              preexec_fn=preexec))
            if stop:
                procs[-1].send_signal(stop)
        codes = _wait_ranks(procs, lambda: bool(stop))
    finally:
        for p in procs:  # only on an error above: never leave a rank behind
            if p.returncode is None:
                p.kill()
                p.wait()
        for sig, handler in old.items():
            signal.signal(sig, handler)
    return _parent_exit_code(codes)


def _wait_ranks(procs: Sequence[subprocess.Popen[bytes]],
                signalled: Callable[[], bool]) -> list[int]:
    """Every rank's exit code, each reaped as it exits (in any order: none is left a
    zombie behind a rank started before it). Once one has exited the rest are stopped as
    the module docstring says, each step said in one line. ``signalled()``: the parent
    was told to stop (SIGTERM / SIGINT, already forwarded to every rank): no SIGTERM of
    its own then, only the SIGKILL past the grace periods."""
    first: float | None = None
    termed = killed = False
    while True:
        alive = [(r, p) for r, p in enumerate(procs) if p.poll() is None]
        if not alive:
            return [p.returncode for p in procs]
        if len(alive) < len(procs):
            now = time.monotonic()
            first = now if first is None else first
            if not termed and now - first >= SIBLING_GRACE_S:
                termed = True
                if not signalled():
                    gone = ", ".join(str(r) for r, p in enumerate(procs)
                                     if p.returncode is not None)
                    _stop_ranks(alive, signal.SIGTERM, f"rank(s) {gone} exited, and the "
                                                       "group cannot serve without them")
            elif termed and not killed and now - first >= SIBLING_GRACE_S + SIBLING_KILL_S:
                killed = True
                _stop_ranks(alive, signal.SIGKILL, f"still running {SIBLING_KILL_S:g} s "
                                                   "after SIGTERM")
        time.sleep(_REAP_POLL_S)


def _stop_ranks(alive: list[tuple[int, subprocess.Popen[bytes]]], sig: signal.Signals,
                why: str) -> None:
    ranks = ", ".join(str(r) for r, _ in alive)
    _line(f"{PROG}: sending {sig.name} to rank(s) {ranks}: {why}")
    for _, p in alive:
        try:
            p.send_signal(sig)
        except ProcessLookupError:  # pragma: no cover - exited meanwhile
            pass


def _parent_exit_code(codes: list[int]) -> int:
    for rank, code in enumerate(codes):
        if code != 0:
            how = f"signal {-code}" if code < 0 else f"code {code}"
            _line(f"{PROG}: rank {rank} exited with {how}")
    bad = [c for c in codes if c != 0]
    if not bad:
        return 0
    return 128 - bad[0] if bad[0] < 0 else bad[0]


# ---------------------------------------------------------------------------- one rank


class _Stopper:
    """SIGTERM/SIGINT -> a flag plus a readable pipe (``fd``) that wakes any poll()."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.signum = EarlyStop.signum  # one that came before this stopper: stop at once
        self._old = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        self._old_wakeup = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum

    def drain(self) -> None:
        try:
            while os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_wakeup)
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        os.close(self.fd)
        os.close(self._w)


def run_rank(name: str, rank: int, world: int, *, connect_timeout: float,
             spin_us: float, device: DeviceKind = DeviceKind.CPU,
             fence_by_kill: bool = False) -> int:
    """One standalone rank until Shutdown, lifeline EOF or a stop signal; the exit code.
    ``fence_by_kill`` (a rank's own process only): offered in its Hello."""
    import torch

    from kvshm.errors import KvshmError
    from workers.worker import Worker

    torch.set_num_threads(1)
    stopper = _Stopper()
    worker: Worker | None = None
    try:
        worker = Worker.attach(name, rank, world, None, spin_us=spin_us, device=device,
                               fence_by_kill=fence_by_kill)
        return _serve(worker, stopper, connect_timeout)
    except (KvshmError, TimeoutError) as exc:
        _line(f"{PROG}[rank {rank}]: error: {exc}")
        return 1
    finally:
        if worker is not None:
            worker.close()
        stopper.close()


def _say(worker: Worker, text: str) -> None:
    """One progress line on stderr: ``kvshm-workers[rank R]: text``."""
    _line(f"{PROG}[rank {worker.rank}]: {text}")


def _line(text: str) -> None:
    """One line on stderr in one write: the ranks of one parent share its stderr, and
    ``print`` writes the text and its newline separately, so two ranks' lines could
    interleave (seen in CI: "...closed)kvshm-workers[rank 0]: ...").

    A line nobody can read is dropped, never an error: stderr closed at the start
    (``2>&-``: Python's ``sys.stderr`` is None) or a pipe whose reader is gone (EPIPE:
    ``| tee`` after tee died) killed the rank with AttributeError or BrokenPipeError
    before it ever connected -- its engine then waited out its whole connect timeout
    (a hostile probe). A rank serves whatever happens to its log stream."""
    err = sys.stderr
    if err is None:
        return
    try:
        err.write(text + "\n")
        err.flush()
    except (OSError, ValueError):  # a broken pipe, a closed file: nothing more to say
        pass


#: Detach reasons of a rank that never got a usable Ready.
_BEFORE_READY: Final = (DetachReason.REFUSED, DetachReason.SETUP_FAILED)

#: The exit line of each detach reason that is an error (exit code 1).
_ERRORS: Final = {
    DetachReason.PEER_DIED: "the engine died (its lifeline closed without a Shutdown)",
    DetachReason.REFUSED: "the engine refused this rank or closed before Ready "
                          "(the engine's log names the reason)",
    DetachReason.SETUP_FAILED: "could not use the engine's resources",
    DetachReason.PROTOCOL_ERROR: "protocol error",
    DetachReason.REVOKED: "the engine declared this rank dead",
}


def _serve(worker: Worker, stopper: _Stopper, connect_timeout: float) -> int:
    """Serve until the link ends; prints ``ready`` and ``detached (reason)`` or the error.
    Exit 0 only for the engine's Shutdown or a stop signal (a supervisor tells a closed
    engine from a dead one by it)."""
    if not _await_ready(worker, stopper, connect_timeout):
        _say(worker, f"detached (signal {signal.Signals(stopper.signum).name})")
        return 0
    if worker.phase in LINKED or worker.detach_reason not in _BEFORE_READY:
        _say(worker, "ready")  # also when Ready and the end came in one service()
    if worker.phase in LINKED:
        worker.watch(stopper.fd)
    while worker.phase in LINKED and not stopper.signum:
        for step in worker.queued_steps():
            worker.begin_step(step)
            worker.submit_loads(step)
            worker.submit_stores(step)
        worker.poll()
        # Any call above may have drained new Transfers from the ring: park only with
        # none queued, or they would wait for the next wake-up.
        if worker.phase in LINKED and not worker.queued_steps():
            worker.wait_for_work(PARK_S)
            stopper.drain()
    reason = worker.detach_reason
    if reason is None or reason is DetachReason.SHUTDOWN:
        how = "the engine closed" if reason is not None \
            else f"signal {signal.Signals(stopper.signum).name}"
        _say(worker, f"detached ({how})")
        return 0
    why = _ERRORS.get(reason, f"detached ({reason.value})")
    _say(worker, f"error: {why}: {worker.last_error}")
    return 1


class WaitProgress:
    """When a waiting rank prints its next "still waiting" line: first ``interval`` seconds
    after ``start``, then every ``interval`` seconds (monotonic clock). A late check (a
    stopped, then resumed process) prints one line, not one per interval missed, and the
    next is due on the next multiple of ``interval`` after ``start``."""

    def __init__(self, start: float, interval: float = PROGRESS_S) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        self._start, self._interval = start, interval
        self._next = start + interval

    def due(self, now: float) -> bool:
        """True (once per interval) when a line is due at ``now``."""
        if now < self._next:
            return False
        beats = (now - self._start) // self._interval
        self._next = self._start + (beats + 1) * self._interval
        return True


def _await_ready(worker: Worker, stopper: _Stopper, timeout: float) -> bool:
    """Connect and wait for Ready; False if a stop signal came first. TimeoutError when
    no Ready came within ``timeout`` -- but a rank the engine spawned, once connected
    (the lifeline open), waits for Ready with no deadline of its own: it watches the
    engine process (its parent) and the lifeline, and the engine kills it at close.
    Before, its timeout (60 s) ran on while the engine read its disk slabs after every
    rank connected, and a warm restart over a large slab lost every rank (a hostile
    probe: 320,000 slots took 3.6 s; millions take minutes; the scan now runs on a
    thread after Ready, :mod:`kvshm.engine.warm_scan`, but a busy or slow engine start
    must still not cost a spawned rank). A rank started by hand keeps its
    ``--connect-timeout`` for the whole wait (an engine that hangs must not hold it for
    ever, a review). Prints the
    waiting line at once when nobody listens on the name yet, and a progress line every
    :data:`PROGRESS_S` seconds while it waits (not connected, or no Ready)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    progress = WaitProgress(t0, PROGRESS_S)
    poller_fds = [stopper.fd]
    first = True
    engine_pid = _spawning_engine()
    while True:
        if engine_pid is not None and os.getppid() != engine_pid:
            raise PeerDied(f"the engine process {engine_pid} that spawned this rank "
                           "exited before it was ready")
        was_new = worker.phase is Phase.NEW
        worker.service()
        if was_new and worker.phase is not Phase.NEW and worker.lifeline_fd() is not None:
            _say(worker, f"connected to kvshm engine {worker.name!r} "
                         f"(rank {worker.rank} of {worker.world_size})")
        if worker.phase not in (Phase.NEW, Phase.CONNECTING):
            return True
        if first and worker.phase is Phase.NEW:
            _say(worker, _waiting_message(worker, timeout))
        first = False
        if stopper.signum:
            return False
        now = time.monotonic()
        lifeline = worker.lifeline_fd()
        connected = (engine_pid is not None and worker.phase is Phase.CONNECTING
                     and lifeline is not None)
        left = deadline - now
        if left <= 0 and not connected:
            raise TimeoutError(_timeout_message(worker, timeout))
        if progress.due(now):
            _say(worker, _progress_message(worker, now - t0, timeout, connected))
        fds = poller_fds if lifeline is None else [*poller_fds, lifeline]
        nap = PARK_S if connected else min(left, 0.05 if worker.phase is Phase.NEW else PARK_S)
        select.select(fds, [], [], nap)
        stopper.drain()


def _spawning_engine() -> int | None:
    """The pid of the engine that spawned this rank (:data:`ENGINE_PID_ENV`), or None
    (started by hand, or a value that is not a pid)."""
    value = os.environ.get(ENGINE_PID_ENV, "")
    return int(value) if value.isascii() and value.isdigit() else None


def _waiting_message(worker: Worker, timeout: float) -> str:
    return (f"waiting for kvshm engine {worker.name!r} (nothing listens on "
            f"\\0kvshm.{worker.name} yet; timeout {timeout:g} s: start the engine first, "
            f"or pass {Flag.CONNECT_TIMEOUT.value} SECONDS)")


def _progress_message(worker: Worker, waited: float, timeout: float,
                      connected: bool = False) -> str:
    if connected:
        return (f"still waiting for kvshm engine {worker.name!r}'s Ready ({waited:.0f} s): "
                f"it waits for all {worker.world_size} ranks")
    what = (f"for kvshm engine {worker.name!r} to appear" if worker.phase is Phase.NEW
            else f"for kvshm engine {worker.name!r}'s Ready: it waits for all "
                 f"{worker.world_size} ranks")
    return f"still waiting {what} ({waited:.0f} s of {timeout:g} s)"


def _timeout_message(worker: Worker, timeout: float) -> str:
    give_up = (f"gave up ({Flag.CONNECT_TIMEOUT.value} {timeout:g}; start the engine "
               f"first, or wait longer with a larger {Flag.CONNECT_TIMEOUT.value})")
    if worker.phase is Phase.NEW:
        return (f"no kvshm engine named {worker.name!r} appeared within {timeout:g} s "
                f"(nothing listens on \\0kvshm.{worker.name}); {give_up}")
    return (f"kvshm engine {worker.name!r} sent no Ready within {timeout:g} s: it waits for "
            f"all {worker.world_size} ranks (are the others running?); {give_up}")
