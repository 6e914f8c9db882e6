"""A flood of refused connections cannot stall the scheduler through its log: a real
engine process (two embedded ranks, logging to stderr at INFO, as a served engine does)
whose stderr is a pipe that nobody reads, and 3,000 rogue connections, each sending a
frame the rendezvous refuses.

Before (issue 31): each refusal wrote one WARNING line (3,007 lines, 441 KB for 3,000
connections); the pipe's 64 KiB filled and the engine's event loop blocked in
``write(2)`` for good -- no ping was ever answered. Now refusals are logged one line
per kind per interval (:class:`kvshm.ratelog.RateLimitedLog`), counted all the same.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvshm.ipc.rendezvous_client import query_stats

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ROGUES = 3000


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _line(proc: subprocess.Popen[str], timeout: float) -> str | None:
    """The child's next stdout line, or None after ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else None


def _flood(name: str, n: int, deadline: float) -> int:
    """Connect ``n`` times, each sending a frame that is no kvshm message, then closing;
    a full backlog is retried until ``deadline``. Returns how many got through."""
    sent = 0
    while sent < n and time.monotonic() < deadline:
        s = socket.socket(socket.AF_UNIX,
                          socket.SOCK_SEQPACKET | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
        try:
            s.connect(b"\0kvshm." + name.encode())
            s.send(b"\xc1 not a kvshm frame")
            sent += 1
        except OSError:  # EAGAIN: the backlog is full (the engine is not accepting)
            time.sleep(0.002)
        finally:
            s.close()
    return sent


def test_refused_connections_flooding_an_undrained_stderr_never_stall_the_engine() -> None:
    """The engine is READY and answers a ping. 3,000 rogue connections are refused
    while its stderr pipe is never read; the engine still accepts them all within 30 s,
    answers a ping (a store and a lookup hit of 16 tokens, on its event loop) and its
    statistics over the rendezvous socket, which count every refusal; EOF on stdin
    closes it with exit code 0."""
    name = f"flood-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen([sys.executable, str(HERE / "refusal_flood_proc.py"), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        assert _line(proc, 60.0) == "READY"
        assert proc.stdin is not None
        proc.stdin.write("ping 1\n")
        proc.stdin.flush()
        assert _line(proc, 20.0) == "pong 1 16"
        sent = _flood(name, ROGUES, time.monotonic() + 30.0)
        assert sent == ROGUES
        proc.stdin.write("ping 2\n")
        proc.stdin.flush()
        assert _line(proc, 20.0) == "pong 2 16"
        deadline = time.monotonic() + 10.0
        while query_stats(name, timeout=10.0)["counters"]["refused"] < ROGUES:
            assert time.monotonic() < deadline, "the refusals were not all counted"
            time.sleep(0.05)
        proc.stdin.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            for n in os.listdir("/dev/shm"):  # the killed engine's own segments
                if f"-{proc.pid}-" in n:
                    os.unlink(f"/dev/shm/{n}")
