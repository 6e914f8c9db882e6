"""kvshm-workers (``python -m workers``): real worker processes against a test scheduler
side whose device caches are shared-memory tensors allocated here."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from worker_rig import Sched, live_children, rank_lost_error, transfer, unique_name

from kvshm.config import MAX_WORLD_SIZE, EngineConfig
from kvshm.errors import ConfigError, WorkerDied
from kvshm.ipc.protocol import Direction, Shutdown
from kvshm.ipc.rendezvous_events import EventKind
from kvshm.shm import shared_tensor
from kvshm.types import DeviceKind
from kvshm.worker_cli import ENGINE_PID_ENV, Flag, rank_argv
from workers.loop import UsageError, _world_size, build_parser, cli_main

NB = 128  # device blocks per rank
STORE, LOAD = Direction.STORE, Direction.LOAD


def caches(world: int) -> list[list[torch.Tensor]]:
    """Per rank: a [NB, 2, 128] fp32 cache and a [NB, 64] uint8 one, random contents."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(r)
        a = shared_tensor((NB, 2, 128), torch.float32)
        a.copy_(torch.randn(NB, 2, 128, generator=g))
        b = shared_tensor((NB, 64), torch.uint8)
        b.copy_(torch.randint(0, 256, (NB, 64), dtype=torch.uint8, generator=g))
        out.append([a, b])
    return out


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "workers", *args], text=True,
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture
def sched_tp2() -> Iterator[tuple[Sched, list[list[torch.Tensor]]]]:
    cs = caches(2)
    sched = Sched(2, device_caches=cs, num_cpu_blocks=256)
    try:
        yield sched, cs
    finally:
        sched.close()


def test_tp2_round_trip_byte_exact_idle_parks_and_shutdown_is_clean(
        sched_tp2: tuple[Sched, list[list[torch.Tensor]]]) -> None:
    """The parent form starts 2 ranks; stores then loads through them are byte-exact on
    both ranks' shards; idle ranks park (no spinning) yet wake at once; Shutdown ends
    every process with code 0 and nothing left in /dev/shm (the conftest fixture checks that)."""
    sched, cs = sched_tp2
    parent = spawn("--name", sched.name, "--tp", "2", "--connect-timeout", "30")
    try:
        sched.wait_for(sched.ready, timeout=30, what="both ranks Ready")
        pids = [sched.server.peer_pid(r) for r in range(2)]
        time.sleep(0.3)  # let both loops settle into their park
        before = [cpu_seconds(p) for p in pids]
        time.sleep(1.0)
        used = [cpu_seconds(p) - b for p, b in zip(pids, before)]
        assert max(used) < 0.3, f"idle ranks burned {used} CPU-s in 1 s (spinning?)"
        worst = 0.0
        for j in range(100):  # ping-pong: the next job lands while a rank finishes the last
            t0 = time.monotonic()
            sched.post(transfer(j, 100 + j, STORE, [j % NB], [j]))
            for chan in sched.chans.values():
                while not chan.receive_nowait():
                    assert time.monotonic() - t0 < 10, f"job {100 + j} never answered"
            worst = max(worst, time.monotonic() - t0)
        # under the 1 s park (0.5 s left a loaded machine little room: the parent spins)
        assert worst < 0.9, f"a round trip took {worst:.3f} s: a lost wake-up (1 s park)?"

        orig = [[t.clone() for t in c] for c in cs]
        g = torch.Generator().manual_seed(9)
        cpu_ids = torch.randperm(256, generator=g)[:NB].tolist()
        perm = torch.randperm(NB, generator=g).tolist()
        for j in range(4):
            sl = slice(32 * j, 32 * (j + 1))
            sched.post(transfer(1 + j // 2, j, STORE, range(NB)[sl], cpu_ids[sl]))
        got = sched.collect(range(4))
        assert all(d.ok for per_rank in got.values() for d in per_rank.values())
        for c in cs:
            for t in c:
                t.zero_()
        for j in range(4):
            sl = slice(32 * j, 32 * (j + 1))
            sched.post(transfer(3, 10 + j, LOAD, cpu_ids[sl], perm[sl]))
        got = sched.collect(range(10, 14))
        assert all(d.ok for per_rank in got.values() for d in per_rank.values())
        for r in range(2):
            for t, o in zip(cs[r], orig[r]):
                assert torch.equal(t[perm], o)
        assert not torch.equal(orig[0][1], orig[1][1])

        sched.post(Shutdown())
        assert parent.wait(timeout=20) == 0, parent.stderr.read() if parent.stderr else ""
        sched.wait_for(lambda: len(sched.lost()) == 2, what="both lifelines closed")
        assert all(gone(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_sigkill_rank_is_lifeline_eof_and_sigterm_stops_the_rest(
        sched_tp2: tuple[Sched, list[list[torch.Tensor]]]) -> None:
    """SIGKILL of rank 1: the scheduler side sees its lifeline EOF (RANK_LOST ->
    WorkerDied). SIGTERM to the parent is forwarded: rank 0 exits cleanly, the parent
    reports rank 1's signal (exit 128 + 9), and no process is left."""
    sched, _ = sched_tp2
    parent = spawn("--name", sched.name, "--tp", "2")
    try:
        sched.wait_for(sched.ready, timeout=30, what="both ranks Ready")
        pids = [sched.server.peer_pid(r) for r in range(2)]
        os.kill(pids[1], signal.SIGKILL)
        sched.wait_for(lambda: bool(sched.lost()), timeout=10, what="RANK_LOST")
        err = rank_lost_error(sched.lost()[0])
        assert isinstance(err, WorkerDied) and err.rank == 1
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=20) == 128 + signal.SIGKILL
        stderr = parent.stderr.read() if parent.stderr else ""
        assert "rank 1 exited with signal 9" in stderr and "rank 0 exited" not in stderr
        assert "kvshm-workers[rank 0]: ready\n" in stderr
        assert "kvshm-workers[rank 0]: detached (signal SIGTERM)\n" in stderr
        sched.wait_for(lambda: len(sched.lost()) == 2, what="rank 0's lifeline closed")
        assert all(gone(p) for p in pids)
        assert not any(e.kind is EventKind.REFUSED for e in sched.events)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_help_and_usage_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "workers", "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0
    for flag in ("--name", "--tp", "--pp", "--rank", "--world-size", "--device"):
        assert flag in out.stdout
    # --device cuda where no GPU is visible (hidden here, so a GPU machine refuses too)
    bad = subprocess.run([sys.executable, "-m", "workers", "--name", "x", "--tp", "2",
                          "--device", "cuda"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert bad.returncode == 2, bad.stderr
    assert "kvshm-workers: error: --device cuda: no CUDA device is visible here " \
        "(torch.cuda.is_available() is False; check the driver and CUDA_VISIBLE_DEVICES)" \
        in bad.stderr
    assert cli_main(["--name", "x"]) == 2  # neither --tp nor --world-size
    assert cli_main(["--name", "x", "--tp", "2", "--world-size", "3"]) == 2
    assert cli_main(["--name", "x", "--tp", "2", "--rank", "2"]) == 2
    # not finite numbers and unusable names (the hazard: --spin-us nan got a rank Ready,
    # then it died converting NaN and took the engine to FAILED; --connect-timeout nan
    # was a traceback and inf waited for ever; a bad name failed only after the ranks
    # were spawned and torch imported, exit 1): usage errors, exit 2, before anything
    for flags in (["--spin-us", "nan"], ["--spin-us", "-1"], ["--spin-us", "1e9"],
                  ["--connect-timeout", "nan"], ["--connect-timeout", "inf"],
                  ["--connect-timeout", "0"]):
        assert cli_main(["--name", "x", "--tp", "1", *flags]) == 2, flags
    assert cli_main(["--name", "", "--tp", "1"]) == 2
    assert cli_main(["--name", "a" * 200, "--tp", "1"]) == 2


def test_a_world_or_name_no_engine_can_have_is_a_usage_error_before_any_fork(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``--tp 99999999999999999999`` (a typo) started one rank process after another
    until fork(2) failed with EAGAIN -- every process the user may have, then a
    traceback; ``--name ../x`` (no engine can have it: an engine name is 1-80
    characters of [A-Za-z0-9._-]) spawned its ranks and waited the whole connect
    timeout. Both are usage errors now, exit 2, one line, nothing started. (The world
    sizes go through the check alone: a regression here must not fork a thousand
    ranks; the names through the whole command, bounded by a short connect timeout.)"""
    parser = build_parser()
    for argv in (["--tp", "99999999999999999999"], ["--world-size", str(MAX_WORLD_SIZE + 1)],
                 ["--tp", "64", "--pp", "17"]):
        with pytest.raises(UsageError, match=f"ranks: an engine has at most {MAX_WORLD_SIZE}"):
            _world_size(parser.parse_args(["--name", "x", *argv]))
    assert _world_size(parser.parse_args(["--name", "x", "--world-size",
                                          str(MAX_WORLD_SIZE)])) == MAX_WORLD_SIZE
    kids = live_children()
    for name in ("../x", "a b"):
        assert cli_main(["--name", name, "--tp", "1", "--connect-timeout", "0.5"]) == 2
        err = capsys.readouterr().err
        assert "kvshm-workers: error: --name: name must be 1-80" in err, err
    assert live_children() == kids
    with pytest.raises(ConfigError, match=f"at most {MAX_WORLD_SIZE}"):
        EngineConfig(block_size=16, tp=64, pp=17)


def test_rank_argv_parses_back_with_the_workers_parser() -> None:
    """One definition of the per-rank command line (kvshm.worker_cli): what the parent
    form and the engine's launcher start parses with the workers' own parser to exactly
    the values it was built from, and every flag it may write is one the parser knows."""
    from kvshm.engine.launcher import worker_command  # the engine side: here only

    parser = build_parser()
    known = {opt for action in parser._actions for opt in action.option_strings}
    assert {f.value for f in Flag} <= known
    argv = rank_argv("eng-1", 2, 4, connect_timeout=0.1 + 0.2, spin_us=12.5)
    assert argv[:3] == [sys.executable, "-m", "workers"]
    args = parser.parse_args(argv[3:])
    assert (args.name, args.rank, args.world_size, args.connect_timeout, args.spin_us) == \
        ("eng-1", 2, 4, 0.1 + 0.2, 12.5)
    spawned = worker_command("eng-1", 3, 4)
    assert spawned == rank_argv("eng-1", 3, 4, device="cpu")
    args = parser.parse_args(spawned[3:])
    defaults = parser.parse_args([Flag.NAME.value, "x"])
    assert (args.name, args.rank, args.world_size, args.device) == ("eng-1", 3, 4, "cpu")
    cuda = parser.parse_args(worker_command("eng-1", 0, 1, DeviceKind.CUDA)[3:])
    assert cuda.device == "cuda"
    assert (args.connect_timeout, args.spin_us) == (defaults.connect_timeout, defaults.spin_us)


def test_rank_without_engine_times_out_with_clear_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The per-rank form in-process (torch is already imported here): nobody listens."""
    name = unique_name()
    t0 = time.monotonic()
    assert cli_main(["--name", name, "--rank", "0", "--world-size", "1",
                     "--connect-timeout", "0.3"]) == 1
    assert time.monotonic() - t0 < 5
    assert f"no kvshm engine named {name!r}" in capsys.readouterr().err


def test_parent_without_engine_says_at_once_what_it_waits_for_then_gives_up() -> None:
    """``kvshm-workers --name X --tp 2`` with no engine: the parent's first line (written
    before any rank starts, so before torch is imported) names the engine, the timeout
    and the flag that changes it; each rank says it waits, then gives up with a line
    naming the timeout; the parent exits 1."""
    name = unique_name()
    t0 = time.monotonic()
    proc = spawn("--name", name, "--tp", "2", "--connect-timeout", "2")
    assert proc.stderr is not None
    first = proc.stderr.readline()
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 1
    assert first == (f"kvshm-workers: starting 2 rank(s) for kvshm engine {name!r}; each "
                     "waits up to 2 s for it (start the engine first, or pass "
                     "--connect-timeout SECONDS)\n")
    for rank in (0, 1):
        assert (f"kvshm-workers[rank {rank}]: waiting for kvshm engine {name!r} (nothing "
                f"listens on \\0kvshm.{name} yet; timeout 2 s: start the engine first, or "
                "pass --connect-timeout SECONDS)\n") in rest
        assert (f"kvshm-workers[rank {rank}]: error: no kvshm engine named {name!r} "
                "appeared within 2 s") in rest
        assert f"kvshm-workers: rank {rank} exited with code 1\n" in rest
    assert "gave up (--connect-timeout 2; " in rest
    assert time.monotonic() - t0 < 60


def _rank_pids(parent: int, world: int, timeout: float = 30.0) -> list[int]:
    """The pids of ``parent``'s rank processes, by rank (read from their command lines)."""
    deadline = time.monotonic() + timeout
    while True:
        found: dict[int, int] = {}
        with open(f"/proc/{parent}/task/{parent}/children") as f:
            kids = [int(x) for x in f.read().split()]
        for pid in kids:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    argv = f.read().decode().split("\0")
            except OSError:
                continue
            if "--rank" in argv:
                found[int(argv[argv.index("--rank") + 1])] = pid
        if len(found) == world:
            return [found[r] for r in range(world)]
        assert time.monotonic() < deadline, f"ranks of {parent}: {found}"
        time.sleep(0.05)


def test_a_rank_that_exits_early_stops_its_siblings_instead_of_leaving_them_waiting() -> None:
    """The hazard (a soak probe): rank 1 of ``kvshm-workers --tp 2`` got SIGTERM while
    both waited for their engine (which, having lost a rank, had already given up). The
    parent waited for its ranks in rank order: rank 0 kept waiting out its 60 s
    connect timeout for nobody, rank 1 stayed a zombie, and the parent exited a minute
    later. Now the parent reaps each rank as it exits and, once one has, gives the
    others SIBLING_GRACE_S, then SIGTERM: everything is gone within seconds, exit 0
    (both stopped cleanly), nothing left."""
    from workers.loop import SIBLING_GRACE_S

    name = unique_name()
    parent = spawn("--name", name, "--tp", "2", "--connect-timeout", "60")
    try:
        assert parent.stderr is not None
        parent.stderr.readline()                              # "starting 2 rank(s) ..."
        pids = _rank_pids(parent.pid, 2)
        waiting = 0
        while waiting < 2:                                    # both are waiting now
            waiting += "waiting for kvshm engine" in parent.stderr.readline()
        t0 = time.monotonic()
        os.kill(pids[1], signal.SIGTERM)
        assert parent.wait(timeout=SIBLING_GRACE_S + 15) == 0
        took = time.monotonic() - t0
        rest = parent.stderr.read()
        assert SIBLING_GRACE_S - 0.5 < took < SIBLING_GRACE_S + 10, took
        assert ("kvshm-workers: sending SIGTERM to rank(s) 0: rank(s) 1 exited, and the "
                "group cannot serve without them\n") in rest
        assert "kvshm-workers[rank 0]: detached (signal SIGTERM)" in rest
        assert all(gone(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_waiting_rank_prints_a_progress_line_each_interval(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-rank form in-process, nobody listening, the interval shortened to 0.4 s
    (10 s in production): "still waiting" lines come while it waits, with the time
    waited and the timeout, and stop at the timeout line."""
    import workers.loop

    monkeypatch.setattr(workers.loop, "PROGRESS_S", 0.4)
    name = unique_name()
    assert cli_main(["--name", name, "--rank", "0", "--world-size", "1",
                     "--connect-timeout", "1.5"]) == 1
    lines = capsys.readouterr().err.splitlines()
    progress = [i for i, line in enumerate(lines) if "still waiting" in line]
    assert len(progress) >= 2, lines
    for i in progress:
        assert re.fullmatch(rf"kvshm-workers\[rank 0\]: still waiting for kvshm engine "
                            rf"'{name}' to appear \(\d+ s of 1\.5 s\)", lines[i]), lines[i]
    assert "waiting for kvshm engine" in lines[0] and "no kvshm engine named" in lines[-1]
    assert progress[-1] < len(lines) - 1


def test_rank_refused_by_engine_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    """A scheduler with no device caches for a standalone rank fails its Ready."""
    sched = Sched(1)
    try:
        import threading

        stop = threading.Event()

        def serve() -> None:
            while not stop.is_set():
                sched.service()
                time.sleep(0.005)

        t = threading.Thread(target=serve)
        t.start()
        try:
            rc = cli_main(["--name", sched.name, "--rank", "0", "--world-size", "1",
                           "--connect-timeout", "10"])
        finally:
            stop.set()
            t.join()
        assert rc == 1
        assert "refused" in capsys.readouterr().err
    finally:
        sched.close()


class _SlowReadySched(Sched):
    """A scheduler whose Ready takes 3 s to make once every rank connected: as an
    engine's did while it read its disk slabs for a warm restart (now on a thread after
    Ready), or any slow start of a busy engine."""

    def _make_ready(self, hellos: Any) -> Any:
        time.sleep(3.0)
        return super()._make_ready(hellos)


def test_a_spawned_rank_waits_out_a_slow_ready_beyond_its_connect_timeout() -> None:
    """The hazard (a hostile probe at production scale): an engine reads its disk slabs
    after every rank connected and before it sends Ready -- 320,000 slots took 3.6 s,
    millions take minutes. A spawned rank's timeout (60 s) ran on meanwhile: the ranks
    gave up ("sent no Ready within ...") and exited, and the engine was FAILED from its
    start. Now a rank the engine spawned (``KVSHM_ENGINE_PID``: it watches its parent),
    once connected, waits for Ready as long as the engine lives -- here 3 s against a
    1.5 s --connect-timeout -- then serves and exits 0."""
    sched = _SlowReadySched(1, device_caches=caches(1), num_cpu_blocks=64)
    rank = subprocess.Popen([sys.executable, "-m", "workers", "--name", sched.name,
                             "--rank", "0", "--world-size", "1", "--connect-timeout", "1.5"],
                            text=True, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, ENGINE_PID_ENV: str(os.getpid())})
    try:
        sched.wait_for(sched.ready, timeout=30, what="Ready")
        time.sleep(0.5)
        assert rank.poll() is None, rank.stderr.read() if rank.stderr else ""
        assert not sched.lost()
        sched.post(Shutdown())
        assert rank.wait(timeout=20) == 0, rank.stderr.read() if rank.stderr else ""
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
        sched.close()


def test_a_rank_started_by_hand_still_gives_up_on_an_engine_that_sends_no_ready(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A rank started by hand (no spawning engine to watch) keeps ``--connect-timeout``
    for the whole wait: an engine that took its connection and never answers (hung)
    does not hold it for ever (a review of the fix above). Its last line says what the
    engine waits for."""
    sched = _SlowReadySched(1, device_caches=caches(1), num_cpu_blocks=64)
    try:
        t0 = time.monotonic()
        assert cli_main(["--name", sched.name, "--rank", "0", "--world-size", "1",
                         "--connect-timeout", "1"]) == 1   # nobody services the engine
        assert time.monotonic() - t0 < 10
        last = capsys.readouterr().err.splitlines()[-1]
        assert "sent no Ready within 1 s" in last and "waits for all 1 ranks" in last, last
    finally:
        sched.close()
