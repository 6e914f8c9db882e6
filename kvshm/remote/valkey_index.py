"""The readiness index on Valkey: the scheduler side of the remote tier.

:class:`ValkeyReadyIndex` implements :class:`~kvshm.remote.tier.ReadyIndex`: one
background thread with its own glide_sync client (made anew after its breaker opened)
takes everything queued since its last round -- readiness keys to publish, prefix
queries, small values (hand-off manifests) to set, get, delete or expire -- and sends it
in one pipelined, non-atomic batch (a second one for the small values). Nothing here
blocks its caller: ``publish``, ``query``, ``put_value``, ``get_value``, ``delete`` and
``expire`` enqueue; ``answers`` and ``values`` pop what the thread finished. A failed
round answers every query 0 and every GET None (failure = miss), counted, and feeds the
one :class:`~kvshm.remote.breaker.CircuitBreaker`; while it is open nothing is sent and
:meth:`ValkeyReadyIndex.healthy` says so, so lookups do not even ask.

Ordering: one round's commands run in queue order (readiness keys before the manifest
queued after them: a manifest is written last).

A server that lost its data is noticed: while the breaker is closed, the thread reads
the server's ``run_id`` (``INFO server``; a cluster's, every primary's) at most every
:data:`RUN_ID_EVERY_S`, before a round or, idle once it has a client, on its own (an
engine whose puts are all skipped as already there sends nothing else). A change (a
restart, a failover) bumps :meth:`ValkeyReadyIndex.restarts`, and the engine forgets
what it believes it put, so write-through refills the tier.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.glide_client import Counters, expiry_of, glide_module, header_key, make_client
from kvshm.remote.resp import info_field
from kvshm.remote.tier import RemoteSpec

__all__ = ["RUN_ID_EVERY_S", "ValkeyReadyIndex", "run_ids"]

#: The server's run_id is read at most this often (seconds), before a round.
RUN_ID_EVERY_S: Final = 1.0


def run_ids(reply: Any) -> frozenset[str]:
    """The ``run_id`` s of an ``INFO server`` reply: one server's bytes, or a cluster's
    node -> bytes (empty: none found)."""
    parts = reply.values() if isinstance(reply, dict) else [reply]
    found = (info_field(p if isinstance(p, bytes) else str(p).encode(), "run_id")
             for p in parts)
    return frozenset(r for r in found if r)


class ValkeyReadyIndex:
    """The scheduler side on Valkey (see the module). Never blocks its caller: ``publish``
    and ``query`` enqueue, ``answers`` pops what the background thread finished."""

    def __init__(self, spec: RemoteSpec, *, breaker_threshold: int = 3,
                 breaker_backoff_s: float = 0.25, breaker_max_backoff_s: float = 5.0,
                 run_id_every_s: float = RUN_ID_EVERY_S) -> None:
        self.spec = spec
        self._glide = glide_module()
        self._ttl = expiry_of(self._glide, spec)
        self._hold = self._glide.ExpirySet(self._glide.ExpiryType.SEC, spec.hold_ttl_s)
        self.breaker = CircuitBreaker(breaker_threshold, breaker_backoff_s,
                                      breaker_max_backoff_s)
        self._q: queue.SimpleQueue[tuple[str, int, Sequence[Any]] | None] = \
            queue.SimpleQueue()
        self._answers: list[tuple[int, int]] = []
        self._values: list[tuple[int, bytes | None]] = []
        self._refused: list[str] = []
        self._lock = threading.Lock()
        self._n = Counters("queries", "answered", "answered_zero", "keys_queried",
                            "keys_present", "published", "publish_failed", "errors",
                            "timeouts", "rejected", "round_trips", "clients_created",
                            "values_set", "values_got", "values_dropped",
                            "run_id_checks", "run_id_errors", "run_id_changes")
        self._run_id_every = run_id_every_s
        self._run_ids: frozenset[str] = frozenset()  # the last seen; empty: none yet
        self._run_id_at = -float("inf")
        self._restarts = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvshm-remote-index",
                                        daemon=True)
        self._thread.start()

    def publish(self, keys: Sequence[str], *, keep: bool = False) -> None:
        if keys and not self._closed:
            self._q.put(("keep" if keep else "publish", 0, list(keys)))

    def expire(self, keys: Sequence[str]) -> None:
        if keys and not self._closed and self.spec.ttl_s is not None:
            self._q.put(("expire", self.spec.ttl_s, list(keys)))

    def query(self, token: int, keys: Sequence[str]) -> None:
        self._n.add(queries=1)
        if self._closed or not keys:
            self._answer([(token, 0)])
            return
        self._q.put(("query", token, list(keys)))

    def answers(self) -> list[tuple[int, int]]:
        with self._lock:
            out, self._answers = self._answers, []
        return out

    def healthy(self) -> bool:
        return not self._closed and self.breaker.would_allow()

    def put_value(self, key: str, value: bytes, ttl_s: int) -> None:
        if not self._closed:
            self._q.put(("set", ttl_s, [key, value]))

    def get_value(self, token: int, key: str) -> None:
        if self._closed:
            with self._lock:
                self._values.append((token, None))
            return
        self._q.put(("get", token, [key]))

    def delete(self, keys: Sequence[str]) -> None:
        if keys and not self._closed:
            self._q.put(("delete", 0, list(keys)))

    def refused(self) -> list[str]:
        with self._lock:
            out, self._refused = self._refused, []
        return out

    def restarts(self) -> int:
        return self._restarts

    def values(self) -> list[tuple[int, bytes | None]]:
        with self._lock:
            out, self._values = self._values, []
        return out

    def _answer(self, items: list[tuple[int, int]]) -> None:
        self._n.add(answered=len(items), answered_zero=sum(1 for _, p in items if p == 0))
        with self._lock:
            self._answers.extend(items)

    def _run(self) -> None:
        client: Any = None
        gen_opens = 0
        while True:
            try:  # idle with a client: wake to read the run_id (a server restarted meanwhile)
                ops = [self._q.get(timeout=None if client is None
                                   else max(self._run_id_every, 0.05))]
            except queue.Empty:
                ops = []
            while True:  # drain: one round trip for everything queued meanwhile
                try:
                    ops.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = None in ops
            work = [o for o in ops if o is not None]
            queries = [(tok, keys) for kind, tok, keys in work if kind == "query"]
            publishes = [(k, kind == "keep") for kind, _, keys in work
                         if kind in ("publish", "keep") for k in keys]
            others = [o for o in work if o[0] in ("set", "get", "delete", "expire")]
            if work:
                if client is None or self.breaker.opens != gen_opens:
                    if client is not None:
                        try:
                            client.close()
                        except Exception:  # noqa: BLE001 - a broken client: drop it
                            pass
                    client = make_client(self.spec)
                    gen_opens = self.breaker.opens
                    self._n.add(clients_created=1)
                self._check_run_id(client)
                ok = True
                if queries or publishes:  # an empty batch is an error to glide
                    ok = self._round(client, queries, publishes)
                if not ok:  # a manifest goes last: not after readiness the server refused
                    kept = [o for o in others if o[0] != "set"]
                    self._n.add(values_dropped=len(others) - len(kept))
                    others = kept
                if others:
                    self._values_round(client, others)
            elif client is not None and not stop:
                self._check_run_id(client)
            if stop:
                break
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing: nothing to do
                pass

    def _check_run_id(self, client: Any) -> None:
        """Read the server's run_id(s) if due and the breaker is closed (a failure only
        counts: the rounds feed the breaker). A set other than the last one seen is a
        server that may have lost its data: :meth:`restarts` goes up by one."""
        now = time.monotonic()
        if now - self._run_id_at < self._run_id_every \
                or self.breaker.state is not BreakerState.CLOSED:
            return
        self._run_id_at = now
        g = self._glide
        try:
            if self.spec.cluster:
                reply = client.info([g.InfoSection.SERVER], route=g.AllPrimaries())
            else:
                reply = client.info([g.InfoSection.SERVER])
        except Exception:  # noqa: BLE001 - counted; the next check reads it again
            self._n.add(run_id_errors=1)
            return
        ids = run_ids(reply)
        self._n.add(run_id_checks=1)
        if not ids:
            self._n.add(run_id_errors=1)
            return
        if self._run_ids and ids != self._run_ids:
            self._restarts += 1  # one writer (this thread); an int read is atomic
            self._n.add(run_id_changes=1)
        self._run_ids = ids

    def _round(self, client: Any, queries: list[tuple[int, Sequence[str]]],
               publishes: list[tuple[str, bool]]) -> bool:
        """One batch of readiness writes and queries; False if a write failed (its key
        goes to :meth:`refused`)."""
        g = self._glide
        if not self.breaker.allow():
            self._n.add(rejected=1, publish_failed=len(publishes))
            self._answer([(tok, 0) for tok, _ in queries])
            return self._refuse([k for k, _ in publishes])
        batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
        for k, keep in publishes:
            batch.set(k, b"1", expiry=self._hold if keep else self._ttl)
        for _, keys in queries:
            for k in keys:
                batch.exists([k])
        try:
            result = client.exec(batch, raise_on_error=False)
            self._n.add(round_trips=1)
        except Exception as exc:  # noqa: BLE001 - failure = 0: counted, never raised
            self.breaker.failure()
            self._n.add(errors=1, timeouts=int(isinstance(exc, g.TimeoutError)),
                        publish_failed=len(publishes))
            self._answer([(tok, 0) for tok, _ in queries])
            return self._refuse([k for k, _ in publishes])
        self.breaker.success()
        result = list(result or [])
        pub, rest = result[:len(publishes)], result[len(publishes):]
        bad = [k for (k, _), r in zip(publishes, pub) if r not in ("OK", b"OK")]
        bad += [k for k, _ in publishes[len(pub):]]
        self._n.add(published=len(publishes) - len(bad), publish_failed=len(bad))
        answers, pos = [], 0
        for tok, keys in queries:
            part = rest[pos:pos + len(keys)]
            pos += len(keys)
            prefix = 0
            for r in part:
                if r != 1:
                    break
                prefix += 1
            self._n.add(keys_queried=len(keys), keys_present=prefix)
            answers.append((tok, prefix))
        self._answer(answers)
        return self._refuse(bad)

    def _refuse(self, keys: list[str]) -> bool:
        """Record readiness writes that failed; True when there were none."""
        if keys:
            with self._lock:
                self._refused.extend(keys)
        return not keys

    def _values_round(self, client: Any, ops: list[tuple[str, int, Sequence[Any]]]) -> None:
        """Small values (hand-off manifests): SET with their own TTL, GET, DEL; one
        round trip. A failure answers every GET with None (a miss)."""
        g = self._glide
        gets = [tok for kind, tok, _ in ops if kind == "get"]
        if not self.breaker.allow():
            self._n.add(rejected=1)
            self._put_values([(tok, None) for tok in gets])
            return
        batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
        for kind, arg, items in ops:
            if kind == "set":
                batch.set(items[0], items[1], expiry=g.ExpirySet(g.ExpiryType.SEC, arg))
            elif kind == "get":
                batch.get(items[0])
            elif kind == "expire":  # a block key's header key too (none: a no-op)
                for k in items:
                    batch.expire(k, arg)
                    batch.expire(header_key(k), arg)
            else:
                batch.delete(list(items))
        try:
            result = list(client.exec(batch, raise_on_error=False) or [])
            self._n.add(round_trips=1)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self.breaker.failure()
            self._n.add(errors=1, timeouts=int(isinstance(exc, g.TimeoutError)))
            self._put_values([(tok, None) for tok in gets])
            return
        self.breaker.success()
        got, pos = [], 0
        for kind, tok, items in ops:  # one reply per command, an EXPIRE per key
            if kind == "get":
                r = result[pos] if pos < len(result) else None
                got.append((tok, r if isinstance(r, bytes) else None))
            pos += 2 * len(items) if kind == "expire" else 1
        self._n.add(values_set=sum(1 for o in ops if o[0] == "set"), values_got=len(got))
        self._put_values(got)

    def _put_values(self, items: list[tuple[int, bytes | None]]) -> None:
        with self._lock:
            self._values.extend(items)

    def statistics(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._n.snapshot()
        b = self.breaker.statistics()
        stats.update(breaker_state=b["state"], breaker_opens=b["opens"],
                     breaker_closes=b["closes"])
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=2 * (self.spec.request_timeout_ms
                                       + self.spec.connect_timeout_ms) / 1000 + 1)
