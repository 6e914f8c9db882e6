"""``kvshm-workers`` tells a supervisor how its engine ended, and the engine does not
count a clean close as a failure: real processes on both sides (the engine in
``tests/engine_proc.py``, the workers as ``python -m workers``), and an idle rank's
process is gone within half a second of its engine's Shutdown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from worker_rig import unique_name

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    return env


class Pair:
    """An engine process (tp=2) and a ``kvshm-workers --tp 2`` parent serving it."""

    def __init__(self, stderr: str = "pipe") -> None:
        """``stderr``: the workers' stderr -- "pipe" (read by :meth:`finish_workers`),
        "closed" (no fd 2 at all, as under ``2>&-``) or "reader_gone" (a pipe whose
        read end is closed before they start: every write is EPIPE)."""
        self.name = unique_name()
        self.engine = subprocess.Popen(
            [sys.executable, str(HERE / "engine_proc.py"), self.name, "2"], env=_env(),
            text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        err: int | None = subprocess.PIPE
        argv = [sys.executable, "-m", "workers", "--name", self.name, "--tp", "2",
                "--connect-timeout", "60"]
        if stderr == "reader_gone":
            r, err = os.pipe()
            os.close(r)
        elif stderr == "closed":  # the shell closes fd 2 at exec: no Python code runs in
            # the fork (a preexec_fn did, in a pytest worker with other threads: it hung
            # there now and then, and the workers never started)
            err, argv = None, ["/bin/sh", "-c", 'exec "$@" 2>&-', "sh", *argv]
        self.workers = subprocess.Popen(argv, env=_env(), text=True,
                                        stdin=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        if stderr == "reader_gone":
            assert err is not None
            os.close(err)
        assert self.engine.stdout is not None
        line = self.engine.stdout.readline()
        assert line == "READY\n", f"engine did not start: {line!r}"

    def finish_workers(self) -> tuple[int, str]:
        rc = self.workers.wait(timeout=30)
        return rc, self.workers.stderr.read() if self.workers.stderr else ""

    def kill(self) -> None:
        for p in (self.workers, self.engine):
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    try:
        yield p
    finally:
        p.kill()


def test_engine_closed_workers_exit_0_and_no_rank_counts_as_failed(pair: Pair) -> None:
    """The engine closes (Shutdown, then lifeline EOF): every rank prints ``connected``,
    ``ready`` and ``detached (the engine closed)`` and the workers exit 0. The engine's
    final statistics: CLOSED, ranks_failed 0, each rank detached and not dead."""
    assert pair.engine.stdin is not None and pair.engine.stdout is not None
    pair.engine.stdin.write("close\n")
    pair.engine.stdin.flush()
    stats = json.loads(pair.engine.stdout.readline())
    rc, err = pair.finish_workers()
    assert rc == 0, err
    for r in range(2):
        assert (f"kvshm-workers[rank {r}]: connected to kvshm engine {pair.name!r} "
                f"(rank {r} of 2)\n") in err
        assert f"kvshm-workers[rank {r}]: ready\n" in err
        assert f"kvshm-workers[rank {r}]: detached (the engine closed)\n" in err
    assert "error" not in err
    assert pair.engine.wait(timeout=30) == 0
    assert stats["state"] == "closed"
    assert stats["counters"]["ranks_failed"] == 0
    assert [(r["alive"], r["detached"], r["why"]) for r in stats["ranks"]] == \
        [(True, True, "the engine closed")] * 2


@pytest.mark.parametrize("stderr", ["closed", "reader_gone"])
def test_workers_serve_and_exit_0_whatever_became_of_their_stderr(stderr: str) -> None:
    """A hostile probe: ``kvshm-workers ... 2>&-`` (``sys.stderr`` None) or a stderr
    pipe whose reader was gone (``| tee log`` after tee died): each rank died at its
    first progress line (AttributeError, BrokenPipeError) before it connected, the
    parent exited 1 with nothing said, and the engine waited out its whole connect
    timeout for ranks that were dead; a SPAWN engine whose own stderr was such a pipe
    failed its launch ("worker rank 0 died", no cause). Now a line nobody can read is
    dropped: the engine starts (READY here), closes with no rank failed, and the
    workers exit 0."""
    pair = Pair(stderr)
    try:
        assert pair.engine.stdin is not None and pair.engine.stdout is not None
        pair.engine.stdin.write("close\n")
        pair.engine.stdin.flush()
        stats = json.loads(pair.engine.stdout.readline())
        assert pair.workers.wait(timeout=30) == 0
        assert stats["counters"]["ranks_failed"] == 0
        assert [(r["detached"], r["why"]) for r in stats["ranks"]] == \
            [(True, "the engine closed")] * 2
    finally:
        pair.kill()


def test_engine_killed_workers_exit_1_saying_it_died(pair: Pair) -> None:
    """SIGKILL of the engine: lifeline EOF without a Shutdown. Each rank prints that the
    engine died and the parent exits 1, naming the ranks' codes."""
    pair.engine.send_signal(signal.SIGKILL)
    rc, err = pair.finish_workers()
    assert rc == 1, err
    for r in range(2):
        assert (f"kvshm-workers[rank {r}]: error: the engine died (its lifeline closed "
                "without a Shutdown)") in err
        assert f"kvshm-workers: rank {r} exited with code 1" in err
        assert "detached (the engine closed)" not in err


#: How soon an idle rank's process must be gone after its engine closed (the issue's
#: target). Measured 0.04 - 0.08 s at load 9 on 2 cores; before the fix 1.3 - 1.5 s idle
#: and 2.3 - 2.9 s at load 9 (the interpreter unloading torch), so the bound stays
#: meaningful on a loaded CI machine.
EXIT_WITHIN_S = 0.5


def _idle_rank_exit_s() -> float:
    """One engine process and one idle standalone rank; the engine closes. Seconds from
    the engine's close returning until the rank's process is gone (its exit and its
    last line checked)."""
    name = unique_name()
    engine = subprocess.Popen([sys.executable, str(HERE / "engine_proc.py"), name, "1"],
                              env=_env(), text=True, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    rank = subprocess.Popen([sys.executable, "-m", "workers", "--name", name, "--rank", "0",
                             "--world-size", "1", "--connect-timeout", "60"], env=_env(),
                            text=True, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=ROOT)
    try:
        assert engine.stdin is not None and engine.stdout is not None
        assert engine.stdout.readline() == "READY\n"
        time.sleep(0.5)  # idle: parked in its wait
        engine.stdin.write("close\n")
        engine.stdin.flush()
        stats = json.loads(engine.stdout.readline())  # the engine's close returned
        t0 = time.monotonic()
        rc = rank.wait(timeout=30)
        took = time.monotonic() - t0
        err = rank.stderr.read() if rank.stderr else ""
        assert rc == 0, err
        assert err.endswith("kvshm-workers[rank 0]: detached (the engine closed)\n"), err
        assert stats["counters"]["ranks_failed"] == 0
        assert engine.wait(timeout=30) == 0
        return took
    finally:
        for p in (rank, engine):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_an_idle_rank_exits_within_half_a_second_of_shutdown() -> None:
    """One real standalone rank (``python -m workers --rank 0 --world-size 1``, torch
    imported) serving an engine in its own process, idle; the engine closes (Shutdown).
    The rank's process is gone within 0.5 s of the engine's close returning, with exit
    code 0 and its ``detached (the engine closed)`` line flushed (the fast exit skips the
    interpreter's teardown only after the rank closed cleanly).

    A busy neighbour (the other test process, its servers) can hold the machine for a
    few hundred ms at the wrong moment, so up to three tries, each checked in full;
    one must be under the bound. The slow exit this guards against took 1.3 - 2.9 s
    every time, so it fails all three."""
    took: list[float] = []
    while len(took) < 3 and min(took, default=EXIT_WITHIN_S) >= EXIT_WITHIN_S:
        took.append(_idle_rank_exit_s())
    assert min(took) < EXIT_WITHIN_S, f"the rank took {took} s to exit after Shutdown"


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody reaped counts: its parent here is
    not this test)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_spawned_rank_whose_engine_died_before_ready_exits_at_once(tmp_path: Path) -> None:
    """The hazard: an engine process killed (SIGTERM, OOM) while ``Engine.launch``
    waited for the ranks it spawned left them running, reparented, for their whole
    connect timeout (60 s) -- and ``kvshm demo`` stopped with Ctrl-C or SIGTERM during
    its start left two. A rank spawned by an engine now knows that engine's pid
    (``KVSHM_ENGINE_PID``) and gives up, exit 1 with the reason, once that process is
    no longer its parent. Here the "engine" spawns the rank and exits at once."""
    log = tmp_path / "rank.log"
    spawner = f"""
import os, subprocess, sys
env = dict(os.environ, KVSHM_ENGINE_PID=str(os.getpid()))
p = subprocess.Popen([sys.executable, "-m", "workers", "--name", {unique_name()!r},
                      "--rank", "0", "--world-size", "1"], env=env,
                     stdin=subprocess.DEVNULL, stderr=open({str(log)!r}, "w"))
print(p.pid)
"""
    out = subprocess.run([sys.executable, "-c", spawner], capture_output=True, text=True,
                         check=True, timeout=30)
    pid = int(out.stdout)
    deadline = time.monotonic() + 30  # a rank imports torch first (seconds when loaded)
    while not _gone(pid):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    text = log.read_text()
    # one plain line (it was wrapped in "no kvshm engine named '<this sentence>' is
    # running (nothing listens on ... \0kvshm.<this sentence>)": a probe)
    assert "that spawned this rank exited before it was ready" in text
    assert "no kvshm engine named" not in text and "abstract socket" not in text, text


def _launch(name: str) -> subprocess.Popen[str]:
    """``kvshm-workers --tp 2`` for ``name`` (nothing listens), in a process group of its
    own (what a shell's job or a supervisor's unit is)."""
    return subprocess.Popen([sys.executable, "-m", "workers", "--name", name, "--tp", "2",
                             "--connect-timeout", "60"], stdin=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ended(p: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return p.returncode, err


def test_a_stop_signal_sent_twice_still_ends_every_rank_with_exit_0() -> None:
    """``timeout``, systemd's control-group kill, or ``kill PARENT; kill -TERM -PGID``:
    each rank gets SIGTERM twice within milliseconds, once forwarded by the parent and
    once directly. A rank that had stopped on the first restored the default handlers
    on its way out, and the second killed it: the parent reported "rank N exited with
    signal 15" and exited 143, where the documented code is 0. (Copies keep coming
    every 2 ms here, so one lands in that window whatever the timing.)"""
    p = _launch(unique_name())
    assert p.stderr is not None
    waiting = 0
    for line in p.stderr:  # both ranks are up (their handlers installed) and waiting
        waiting += "no kvshm engine named" in line or "waiting" in line
        if waiting >= 2:
            break
    os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5  # more copies, every 2 ms, until the group is gone:
    while p.poll() is None and time.monotonic() < deadline:  # some land after the stop
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            break
        time.sleep(0.002)
    code, err = _ended(p)
    assert code == 0, err
    assert "exited with signal" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_stop_signal_while_the_ranks_still_start_is_a_clean_stop(sig: int) -> None:
    """Ctrl-C (SIGINT to the process group) or SIGTERM 0.3 s after the start, while each
    rank still imports torch (1-2 s), before its stop handler existed: SIGINT raised
    KeyboardInterrupt out of ``import torch`` (two tracebacks, exit 130), SIGTERM
    killed the ranks (exit 143). Now a rank records a stop signal from its first line
    and stops at its first look: exit 0, no traceback."""
    p = _launch(unique_name())
    time.sleep(0.3)
    os.killpg(p.pid, sig)
    code, err = _ended(p)
    assert code == 0, err
    assert "Traceback" not in err and "exited with signal" not in err, err


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["INT", "TERM"])
def test_a_stop_signal_in_a_ranks_first_milliseconds_is_a_clean_stop(sig: int) -> None:
    """The window the test above could miss (flaky under load): a stop signal to the
    group as soon as the parent's first rank exists -- while that rank's interpreter
    still starts, before its first line installed any handler. It killed the ranks
    (``rank N exited with signal 2``, exit 130), every time. Now the parent starts each
    rank with the stop signals blocked and the rank unblocks them once it records
    them: the signal waits, pending, and the rank stops cleanly (exit 0)."""
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        pytest.skip("needs /proc/PID/task/TID/children (CONFIG_PROC_CHILDREN)")
    p = _launch(unique_name())
    children = f"/proc/{p.pid}/task/{p.pid}/children"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(children) as f:
                if f.read().split():
                    break
        except FileNotFoundError:
            pass
        time.sleep(0.0005)
    os.killpg(p.pid, sig)
    code, err = _ended(p)
    assert code == 0, err
    assert "Traceback" not in err and "exited with signal" not in err, err
