"""The glide plumbing both Valkey backends share: clients, cluster slots, counters.

* :func:`make_client`: a lazily connected glide_sync client (standalone or cluster)
  with explicit request and connect timeouts and a bounded reconnect backoff; creating
  one never blocks. :func:`glide_module` imports glide once and turns its console
  logging off (kvshm counts timeouts and reconnects instead).
* :func:`key_slot`: a key's cluster hash slot (CRC16/XMODEM, hash tags honoured), and
  :func:`header_key`, which keeps a block's header in its payload's slot.
* :class:`Shards`: which circuit breaker guards a key -- one for a standalone server,
  one per cluster primary from a ``CLUSTER SLOTS`` map, read again at most every
  ``_REFRESH_EVERY_S`` by one thread at a time (the others keep the old map).
* :class:`Counters`: named counters under one lock (read as one snapshot).
* :func:`report_failure`: the log line of a request a shard did not answer.

Used by :mod:`kvshm.remote.valkey` (the block store), :mod:`kvshm.remote.valkey_index`
(the readiness index) and :mod:`kvshm.remote.janitor`.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from kvshm.errors import MissingExtra
from kvshm.ratelog import RateLimitedLog
from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.resp import ServerReplyError, command, parse_reply
from kvshm.remote.tier import RemoteSpec

__all__ = ["UNSERVED", "Counters", "ShardBreakers", "Shards", "expiry_of", "glide_module",
           "header_key", "key_slot", "make_client", "read_slot_map", "report_failure",
           "too_long"]

_SLOTS: Final = 16384
#: The shard name of a slot no primary serves (a partial slot map), and of every key
#: before any map was read.
UNSERVED: Final = "cluster"
#: A slot-map refresh is attempted at most this often (seconds).
_REFRESH_EVERY_S: Final = 0.5
_RECONNECT: Final = (3, 50, 2)  # glide BackoffStrategy: retries, factor ms, base
#: Most characters of a server's or client's error text in a log line.
_ERROR_CHARS: Final = 300

#: A server that is down, or refuses every connection (it wants a password kvshm was
#: not given: ``NOAUTH``), fails every request: one line per side and shard per
#: interval (:mod:`kvshm.ratelog`).
log = logging.getLogger("kvshm.remote")
_failure_log = RateLimitedLog(log)


def report_failure(spec: RemoteSpec, side: str, shard: str, exc: BaseException) -> None:
    """A request of ``side`` (the workers' block store, the scheduler's index) to
    ``shard`` failed with ``exc`` (not answered: a refused connection, a timeout, a
    handshake the server refused): a WARNING that names the server and glide's error
    text, at most one per side and shard per interval. Without it the tier's only trace
    would be its counters, every block a miss."""
    where = shard if spec.cluster else ",".join(f"{h}:{p}" for h, p in spec.nodes)
    text = " ".join(str(exc).split())[:_ERROR_CHARS]
    _failure_log.warning(f"failed:{side}:{shard}", "kvshm remote tier (%s): a request to "
                         "%s failed: %s: %s; its blocks are misses (counted: errors)",
                         side, where, type(exc).__name__, text)


def header_key(key: str) -> str:
    """The key of ``key``'s header: same hash slot as ``key`` (``{key}h``)."""
    return "{" + key + "}h"


def glide_module() -> Any:
    """The ``glide_sync`` module (MissingExtra without it), its console logging off."""
    try:
        import glide_sync
    except ImportError as exc:
        raise MissingExtra("valkey-glide-sync", "remote", "the Valkey remote tier") from exc
    _quiet(glide_sync)
    return glide_sync


_quiet_done = False


def _quiet(glide: Any) -> None:
    """glide logs every timeout, reconnect and failed request (one line each, for the
    whole of an outage) on the console; kvshm counts them instead. Only if nobody
    configured glide's logger before (``Logger.init`` keeps an existing configuration:
    call ``glide_sync.Logger.set_logger_config`` first to see them)."""
    global _quiet_done
    if not _quiet_done:
        _quiet_done = True
        glide.Logger.init(glide.LogLevel.OFF)


def make_client(spec: RemoteSpec, request_timeout_ms: int | None = None) -> Any:
    """A lazily connected glide_sync client for ``spec`` (standalone or cluster) with
    explicit timeouts and a bounded reconnect backoff. Creating it never blocks."""
    g = glide_module()
    addrs = [g.NodeAddress(h, p) for h, p in spec.nodes]
    backoff = g.BackoffStrategy(num_of_retries=_RECONNECT[0], factor=_RECONNECT[1],
                                exponent_base=_RECONNECT[2])
    timeout = request_timeout_ms or spec.request_timeout_ms
    creds = None if spec.password is None else g.ServerCredentials(password=spec.password)
    if spec.cluster:
        return g.GlideClusterClient.create(g.GlideClusterClientConfiguration(
            addrs, credentials=creds, request_timeout=timeout, reconnect_strategy=backoff,
            lazy_connect=True, advanced_config=g.AdvancedGlideClusterClientConfiguration(
                connection_timeout=spec.connect_timeout_ms)))
    return g.GlideClient.create(g.GlideClientConfiguration(
        addrs, credentials=creds, request_timeout=timeout, reconnect_strategy=backoff,
        lazy_connect=True, advanced_config=g.AdvancedGlideClientConfiguration(
            connection_timeout=spec.connect_timeout_ms)))


def _crc16_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021 if crc & 0x8000 else crc << 1) & 0xFFFF
        table.append(crc)
    return table


_CRC16: Final = _crc16_table()


def key_slot(key: str) -> int:
    """The cluster hash slot of ``key`` (CRC16/XMODEM mod 16384, hash tags honoured)."""
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1:end]
    crc = 0
    for b in raw:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ b) & 0xFF]
    return crc % _SLOTS


def too_long(exc: BaseException, glide: Any) -> bool:
    """Whether a get failed because a value does not fit its buffer (the server answered:
    the value is longer than the expected block: BAD). Every other exception of a
    request is a failure to reach the server (glide reports a refused or timed-out
    connect as a plain RequestError): the breaker counts it."""
    return isinstance(exc, glide.RequestError) and "exceeds buffer capacity" in str(exc)


class Counters:
    """Named counters under one lock, every one declared at construction (a snapshot
    has the same keys from the start; a name not declared is a KeyError, not a new
    counter that appears once it is first counted)."""

    def __init__(self, *names: str) -> None:
        self._lock = threading.Lock()
        self._c = dict.fromkeys(names, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            c = self._c
            if not deltas.keys() <= c.keys():  # all or nothing: no half-added call
                raise KeyError(f"undeclared counters {sorted(deltas.keys() - c.keys())}")
            for k, v in deltas.items():
                c[k] += v

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


class ShardBreakers:
    """One circuit breaker per shard name, made on first use; a shard that leaves the
    slot map retires its breaker (:meth:`retire`).

    Invariants: a name has at most one live breaker. A retired breaker stays countable:
    a thread that took it before it retired may still record a failure on it, so the
    last ``RETIRED_KEPT`` retired ones are summed as they are now, older ones folded at
    the count they had when they left the window -- :meth:`totals` never goes back.
    :meth:`name_of` answers for a live or retired breaker while anything holds it (a
    weak map). All under one lock."""

    RETIRED_KEPT: Final = 64

    def __init__(self, make: Callable[[], CircuitBreaker]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._live: dict[str, CircuitBreaker] = {}
        self._names: weakref.WeakKeyDictionary[CircuitBreaker, str] = (
            weakref.WeakKeyDictionary())
        self._retired: deque[CircuitBreaker] = deque()
        self._folded_opens = 0
        self._folded_closes = 0

    def get(self, name: str) -> CircuitBreaker:
        """``name``'s live breaker (a new one the first time, or after it retired)."""
        with self._lock:
            found = self._live.get(name)
            if found is None:
                found = self._live[name] = self._make()
                self._names[found] = name
            return found

    def name_of(self, breaker: CircuitBreaker) -> str:
        """The shard ``breaker`` guards or guarded ("?" for one never made here)."""
        with self._lock:
            return self._names.get(breaker, "?")

    def live(self) -> dict[str, CircuitBreaker]:
        """A copy of the live breakers by shard name."""
        with self._lock:
            return dict(self._live)

    def retire(self, keep: frozenset[str]) -> None:
        """Retire the breaker of every shard ``keep`` does not name."""
        with self._lock:
            for name in [n for n in self._live if n not in keep]:
                self._retired.append(self._live.pop(name))
            while len(self._retired) > self.RETIRED_KEPT:
                old = self._retired.popleft()
                self._folded_opens += old.opens
                self._folded_closes += old.closes

    def totals(self) -> tuple[int, int]:
        """Opens and closes of every breaker made here, live or retired, in one
        snapshot."""
        with self._lock:
            every = [*self._live.values(), *self._retired]
            return (self._folded_opens + sum(b.opens for b in every),
                    self._folded_closes + sum(b.closes for b in every))


class Shards:
    """Which breaker guards a key: one for a standalone server; one per primary of a
    cluster, from a slot map read with ``CLUSTER SLOTS`` (raw, short-timeout
    connections to the known nodes, so a dead node costs a refused connect). The
    breakers are an object it holds (:class:`ShardBreakers`)."""

    def __init__(self, spec: RemoteSpec, make: Callable[[], CircuitBreaker]) -> None:
        self.spec = spec
        self._refresh_lock = threading.Lock()
        self.breakers = ShardBreakers(make)
        self._slots: list[str] | None = None
        self._current: frozenset[str] | None = None  # the shards of _slots
        self._known: list[tuple[str, int]] = list(spec.nodes)
        self._last_refresh = -1e9
        self.refreshes = 0

    def breaker(self, name: str) -> CircuitBreaker:
        return self.breakers.get(name)

    def name_of(self, breaker: CircuitBreaker) -> str:
        """The shard ``breaker`` guards or guarded ("?" for one never made here)."""
        return self.breakers.name_of(breaker)

    def shard_of(self, key: str) -> str:
        if not self.spec.cluster:
            return "server"
        slots = self._slots
        if slots is None:
            self.refresh()
            slots = self._slots
        return slots[key_slot(key)] if slots is not None else UNSERVED

    def refresh(self, force: bool = False) -> None:
        """Read the slot map again (one thread at a time, the others go on with the old
        map), at most once per ``_REFRESH_EVERY_S`` counted from the end of the last
        attempt: a refresh past dead nodes costs a connect timeout each, and counted from
        its start, one that took longer than the interval was due again at once -- every
        part of a call for a stopped shard paid it again (10 s calls at 0.3 s timeouts, a
        hostile probe). The node that answered is asked first next time, a node that
        did not goes to the back; besides that one, a node neither the new map names
        nor the URL lists is forgotten, and the breaker of a shard the new map does not
        name retires (:meth:`ShardBreakers.retire`): the nodes and live breakers stay
        bounded by the cluster's size, whatever its history."""
        if not self.spec.cluster or not self._refresh_lock.acquire(blocking=False):
            return
        try:
            if not force and time.monotonic() - self._last_refresh < _REFRESH_EVERY_S:
                return
            try:
                self._read_slots()
            finally:
                self._last_refresh = time.monotonic()
        finally:
            self._refresh_lock.release()

    def _read_slots(self) -> None:
        """Ask the known nodes in turn for ``CLUSTER SLOTS``; the first usable answer
        becomes the map (nodes that failed before it move to the back)."""
        timeout = self.spec.connect_timeout_ms / 1000
        failed: list[tuple[str, int]] = []
        for node in list(self._known):
            slots = read_slot_map(node, timeout, self.spec.password)
            if slots is None:
                failed.append(node)
                continue
            slots_of, nodes = slots
            # only the nodes this map names and the configured seeds are kept: a cluster
            # whose nodes come back at new addresses (a restarted pod) grew the list by
            # one a failover, each dead one a connect timeout at the next refresh past it
            keep = set(nodes).union(self.spec.nodes)
            known = [node] + [n for n in self._known
                              if n != node and n not in failed and n in keep]
            known += [n for n in nodes if n not in known and n not in failed]
            known = list(dict.fromkeys(known + [n for n in failed if n in keep]))
            self._slots = slots_of
            self._current = current = frozenset(slots_of)
            self._known = known
            self.refreshes += 1
            self.breakers.retire(current)  # a failed-over primary's
            return
        self._known = [n for n in self._known if n not in failed] + failed

    def current(self) -> frozenset[str] | None:
        """The shards of the slot map read last (None: none read yet, or standalone)."""
        return self._current

    def states(self) -> dict[str, BreakerState]:
        """Each live shard breaker's state, by the shard's name (a name the last map
        does not name may be among them until the next map is read: a thread took its
        breaker by a name from the map before; filter by :meth:`current`)."""
        return {k: b.state for k, b in self.breakers.live().items()}


def read_slot_map(node: tuple[str, int], timeout: float, password: str | None = None
                  ) -> tuple[list[str], list[tuple[str, int]]] | None:
    """``node``'s ``CLUSTER SLOTS``: each slot's primary (``"cluster"`` where no
    shard serves it) and every node named, once; None when it does not answer in
    ``timeout`` or answers anything else (an error, an empty map, not RESP, a range
    outside the 16,384 slots, a host or port of another type). A NULL or empty host
    (``cluster-preferred-endpoint-type unknown-endpoint``) is the address asked."""
    try:
        reply = parse_reply(command(node[0], node[1], "CLUSTER", "SLOTS", timeout=timeout,
                                    password=password))
        if isinstance(reply, ServerReplyError) or not isinstance(reply, list) or not reply:
            return None
        slots = [UNSERVED] * _SLOTS
        nodes: dict[tuple[str, int], None] = {}
        for lo, hi, primary, *replicas in reply:
            if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi < _SLOTS):
                return None
            named = [_endpoint(n, node[0]) for n in (primary, *replicas)]
            slots[lo:hi + 1] = [f"{named[0][0]}:{named[0][1]}"] * (hi - lo + 1)
            nodes.update(dict.fromkeys(named))
        return slots, list(nodes)
    except (OSError, ValueError, TypeError, IndexError, AttributeError):  # not a map
        return None


def _endpoint(entry: Any, asked: str) -> tuple[str, int]:
    """(host, port) of a ``CLUSTER SLOTS`` node entry; a NULL or empty host is the
    address asked. ValueError for anything but a bulk host and an integer port."""
    host, port = entry[0], entry[1]
    if host is not None and not isinstance(host, bytes) or type(port) is not int:
        raise ValueError(f"not a node entry: {entry!r:.80}")
    return (host.decode() if host else asked), port


def expiry_of(glide: Any, spec: RemoteSpec) -> Any:
    """The ``SET ... EX ttl_s`` option of ``spec`` (None: no TTL)."""
    return glide.ExpirySet(glide.ExpiryType.SEC, spec.ttl_s) if spec.ttl_s is not None \
        else None
