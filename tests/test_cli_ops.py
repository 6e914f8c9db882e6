"""``kvshm ls`` and ``kvshm stats --prometheus`` against a real running engine (SPAWN,
two worker processes), the CLI in its own process while the engine's loop serves it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from engine_rig import BS, ROW, Client, spawned_engine, tokens
from prometheus_client.parser import text_string_to_metric_families

from kvshm.cli import EXIT_READER_GONE, main
from kvshm.cli_ls import engine_names
from kvshm.series import SERIES

_BLOCK_PROMETHEUS = """
import sys
from pathlib import Path
class _NoPrometheus:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "prometheus_client":
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _NoPrometheus())
from kvshm.cli import main
sys.exit(main(sys.argv[1:]))
"""


async def _kvshm(*argv: str, code: str | None = None) -> tuple[int, str, str]:
    """Run the ``kvshm`` CLI in a child process without blocking the engine's loop."""
    pre = ["-c", code] if code else ["-m", "kvshm.cli"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, *pre, *argv, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_ls_lists_a_running_engine_with_pid_state_world_and_tier() -> None:
    """The engine is found by its abstract socket and described by its own answer."""
    async with spawned_engine(num_cpu_blocks=64) as (eng, gpu, _):
        await Client(eng, gpu).store_only("a", tokens(3 * BS + 1, seed=5))
        assert eng.name in engine_names()
        rc, out, err = await _kvshm("ls")
        assert rc == 0, err
        lines = out.splitlines()
        assert lines[0].split() == ["NAME", "PID", "STATE", "WORLD", "CPU", "TIER",
                                    "CACHED", "UPTIME", "DISK", "TIER"]
        mine = [ln for ln in lines if ln.startswith(eng.name + " ")]
        assert len(mine) == 1, out
        gib = 64 * 2 * ROW / 2**30
        assert mine[0].split()[:9] == [eng.name, str(os.getpid()), "ready", "2", "64",
                                       "blocks", "/", f"{gib:.2f}", "GiB"]
        assert mine[0].split()[9] == "3" and mine[0].split()[-1] == "-"  # no disk tier
    assert eng.name not in engine_names()


async def test_stats_prometheus_counters_histograms_hit_rate_uptime() -> None:
    """Counters end in ``_total`` and are typed counter; per-rank ack latency is a
    histogram whose +Inf bucket equals the rank's acks; hit rate and uptime are there;
    no old ``q=`` gauge."""
    async with spawned_engine(num_cpu_blocks=64) as (eng, gpu, _):
        c = Client(eng, gpu)
        toks = tokens(4 * BS + 1, seed=7)
        await c.store_only("a", toks)
        hit, table, _ = c.load("b", toks)
        assert hit == 4 * BS
        assert (await c.loaded("b")).ok
        c.finish("b", table, 0)
        await c.settle()
        rc, out, err = await _kvshm("stats", "--name", eng.name, "--prometheus")
        acks = [r.acks for r in eng.statistics().ranks]
    assert rc == 0, err
    assert 'q="' not in out
    fams = {f.name: f for f in text_string_to_metric_families(out)}
    assert fams["kvshm_stored_blocks"].type == "counter"
    (stored,) = fams["kvshm_stored_blocks"].samples
    assert stored.name == "kvshm_stored_blocks_total" and stored.value == 4
    assert fams["kvshm_stored_bytes"].samples[0].value == 4 * 2 * ROW
    assert fams["kvshm_cpu_blocks_cached"].type == "gauge"
    lat = fams["kvshm_ack_latency_seconds"]
    assert lat.type == "histogram"
    for rank in (0, 1):
        inf = [s for s in lat.samples if s.name == "kvshm_ack_latency_seconds_bucket"
               and s.labels["rank"] == str(rank) and s.labels["le"] == "+Inf"]
        assert [s.value for s in inf] == [acks[rank]] and acks[rank] >= 2
    (rate,) = fams["kvshm_hit_rate"].samples
    assert rate.value == (4 * BS) / (4 * BS + 1)
    assert fams["kvshm_uptime_seconds"].samples[0].value > 0
    assert fams["kvshm_state"].samples[0].labels["state"] == "ready"
    assert fams["kvshm_hit_tokens"].samples[0].value == 4 * BS  # granted once
    assert {s.labels["engine"] for f in fams.values() for s in f.samples} == {eng.name}


async def test_stats_prometheus_every_series_has_its_own_help() -> None:
    """Issue 28: every series ``kvshm stats --prometheus`` exports has the one-line HELP
    of kvshm.series' table (what it counts, its unit), none a generic "counter X" --
    every engine counter of a real engine included; the table's types match."""
    async with spawned_engine(num_cpu_blocks=64) as (eng, gpu, _):
        await Client(eng, gpu).store_only("a", tokens(2 * BS + 1, seed=3))
        rc, out, err = await _kvshm("stats", "--name", eng.name, "--prometheus")
    assert rc == 0, err
    fams = list(text_string_to_metric_families(out))
    assert len(fams) > 40
    undescribed = [f.name for f in fams if f.name not in SERIES]
    assert undescribed == []
    for f in fams:
        assert f.documentation == SERIES[f.name].help, f.name
        assert f.type == SERIES[f.name].kind.value, f.name
        assert "counter " not in f.documentation and ";" in f.documentation, f.name


async def test_stats_json_keeps_its_fields_and_prometheus_missing_names_the_extra() -> None:
    """The JSON answer keeps every old field (and adds pid, uptime, tier bytes, the
    histogram); without prometheus-client, --prometheus says what to install."""
    async with spawned_engine() as (eng, _, _):
        rc, out, err = await _kvshm("stats", "--name", eng.name)
        assert rc == 0, err
        data = json.loads(out)
        for key in ("name", "state", "world_size", "num_cpu_blocks", "cpu_blocks_cached",
                    "pins_held", "jobs_in_flight", "stored_bytes", "loaded_bytes",
                    "quarantined_gpu_blocks", "quarantined_cpu_blocks", "counters", "ranks",
                    "pid", "uptime_s", "cpu_tier_bytes"):
            assert key in data, key
        assert {"ack_latency_us", "ack_latency_hist", "alive", "detached"} <= \
            set(data["ranks"][0])
        rc, out, err = await _kvshm("stats", "--name", eng.name, "--prometheus",
                                    code=_BLOCK_PROMETHEUS)
    assert rc == 1 and out == ""
    assert err.strip() == ("kvshm stats: the Prometheus exposition needs prometheus-client: "
                           "pip install 'kvshm[prometheus]'")


async def test_ls_with_no_engine_of_ours_says_so_or_lists_others() -> None:
    """Without an engine of this test the table has no row for a closed one."""
    async with spawned_engine() as (eng, _, _):
        name = eng.name
    rc, out, _ = await _kvshm("ls")
    assert rc == 0
    assert name not in out
    assert out.startswith(("NAME", "no kvshm engines running"))


async def test_stats_of_an_engine_not_running_says_so_and_names_kvshm_ls() -> None:
    """``kvshm stats --name nope``: exit 1, one line saying no such engine runs and how to
    list the ones that do."""
    rc, out, err = await _kvshm("stats", "--name", "nope-kvshm-test")
    assert rc == 1 and out == ""
    assert err == ("kvshm stats: no kvshm engine named 'nope-kvshm-test' is running (nothing "
                   "listens on the abstract socket \\0kvshm.nope-kvshm-test); `kvshm ls` "
                   "lists the running engines\n")


def test_a_timeout_that_is_not_a_finite_positive_number_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The hazard: ``kvshm ls --timeout nan`` (or ``kvshm stats``) was a ValueError
    traceback, ``inf`` / ``1e300`` an OverflowError, and ``-1`` listed a READY engine
    as "no answer: TimeoutError". Now the parser refuses them: exit 2, one line."""
    from kvshm.cli import main as kvshm_main

    for cmd in (["ls"], ["stats", "--name", "x"]):
        for bad in ("nan", "inf", "1e300", "-1", "0", "soon"):
            with pytest.raises(SystemExit) as info:
                kvshm_main([*cmd, "--timeout", bad])
            assert info.value.code == 2
            assert "argument --timeout:" in capsys.readouterr().err


def test_stats_of_a_name_no_engine_can_have_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found by a hostile probe: ``kvshm stats --name ""`` (or 200 characters, or
    ``../x``) looked the name up and said "not running", exit 1, where bad usage is
    documented as 2. The name rule ``kvshm-workers`` applies refuses them in the parser."""
    from kvshm.cli import main as kvshm_main

    for bad in ("", "x" * 200, "../x", "a b"):
        with pytest.raises(SystemExit) as info:
            kvshm_main(["stats", "--name", bad])
        assert info.value.code == 2
        assert "argument --name: name must be 1-80 characters" in capsys.readouterr().err


def test_engine_names_takes_listeners_only(tmp_path: Path) -> None:
    """A rank's connection carries the engine's name too, without __SO_ACCEPTCON: it
    must not add a row; other sockets are skipped, and so is a name with a space (no
    engine can have one: 1-80 characters of [A-Za-z0-9._-])."""
    table = tmp_path / "unix"
    table.write_text(
        "Num       RefCount Protocol Flags    Type St Inode Path\n"
        "0000000000000001: 00000002 00000000 00010000 0005 01 11 @kvshm.alpha\n"
        "0000000000000002: 00000003 00000000 00000000 0005 03 12 @kvshm.alpha\n"
        "0000000000000003: 00000003 00000000 00000000 0005 03 13 @kvshm.ghost\n"
        "0000000000000004: 00000002 00000000 00010000 0001 01 14 /tmp/x.sock\n"
        "0000000000000005: 00000002 00000000 00010000 0005 01 15 @kvshm.my engine\n"
        "0000000000000006: 00000002 00000000 00010000 0005 01 16\n")
    assert engine_names(str(table)) == ["alpha"]


def test_any_users_socket_names_never_break_ls_or_sweep(tmp_path: Path) -> None:
    """/proc/net/unix lists every user's sockets with their names' raw bytes. Attack
    (any uid): a socket named ``\\0some-app-\\xe9`` made ``kvshm ls`` and ``kvshm sweep
    --disk-path`` end in a UnicodeDecodeError traceback; one whose name holds a newline
    and a forged line with non-hex flags, in a ValueError; one named
    ``kvshm.<escape codes>`` had ``ls`` write the codes to root's terminal. Each such
    line is skipped now; the real listener is still found."""
    table = tmp_path / "unix"
    table.write_bytes(
        b"Num       RefCount Protocol Flags    Type St Inode Path\n"
        b"0000000000000001: 00000002 00000000 00010000 0005 01 11 @some-app-\xe9\n"
        b"0000000000000002: 00000002 00000000 00010000 0005 01 12 @kvshm.\xe9x\n"
        b"0000000000000003: 00000002 00000000 00010000 0005 01 13 @x\n"
        b"forged: 00000002 00000000 zzzz 0005 01 13 @kvshm.fake\n"
        b"0000000000000004: 00000002 00000000 00010000 0005 01 14 "
        b"@kvshm.\x1b[2J\x1b[31mprod\x1b[0m\n"
        b"0000000000000005: 00000002 00000000 00010000 0005 01 15 @kvshm.real-1\n")
    assert engine_names(str(table)) == ["real-1"]


def test_a_malformed_or_refusing_answer_is_one_row_or_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A listener of this uid may answer anything (the peer seam: ``query_stats``).
    ``{"pid": null}`` or ``{"disk": [1]}`` made ``kvshm ls`` a traceback that hid every
    other engine; the engine's own refusal (``{"error": ...}``: a snapshot too large to
    send) made ``kvshm stats --prometheus`` a TypeError and ``--disk`` print "no disk
    tier". Now the bad answer is its own row, and ``stats`` says the refusal in one
    line, exit 1."""
    import kvshm.cli_ls as cli_ls
    import kvshm.ipc.rendezvous_client as rc

    answers = {"bad": {"state": "ready", "pid": None}, "odd": {"state": "ready", "disk": [1]},
               "good": {"state": "ready", "pid": 7, "world_size": 2}}
    monkeypatch.setattr(cli_ls, "engine_names", lambda: sorted(answers))
    monkeypatch.setattr(rc, "query_stats", lambda name, timeout: answers[name])
    rows = {r.name: r for r in cli_ls.list_engines()}
    assert rows["good"].pid == 7 and not rows["good"].error
    assert rows["bad"].error.startswith("a malformed answer (TypeError")
    assert rows["odd"].error.startswith("a malformed answer (AttributeError")
    refusal = {"error": "stats snapshot of 300000 bytes is too large to send"}
    monkeypatch.setattr(rc, "query_stats", lambda name, timeout: refusal)
    for flag in ("--prometheus", "--disk", "--remote"):
        assert main(["stats", "--name", "big", flag]) == 1
        err = capsys.readouterr().err
        assert err == "kvshm stats: engine 'big' answered: stats snapshot of 300000 " \
                      "bytes is too large to send\n", err


def test_remove_slabs_without_a_directory_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``kvshm sweep --remove-slabs`` without ``--disk-path`` ignored the flag and exited
    0 (after sweeping /dev/shm), as if the slabs had been looked at. Now: exit 2, one
    line, before anything is swept."""
    assert main(["sweep", "--remove-slabs"]) == 2
    err = capsys.readouterr().err
    assert err == "kvshm sweep: error: --remove-slabs needs --disk-path DIR (where the " \
                  "slab files are)\n", err



@pytest.mark.parametrize("args", [["ls"], ["sweep", "--dry-run"]])
def test_a_reader_gone_ends_ls_and_sweep_quietly(args: list[str]) -> None:
    """A hostile probe: ``kvshm ls | head -1`` style -- stdout a pipe whose reader is
    gone -- printed a BrokenPipeError traceback on stderr and exited 1. Now it ends as a
    coreutils tool ended by SIGPIPE would look to a shell: nothing on stderr, status 141
    (``EXIT_READER_GONE``)."""
    r, w = os.pipe()
    os.close(r)
    try:
        out = subprocess.run([sys.executable, "-m", "kvshm.cli", *args], stdout=w,
                             stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(w)
    assert (out.returncode, out.stderr) == (EXIT_READER_GONE, "")


def test_ls_and_sweep_with_stdout_closed_exit_0() -> None:
    """A review: the quiet ending for a reader gone flushed ``sys.stdout``, which is
    None for a command started with stdout closed (``kvshm sweep >&-`` from cron): an
    AttributeError traceback and exit 1 after the sweep had done its work. Exit 0."""
    for args in (["ls"], ["sweep", "--dry-run"]):
        # the shell closes fd 1 at exec: no Python code runs in the fork (a preexec_fn
        # did, in a pytest worker with other threads -- glide's among them)
        out = subprocess.run(["/bin/sh", "-c", 'exec "$@" >&-', "sh", sys.executable,
                              "-m", "kvshm.cli", *args], stderr=subprocess.PIPE,
                             text=True, timeout=60, check=False)
        assert (out.returncode, out.stderr) == (0, ""), args


def test_a_broken_pipe_of_the_commands_own_is_not_taken_for_stdouts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A review: every BrokenPipeError became the quiet exit 141, also one from a pipe
    of the command's own (a server's socket, a child's pipe) with stdout fine. Only a
    stdout whose reader is gone ends quietly; the command's own error stands."""
    import kvshm.cli as cli

    def broken(args: object) -> int:
        raise BrokenPipeError(32, "a pipe of the command's own")

    monkeypatch.setattr(cli, "_cmd_sweep", broken)
    with pytest.raises(BrokenPipeError, match="command's own"):
        main(["sweep"])
