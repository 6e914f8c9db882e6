"""The Valkey backend of the remote tier (glide_sync), standalone and cluster.

**Values.** One block of one rank is two keys in the same hash slot: the payload under
its :func:`~kvshm.remote.tier.block_key` and its :class:`~kvshm.remote.tier.BlockHeader`
under :func:`header_key` (``{<key>}h``: the braces make the header hash to the payload's
slot, so a cluster keeps them on one node). A put is one pipelined round trip (``SET key
<row> EX ttl``, then ``SET {key}h <header> EX ttl``; the row goes out zero-copy from the
caller's view); a get is one ``MGET {key}h key`` that lands the header in a small
per-thread buffer and the payload directly in the caller's view (glide's ``buffers=``:
no intermediate bytes). A value longer than the view, shorter than the header says, or
a header that does not match the expected one is BAD (counted, never loaded); a missing
payload or header (never stored, expired, one of the two evicted) is a MISS. The
payload's checksum is CRC32C (hardware, the ``crc32c`` package) or zlib's CRC32 where
that is not installed; the header names which, and a reader accepts only its own (a
header naming another, ``none`` included, is BAD and counted ``checksum_refused``: the
engines sharing a server need the same one, the ``remote`` extra installs ``crc32c``).

**Threads and clients.** :class:`ValkeyBlockStore` runs ``spec.threads`` threads, each
with its own lazily connected glide_sync client (LMCache's pattern: per-thread clients,
2-4 requests in flight, no deep pipelines of MB values). Every request has
``request_timeout_ms``; connections ``connect_timeout_ms`` and a bounded reconnect
backoff.

**Failures.** Each shard (the one server; in a cluster, each primary, found from
``CLUSTER SLOTS``) has a :class:`~kvshm.remote.breaker.CircuitBreaker`: consecutive
timeouts or connection errors open it, and while it is open the keys of that shard are
ERROR at once, without a request; a probe after the backoff closes it when the server
answers. When a standalone server's breaker opens the thread clients are re-created
(connected anew once it is back); when a cluster primary's opens, the slot map is read
again, so the slots of a failed-over primary go to the replica that took them over
(the clients stay: glide's cluster client follows the failover, and new clients would
cost the healthy primaries a reconnection). No call raises; every outcome is counted.

The scheduler side, ``ValkeyReadyIndex``, is :mod:`kvshm.remote.valkey_index`; the
client factory, slot map and counters both use are :mod:`kvshm.remote.glide_client`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvshm.errors import ConfigError
from kvshm.ratelog import RateLimitedLog
from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.glide_client import (
    Counters,
    Shards,
    expiry_of,
    glide_module,
    header_key,
    make_client,
    too_long,
)
from kvshm.remote.tier import (
    HEADER_BYTES,
    BlockHeader,
    GetOutcome,
    RemoteSpec,
    header_checksum_id,
)

__all__ = ["ValkeyBlockStore"]

log = logging.getLogger(__name__)
#: Warnings a caller (or a bug) can repeat per block: one line per kind per interval.
rlog = RateLimitedLog(log)


class ValkeyBlockStore:
    """The worker side on Valkey (see the module). ``breaker_*``: consecutive failures
    that open a shard's breaker, and its first and longest backoff."""

    def __init__(self, spec: RemoteSpec, *, breaker_threshold: int = 3,
                 breaker_backoff_s: float = 0.25, breaker_max_backoff_s: float = 5.0) -> None:
        self.spec = spec
        self._glide = glide_module()
        self._ttl = expiry_of(self._glide, spec)
        self._hold = self._glide.ExpirySet(self._glide.ExpiryType.SEC, spec.hold_ttl_s)
        self._shards = Shards(spec, lambda: CircuitBreaker(
            breaker_threshold, breaker_backoff_s, breaker_max_backoff_s))
        self._pool = ThreadPoolExecutor(spec.threads, thread_name_prefix="kvshm-remote")
        self._local = threading.local()
        self._gen = 0
        self._clients: list[Any] = []
        self._clients_lock = threading.Lock()
        self._closed = False
        self._n = Counters("puts", "put_ok", "put_failed", "put_refused", "gets", "hits",
                            "misses", "bad", "errors", "timeouts", "rejected",
                            "bytes_put", "bytes_got", "invalid_calls", "clients_created",
                            "checksum_refused")

    # ------------------------------------------------------------------ clients

    def _client(self) -> Any:
        local = self._local
        if getattr(local, "gen", -1) != self._gen or local.client is None:
            old = getattr(local, "client", None)
            if old is not None:
                self._close_client(old)
            local.client = make_client(self.spec)
            local.gen = self._gen
            with self._clients_lock:
                self._clients.append(local.client)
            self._n.add(clients_created=1)
        return local.client

    def _close_client(self, client: Any) -> None:
        with self._clients_lock:
            if client in self._clients:
                self._clients.remove(client)
        try:
            client.close()
        except Exception:  # noqa: BLE001 - closing a broken client: nothing to do
            pass

    def _failed(self, breaker: CircuitBreaker, exc: BaseException) -> None:
        before = breaker.opens
        breaker.failure()
        self._n.add(errors=1, timeouts=int(isinstance(exc, self._glide.TimeoutError)))
        if breaker.opens != before:
            if self.spec.cluster:  # a fresh slot map; glide's cluster client follows the
                self._shards.refresh(force=True)  # failover itself, the others' too
            else:  # the one server: new clients (connected anew once it is back)
                self._gen += 1

    def _guard(self, key: str) -> CircuitBreaker | None:
        """The key's breaker if it allows a request now; None (counted) otherwise."""
        breaker = self._shards.breaker(self._shards.shard_of(key))
        if breaker.allow():
            return breaker
        if breaker.state is BreakerState.OPEN:  # maybe the slots moved (failover)
            self._shards.refresh()
        self._n.add(rejected=1, errors=1)
        return None

    # ------------------------------------------------------------------ put

    def _put_one(self, key: str, view: memoryview, header: BlockHeader,
                 keep: bool = False) -> bool:
        try:
            raw = header.pack(view)  # before the breaker: a caller's error is no outage
        except (ConfigError, TypeError, ValueError):
            self._n.add(invalid_calls=1)
            rlog.warning("put_view", "remote put %s: the view does not match its header", key)
            return False
        breaker = self._guard(key)
        if breaker is None:
            return False
        try:
            g = self._glide
            batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
            expiry = self._hold if keep else self._ttl
            batch.set(key, view, expiry=expiry)
            batch.set(header_key(key), raw, expiry=expiry)
            result = self._client().exec(batch, raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self._failed(breaker, exc)
            return False
        breaker.success()
        if not result or any(r != "OK" and r != b"OK" for r in result):
            self._n.add(put_refused=1)  # a reply error in the batch, e.g. OOM
            log.debug("remote put %s refused: %s", key, result)
            return False
        self._n.add(put_ok=1, bytes_put=view.nbytes)
        return True

    def put_many(self, keys: Sequence[str], views: Sequence[memoryview],
                 header: Sequence[BlockHeader], *, keep: bool = False) -> list[bool]:
        n = len(keys)
        if self._closed or len(views) != n or len(header) != n:
            self._n.add(invalid_calls=1, put_failed=n)
            return [False] * n
        self._n.add(puts=n)
        out = self._fan_out(n, lambda i: self._put_one(keys[i], views[i], header[i], keep),
                            False)
        self._n.add(put_failed=out.count(False))
        return out

    # ------------------------------------------------------------------ get

    def _get_one(self, key: str, view: memoryview, header: BlockHeader) -> GetOutcome:
        if view.readonly or not view.c_contiguous:  # a caller's error, not an outage
            self._n.add(invalid_calls=1, errors=1)
            rlog.warning("get_view", "remote get %s: the view is read-only or not contiguous",
                         key)
            return GetOutcome.ERROR
        breaker = self._guard(key)
        if breaker is None:
            return GetOutcome.ERROR
        local = self._local
        hbuf = getattr(local, "hbuf", None)
        if hbuf is None:
            hbuf = local.hbuf = memoryview(bytearray(HEADER_BYTES))
        try:
            result = self._client().mget([header_key(key), key], buffers=[hbuf, view])
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            if too_long(exc, self._glide):
                breaker.success()  # the server answered: a value longer than the view
                self._n.add(bad=1)
                return GetOutcome.BAD
            self._failed(breaker, exc)
            return GetOutcome.ERROR
        breaker.success()
        hlen, plen = result
        if plen is None or hlen is None:  # never stored, expired, or half evicted
            self._n.add(misses=1)
            return GetOutcome.MISS
        if int(hlen) != HEADER_BYTES or int(plen) != view.nbytes \
                or not header.check(hbuf, view):
            cid = header_checksum_id(hbuf) if int(hlen) == HEADER_BYTES else None
            self._n.add(bad=1, checksum_refused=int(cid is not None
                                                    and cid != header.checksum_id))
            return GetOutcome.BAD
        self._n.add(hits=1, bytes_got=view.nbytes)
        return GetOutcome.HIT

    def get_many_into(self, keys: Sequence[str], views: Sequence[memoryview],
                      header: Sequence[BlockHeader]) -> list[GetOutcome]:
        n = len(keys)
        if self._closed or len(views) != n or len(header) != n:
            self._n.add(invalid_calls=1, errors=n)
            return [GetOutcome.ERROR] * n
        self._n.add(gets=n)
        return self._fan_out(n, lambda i: self._get_one(keys[i], views[i], header[i]),
                             GetOutcome.ERROR)

    # ------------------------------------------------------------------ plumbing

    def _fan_out(self, n: int, one: Callable[[int], Any], failed: Any) -> list[Any]:
        """Run ``one(i)`` for every i over the threads (thread t takes i = t, t+T, ...).

        While a breaker is not closed, item 0 runs alone first: it is the probe, and a
        half-open breaker refuses every request that would race it, which would fail
        the rest of the batch (a whole job) against a server that is back."""
        out: list[Any] = [failed] * n
        if n == 0:
            return out
        if any(s != "closed" for s in self._shards.states().values()):
            out[0] = self._run_one(one, 0, failed)
            rest = self._fan_out(n - 1, lambda i: one(i + 1), failed) if n > 1 else []
            return [out[0], *rest]
        threads = min(self.spec.threads, n)

        def chunk(t: int) -> None:
            for i in range(t, n, threads):
                out[i] = self._run_one(one, i, failed)
        try:
            futures = [self._pool.submit(chunk, t) for t in range(threads)]
        except RuntimeError:  # closed concurrently
            return out
        for f in futures:
            f.result()
        return out

    def _run_one(self, one: Callable[[int], Any], i: int, failed: Any) -> Any:
        try:
            return one(i)
        except Exception:  # noqa: BLE001 - a bug must not raise into a worker: logged
            rlog.error("unexpected", "remote tier: unexpected error", exc_info=True)
            self._n.add(errors=1)
            return failed

    def statistics(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._n.snapshot()
        breakers = [b.statistics() for b in list(self._shards.breakers.values())]
        stats["breaker_opens"] = sum(b["opens"] for b in breakers)
        stats["breaker_closes"] = sum(b["closes"] for b in breakers)
        states = self._shards.states()
        stats["breaker_state"] = ("open" if "open" in states.values() else
                                  "half_open" if "half_open" in states.values() else
                                  "closed")
        stats["breakers"] = states
        stats["slot_map_refreshes"] = self._shards.refreshes
        return stats

    def warm(self) -> None:
        """Connect every thread's client now (best effort; a failure is only counted):
        the first job then costs a round trip, not a connection per thread."""
        def connect(_: int) -> None:
            try:
                self._client()
            except Exception:  # noqa: BLE001 - a server down: the first job will tell
                self._n.add(errors=1)
        self._fan_out(self.spec.threads, connect, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for c in clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001 - closing: nothing to do
                pass
