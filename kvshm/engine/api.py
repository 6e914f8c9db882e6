"""The public engines: ``Engine`` (asyncio, for custom servers) and ``SyncClient``.

Both are :class:`~kvshm.engine.facade.Facade` s over one
:class:`~kvshm.engine.runtime.Runtime`, which owns the manager, the CPU pool, the
rendezvous and the channels; the facade holds the scheduler calls and the one state
guard they share. Lifecycle: :mod:`kvshm.engine.lifecycle` (diagram and what each state
promises). The rule both keep: every call that touches the manager or a pool runs on one
thread -- the event loop's for ``Engine``, the caller's for ``SyncClient``. ``Engine``
checks it: a scheduler call from anywhere but the loop it was launched on (another
thread, another loop, no loop) is a StateError that changes nothing -- the rings, the
ranks' pidfds and the ticker are watched by that loop alone, so a call elsewhere would
post work whose answers nobody reads. ``aclose`` works from anywhere, the launch loop
closed included.

What differs: ``Engine`` is driven by loop callbacks (rendezvous, done rings, pidfds of
the ranks it spawned, a 0.25 s ticker) and hands load results to ``wait_loaded``
waiters as they arrive (:class:`~kvshm.engine.load_waiters.LoadWaiters`; a waiter never
outlives ``aclose``: it resolves failed, cause ENGINE_CLOSED). ``SyncClient`` pumps the
runtime at the start of every call and hands load results out through ``poll``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Generator, Sequence
from enum import Enum
from types import TracebackType
from typing import Any, Final, Self

import torch

from kvshm.config import EngineConfig, check_timeout
from kvshm.engine.admission import check_id
from kvshm.engine.facade import Facade
from kvshm.engine.launcher import Launcher
from kvshm.engine.lifecycle import EngineState
from kvshm.engine.load_waiters import LoadWaiters
from kvshm.engine.provision import cache_device
from kvshm.engine.runtime import Runtime
from kvshm.errors import ConfigError, StateError
from kvshm.ratelog import RateLimitedLog
from kvshm.stats import EngineStats
from kvshm.types import GpuBlocks, LoadFailure, LoadResult, RequestView, StepInput

__all__ = ["ATTACH", "SPAWN", "Engine", "SyncClient", "WorkerMode"]


class WorkerMode(Enum):
    """Who provides the worker processes."""

    SPAWN = "spawn"  # kvshm starts world_size CPU workers and supervises them
    ATTACH = "attach"  # embedded (in the serving engine) or `kvshm-workers` ones connect


SPAWN = WorkerMode.SPAWN
ATTACH = WorkerMode.ATTACH

log = logging.getLogger(__name__)
#: The tick's errors: one line a minute however often it fails.
rlog = RateLimitedLog(log)

_TICK_S = 0.25
#: How long ``statistics()`` from another thread waits for the launch loop to take the
#: snapshot (a loop blocked that long is a StateError, not a hang of the caller).
STATS_WAIT_S = 5.0
#: How often :func:`_reaped` looks at the ranks' stop (seconds).
_REAP_POLL_S: Final = 0.1


async def _reaped(stopping: asyncio.Future[None]) -> None:
    """Until ``stopping`` (the launcher's stop, on an executor thread) is done; its
    exception, if any, is raised. Not cancelled with the caller (like ``shield``). It
    looks every :data:`_REAP_POLL_S` besides the executor's wake-up: a forked child that
    closed its copy of the loop took the loop's self-pipe out of the epoll set both
    share, after which a result handed over from another thread woke nothing, and
    ``aclose()`` waited for good (a hostile probe). :mod:`kvshm.engine.forks` now gives
    a selector loop's copy an epoll of its own in the child; this bound stays for loops
    it cannot (uvloop)."""
    while not stopping.done():
        await asyncio.wait((stopping,), timeout=_REAP_POLL_S)
    stopping.result()


class Engine(Facade):
    """asyncio engine. Create with ``async with Engine.launch(config, ...) as eng``."""

    def __init__(self, core: Runtime, launcher: Launcher | None) -> None:
        super().__init__(core)
        self._launcher = launcher
        self._waits = LoadWaiters()
        self._ticker: asyncio.TimerHandle | None = None
        self._closed = asyncio.Event()
        self._aclosing = False  # an aclose() is under way (its drain comes before CLOSING)
        self._loop: asyncio.AbstractEventLoop | None = None  # the launch loop (_start)

    # -- lifecycle -------------------------------------------------------------------
    @classmethod
    def launch(cls, config: EngineConfig, *, workers: WorkerMode = SPAWN,
               gpu_blocks: GpuBlocks,
               device_caches: Sequence[Sequence[torch.Tensor]] | None = None,
               ) -> _Launch:
        """Start an engine; use as ``async with`` (closes on exit) or ``await`` it.

        SPAWN needs ``device_caches`` (one list of shared-memory tensors per rank, made
        with :func:`kvshm.shm.shared_tensor`); ATTACH waits for embedded workers (which
        bring their own layout) or ``kvshm-workers`` (which need ``device_caches``).
        """
        if not isinstance(workers, WorkerMode):  # (a str ran as ATTACH: 60 s, then a
            raise ConfigError(f"workers must be kvshm.SPAWN or kvshm.ATTACH, got "  # timeout)
                              f"{workers!r}")
        return _Launch(cls, config, workers, gpu_blocks, device_caches)

    async def _start(self, mode: WorkerMode) -> None:
        """Start workers (SPAWN) and wait for READY. Any failure on the way - a rank
        that dies or is refused, a timeout, a cancellation - closes everything started
        (listener, timer, pidfds, spawned ranks) before the error propagates."""
        loop = self._loop = asyncio.get_running_loop()
        self._core.attach_loop(loop, self._on_change)
        try:
            if mode is SPAWN:
                assert self._launcher is not None
                self._core.set_killer(self._launcher.kill)
                for w in self._launcher.start():
                    loop.add_reader(w.pidfd, self._on_worker_exit, w.rank, w.pidfd)
            self._ticker = loop.call_later(_TICK_S, self._tick)
            timeout = self._core.config.connect_timeout_s
            try:
                await asyncio.wait_for(self._core.wait_started(), timeout)
            except TimeoutError:
                raise self._core.start_timeout_error(timeout) from None
            self._core.raise_if_start_failed()
        except BaseException:
            await self.aclose()
            raise

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Shut down: Shutdown to workers, close lifelines, then TERM/KILL (idempotent; a
        second call while one runs waits for it, so every caller returns only once the
        spawned ranks are reaped). Cancelled, it still closes: a cancel while jobs in
        flight drain ends the drain and the closing goes on; one while the ranks stop
        leaves their reaping to a thread (not cancelled with it); either way CancelledError follows.
        From another thread while the launch loop runs, the close runs on that loop (its
        callbacks and the close must not race); with the launch loop closed, here."""
        if self._closed.is_set() or self._core.owner_pid is not None:
            return  # (a forked child: the parent's engine, nothing here to close)
        owner = self._loop
        if owner is not None and owner is not asyncio.get_running_loop() \
                and owner.is_running() and await self._closed_on(owner):
            return
        if self._ended or self._aclosing:
            await self._closed.wait()
            return
        self._aclosing = True
        loop = asyncio.get_running_loop()
        try:  # the graceful part only: a cancel here skips to the closing, which goes on
            if loop is self._loop:  # (elsewhere no Done is read: nothing would drain)
                await self._drain(loop.time() + self._core.config.shutdown_grace_s)
            cancelled = False
        except asyncio.CancelledError:  # (it left the engine READY with its ranks up,
            cancelled = True  # and every later aclose() waiting for _closed for good)
        stopping: asyncio.Future[None] | None = None
        try:  # from here on _closed is set whatever raises: no later aclose() waits for good
            try:
                self._close_core()
            finally:  # whatever the closing raised (a bug, a KeyboardInterrupt in it), the
                # ranks stop: it used to leave them running, never reaped, for good
                if self._launcher is not None:  # (the thread escalates to SIGKILL, so
                    self._unwatch_ranks()  # this ends; it closes their pidfds)
                    stopping = loop.run_in_executor(
                        None, self._launcher.stop, self._core.config.shutdown_grace_s)
            if stopping is not None:  # a cancelled aclose still reaps every rank
                await _reaped(stopping)
        finally:  # even when cancelled: no waiter is left hanging
            if stopping is None or stopping.done():
                self._stopped()
            else:  # cancelled while the ranks stop: the waiters and the other aclose()s
                stopping.add_done_callback(lambda _: self._stopped())  # wait for the reaping
        if cancelled:  # the caller's cancel, delivered once the engine is closed
            raise asyncio.CancelledError

    def _close_core(self) -> None:
        """aclose()'s synchronous part: the ticker goes, the runtime closes (Shutdown,
        channels, the rendezvous)."""
        self._core.begin_close()
        if self._ticker is not None:
            self._ticker.cancel()
        self._core.detach_loop()
        self._core.close()

    def _unwatch_ranks(self) -> None:
        """The launch loop stops watching the spawned ranks' pidfds, before the stop
        closes them (a closed fd left in its selector could fail a later ``add_reader``
        of a reused number: a review). Never raises."""
        assert self._launcher is not None
        if self._loop is None:
            return
        for w in self._launcher.workers:  # (the launch loop watches them, closed or not)
            with contextlib.suppress(ValueError, OSError, RuntimeError):
                self._loop.remove_reader(w.pidfd)

    async def _closed_on(self, owner: asyncio.AbstractEventLoop) -> bool:
        """Run :meth:`aclose` on ``owner`` (the launch loop, running in another thread)
        and wait for it; False when ``owner`` stopped before that close finished (the
        caller then closes here: a handed close that never ran must not wait for
        ever). A close the stop cut off half-way is not finished here."""
        handed = asyncio.run_coroutine_threadsafe(self.aclose(), owner)
        done = asyncio.wrap_future(handed)
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(done), 0.1)
                return True
            except TimeoutError:
                if not owner.is_running():
                    handed.cancel()
                    return False

    def _stopped(self) -> None:
        """The ranks are stopped. In this order: every ``wait_loaded`` waiter resolves
        failed (ENGINE_CLOSED: recompute) -- with spawned ranks only once they are
        reaped, never while one may still copy into its blocks (a cancelled ``aclose``
        used to fail them at the cancel, and a rank slow to stop then overwrote the
        recomputed blocks with its late load); ATTACH ranks were sent Shutdown and
        their links closed, their exits are not awaited (docs/operations.md); a close
        that was cut off half-way is finished; the slabs of ranks the stop killed
        before they removed their own go (a rank stuck or busy past the grace period is
        killed without removing its slab); the pins of the reaped ranks' jobs go (an
        attached rank gives no such proof: its jobs keep theirs); then every ``aclose``
        returns."""
        try:
            self._waits.fail_all(LoadFailure.ENGINE_CLOSED)
        except RuntimeError:  # waiters on a launch loop closed meanwhile: nobody can
            pass  # await those futures any more, and _closed must still be set
        if self._core.state is not EngineState.CLOSED:  # its close was cut off half-way:
            try:  # the rest now (the rendezvous name, channels and segments go)
                self._core.close()
            except Exception:  # the close must end; the cause is logged
                log.exception("kvshm engine %r: closing after an interrupted aclose "
                              "failed", self.name)
        if self._launcher is not None:  # reaped: the pins of their jobs go (the host's
            self._core.ranks_stopped(self._launcher.reaped())  # GPU pool gets its blocks)
        self._core.remove_orphan_slabs()
        self._closed.set()

    async def _drain(self, deadline: float) -> None:
        """Graceful part of aclose: let jobs in flight finish (so their pins are released)
        until ``deadline``; a FAILED or starting engine does not wait."""
        loop = asyncio.get_running_loop()
        while (self._core.state is EngineState.READY and self._core.jobs_in_flight()
               and loop.time() < deadline):
            await asyncio.sleep(0.002)

    # -- scheduler calls (the rest: Facade) ----------------------------------------------
    def lookup(self, req: RequestView, num_local_tokens: int) -> int | None:
        """:meth:`Facade.lookup`, on the launch loop only (module docstring)."""
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()
        return super().lookup(req, num_local_tokens)

    def lookup_skipped(self, req: RequestView) -> None:
        """:meth:`Facade.lookup_skipped`, on the launch loop only (module docstring)."""
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()
        super().lookup_skipped(req)

    def allocated(self, req_id: str, gpu_block_ids: Sequence[Sequence[int]],
                  num_external_tokens: int) -> None:
        """:meth:`Facade.allocated`, on the launch loop only (module docstring)."""
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()
        super().allocated(req_id, gpu_block_ids, num_external_tokens)

    def finished(self, req_id: str, num_confirmed_tokens: int,
                 gpu_block_ids: Sequence[Sequence[int]], *,
                 tail_hash: bytes | None = None) -> bool:
        """:meth:`Facade.finished`, on the launch loop only (module docstring)."""
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()
        return super().finished(req_id, num_confirmed_tokens, gpu_block_ids,
                                tail_hash=tail_hash)

    def transfer_params(self, req_id: str) -> dict[str, Any] | None:
        """:meth:`Facade.transfer_params` (handed out once), on the launch loop only."""
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()
        return super().transfer_params(req_id)

    def _enter(self, *, service: bool = True) -> None:
        """The face's guard, then: only on the launch loop (``step``, ``wait_loaded``,
        ``reset``)."""
        super()._enter(service=service)
        if asyncio._get_running_loop() is not self._loop:
            raise self._foreign_loop()

    def _foreign_loop(self) -> StateError:
        """What a scheduler call off the launch loop raises (nothing changed)."""
        if self._ended:
            return self._ended_error()
        loop = self._loop
        if loop is not None and loop.is_closed():
            why = "that loop is closed"
        elif asyncio._get_running_loop() is None:
            why = "this call ran with no running loop (another thread, or between runs)"
        else:
            why = "this call ran on another loop"
        return StateError(f"engine {self.name!r} runs on the event loop it was launched "
                          f"on and {why}: call it from a coroutine on that loop (close it "
                          "with aclose() from anywhere)")

    async def wait_loaded(self, req_id: str) -> LoadResult:
        """The outcome of ``req_id``'s load; never raises on worker death.

        Cancelling it cancels only this wait: the load itself goes on and its result is
        kept for a later ``wait_loaded`` (until the request finishes).
        """
        self._enter()
        if type(req_id) is not str:
            check_id("wait_loaded", req_id)  # InvalidRequest unless a str subclass
        return await self._waits.wait(req_id)

    async def reset(self, timeout: float | None = None) -> bool:
        """Drop the CPU index; waits until no transfer that was in flight at the call is
        (transfers planned since are not waited for: under traffic each step plans new
        ones). True when done; False when ``timeout`` (seconds, a finite number >= 0,
        or None) ran out first. ConfigError for any other timeout."""
        if timeout is not None:
            timeout = check_timeout("reset: timeout", timeout, zero_ok=True)
        self._enter()
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        done = self._core.reset()
        while not done:
            if deadline is not None and asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.001)
            if self._ended:  # closed meanwhile: its jobs will never be acked
                raise self._ended_error()
            done = self._core.reset_done()
        self._publish()  # the loads the reset failed: their waiters now, not at a tick
        return True

    def statistics(self) -> EngineStats:
        """A statistics snapshot, in every state (closed included), from any thread.
        The manager's state belongs to the launch loop: from another thread while that
        loop runs, the snapshot is taken there and this thread waits for it (at most
        :data:`STATS_WAIT_S`, then StateError; a loop that stops meanwhile is read
        here) -- read in place, a metrics thread saw the pin table change under it
        (RuntimeError: dictionary changed during iteration)."""
        loop = self._loop
        if loop is None or asyncio._get_running_loop() is loop or not loop.is_running() \
                or self._core.owner_pid is not None:  # (a forked child: its copy, read here)
            return super().statistics()
        fut: concurrent.futures.Future[EngineStats] = concurrent.futures.Future()

        def snapshot() -> None:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(super(Engine, self).statistics())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
        try:
            loop.call_soon_threadsafe(snapshot)
        except RuntimeError:  # the loop closed since: nothing runs on it any more
            return super().statistics()
        deadline = time.monotonic() + STATS_WAIT_S
        while True:  # in slices: a loop that stops meanwhile never runs the snapshot
            try:
                return fut.result(0.05)
            except concurrent.futures.TimeoutError:
                pass
            if not loop.is_running() and fut.cancel():  # stopped: nothing races us now
                return super().statistics()
            if time.monotonic() > deadline and fut.cancel():
                raise StateError(f"engine {self.name!r}: its event loop took no snapshot "
                                 f"in {STATS_WAIT_S} s (blocked)") from None

    def has_pending_work(self) -> bool:
        """True while any job is planned, queued, in flight or not acked by every rank
        (no state guard: answers after ``aclose`` too)."""
        return self._core.has_pending_work()

    # -- Facade hooks -----------------------------------------------------------------
    def _after_allocated(self, req_id: str, num_external_tokens: int) -> None:
        if num_external_tokens > 0:  # only once accepted: a refusal leaves nothing to wait
            # a new load of the request (re-admitted after a preemption): a result kept
            # from its earlier load is not this one's. That load was reported already: a
            # lookup whose hit touches blocks still being loaded asks again, so a
            # request's next load is planned only once its earlier one was reported.
            self._waits.expect(req_id)
        self._publish()

    def _after_step(self, step_input: StepInput) -> None:
        self._publish()
        for req_id in step_input.finished:  # ended in the step: as finished() would
            self._waits.end(req_id)

    def _after_finished(self, req_id: str) -> None:
        """``req_id`` ended: a load still queued is dropped with it and a planned one's
        result is moot (:meth:`LoadWaiters.end`)."""
        self._publish()
        self._waits.end(req_id)

    # -- internals --------------------------------------------------------------------
    def _on_change(self) -> None:
        self._publish()

    def _publish(self) -> None:
        """The load results decided since the last call, to their waiters
        (:meth:`LoadWaiters.publish`: a result is never dropped)."""
        self._waits.publish(self._core.take_load_results())

    def _on_worker_exit(self, rank: int, pidfd: int) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(ValueError, OSError):
            loop.remove_reader(pidfd)
        exitcode = None
        if self._launcher is not None:
            exitcode = self._launcher.workers[rank].reap_nowait()
        self._core.rank_died(rank, exitcode, fenced=True)
        self._publish()

    def _tick(self) -> None:
        """Hang checks, fencing, load results and deferred eviction work, every
        ``_TICK_S``. The next tick is armed before this one's work, so that whatever
        that work raises (a bug, or a KeyboardInterrupt the loop delivers inside the
        callback) cannot end the ticks: without them no hung rank would ever be judged
        and its requests' waits would never end. An Exception is counted
        (``tick_errors``) and logged at most once a minute; a KeyboardInterrupt or
        SystemExit goes on to the loop's runner."""
        if self._core.owner_pid is not None:
            return  # a forked child's copy of the loop: the engine is its parent's
        loop = asyncio.get_running_loop()
        if not self._ended:
            self._ticker = loop.call_later(_TICK_S, self._tick)
        now = loop.time()
        # each step on its own: one that keeps failing does not skip the others (the
        # results' publication above all); settle: the eviction order's deferred work
        for step in (lambda: self._core.tick(now), self._publish, self._core.settle):
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - counted; a line a minute per engine
                self._core.counters.tick_errors += 1
                rlog.error(f"tick {self.name}", "kvshm engine %r: a tick raised %s: %s",
                           self.name, type(exc).__name__, exc, exc_info=exc)


class _Launch:
    """What ``Engine.launch`` returns: awaitable and an async context manager."""

    def __init__(self, cls: type[Engine], config: EngineConfig, mode: WorkerMode,
                 gpu_blocks: GpuBlocks,
                 device_caches: Sequence[Sequence[torch.Tensor]] | None) -> None:
        self._args = (cls, config, mode, gpu_blocks, device_caches)
        self._engine: Engine | None = None

    async def _go(self) -> Engine:
        cls, config, mode, gpu_blocks, device_caches = self._args
        core = Runtime(config, gpu_blocks=gpu_blocks, device_caches=device_caches,
                       spawned=mode is SPAWN)
        core.open()
        launcher = None if mode is not SPAWN else Launcher(
            config.name, config.world_size,
            None if device_caches is None else [cache_device(c) for c in device_caches])
        engine = cls(core, launcher)
        await engine._start(mode)
        return engine

    def __await__(self) -> Generator[Any, None, Engine]:
        return self._go().__await__()

    async def __aenter__(self) -> Engine:
        self._engine = await self._go()
        return self._engine

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._engine is not None:
            await self._engine.aclose()


class SyncClient(Facade):
    """Synchronous engine for a serving engine whose scheduler is synchronous (vLLM).

    Workers ATTACH (embedded or standalone). ``step``, ``poll``, ``reset``,
    ``reset_done`` and ``has_pending_work`` first service the rendezvous and drain the
    done rings without waiting, applying completions on the caller's thread; the per-request calls
    (``lookup``, ``allocated``, ``finished``) act on what the last of those left (see
    :mod:`kvshm.engine.facade`). Until every rank has connected, ``lookup`` returns 0
    and ``step`` plans nothing. A context manager: ``with SyncClient(...) as client``
    closes on exit.
    """

    _kind = "client"

    def __init__(self, config: EngineConfig, *, gpu_blocks: GpuBlocks,
                 device_caches: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        core = Runtime(config, gpu_blocks=gpu_blocks, device_caches=device_caches,
                       spawned=False)
        core.open()
        super().__init__(core)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _service(self) -> None:
        self._core.pump()

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every rank connected (READY), pumping every few ms; for a host
        that wants its ranks before serving. ``timeout_s`` defaults to the config's
        ``connect_timeout_s``. Raises :class:`~kvshm.engine.startup.StartTimeout` (how
        many ranks connected, which are missing, what to run, the refusals seen), or
        what failed the start (:class:`~kvshm.errors.WorkerDied`, a ConfigError)."""
        timeout = (self._core.config.connect_timeout_s if timeout_s is None
                   else check_timeout("wait_ready: timeout_s", timeout_s))
        self._enter()
        deadline = time.monotonic() + timeout
        while self._core.state is EngineState.STARTING:
            if time.monotonic() >= deadline:
                raise self._core.start_timeout_error(timeout)
            time.sleep(0.005)
            self._core.pump()
        self._core.raise_if_start_failed()

    def poll(self, *, rendezvous: bool = True) -> list[LoadResult]:
        """Service, drain, and return the load results that arrived since the last call.
        ``rendezvous=False``: the done rings and the hang check only, not the
        rendezvous's sockets (``Runtime.pump``): for a host's second pump of a step,
        whose first pump read them (each read is a syscall, and one in a process with
        copy threads can cost it the GIL)."""
        self._enter(service=False)
        self._core.pump(rendezvous=rendezvous)
        return self._core.take_load_results()

    def reset(self) -> bool:
        """Drop the CPU index and abandon the jobs in flight; True once they are done,
        else poll :meth:`reset_done`. Each call is a new reset: polling this under
        traffic abandons each step's new stores again and may never see the end."""
        self._enter()
        return self._core.reset()

    def reset_done(self) -> bool:
        """True once the jobs the last :meth:`reset` abandoned are done."""
        self._enter()
        return self._core.reset_done()

    def settle(self, limit: int = 0) -> bool:
        """Do the CPU tier's deferred eviction bookkeeping now, oldest first, at most
        ``limit`` items of it (0: all; ``BlockPool.settle``); True while some is left.
        For a host's idle time, e.g. while its forward runs: a host that holds a lock
        its hooks need while it settles bounds the hold with ``limit``. No I/O, no state
        guard; evictions are the same whether or not it is called. ConfigError for a
        ``limit`` that is not an int >= 0."""
        if type(limit) is not int or limit < 0:
            raise ConfigError(f"settle: limit must be an int >= 0, got {limit!r}")
        return self._core.settle(limit)

    def fetch_to_plan(self) -> bool:
        """True while a lower tier's fetch is answered and only the next ``step`` can
        start it (a remote GET): a lookup waiting for it would only delay that step.
        No pump (the caller pumps)."""
        self._enter(service=False)
        return self._core.fetch_to_plan()

    def has_pending_work(self, *, rendezvous: bool = True) -> bool:
        """True while any job is not yet acked by every rank (after a pump; without the
        rendezvous with ``rendezvous=False``, as :meth:`poll`)."""
        self._enter(service=False)
        self._core.pump(rendezvous=rendezvous)
        return self._core.has_pending_work()

    def close(self) -> None:
        """Send Shutdown, close the channels and the rendezvous (idempotent)."""
        if self._ended:
            return
        self._core.begin_close()
        self._core.close()
