"""The readiness index on Valkey: the scheduler side of the remote tier.

:class:`ValkeyReadyIndex` implements :class:`~kvshm.remote.tier.ReadyIndex`: one
background thread with its own glide_sync client (made anew after the server's breaker
opened) takes everything queued since its last round -- readiness keys to publish, prefix
queries, small values (hand-off manifests) to set, get, delete or expire -- and sends it
in pipelined, non-atomic batches, one per shard (the server; in a cluster, each primary,
from the slot map of :class:`~kvshm.remote.glide_client.Shards`), the small-value writes
in a second such round. Nothing here blocks its caller: ``publish``, ``query``,
``put_value``, ``get_value``, ``delete_if_same`` and ``expire`` enqueue; ``answers`` and
``values`` pop what the thread finished.

The batches go through :class:`~kvshm.remote.shard_batches.ShardBatches` (one round
trip per shard, each shard under its own :class:`~kvshm.remote.breaker.CircuitBreaker`,
a cluster primary with a client of its own). A shard's failed batch feeds its breaker
and makes its keys misses (a query's prefix stops at the first key of a shard that is
down; its readiness writes are refused and put again later; its GETs answer None),
counted (``keys_shard_down``, ``values_shard_down``); while a
breaker is open nothing is sent to that shard and its slot map is read again (a replica
may have taken over). The other shards' keys answer and publish as usual: one dead
cluster primary does not blind the index. :meth:`ValkeyReadyIndex.healthy` is False
only while every shard's breaker refuses, so lookups do not even ask. (A shard that just
died costs each round its request deadline until its breaker opens: the shards' batches
run one after the other.)

Ordering: a drain's small-value reads (manifests), then its readiness writes and
queries go in one batch per shard, in that order (a readiness key asked with a manifest
read is read after it); its small-value writes follow in a second round, only after the
readiness writes succeeded (a manifest is written last, never after one of its own
readiness keys -- ``put_value(after=...)`` -- was refused; another key's refusal does not
hold it back). A drain that writes or deletes a value keeps every small-value
command in that second round, in queue order (a read queued after a write sees it).

A server that lost its data is noticed (:class:`RunIdWatch`): while every breaker is
closed, the thread reads the server's ``run_id`` (``INFO server``; a cluster's, every
primary's) and checks its own *sentinel* key at most every :data:`RUN_ID_EVERY_S`,
after a round (not before it: its two round trips would delay that round's answers,
a hand-off's included, on an engine whose loop starves the thread of the GIL) or, idle
once it has a client, on its own (an engine whose puts are all skipped as already
there sends nothing else). A new run_id (a restart, a failover) or a
sentinel gone (``FLUSHALL`` / ``FLUSHDB`` on a running server, which keeps its run_id)
bumps :meth:`ValkeyReadyIndex.restarts`, and the engine forgets what it believes it
put, so write-through refills the tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from enum import Enum
from typing import Any, Final, NamedTuple

from kvshm.ratelog import RateLimitedLog
from kvshm.remote.breaker import BreakerState, CircuitBreaker, worst
from kvshm.remote.glide_client import Counters, Shards, glide_module, make_client
from kvshm.remote.resp import info_field
from kvshm.remote.shard_batches import DOWN, SERVER, Command, Op, ShardBatches
from kvshm.remote.tier import RemoteSpec

__all__ = ["RUN_ID_EVERY_S", "RunIdWatch", "ValkeyReadyIndex", "run_ids"]

log = logging.getLogger(__name__)
rlog = RateLimitedLog(log)

#: The server's run_id is read at most this often (seconds), before a round.
RUN_ID_EVERY_S: Final = 1.0
#: The prefix of an index's sentinel key (outside ``kvshm:``: no block, readiness key
#: or manifest, and no scan of them, ever meets one).
SENTINEL_PREFIX: Final = "kvshm-sentinel"
#: The TTL of an index's sentinel key (seconds; written again at every check, so it
#: only goes by a flush, or by its engine's end: it is not left for ever). Touched
#: every check, it is the last key an LRU policy would evict.
SENTINEL_TTL_S: Final = 600


class Ask(Enum):
    """What a caller queued for the thread (:class:`_Queued`)."""

    QUERY = "query"  # token, readiness keys: how many of them, from the first, exist
    PUBLISH = "publish"  # readiness keys, the tier's TTL
    KEEP = "keep"  # readiness keys, the hold TTL (a hand-off's)
    EXPIRE = "expire"  # block keys, ``arg`` seconds
    SET = "set"  # [key, value], ``arg``: its TTL
    GET = "get"  # token, [key]
    DELETE_IF_SAME = "delete_if_same"  # [key, the value read]


class _Queued(NamedTuple):
    """One caller's request, queued for the thread (drained all at once, in order)."""

    ask: Ask
    arg: int  # a QUERY's or GET's token; EXPIRE's or SET's seconds; else 0
    items: Sequence[Any]


def _info_fields(reply: Any, name: str) -> Iterator[str | None]:
    """Field ``name`` of each server's part of an ``INFO`` reply (one server's bytes, or
    a cluster's node -> bytes); None where a part lacks it."""
    parts = reply.values() if isinstance(reply, dict) else [reply]
    for p in parts:
        yield info_field(p if isinstance(p, bytes) else str(p).encode(), name)


def evicted_keys(reply: Any) -> int | None:
    """The servers' ``evicted_keys`` summed over an ``INFO`` reply; None where no part
    says (an old server, a refusal)."""
    total, seen = 0, False
    for field in _info_fields(reply, "evicted_keys"):
        if field is not None and field.isdigit():
            total, seen = total + int(field), True
    return total if seen else None


def run_ids(reply: Any) -> frozenset[str]:
    """The ``run_id`` s of an ``INFO server`` reply (empty: none found)."""
    return frozenset(r for r in _info_fields(reply, "run_id") if r)


class RunIdWatch:
    """Notices a server that lost its data: reads the server's ``run_id`` (a cluster's,
    every primary's) at most every ``every_s`` while ``calm()`` (every breaker closed: a
    failure only counts, the rounds feed the breakers); a set other than the last one
    seen bumps :attr:`restarts` (one writer, the index's thread; an int read is
    atomic). So does the loss of its sentinel: a key of this watch's own (a random
    name: engines sharing a server never see each other's), asked for then written
    again with :data:`SENTINEL_TTL_S` at each check -- a ``FLUSHALL`` keeps the
    run_id and took every block with it unnoticed (a review; on a cluster the
    sentinel lives on one primary: a flush of the others alone goes unnoticed)."""

    def __init__(self, spec: RemoteSpec, glide: Any, counters: Counters, every_s: float,
                 calm: Callable[[], bool]) -> None:
        self.spec = spec
        self._glide = glide
        self._n = counters
        self.every_s = every_s
        self._calm = calm
        self._ids: frozenset[str] = frozenset()  # the last seen; empty: none yet
        self._at = -float("inf")
        self.restarts = 0
        self._sentinel = f"{SENTINEL_PREFIX}:{uuid.uuid4().hex}"
        self._sentinel_written = False
        self._evicted: int | None = None  # the servers' evicted_keys at the last read

    def check(self, client: Any) -> None:
        """Read the run_id(s) through ``client`` if due (class docstring)."""
        now = time.monotonic()
        if now - self._at < self.every_s or not self._calm():
            return
        self._at = now
        g = self._glide
        sections = [g.InfoSection.SERVER, g.InfoSection.STATS]
        try:
            if self.spec.cluster:
                reply = client.info(sections, route=g.AllPrimaries())
            else:
                reply = client.info(sections)
        except Exception as exc:  # noqa: BLE001 - counted; the next check reads it again
            self._n.add(run_id_errors=1)
            if not isinstance(exc, (g.TimeoutError, g.ConnectionError, g.ClosingError)):
                self._blind(f"{type(exc).__name__}: {exc}")  # an answer: a refusal
            return
        self._evictions(evicted_keys(reply))
        ids = run_ids(reply)
        self._n.add(run_id_checks=1)
        if not ids:
            self._n.add(run_id_errors=1)
            self._blind("the reply has no run_id")
            return
        changed = bool(self._ids) and ids != self._ids
        self._ids = ids
        if changed:
            self._n.add(run_id_changes=1)
        if self._sentinel_gone(client) and not changed:
            self._n.add(flushes_seen=1)
        elif not changed:
            return
        self.restarts += 1

    def _sentinel_gone(self, client: Any) -> bool:
        """Whether the sentinel this watch wrote is gone: one ``SET ... GET`` writes it
        again and answers what it held (nothing: gone)."""
        g = self._glide
        try:
            gone = client.set(self._sentinel, b"1", return_old_value=True,
                              expiry=g.ExpirySet(g.ExpiryType.SEC, SENTINEL_TTL_S)) is None
        except Exception:  # noqa: BLE001 - counted; the next check tries again
            self._n.add(run_id_errors=1)
            return False
        written, self._sentinel_written = self._sentinel_written, True
        return written and gone

    def _evictions(self, total: int | None) -> None:
        """The server evicted keys since the last read (``maxmemory`` reached): counted
        (``server_evictions``) and said once a minute. Under ``volatile-lru`` a full
        server drops a prefix's first blocks -- written earliest -- before its last, and
        a prefix without its head serves nothing (a probe: 204,000 keys evicted, no hit
        left, not a line said)."""
        if total is None:
            return
        last, self._evicted = self._evicted, total
        if last is None or total <= last:  # the first read, or a restart's new count
            return
        self._n.add(server_evictions=total - last)
        rlog.warning("evicted", "kvshm remote tier (index): the server evicted %d keys "
                     "since the last check (maxmemory reached: prefixes lose their first "
                     "blocks first and then serve nothing); give it more memory, or a "
                     "shorter ttl_s (counted: server_evictions)", total - last)

    def forget(self, client: Any) -> None:
        """At close: delete the sentinel, if written (each engine's start would else
        leave one on the server for :data:`SENTINEL_TTL_S`: a probe's 20 restarts left
        20). Best effort: a server that does not answer keeps it until its TTL."""
        if not self._sentinel_written:
            return
        try:
            client.delete([self._sentinel])
            self._sentinel_written = False
        except Exception:  # noqa: BLE001 - the TTL removes it
            self._n.add(run_id_errors=1)


    def _blind(self, why: str) -> None:
        """The server answered ``INFO server`` without a run_id, or refused it (an ACL
        without ``+info``): a restart or flush goes unnoticed, and the blocks the engine
        believes it put stay skipped for up to ``ttl_s / 2``. One WARNING a minute."""
        rlog.warning("run_id", "kvshm remote tier (index): cannot read the server's "
                     "run_id (%s); a restart or flush of the server will not be noticed "
                     "(counted: run_id_errors)", " ".join(why.split())[:300])


class ValkeyReadyIndex:
    """The scheduler side on Valkey (see the module). Never blocks its caller: ``publish``
    and ``query`` enqueue, ``answers`` pops what the background thread finished."""

    def __init__(self, spec: RemoteSpec, *, breaker_threshold: int = 3,
                 breaker_backoff_s: float = 0.25, breaker_max_backoff_s: float = 5.0,
                 run_id_every_s: float = RUN_ID_EVERY_S) -> None:
        self.spec = spec
        glide = glide_module()
        self._shards = Shards(spec, lambda: CircuitBreaker(
            breaker_threshold, breaker_backoff_s, breaker_max_backoff_s))
        #: the one server's breaker (standalone); a cluster has one per primary
        self.breaker = self._shards.breaker(SERVER)
        self._q: queue.SimpleQueue[_Queued | None] = queue.SimpleQueue()
        self._answers: list[tuple[int, int]] = []
        self._values: list[tuple[int, bytes | None]] = []
        self._refused: list[str] = []
        self._lock = threading.Lock()
        self._n = Counters("queries", "answered", "answered_zero", "keys_queried",
                            "keys_present", "published", "publish_failed", "errors",
                            "timeouts", "rejected", "round_trips", "clients_created",
                            "values_set", "values_got", "values_dropped", "values_refused",
                            "run_id_checks", "run_id_errors", "run_id_changes", "flushes_seen",
                            "server_evictions",
                            "keys_shard_down", "values_shard_down", "drains_failed")
        self._batches = ShardBatches(spec, glide, self._shards, self._n)
        self._run_id = RunIdWatch(spec, glide, self._n, run_id_every_s, self._calm)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvshm-remote-index",
                                        daemon=True)
        self._thread.start()

    def publish(self, keys: Sequence[str], *, keep: bool = False) -> None:
        if keys and not self._closed:
            self._q.put(_Queued(Ask.KEEP if keep else Ask.PUBLISH, 0, list(keys)))

    def expire(self, keys: Sequence[str]) -> None:
        if keys and not self._closed and self.spec.ttl_s is not None:
            self._q.put(_Queued(Ask.EXPIRE, self.spec.ttl_s, list(keys)))

    def query(self, token: int, keys: Sequence[str]) -> None:
        self._n.add(queries=1)
        if self._closed or not keys:
            self._answer([(token, 0)])
            return
        self._q.put(_Queued(Ask.QUERY, token, list(keys)))

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

    def _calm(self) -> bool:
        """Every breaker in use is closed."""
        return all(b.state is BreakerState.CLOSED for b in self._breakers())

    def _named(self) -> dict[str, CircuitBreaker]:
        if not self.spec.cluster:
            return {SERVER: self.breaker}
        now = self._shards.current()
        return {n: b for n, b in self._shards.breakers.live().items()
                if n != SERVER and (now is None or n in now)}

    def put_value(self, key: str, value: bytes, ttl_s: int, *,
                  after: Sequence[str] = ()) -> None:
        if not self._closed:
            self._q.put(_Queued(Ask.SET, ttl_s, [key, value, after]))

    def get_value(self, token: int, key: str) -> None:
        if self._closed:
            with self._lock:
                self._values.append((token, None))
            return
        self._q.put(_Queued(Ask.GET, token, [key]))

    def delete_if_same(self, key: str, value: bytes) -> None:
        if not self._closed:
            self._q.put(_Queued(Ask.DELETE_IF_SAME, 0, [key, value]))

    def refused(self) -> list[str]:
        with self._lock:
            out, self._refused = self._refused, []
        return out

    def restarts(self) -> int:
        return self._run_id.restarts

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
                                   else max(self._run_id.every_s, 0.05))]
            except queue.Empty:
                ops = []
            while True:  # drain: one round trip for everything queued meanwhile
                try:
                    ops.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = None in ops
            work = [o for o in ops if o is not None]
            if work:
                try:
                    if client is None or (not self.spec.cluster
                                          and self.breaker.opens != gen_opens):
                        if client is not None:
                            _close(client)
                        client = make_client(self.spec)
                        gen_opens = self.breaker.opens
                        self._n.add(clients_created=1)
                    self._drain(client, work)
                    self._run_id.check(client)  # after: never in a lookup's wait
                except Exception as exc:  # noqa: BLE001 - the thread must outlive any drain
                    client = self._failed_drain(client, work, exc)
            elif client is not None and not stop:
                self._run_id.check(client)
            if stop:
                break
        self._batches.close()
        if client is not None:
            self._run_id.forget(client)
            _close(client)

    def _failed_drain(self, client: Any, work: list[_Queued], exc: Exception) -> Any:
        """A drain raised where nothing should (a client or library fault): its queries
        answer 0 and its reads None (no caller waits for an answer that never comes --
        the thread lives on, where its death left every later lookup asking again until
        its deadline), its writes are dropped (counted; write-through puts them again),
        and the client is made anew. (A token this drain answered before the fault is
        answered again: its consumer took the first and counts the second stale.)
        Returns the client to use next: None."""
        queries = [(q.arg, 0) for q in work if q.ask is Ask.QUERY]
        reads: list[tuple[int, bytes | None]] = [(q.arg, None) for q in work
                                                 if q.ask is Ask.GET]
        self._n.add(errors=1, drains_failed=1,
                    values_dropped=sum(1 for q in work if q.ask is Ask.SET))
        self._answer(queries)
        self._put_values(reads)
        rlog.error("drain_failed", "kvshm: remote index round failed (%s: %s); its "
                   "lookups miss and a new client is made", type(exc).__name__, exc)
        if client is not None:
            _close(client)
        return None

    def _drain(self, client: Any, work: list[_Queued]) -> None:
        """Everything queued since the last drain: the readiness round, then the
        small-value writes (module docstring: ordering)."""
        queries = [(q.arg, q.items) for q in work if q.ask is Ask.QUERY]
        publishes = [(k, q.ask is Ask.KEEP) for q in work
                     if q.ask in (Ask.PUBLISH, Ask.KEEP) for k in q.items]
        # reads go with the readiness round unless a value is written or deleted in
        # this drain (a read queued after it must see it: then all keep their order)
        early = not any(q.ask in (Ask.SET, Ask.DELETE_IF_SAME) for q in work)
        gets = [(q.arg, q.items[0]) for q in work if q.ask is Ask.GET and early]
        others = [q for q in work if q.ask in (Ask.SET, Ask.DELETE_IF_SAME, Ask.EXPIRE)
                  or (q.ask is Ask.GET and not early)]
        bad: frozenset[str] = frozenset()
        if queries or publishes or gets:  # an empty batch is an error to glide
            bad = self._round(client, queries, publishes, gets)
        if bad:  # a manifest goes last: not after its own readiness keys were refused
            kept = [q for q in others if q.ask is not Ask.SET or bad.isdisjoint(q.items[2])]
            self._n.add(values_dropped=len(others) - len(kept))
            others = kept
        if others:
            self._values_round(client, others)

    def _round(self, client: Any, queries: list[tuple[int, Sequence[str]]],
               publishes: list[tuple[str, bool]], gets: list[tuple[int, str]]
               ) -> frozenset[str]:
        """Small-value reads (hand-off manifests), readiness writes and queries, in
        that order: one batch per shard (the server; each cluster primary), each under
        its shard's breaker. The reads go first so that a readiness key asked with a
        manifest read is read after it (the prefill side writes the manifest after the
        readiness keys: a manifest found means its keys were there), and in the same
        batch: one round trip, and one wait for the GIL after it, where two rounds took
        two. A key of a shard that is down (its breaker refuses, or its batch failed)
        is absent to the queries, None to the reads, and its write is refused (goes to
        :meth:`refused`); the other shards' keys answer as usual. Returns the readiness
        keys whose write failed."""
        cmds = [Command(Op.GET, k) for _, k in gets]
        cmds += [Command(Op.MARK, k, keep) for k, keep in publishes]
        cmds += [Command(Op.EXISTS, k) for _, keys in queries for k in keys]
        replies = self._batches.run(client, cmds)
        read, replies = replies[:len(gets)], replies[len(gets):]
        self._got([tok for tok, _ in gets], read)
        pub, rest = replies[:len(publishes)], replies[len(publishes):]
        bad = [k for (k, _), r in zip(publishes, pub, strict=True) if r not in ("OK", b"OK")]
        self._n.add(published=len(publishes) - len(bad), publish_failed=len(bad),
                    keys_shard_down=sum(1 for r in rest if r is DOWN))
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
        if bad:
            with self._lock:
                self._refused.extend(bad)
        return frozenset(bad)

    def _values_round(self, client: Any, ops: list[_Queued]) -> None:
        """Small values (hand-off manifests), after the readiness round, in queue
        order: SET with their own TTL, compare-and-DEL, EXPIRE (never shortening a TTL),
        and GETs queued with a SET or a DEL
        (else they went with the readiness round: :meth:`_round`); one round trip per
        shard. A GET of a shard that is down is None (a miss)."""
        cmds: list[Command] = []
        gets: list[tuple[int, int]] = []  # (token, its command's position)
        for q in ops:
            if q.ask is Ask.SET:
                cmds.append(Command(Op.SET_VALUE, q.items[0], (q.items[1], q.arg)))
            elif q.ask is Ask.GET:
                gets.append((q.arg, len(cmds)))
                cmds.append(Command(Op.GET, q.items[0]))
            elif q.ask is Ask.DELETE_IF_SAME:
                cmds.append(Command(Op.DELETE_IF_SAME, q.items[0], q.items[1]))
            else:  # expire: one command per key (keys may span shards)
                cmds += [Command(Op.EXPIRE, k, q.arg) for k in q.items]
        replies = self._batches.run(client, cmds)
        # a SET stored only on OK; an error reply (OOM, no permission) is a refusal
        self._n.add(values_set=sum(1 for c, r in zip(cmds, replies, strict=True)
                                   if c.op is Op.SET_VALUE and r in ("OK", b"OK")),
                    values_refused=sum(1 for c, r in zip(cmds, replies, strict=True)
                                       if c.op is not Op.GET and isinstance(r, Exception)))
        self._got([tok for tok, _ in gets], [replies[at] for _, at in gets])

    def _got(self, tokens: list[int], replies: list[Any]) -> None:
        """The small-value reads' answers: a value, or None (no such key; a shard that
        was down, counted)."""
        if tokens:
            self._n.add(values_got=sum(1 for r in replies if r is not DOWN),
                        values_shard_down=sum(1 for r in replies if r is DOWN))
            self._put_values([(tok, r if isinstance(r, bytes) else None)
                              for tok, r in zip(tokens, replies, strict=True)])

    def _put_values(self, items: list[tuple[int, bytes | None]]) -> None:
        with self._lock:
            self._values.extend(items)

    def statistics(self) -> dict[str, Any]:
        """Counters; ``breaker_state``: the worst shard's (open, half_open, closed),
        ``breaker_opens``/``_closes``: summed over the shards, those a failover
        retired too (they never go back), ``breakers``: each
        shard's state (a cluster: by primary)."""
        stats: dict[str, Any] = self._n.snapshot()
        named = self._named()
        states = {n: b.state for n, b in named.items()}
        opens, closes = (self._shards.breakers.totals() if self.spec.cluster
                         else (self.breaker.opens, self.breaker.closes))
        stats.update(breaker_state=worst(states.values()).value,
                     breaker_opens=opens, breaker_closes=closes,
                     breakers={n: s.value for n, s in states.items()},
                     slot_map_refreshes=self._shards.refreshes)
        return stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._q.put(None)
        self._thread.join(timeout=2 * (self.spec.request_timeout_ms
                                       + self.spec.connect_timeout_ms) / 1000 + 1)


def _close(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a broken or closing client: nothing to do
        pass
