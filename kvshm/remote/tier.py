"""The remote tier's interface: what a backend implements and what the engine calls.

Two protocols, one per side:

* :class:`BlockStore` (worker side, many threads): moves bytes between host rows (views
  of the CPU tier's shared memory) and the server. ``put_many`` stores each row under
  its key with a :class:`BlockHeader`; ``get_many_into`` lands each value's payload
  directly in the caller's view and checks its header against the expected one.
* :class:`ReadyIndex` (scheduler side, never blocks): publishes per-block readiness keys
  once every rank stored a block, and answers longest-present-prefix queries
  asynchronously (``query`` returns at once, ``answers`` polls).

Keys are content-addressed and immutable (:func:`block_key`, :func:`ready_key`): the
layout fingerprint (model, dtype, block size, layout) and the rank are part of the key,
so two deployments never read each other's bytes, and a key never changes meaning.

Rule (the part's invariant): failure = miss = recompute. Every outcome is a value
(:class:`GetOutcome`, ``False``, a prefix of 0), counted in ``statistics()``, never an
exception into the caller.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import stat
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Final, Protocol, runtime_checkable
from urllib.parse import parse_qsl

from kvshm.errors import ConfigError

#: The prefix of every key kvshm writes (``v1``: the key and header format version).
KEY_PREFIX: Final = "kvshm:v1"
#: :attr:`BlockHeader.version` of the values this code writes and accepts.
FORMAT_VERSION: Final = 1

_FINGERPRINT_RE = re.compile(r"^[A-Za-z0-9._+=/-]{1,200}$")
_MAX_HASH_BYTES: Final = 64

# ---------------------------------------------------------------------------- outcomes


class GetOutcome(Enum):
    """What one key of a ``get_many_into`` came to."""

    HIT = "hit"
    """The payload landed in the caller's view and its header matched: load it."""
    MISS = "miss"
    """No such key (never stored, expired, evicted)."""
    BAD = "bad"
    """A value was there but its header, length or checksum did not match the expected
    one (another fingerprint, rank, hash; a truncated or corrupted value). Counted; the
    view's bytes are garbage and are never loaded."""
    ERROR = "error"
    """The server failed, timed out, or the breaker is open: treat as a miss."""


# ---------------------------------------------------------------------------- the spec

_SCHEMES: Final = {"valkey": False, "redis": False,
                   "valkey+cluster": True, "redis+cluster": True}
_INT_KNOBS: Final = ("request_timeout_ms", "connect_timeout_ms", "threads", "hold_ttl_s")
#: The longest TTL a spec takes (about 68 years): a server refuses an ``EX`` whose
#: milliseconds overflow its clock, and a tier with such a ``ttl_s`` refused every put
#: (counted, nothing said) while its URL parsed (a hostile probe).
MAX_TTL_S: Final = 2**31 - 1
#: The longest request or connect timeout a spec takes: a day, as the engine's other
#: timeouts (``kvshm.config.MAX_TIMEOUT_S``). Unbounded, ``request_timeout_ms=2**32``
#: parsed, then glide refused it on every connect ("Value out of range": the tier never
#: worked, an ERROR line a round), ``kvshm janitor`` died with a traceback, and the
#: index's close raised OverflowError from a thread join (a hostile probe).
MAX_TIMEOUT_MS: Final = 86_400_000


@dataclass(frozen=True)
class RemoteSpec:
    """A remote tier's address and knobs, parsed from a URL by :meth:`parse`.

    ``valkey://host:port`` is one standalone server; ``valkey+cluster://h1:p1,h2:p2,...``
    a cluster, reached through any of the listed seed nodes (``redis://`` and
    ``redis+cluster://`` are accepted as aliases: same protocol). Knobs may also come as
    the URL's query (``valkey://h:p?ttl_s=600&threads=2``); keyword knobs win.

    * ``request_timeout_ms``: the deadline of one request (a 2 MiB GET included); a
      request past it is an ERROR (counted as a timeout).
    * ``connect_timeout_ms``: the deadline of a (re)connection.
    * ``ttl_s``: the TTL of every block and readiness key (``SET ... EX``), so that the
      server's ``volatile-lru`` policy may evict them; ``None``: no TTL (never evicted
      under ``volatile-*``; use with care).
    * ``threads``: worker-side threads (one client each) per :class:`BlockStore`.
    * ``hold_ttl_s``: the TTL of a P/D hand-off's blocks and readiness keys until a
      decoder loads them (then they get ``ttl_s`` where that is longer than what they
      have left: a TTL is never shortened, as another live hand-off may name the same
      blocks -- ``EXPIRE ... GT``, Valkey, or Redis 7.0 and later). Finite on purpose:
      a hand-off no decoder ever collects (aborted, refused, its prefill killed) must
      not pin server memory for ever; it must outlast the publication plus the
      manifest's life.
    * ``password_file``: a file holding the server's password (``AUTH``; ``kvshm
      valkey`` makes one), read when the spec is made (:func:`read_password`: no
      access for group or others). A password never goes in the URL itself: URLs are
      logged and reported. Without one, anyone who reaches the server writes blocks
      every engine loads (a checksum is no seal).
    """

    url: str
    nodes: tuple[tuple[str, int], ...]
    cluster: bool
    request_timeout_ms: int = 500
    connect_timeout_ms: int = 500
    ttl_s: int | None = 3600
    threads: int = 4
    hold_ttl_s: int = 1800
    password_file: str | None = None
    password: str | None = field(default=None, repr=False, compare=False)
    """Read from ``password_file`` (never given directly: :meth:`parse`)."""

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError(f"remote URL {self.url!r}: no host:port")
        if self.password_file is not None and self.password is None:
            object.__setattr__(self, "password", read_password(self.password_file))
        for name in _INT_KNOBS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"remote URL {self.url!r}: {name} must be an int > 0, "
                                  f"got {value!r}")
        for name in ("request_timeout_ms", "connect_timeout_ms"):
            if getattr(self, name) > MAX_TIMEOUT_MS:
                raise ConfigError(f"remote URL {self.url!r}: {name} must be at most "
                                  f"{MAX_TIMEOUT_MS} (a day), got {getattr(self, name)}")
        if self.threads > 64:
            raise ConfigError(f"remote URL {self.url!r}: threads must be <= 64, "
                              f"got {self.threads}")
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool)
                                       or not isinstance(self.ttl_s, int)
                                       or self.ttl_s <= 0):
            raise ConfigError(f"remote URL {self.url!r}: ttl_s must be an int > 0 or none "
                              f"(no TTL), got {self.ttl_s!r}")
        for name in ("ttl_s", "hold_ttl_s"):  # a TTL the server refuses stored nothing
            value = getattr(self, name)
            if value is not None and value > MAX_TTL_S:
                raise ConfigError(f"remote URL {self.url!r}: {name} must be at most "
                                  f"{MAX_TTL_S} s, got {value}")

    @classmethod
    def parse(cls, url: str, **knobs: Any) -> RemoteSpec:
        """Parse ``valkey://host:port`` or ``valkey+cluster://h1:p1,h2:p2`` (plus knobs).

        Raises :class:`~kvshm.errors.ConfigError` naming the URL and what is wrong."""
        if not isinstance(url, str):
            raise ConfigError(f"remote URL must be a str, got {type(url).__name__}")
        scheme, sep, rest = url.partition("://")
        if not sep or scheme.lower() not in _SCHEMES:
            raise ConfigError(
                f"remote URL {url!r}: expected valkey://host:port or "
                "valkey+cluster://host1:port1,host2:port2,... (redis:// also accepted)")
        cluster = _SCHEMES[scheme.lower()]
        # Split by hand, not with urlsplit: a cluster's host list ("h1:7001,[::1]:7003")
        # is no single netloc, and a Python with the fix for CVE-2024-11168 (recent
        # releases; backported by distributions, e.g. Debian 12's 3.11.2) refuses text
        # before a '[' in a netloc ("Invalid IPv6 URL").
        rest, _, fragment = rest.partition("#")
        rest, _, query = rest.partition("?")
        netloc, slash, path = rest.partition("/")
        if slash + path not in ("", "/") or fragment:
            raise ConfigError(f"remote URL {url!r}: unexpected path {slash + path!r} (a "
                              "database number is not supported)")
        if "@" in netloc:
            raise ConfigError(f"remote URL {url!r}: credentials in the URL are not "
                              "supported (URLs are logged): name a 0600 file holding the "
                              "password with ?password_file=PATH")
        nodes: list[tuple[str, int]] = []
        for item in netloc.split(","):
            host, port = _host_port(item.strip())
            if not host or not _digits(port):
                raise ConfigError(f"remote URL {url!r}: {item!r} is not host:port "
                                  "([addr]:port for an IPv6 address)")
            if not 0 < int(port) < 65536:
                raise ConfigError(f"remote URL {url!r}: port {port} out of range")
            nodes.append((host, int(port)))
        if not cluster and len(nodes) != 1:
            raise ConfigError(f"remote URL {url!r}: a standalone URL names one host:port "
                              "(valkey+cluster:// for several)")
        merged: dict[str, Any] = {}
        for key, value in parse_qsl(query, keep_blank_values=True):
            if key not in (*_INT_KNOBS, "ttl_s", "password_file"):
                raise ConfigError(f"remote URL {url!r}: unknown knob {key!r}")
            if key == "password_file":
                merged[key] = value
            elif key == "ttl_s" and value.lower() == "none":  # the one way to say "no TTL":
                merged[key] = None  # ttl_s=0 or ttl_s= meant it too, silently (a probe)
            elif not _digits(value):
                raise ConfigError(f"remote URL {url!r}: {key}={value!r} is not an int")
            else:
                merged[key] = int(value)
        for key, value in knobs.items():
            if key not in (*_INT_KNOBS, "ttl_s", "password_file"):
                raise ConfigError(f"remote URL {url!r}: unknown knob {key!r}")
            merged[key] = value
        return cls(url=url, nodes=tuple(nodes), cluster=cluster, **merged)


#: The longest password file read (a password is tens of bytes).
_MAX_PASSWORD_BYTES: Final = 1024


def read_password(path: object) -> str:
    """The password in the file at ``path`` (one line; a final newline is dropped).
    ConfigError, naming the file, when it cannot be read, is not a regular file, is
    empty, longer than 1 KiB or not one line of printable text, when group or others
    may read or write it (as libpq's ``.pgpass``: ``chmod 600`` it), or when another
    user owns it (who then chose the password: a server started as root with a file
    another user put in a shared directory ran with a password that user knew)."""
    if not isinstance(path, str) or not path:
        raise ConfigError(f"password_file must be a path, got {path!r}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"password_file {path!r}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"password_file {path!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(f"password_file {path!r} may be read by others (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): chmod 600 it")
        if st.st_uid != os.geteuid():  # (its owner chose the password: as ssh's keys)
            raise ConfigError(f"password_file {path!r} is owned by uid {st.st_uid}, not "
                              f"by this process's {os.geteuid()}")
        raw = os.read(fd, _MAX_PASSWORD_BYTES + 1)
    finally:
        os.close(fd)
    text = raw.decode("utf-8", "replace").removesuffix("\n").removesuffix("\r")
    if not text or len(raw) > _MAX_PASSWORD_BYTES or not text.isprintable() \
            or text != text.strip():
        raise ConfigError(f"password_file {path!r} must hold one line of printable text "
                          f"without spaces at its ends (at most {_MAX_PASSWORD_BYTES} "
                          "bytes)")
    return text


def _host_port(item: str) -> tuple[str, str]:
    """``item`` split into host and port text; ("", "") where it is not ``host:port``
    or ``[addr]:port``: an unclosed or stray bracket, or a colon in an unbracketed host
    (``[::1`` once read as host ``:`` and port 1)."""
    if item.startswith("["):
        addr, close, rest = item[1:].partition("]")
        if not close or not rest.startswith(":") or "[" in addr:
            return "", ""
        return addr, rest[1:]
    host, colon, port = item.rpartition(":")
    if not colon or any(c in host for c in ":[]"):
        return "", ""
    return host, port


def _digits(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes "²" and "٣", which ``int`` then
    refuses or reads as 3)."""
    return text.isascii() and text.isdigit()


# ---------------------------------------------------------------------------- keys


@functools.lru_cache(maxsize=64)
def _fingerprint_ok(fingerprint: str) -> bool:
    return _FINGERPRINT_RE.match(fingerprint) is not None


def _check_fingerprint(fingerprint: str) -> None:
    # cached: a mover checks its one fingerprint for every key and header of every job
    if not isinstance(fingerprint, str) or not _fingerprint_ok(fingerprint):
        raise ConfigError(f"layout fingerprint {fingerprint!r} must be 1..200 characters "
                          "of [A-Za-z0-9._+=/-] (no ':' or spaces: it is part of a key)")


@functools.lru_cache(maxsize=64)
def _fingerprint_digest(fingerprint: str) -> bytes:
    """The header's 16-byte BLAKE2b of a (checked) fingerprint."""
    return hashlib.blake2b(fingerprint.encode(), digest_size=16).digest()


def block_key(prefix: str, fingerprint: str, rank: int, world: int,
              block_hash: bytes) -> str:
    """``<prefix>:<fingerprint>:<rank>/<world>:<hash hex>`` -- one rank's shard of one
    block (``prefix`` is normally :data:`KEY_PREFIX`, ``kvshm:v1``)."""
    _check_fingerprint(fingerprint)
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} out of range for world size {world}")
    return f"{prefix}:{fingerprint}:{rank}/{world}:{block_hash.hex()}"


def ready_key(fingerprint: str, world: int, block_hash: bytes, *,
              prefix: str = KEY_PREFIX) -> str:
    """``<prefix>:<fingerprint>:ready/<world>:<hash hex>`` -- written by the scheduler
    once every rank stored its shard of the block, so a reader never sees half a block."""
    _check_fingerprint(fingerprint)
    if world < 1:
        raise ConfigError(f"world size must be >= 1, got {world}")
    return f"{prefix}:{fingerprint}:ready/{world}:{block_hash.hex()}"


# ---------------------------------------------------------------------------- header


#: A CRC32C over fewer bytes runs holding the GIL (at most ~150 us, cold memory at ~7
#: GB/s; ~40 us hot). Releasing it costs a re-acquisition, and in a process where
#: another thread runs Python (vLLM stepping beside the remote tier's threads) one
#: re-acquisition waits up to the switch interval (5 ms): the library's own default
#: (release from 32 KiB) made every block of a GET such a wait.
GIL_FREE_BYTES: Final = 1 << 20


def _crc32(view: memoryview) -> int:
    return zlib.crc32(view) & 0xFFFF_FFFF


def _no_checksum(view: memoryview) -> int:
    return 0


def _checksums() -> dict[int, tuple[str, Callable[[memoryview], int]]]:
    found: dict[int, tuple[str, Callable[[memoryview], int]]] = {
        0: ("none", _no_checksum), 1: ("crc32", _crc32)}
    try:  # hardware CRC32C (SSE4.2 / ARMv8), when the remote extra is installed
        import crc32c  # type: ignore[import-untyped,import-not-found,unused-ignore]

        def _crc32c(view: memoryview) -> int:  # gil_release_mode 1: release, 0: keep
            return int(crc32c.crc32c(view, 0, int(view.nbytes >= GIL_FREE_BYTES))) \
                & 0xFFFF_FFFF

        found[2] = ("crc32c", _crc32c)
    except ImportError:
        pass
    return found


#: checksum id -> (name, function over the payload). The id is stored in each header; a
#: reader accepts only its own (:attr:`BlockHeader.checksum`): a header naming another --
#: ``none`` above all, which only a benchmark configures on both sides -- is BAD.
CHECKSUMS: Final = _checksums()
_CHECKSUM_IDS: Final = {name: cid for cid, (name, _) in CHECKSUMS.items()}
#: The checksum used when none is named: the fastest one installed (crc32c, else crc32).
DEFAULT_CHECKSUM: Final = "crc32c" if "crc32c" in _CHECKSUM_IDS else "crc32"

_MAGIC: Final = b"KVB1"
# magic, version, checksum id, hash length, rank, world, checksum, payload length,
# fingerprint digest (16 bytes of BLAKE2b), block hash (zero-padded to 64 bytes)
_HEADER: Final = struct.Struct("<4sHBBHHIQ16s64s")
#: Bytes of a packed header.
HEADER_BYTES: Final = _HEADER.size
#: Where the payload's checksum (4 bytes, little-endian) sits in a packed header.
_CHECKSUM_AT: Final = struct.calcsize("<4sHBBHH")
_CHECKSUM: Final = struct.Struct("<I")


@dataclass(frozen=True)
class BlockHeader:
    """What a stored value must be to be loaded: written with the payload by
    :meth:`pack`, compared on every get by :meth:`check`. Any difference -- format
    version, layout fingerprint, block hash, rank, world size, payload length, the
    checksum algorithm (the reader's ``checksum`` is the only one it accepts: a header
    cannot turn the check off) or the payload's checksum -- makes the get
    :attr:`GetOutcome.BAD`. ``checksum="none"`` is for benchmarks whose writer and
    reader are both configured so; the engine always checks."""

    fingerprint: str
    block_hash: bytes
    rank: int
    world: int
    length: int
    version: int = FORMAT_VERSION
    checksum: str = DEFAULT_CHECKSUM
    _digest: bytes = field(init=False, repr=False, compare=False)
    # the packed header but its checksum: the bytes before and after that field
    _before: bytes = field(init=False, repr=False, compare=False)
    _after: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_fingerprint(self.fingerprint)
        if not 0 < len(self.block_hash) <= _MAX_HASH_BYTES:
            raise ConfigError(f"block hash must be 1..{_MAX_HASH_BYTES} bytes, "
                              f"got {len(self.block_hash)}")
        if not 0 <= self.rank < self.world <= 0xFFFF:
            raise ConfigError(f"rank {self.rank} / world {self.world} out of range")
        if self.length < 0:
            raise ConfigError(f"payload length must be >= 0, got {self.length}")
        if self.checksum not in _CHECKSUM_IDS:
            raise ConfigError(f"checksum {self.checksum!r} is not available here "
                              f"(have: {sorted(_CHECKSUM_IDS)})")
        object.__setattr__(self, "_digest", _fingerprint_digest(self.fingerprint))
        packed = _HEADER.pack(_MAGIC, self.version, self.checksum_id, len(self.block_hash),
                              self.rank, self.world, 0, self.length, self._digest,
                              self.block_hash)
        object.__setattr__(self, "_before", packed[:_CHECKSUM_AT])
        object.__setattr__(self, "_after", packed[_CHECKSUM_AT + _CHECKSUM.size:])

    @property
    def checksum_id(self) -> int:
        """The id :meth:`pack` writes and :meth:`check` accepts."""
        return _CHECKSUM_IDS[self.checksum]

    def pack(self, payload: memoryview) -> bytes:
        """The header bytes for ``payload`` (:data:`HEADER_BYTES`), its checksum included.
        The payload's length must be :attr:`length`."""
        if payload.nbytes != self.length:
            raise ConfigError(f"payload is {payload.nbytes} bytes, header says "
                              f"{self.length}")
        return b"".join((self._before, _CHECKSUM.pack(self._sum(payload)), self._after))

    def _sum(self, payload: memoryview) -> int:
        return CHECKSUMS[self.checksum_id][1](payload)

    def check(self, raw: bytes | memoryview, payload: memoryview) -> bool:
        """Whether ``raw`` (a stored header) is this header and ``payload`` the bytes it
        was packed with: every byte but the checksum's equals this header's own packing
        (the block hash's zero padding included), then the checksum is the payload's.
        Never raises: anything malformed is False."""
        if len(raw) != HEADER_BYTES or payload.nbytes != self.length:
            return False
        got = bytes(raw)
        end = _CHECKSUM_AT + _CHECKSUM.size
        if got[:_CHECKSUM_AT] != self._before or got[end:] != self._after:
            return False
        return bool(_CHECKSUM.unpack_from(got, _CHECKSUM_AT)[0] == self._sum(payload))


def header_checksum_id(raw: bytes | memoryview) -> int | None:
    """The checksum id a stored header names (None: not a header of this format): lets
    a reader count a header that names another algorithm than its own."""
    if len(raw) != HEADER_BYTES or bytes(raw[:4]) != _MAGIC:
        return None
    return int(raw[6])


# ---------------------------------------------------------------------------- protocols


@runtime_checkable
class BlockStore(Protocol):
    """Worker side: moves bytes between host rows and the server. Thread-safe; each call
    may fan out over the backend's own threads. No method raises (but ``close``'s
    programming errors)."""

    def put_many(self, keys: Sequence[str], views: Sequence[memoryview],
                 header: Sequence[BlockHeader], *, keep: bool = False) -> list[bool]:
        """Store ``views[i]`` under ``keys[i]`` with ``header[i]``; True = stored.
        ``keep``: with the hold TTL (a hand-off's blocks until collected)."""
        ...

    def get_many_into(self, keys: Sequence[str], views: Sequence[memoryview],
                      header: Sequence[BlockHeader]) -> list[GetOutcome]:
        """Land each value's payload in ``views[i]`` and check its header against
        ``header[i]``. Only a HIT's view holds the block; any other outcome leaves the
        view's bytes undefined."""
        ...

    def statistics(self) -> dict[str, Any]:
        """Counters (hits, misses, bad, errors, timeouts, bytes, breaker state ...)."""
        ...

    def close(self) -> None:
        """Stop the threads, close the clients. Idempotent."""
        ...


@runtime_checkable
class ReadyIndex(Protocol):
    """Scheduler side: readiness keys. No method blocks on the network."""

    def publish(self, keys: Sequence[str], *, keep: bool = False) -> None:
        """Queue "every rank stored these blocks" (SET key with the TTL; ``keep``: the
        hold TTL); returns at once."""
        ...

    def query(self, token: int, keys: Sequence[str]) -> None:
        """Queue a longest-present-prefix query over the chain ``keys`` (one pipelined
        round trip); returns at once. Its answer comes back through :meth:`answers`."""
        ...

    def answers(self) -> list[tuple[int, int]]:
        """``(token, prefix length)`` of the queries finished since the last call; an
        error or an open breaker answers 0."""
        ...

    def healthy(self) -> bool:
        """False while a query would only be refused (the breaker is open and no probe
        is due): a caller answers "no remote hit" at once instead of asking."""
        ...

    def put_value(self, key: str, value: bytes, ttl_s: int, *,
                  after: Sequence[str] = ()) -> None:
        """Queue ``SET key value EX ttl_s`` (a small value: a hand-off manifest).
        ``after``: the readiness keys it vouches for; if a write of one of them queued
        before it is refused, the value is not written."""
        ...

    def get_value(self, token: int, key: str) -> None:
        """Queue a GET of a small value; its answer comes back through :meth:`values`."""
        ...

    def delete_if_same(self, key: str, value: bytes) -> None:
        """Queue a DEL of ``key`` that applies only while it holds ``value`` (what its
        reader read): a value written again since -- a hand-off published anew under
        the same name -- stays."""
        ...

    def expire(self, keys: Sequence[str]) -> None:
        """Queue giving ``keys`` the tier's ordinary TTL (a collected or demoted
        hand-off's blocks) where that is longer than what they have left: never
        shorter, since another live hand-off may name the same blocks; a missing key
        is no error."""
        ...

    def values(self) -> list[tuple[int, bytes | None]]:
        """``(token, value)`` of the GETs finished since the last call; None: no such
        key, an error or an open breaker."""
        ...

    def refused(self) -> list[str]:
        """The readiness keys whose write failed since the last call (server error,
        OOM, breaker open)."""
        ...

    def restarts(self) -> int:
        """How many times the server was seen to lose what it held (Valkey: a new
        ``run_id``, i.e. a restart or a failover) since this index started; monotonic. A caller that
        remembers what it put forgets it when this changes."""
        ...

    def statistics(self) -> dict[str, Any]:
        """Counters (queries, answered, publishes, errors, breaker state ...)."""
        ...

    def close(self) -> None:
        """Stop the thread, close the client. Idempotent; pending queries answer 0."""
        ...
