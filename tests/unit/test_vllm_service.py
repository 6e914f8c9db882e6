"""The vLLM scheduler side's service thread (kvshm.integrations.vllm.service): it pumps an
idle client, and never queues on the hooks' lock while hooks run (a thread waiting on
the lock takes it the moment a hook leaves, and the next hook then waits for the thread
to be scheduled: milliseconds on a busy machine)."""

from __future__ import annotations

import os
import threading
import time

from kvshm.integrations.vllm.service import HookGuard, ServiceThread

INTERVAL = 0.01


def _thread(guard: HookGuard, pumped: list[float]) -> ServiceThread:
    t = ServiceThread(guard, lambda: pumped.append(time.monotonic()), "t",
                      interval_s=INTERVAL)
    t.start()
    return t


def test_an_idle_client_is_pumped_every_interval() -> None:
    guard, pumped = HookGuard(), list[float]()
    t = _thread(guard, pumped)
    try:
        time.sleep(0.3)
    finally:
        t.stop()
    assert t.pumps == len(pumped) >= 5 and t.errors == 0
    n = len(pumped)
    time.sleep(0.05)
    assert len(pumped) == n  # stopped: no pump after stop() returned


def test_busy_hooks_are_not_pumped_over_and_the_lock_is_never_waited_for() -> None:
    """Hooks run back to back for 0.3 s (each holds the guard 2 ms): every hook finds the
    lock free (the thread never holds it while hooks run; it may only where the hooks
    paused longer than the interval, which is then a pump); a hook that holds the lock
    longer than the interval is skipped, not queued on."""
    guard, pumped = HookGuard(), list[float]()
    t = _thread(guard, pumped)
    contended = 0
    try:
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            if not guard.lock.acquire(blocking=False):
                contended += 1
                assert guard.lock.acquire(timeout=1.0)
            try:
                time.sleep(0.002)
            finally:
                guard.last_exit = time.monotonic()
                guard.lock.release()
        assert t.skips > 0 and contended <= t.pumps, (contended, t.pumps, t.skips)
        with guard.lock:  # one long hook: the thread sees an old last_exit, skips
            before = t.pumps  # read under the lock: no pump can slip in after it
            time.sleep(0.1)
            assert t.pumps == before
    finally:
        t.stop()


def test_stop_while_a_hook_holds_the_guard_returns() -> None:
    guard, pumped = HookGuard(), list[float]()
    t = _thread(guard, pumped)
    done = threading.Event()
    with guard.lock:
        def stop() -> None:
            t.stop()
            done.set()

        threading.Thread(target=stop, daemon=True).start()
        assert done.wait(2.0)
    assert not t.alive


def test_a_forked_child_gets_a_guard_nobody_holds() -> None:
    """A review: the guard's lock, held by the service thread at the moment another
    thread forked, stayed held for good in the child (the thread does not exist there):
    the child's hooks and the connector's ``shutdown`` waited for it forever instead of
    being refused. In the child the lock is a new one."""
    guard = HookGuard()
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with guard.lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report whether the guard can be taken, then leave at once
        got = guard.lock.acquire(timeout=2)
        os.write(w, b"1" if got else b"0")
        os._exit(0)
    release.set()
    t.join()
    os.close(w)
    try:
        assert os.read(r, 1) == b"1"
    finally:
        os.close(r)
        os.waitpid(pid, 0)
