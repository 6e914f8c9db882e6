"""kvshm's exception tree.

Every error kvshm raises on purpose is a :class:`KvshmError`; callers that only want to
know "did kvshm refuse this" catch that one class::

    KvshmError
    +-- ConfigError (also ValueError)      bad configuration or input; nothing was started
    |   +-- NameInUse                      another scheduler already listens on that name
    |   +-- EngineNotRunning               no engine listens on that name (kvshm stats)
    |   +-- UnsupportedPlatform            e.g. a CPU without the fences the rings rely on
    |   +-- InvalidRequest                 a scheduler call's input breaks the contract; refused
    |                                      before the manager changed anything
    +-- StateError (also RuntimeError)     call not allowed in the object's lifecycle state
    +-- TransportError                     the scheduler <-> worker channel
    |   +-- WouldBlock                     a *_nowait call found nothing to do / no room
    |   +-- ClosedError                    the channel (or engine) was closed by this side
    |   +-- ProtocolError                  undecodable record (names ring and offset)
    |   |   +-- VersionMismatch            PROTOCOL_VERSION differs between the two sides
    |   +-- PeerDied                       the other side is gone (lifeline EOF, pidfd)
    |       +-- WorkerDied                 ... and it was a worker: rank and exit code
    |   +-- UntrustedPeer                  (worker side) the name is held by a process of
    |                                      another uid; nothing was sent to it
    |   +-- RankRevoked                    (worker side) the scheduler declared this rank dead
    +-- CopyError                          a worker copy failed (becomes Done(ok=False))
    +-- PoolExhausted                      BlockPool.allocate(n) with fewer than n free
    +-- RemoteError                        the remote tier (kvshm.remote); its calls turn
        |                                  every failure into an outcome (a miss), so
        |                                  this reaches a caller only from setup
        +-- MissingExtra (also ConfigError) an optional package is not installed; names
        |                                  the extra (pip install 'kvshm[remote]')
        +-- ServerStartError               ``kvshm valkey`` / ValkeyServer: the server did
                                           not start (port taken, not ready in time)

Invariant: a scheduler never dies of a worker's error. A worker's failure reaches the
engine as ``Done(ok=False)`` or as a :class:`PeerDied`, which moves it to ``FAILED``;
serving goes on without offload.
"""

from __future__ import annotations


class KvshmError(Exception):
    """Base class of every error kvshm raises on purpose."""


class ConfigError(KvshmError, ValueError):
    """Bad configuration or argument; raised before anything is started or changed."""


class NameInUse(ConfigError):
    """Another scheduler already listens on ``\\0kvshm.<name>``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"kvshm name {name!r} is already in use by another scheduler on "
                         f"this machine (`kvshm ls` lists them): give this engine another "
                         f"name (vLLM: kv_connector_extra_config's 'name'), or stop that one")
        self.name = name


class EngineNotRunning(ConfigError):
    """Nothing listens on ``\\0kvshm.<name>``: no engine of that name is running (a
    client asked it, e.g. for its statistics; nothing was sent)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no kvshm engine named {name!r} is running "
                         f"(nothing listens on the abstract socket \\0kvshm.{name})")
        self.name = name


class UnsupportedPlatform(ConfigError):
    """The machine lacks something kvshm relies on (e.g. x86-64 store ordering)."""


class InvalidRequest(ConfigError):
    """A scheduler call (``lookup``, ``allocated``, ``build_step``, ``finished``) got input
    that breaks the manager's contract: a wrong type, an id out of range or repeated, a
    count that disagrees with another. Raised before the call changed anything (the
    manager is exactly as before, but for its ``invalid_calls`` counter). ``call``, the
    request id (None when the input names none) and ``field`` say where."""

    def __init__(self, call: str, req_id: str | None, field: str, problem: str) -> None:
        who = f"request {req_id!r}" if req_id is not None else "input"
        super().__init__(f"{call}: {who}: {field}: {problem}")
        self.call = call
        self.req_id = req_id
        self.field = field


class StateError(KvshmError, RuntimeError):
    """A call that the object's current lifecycle state does not allow."""


class TransportError(KvshmError):
    """Something went wrong on the scheduler <-> worker channel."""


class WouldBlock(TransportError):
    """A ``*_nowait`` call could not complete without waiting (empty or full ring)."""


class ClosedError(TransportError):
    """This side closed the channel (or engine) before or during the call."""


class ProtocolError(TransportError):
    """A record that cannot be decoded; names the ring and the byte offset."""

    def __init__(self, message: str, *, ring: str = "", offset: int = -1) -> None:
        where = f" (ring {ring!r}, offset {offset})" if ring else ""
        super().__init__(message + where)
        self.ring = ring
        self.offset = offset


class VersionMismatch(ProtocolError):
    """The peer speaks another ``PROTOCOL_VERSION``."""

    def __init__(self, ours: int, theirs: int) -> None:
        super().__init__(f"protocol version mismatch: this side speaks {ours}, "
                         f"peer speaks {theirs}")
        self.ours = ours
        self.theirs = theirs


class PeerDied(TransportError):
    """The other side of a channel is gone (lifeline EOF, pidfd readable)."""


class RankRevoked(TransportError):
    """Worker side: the scheduler declared this rank dead (a hang verdict, a broken ring)
    and set the revocation word; the rank starts no job and sends no Done any more."""


class UntrustedPeer(TransportError):
    """Worker side: the process listening on ``\\0kvshm.<name>`` runs as another uid than
    this one (SO_PEERCRED right after connect), so it is not our scheduler -- whoever binds
    an abstract name first owns it. The connection was closed before anything (Hello, fds)
    was sent. ``pid``/``uid``: the listener as the kernel reports it; ``expected_uid``:
    ours."""

    def __init__(self, name: str, pid: int, uid: int, expected_uid: int) -> None:
        super().__init__(
            f"kvshm name {name!r} is held by pid {pid} running as uid {uid}, but the "
            f"scheduler must run as uid {expected_uid} (this process's uid): refusing to "
            "connect, nothing was sent to it")
        self.name = name
        self.pid = pid
        self.uid = uid
        self.expected_uid = expected_uid


class WorkerDied(PeerDied):
    """A worker rank died; ``exitcode`` is None when it is not known (not our child)."""

    def __init__(self, rank: int, exitcode: int | None = None, detail: str = "") -> None:
        msg = f"worker rank {rank} died"
        if exitcode is not None:
            msg += f" (exit code {exitcode})"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)
        self.rank = rank
        self.exitcode = exitcode


class CopyError(KvshmError):
    """A copy on a worker failed; reported to the scheduler as ``Done(ok=False)``."""


class PoolExhausted(KvshmError):
    """``BlockPool.allocate(n)`` found fewer than ``n`` free or evictable blocks."""

    def __init__(self, wanted: int, available: int) -> None:
        super().__init__(f"block pool exhausted: wanted {wanted} blocks, {available} available")
        self.wanted = wanted
        self.available = available


class RemoteError(KvshmError):
    """The remote tier (:mod:`kvshm.remote`). Its data calls never raise (failure = miss
    = recompute); this family reaches a caller only from setup: a missing package, a
    server that would not start."""


class MissingExtra(RemoteError, ConfigError):
    """An optional dependency is not installed; ``extra`` names the pip extra that
    brings it (``pip install 'kvshm[<extra>]'``)."""

    def __init__(self, package: str, extra: str, what: str) -> None:
        super().__init__(f"{what} needs the {package!r} package, which is not installed: "
                         f"pip install 'kvshm[{extra}]'")
        self.package = package
        self.extra = extra


class ServerStartError(RemoteError):
    """A server kvshm starts (``kvshm valkey``, :class:`kvshm.remote.server.ValkeyServer`)
    did not come up: it exited (``exitcode``; its log's last lines are in the message) or
    did not answer in time."""

    def __init__(self, message: str, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode
