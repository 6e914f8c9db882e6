"""The readiness index on Valkey: the scheduler side of the remote tier.

:class:`ValkeyReadyIndex` implements :class:`~kvshm.remote.tier.ReadyIndex`: one
background thread with its own glide_sync client (made anew after its breaker opened;
in a cluster one per primary, see :meth:`ValkeyReadyIndex._shard_client`)
takes everything queued since its last round -- readiness keys to publish, prefix
queries, small values (hand-off manifests) to set, get, delete or expire -- and sends it
in pipelined, non-atomic batches, one per shard (the server; in a cluster, each primary,
from the slot map of :class:`~kvshm.remote.glide_client.Shards`), the small-value writes
in a second such round. Nothing here blocks its caller: ``publish``, ``query``,
``put_value``, ``get_value``, ``delete`` and ``expire`` enqueue; ``answers`` and
``values`` pop what the thread finished.

Each shard has its own :class:`~kvshm.remote.breaker.CircuitBreaker`. A shard's failed
batch feeds its breaker and makes its keys misses (a query's prefix stops at the first
key of a shard that is down; its readiness writes are refused and put again later; its
GETs answer None), counted (``keys_shard_down``, ``values_shard_down``); while a
breaker is open nothing is sent to that shard and its slot map is read again (a replica
may have taken over). The other shards' keys answer and publish as usual: one dead
cluster primary does not blind the index. :meth:`ValkeyReadyIndex.healthy` is False
only while every shard's breaker refuses, so lookups do not even ask. (A shard that just
died costs each round its request deadline until its breaker opens: the shards' batches
run one after the other.)

Ordering: a drain's small-value reads (manifests), then its readiness writes and
queries go in one batch per shard, in that order (a readiness key asked with a manifest
read is read after it); its small-value writes follow in a second round, only after the
readiness writes succeeded (a manifest is written last, never after readiness keys
the server refused). A drain that writes or deletes a value keeps every small-value
command in that second round, in queue order (a read queued after a write sees it).

A server that lost its data is noticed: while the breaker is closed, the thread reads
the server's ``run_id`` (``INFO server``; a cluster's, every primary's) at most every
:data:`RUN_ID_EVERY_S`, before a round or, idle once it has a client, on its own (an
engine whose puts are all skipped as already there sends nothing else). A change (a
restart, a failover) bumps :meth:`ValkeyReadyIndex.restarts`, and the engine forgets
what it believes it put, so write-through refills the tier.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any, Final

from kvshm.remote.breaker import BreakerState, CircuitBreaker
from kvshm.remote.glide_client import (
    Counters,
    Shards,
    expiry_of,
    glide_module,
    header_key,
    make_client,
)
from kvshm.remote.resp import info_field
from kvshm.remote.tier import RemoteSpec

__all__ = ["RUN_ID_EVERY_S", "ValkeyReadyIndex", "run_ids"]

#: The server's run_id is read at most this often (seconds), before a round.
RUN_ID_EVERY_S: Final = 1.0
#: The shard name of a standalone server (:class:`~kvshm.remote.glide_client.Shards`).
_SERVER: Final = "server"


class _Down:
    """The reply of a command whose shard was down (its breaker refused, or the batch
    failed): a miss, never an answer."""

    def __repr__(self) -> str:
        return "DOWN"


_DOWN: Final = _Down()
#: Words of a batch's error reply that mean its node was not reached (glide puts them in
#: the batch instead of raising: a stopped primary's commands come back ``Moved`` from
#: the node glide tried instead, or timed out).
_UNREACHABLE: Final = ("Moved", "MOVED", "CLUSTERDOWN", "TRYAGAIN", "timed out",
                       "onnection", "onnect ", "broken pipe", "Broken pipe")


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
        self._shards = Shards(spec, lambda: CircuitBreaker(
            breaker_threshold, breaker_backoff_s, breaker_max_backoff_s))
        #: the one server's breaker (standalone); a cluster has one per primary
        self.breaker = self._shards.breaker(_SERVER)
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
                            "run_id_checks", "run_id_errors", "run_id_changes",
                            "keys_shard_down", "values_shard_down")
        self._shard_clients: dict[str, Any] = {}  # cluster: primary -> its own client
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
        """False once closed, or while every shard's breaker refuses (a standalone
        server's one; in a cluster each primary's: one dead shard does not blind the
        others, its keys are misses)."""
        if self._closed:
            return False
        breakers = self._breakers()
        return not breakers or any(b.would_allow() for b in breakers)

    def _breakers(self) -> list[CircuitBreaker]:
        """The breakers in use: the server's, or those of the cluster's primaries in the
        slot map read last (a failed-over primary's breaker no longer counts)."""
        return list(self._named().values())

    def _named(self) -> dict[str, CircuitBreaker]:
        if not self.spec.cluster:
            return {_SERVER: self.breaker}
        now = self._shards.current()
        return {n: b for n, b in list(self._shards.breakers.items())
                if n != _SERVER and (now is None or n in now)}

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
            # reads go with the readiness round unless a value is written or deleted in
            # this drain (a read queued after it must see it: then all keep their order)
            early = not any(o[0] in ("set", "delete") for o in work)
            gets = [(tok, keys[0]) for kind, tok, keys in work if kind == "get" and early]
            others = [o for o in work if o[0] in ("set", "delete", "expire")
                      or (o[0] == "get" and not early)]
            if work:
                if client is None or (not self.spec.cluster
                                      and self.breaker.opens != gen_opens):
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
                if queries or publishes or gets:  # an empty batch is an error to glide
                    ok = self._round(client, queries, publishes, gets)
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
        for shard in list(self._shard_clients):
            self._drop_shard_client(shard)
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
                or any(b.state is not BreakerState.CLOSED for b in self._breakers()):
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
               publishes: list[tuple[str, bool]], gets: list[tuple[int, str]]) -> bool:
        """Small-value reads (hand-off manifests), readiness writes and queries, in
        that order: one batch per shard (the server; each cluster primary), each under
        its shard's breaker. The reads go first so that a readiness key asked with a
        manifest read is read after it (the prefill side writes the manifest after the
        readiness keys: a manifest found means its keys were there), and in the same
        batch: one round trip, and one wait for the GIL after it, where two rounds took
        two. A key of a shard that is down (its breaker refuses, or its batch failed)
        is absent to the queries, None to the reads, and its write is refused (goes to
        :meth:`refused`); the other shards' keys answer as usual. False if a write
        failed."""
        cmds: list[tuple[str, str, bool]] = [("get", k, False) for _, k in gets]
        cmds += [("set", k, keep) for k, keep in publishes]
        cmds += [("exists", k, False) for _, keys in queries for k in keys]
        replies = self._per_shard(client, cmds)
        read, replies = replies[:len(gets)], replies[len(gets):]
        self._got([tok for tok, _ in gets], read)
        pub, rest = replies[:len(publishes)], replies[len(publishes):]
        bad = [k for (k, _), r in zip(publishes, pub, strict=True) if r not in ("OK", b"OK")]
        self._n.add(published=len(publishes) - len(bad), publish_failed=len(bad),
                    keys_shard_down=sum(1 for r in rest if r is _DOWN))
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

    def _per_shard(self, client: Any, cmds: Sequence[tuple[str, Any, Any]]) -> list[Any]:
        """Run ``cmds`` (kind, key, arg) grouped by their key's shard, one pipelined
        round trip per shard, each under that shard's breaker; the replies in ``cmds``'
        order (:data:`_DOWN` for every command of a shard that is down). Kinds: ``set``
        (arg: keep), ``exists``, ``setv`` (arg: (value, ttl_s)), ``get``, ``expire`` (arg:
        seconds; the header key too: two replies folded into the first), ``delete``."""
        groups: dict[str, list[int]] = {}
        for i, (_, key, _) in enumerate(cmds):
            groups.setdefault(self._shards.shard_of(key), []).append(i)
        out: list[Any] = [_DOWN] * len(cmds)
        for shard, idx in groups.items():
            got = self._shard_batch(self._shard_client(shard, client), shard,
                                    [cmds[i] for i in idx])
            if got is not None:
                for i, r in zip(idx, got, strict=True):
                    out[i] = r
        return out

    def _shard_client(self, shard: str, client: Any) -> Any:
        """The client for ``shard``: the one server's (``client``); in a cluster a
        standalone client of that primary alone (``host:port``), made on first use and
        anew after its breaker opened. (One cluster client for every shard would let a
        stopped primary stall the others: glide's topology refresh after its timeout
        made the next batch to a live primary time out too, measured.) ``client`` where
        no slot map was read."""
        if not self.spec.cluster or shard not in (self._shards.current() or ()):
            return client
        found = self._shard_clients.get(shard)
        if found is None:
            host, _, port = shard.rpartition(":")
            found = make_client(dataclasses.replace(
                self.spec, url=f"valkey://{shard}", nodes=((host, int(port)),), cluster=False))
            self._shard_clients[shard] = found
            self._n.add(clients_created=1)
        return found

    def _drop_shard_client(self, shard: str) -> None:
        old = self._shard_clients.pop(shard, None)
        if old is not None:
            try:
                old.close()
            except Exception:  # noqa: BLE001 - a broken client: drop it
                pass

    def _shard_batch(self, client: Any, shard: str,
                     cmds: list[tuple[str, Any, Any]]) -> list[Any] | None:
        """One shard's commands in one non-atomic batch; None when its breaker refused
        or the batch failed (counted; the breaker told)."""
        g = self._glide
        breaker = self._shards.breaker(shard)
        if not breaker.allow():
            self._n.add(rejected=1)
            if breaker.state is BreakerState.OPEN:
                self._shards.refresh()  # maybe its slots moved (failover)
            return None
        batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
        for kind, key, arg in cmds:
            if kind == "set":
                batch.set(key, b"1", expiry=self._hold if arg else self._ttl)
            elif kind == "exists":
                batch.exists([key])
            elif kind == "setv":
                batch.set(key, arg[0], expiry=g.ExpirySet(g.ExpiryType.SEC, arg[1]))
            elif kind == "get":
                batch.get(key)
            elif kind == "expire":  # a block key's header key too (none: a no-op)
                batch.expire(key, arg)
                batch.expire(header_key(key), arg)
            else:
                batch.delete([key])
        try:
            result = list(client.exec(batch, raise_on_error=False) or [])
            self._n.add(round_trips=1)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self._shard_failed(shard, exc)
            return None
        down = next((r for r in result if self._unreachable(r)), None)
        if down is not None:  # glide may answer a node it cannot reach (or a slot that
            self._shard_failed(shard, down)  # moved) with errors in the batch
            return None
        breaker.success()
        replies, pos = [], 0
        for kind, _, _ in cmds:  # one reply per command, two per EXPIRE
            replies.append(result[pos] if pos < len(result) else None)
            pos += 2 if kind == "expire" else 1
        return replies

    def _shard_failed(self, shard: str, exc: BaseException) -> None:
        breaker = self._shards.breaker(shard)
        before = breaker.opens
        breaker.failure()
        self._n.add(errors=1, timeouts=int(isinstance(exc, self._glide.TimeoutError)))
        if breaker.opens != before and self.spec.cluster:  # a new client once it is back;
            self._drop_shard_client(shard)  # maybe its slots moved (failover): a new map
            self._shards.refresh(force=True)

    def _unreachable(self, reply: Any) -> bool:
        """Whether a batch's reply says its node could not be reached (a timeout, a
        closed connection, a redirection glide could not follow), not that the server
        refused the command (OOM, WRONGTYPE: an answer)."""
        g = self._glide
        if isinstance(reply, (g.TimeoutError, g.ConnectionError, g.ClosingError)):
            return True
        return isinstance(reply, g.GlideError) and any(m in str(reply) for m in _UNREACHABLE)

    def _refuse(self, keys: list[str]) -> bool:
        """Record readiness writes that failed; True when there were none."""
        if keys:
            with self._lock:
                self._refused.extend(keys)
        return not keys

    def _values_round(self, client: Any, ops: list[tuple[str, int, Sequence[Any]]]) -> None:
        """Small values (hand-off manifests), after the readiness round, in queue
        order: SET with their own TTL, DEL, EXPIRE, and GETs queued with a SET or DEL
        (else they went with the readiness round: :meth:`_round`); one round trip per
        shard.
        A GET of a shard that is down is None (a miss)."""
        cmds: list[tuple[str, Any, Any]] = []
        gets: list[tuple[int, int]] = []  # (token, its command's position)
        for kind, arg, items in ops:
            if kind == "set":
                cmds.append(("setv", items[0], (items[1], arg)))
            elif kind == "get":
                gets.append((arg, len(cmds)))
                cmds.append(("get", items[0], None))
            else:  # expire, delete: one command per key (keys may span shards)
                cmds += [(kind, k, arg) for k in items]
        replies = self._per_shard(client, cmds)
        self._n.add(values_set=sum(1 for c, r in zip(cmds, replies, strict=True)
                                   if c[0] == "setv" and r is not _DOWN))
        self._got([tok for tok, _ in gets], [replies[at] for _, at in gets])

    def _got(self, tokens: list[int], replies: list[Any]) -> None:
        """The small-value reads' answers: a value, or None (no such key; a shard that
        was down, counted)."""
        if tokens:
            self._n.add(values_got=sum(1 for r in replies if r is not _DOWN),
                        values_shard_down=sum(1 for r in replies if r is _DOWN))
            self._put_values([(tok, r if isinstance(r, bytes) else None)
                              for tok, r in zip(tokens, replies, strict=True)])

    def _put_values(self, items: list[tuple[int, bytes | None]]) -> None:
        with self._lock:
            self._values.extend(items)

    def statistics(self) -> dict[str, Any]:
        """Counters; ``breaker_state``: the worst shard's (open, half_open, closed),
        ``breaker_opens``/``_closes``: summed over the shards, ``breakers``: each
        shard's state (a cluster: by primary)."""
        stats: dict[str, Any] = self._n.snapshot()
        named = self._named()
        states = {n: b.state.value for n, b in named.items()}
        stats.update(breaker_state=("open" if "open" in states.values() else
                                    "half_open" if "half_open" in states.values() else
                                    "closed"),
                     breaker_opens=sum(b.opens for b in named.values()),
                     breaker_closes=sum(b.closes for b in named.values()),
                     breakers=states, slot_map_refreshes=self._shards.refreshes)
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=2 * (self.spec.request_timeout_ms
                                       + self.spec.connect_timeout_ms) / 1000 + 1)
