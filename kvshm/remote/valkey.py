"""The Valkey backend of the remote tier (glide_sync), standalone and cluster.

**Values.** One block of one rank is two keys in the same hash slot: the payload under
its :func:`~kvshm.remote.tier.block_key` and its :class:`~kvshm.remote.tier.BlockHeader`
under :func:`header_key` (``{<key>}h``: the braces make the header hash to the payload's
slot, so a cluster keeps them on one node).

**Batches.** A call is cut into parts (:meth:`ValkeyBlockStore._parts`) of at most
:data:`PART_BYTES` (a put) or :data:`GET_PART_BYTES` (a get) of payload each. A part is
one request, one round trip: a put is one ``MSETEX 2n {k0}h <header> k0 <row> ... EX
ttl`` -- every block's header and payload in one command, atomic, each row zero-copy
from the caller's view -- or, on a server without MSETEX (older than Valkey 9.1) and
always in a cluster (MSETEX is not slot-checked there: see ``ValkeyBlockStore``), one
non-atomic pipeline of ``SET key <row> EX ttl`` and ``SET {key}h <header> EX ttl`` per
block; a get is one ``MGET {k0}h k0 {k1}h k1 ...`` that lands each header in a small
buffer and each payload directly in the caller's view (glide's ``buffers=``: no
intermediate bytes), except that a block of :data:`GET_ALONE_BYTES` or more is read
alone (one ``MGET {k}h k`` a block: measured faster for large blocks, see the
constant). The parts of a call run in parallel over the threads; a call of one part
runs on the caller's thread. Every block is then judged on its own: a value longer than
its view fails glide's whole ``MGET``, so that part is read again one block per request
(``split_retries``) to find which; a missing block is a MISS and a bad one BAD, the
others of the part HIT.

In a cluster a part is one hash slot's blocks (a block's two keys share a slot; a
batch's blocks rarely do), so a cluster moves one block a round trip, the requests in
parallel over the threads. Measured: letting glide route one multi-slot ``MGET`` per
primary works on a healthy cluster, but after a primary was SIGKILLed the parts of the
*live* primaries timed out too, round after round, for more than 9 s (past the
replica's takeover), where single-slot requests keep the other shards' blocks HIT
throughout (``tests/remote/test_valkey_cluster.py``).

A value longer than the view, shorter than the header says, or a header that does not
match the expected one is BAD (counted, never loaded); a missing payload or header
(never stored, expired, one of the two evicted) is a MISS. The payload's checksum is
CRC32C (hardware, the ``crc32c`` package) or zlib's CRC32 where that is not installed;
the header names which, and a reader accepts only its own (a header naming another,
``none`` included, is BAD and counted ``checksum_refused``: the engines sharing a
server need the same one, the ``remote`` extra installs ``crc32c``).

**Threads and clients.** A call's parts run on ``spec.threads`` threads
(:class:`~kvshm.remote.fan_out.FanOut`: the caller's own takes the first share, a pool
the others; the parts of a shard whose breaker is not closed run alone, in order,
beside the others), each with its own lazily connected glide_sync client
(:class:`~kvshm.remote.thread_clients.ThreadClients`; a few requests of at most
``PART_BYTES`` in flight). A thread holds the GIL only
to build a request and to judge its blocks: the wait is in glide's native threads, and
the payload's checksum keeps the GIL under :data:`~kvshm.remote.tier.GIL_FREE_BYTES` (a
release would cost a re-acquisition, up to the switch interval in a process whose other
threads run Python, e.g. vLLM stepping). Counters are added once a part. Every request has
``request_timeout_ms``; connections ``connect_timeout_ms`` and a bounded reconnect
backoff.

**Failures.** Each shard (the one server; in a cluster, each primary, found from
``CLUSTER SLOTS``) has a :class:`~kvshm.remote.breaker.CircuitBreaker`: consecutive
timeouts or connection errors open it, and while it is open the keys of that shard are
ERROR at once, without a request; a probe after the backoff closes it when the server
answers. When a standalone server's breaker opens the thread clients are renewed
(connected anew once it is back); when a cluster primary's opens, the slot map is read
again, so the slots of a failed-over primary go to the replica that took them over
(the clients stay: glide's cluster client follows the failover, and new clients would
cost the healthy primaries a reconnection). No call raises; every outcome is counted.

The scheduler side, ``ValkeyReadyIndex``, is :mod:`kvshm.remote.valkey_index`; the
client factory, slot map and counters both use are :mod:`kvshm.remote.glide_client`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final

from kvshm.errors import ConfigError
from kvshm.ratelog import RateLimitedLog
from kvshm.remote.breaker import BreakerState, CircuitBreaker, worst
from kvshm.remote.fan_out import FanOut
from kvshm.remote.glide_client import (
    Counters,
    Shards,
    expiry_of,
    glide_module,
    header_key,
    key_slot,
    report_failure,
    too_long,
)
from kvshm.remote.thread_clients import ThreadClients
from kvshm.remote.tier import (
    HEADER_BYTES,
    BlockHeader,
    GetOutcome,
    RemoteSpec,
    header_checksum_id,
)

__all__ = ["GET_ALONE_BYTES", "GET_PART_BYTES", "PART_BYTES", "ValkeyBlockStore"]

#: Most payload bytes one put request (a part of a call) carries: small blocks share a
#: round trip, large ones spread over the threads. Measured as ``GET_PART_BYTES`` was
#: (``tools.bench_remote --put-part-bytes``, 2026-11-29, load 2 - 7, one run of each in
#: turn): tier/raw puts at 128 KiB blocks 0.78 - 0.86 (median 0.82) with 2 MiB parts
#: against 0.74 - 0.81 (0.78) with 4 MiB, at 512 KiB 0.76 - 0.86 (0.81) against 0.71 -
#: 0.82 (0.73); 2 MiB ahead in every round but one at 128 KiB (1 MiB: 0.74 - 0.79 and
#: 0.71 - 0.76).
PART_BYTES: Final = 2 << 20
#: Most payload bytes one GET request carries (a knob of its own for
#: ``tools.bench_remote --get-part-bytes``). Measured (2 ranks x 4 threads, 2-core VM,
#: one run of each size in turn, three rounds, 2026-11-29, load 0.7 - 7): tier/raw at
#: 128 KiB blocks 0.824 - 0.836 with 2 MiB parts, 0.766 - 0.817 with 1 MiB, 0.742 -
#: 0.759 with 4 MiB; at 512 KiB 0.869 - 0.902, 0.821 - 0.825 and 0.771 - 0.801: 2 MiB
#: won every round at both sizes. (At load 8 - 13 on 2026-11-27, 1 MiB parts had lost
#: to 4 MiB, 0.70 - 0.76 against 0.78; 2 MiB was not tried then.)
GET_PART_BYTES: Final = 2 << 20
#: Blocks of at least this many payload bytes are read one a request (a GET part of one
#: block; puts still share parts). Measured (``tools.bench_remote``, 2 ranks x 4
#: threads): at 2 MiB one block a request beat the 4 MiB parts (2 blocks) in 9 of 9
#: runs (by 2-56 %); at 1 MiB neither won twice (parts ahead by 4-9 % in 3 runs, behind
#: by 2-6 % in 3 others), at 512 KiB they were even: there the parts stay (fewer
#: requests and wake-ups). See docs/benchmarks.md's remote section.
GET_ALONE_BYTES: Final = 2 << 20

log = logging.getLogger(__name__)
#: Warnings a caller (or a bug) can repeat per block: one line per kind per interval.
rlog = RateLimitedLog(log)


class ValkeyBlockStore:
    """The worker side on Valkey (see the module). ``breaker_*``: consecutive failures
    that open a shard's breaker, and its first and longest backoff. ``part_bytes``: most
    payload bytes a request (:data:`PART_BYTES`; 0: one block a request, the path before
    batching, which ``tools.bench_remote`` measures against); ``get_part_bytes``: the
    same for a GET (:data:`GET_PART_BYTES`; 0: one block a request). ``get_alone_bytes``:
    a block of at least this many bytes is read one a request (:data:`GET_ALONE_BYTES`;
    0: every GET one block a request)."""

    def __init__(self, spec: RemoteSpec, *, breaker_threshold: int = 3,
                 breaker_backoff_s: float = 0.25, breaker_max_backoff_s: float = 5.0,
                 part_bytes: int = PART_BYTES, get_part_bytes: int = GET_PART_BYTES,
                 get_alone_bytes: int = GET_ALONE_BYTES) -> None:
        for name, value in (("part_bytes", part_bytes), ("get_part_bytes", get_part_bytes),
                            ("get_alone_bytes", get_alone_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")
        self.spec = spec
        self.part_bytes = part_bytes
        self.get_part_bytes = get_part_bytes
        self.get_alone_bytes = get_alone_bytes
        self._glide = glide_module()
        self._ttl = expiry_of(self._glide, spec)
        self._hold = self._glide.ExpirySet(self._glide.ExpiryType.SEC, spec.hold_ttl_s)
        # MSETEX's expiry arguments (none: no TTL)
        self._ttl_args = ["EX", str(spec.ttl_s)] if spec.ttl_s is not None else []
        self._hold_args = ["EX", str(spec.hold_ttl_s)]
        # MSETEX until a server says it has none; never in a cluster: Valkey 9.1's
        # MSETEX does not check that the node owns its keys' slot (SET answers MOVED),
        # and glide sends a batch meant for a dead primary to another node, which then
        # stores keys nobody can read -- and answers OK
        self._msetex = not spec.cluster
        self._shards = Shards(spec, lambda: CircuitBreaker(
            breaker_threshold, breaker_backoff_s, breaker_max_backoff_s))
        self._closed = False
        self._n = Counters("puts", "put_ok", "put_failed", "put_refused", "gets", "hits",
                            "misses", "bad", "errors", "timeouts", "rejected",
                            "bytes_put", "bytes_got", "invalid_calls", "clients_created",
                            "checksum_refused", "split_retries", "msetex_unsupported")
        # the callbacks hold the counters, not the store (no cycle: an unclosed store
        # is freed, its pool and clients with it, without the collector)
        n = self._n
        self._clients = ThreadClients(spec, lambda: n.add(clients_created=1))
        self._fan = FanOut(spec.threads, crashed=lambda: n.add(errors=1))

    # ------------------------------------------------------------------ failures

    def _failed(self, breaker: CircuitBreaker, exc: BaseException, blocks: int) -> None:
        """A request of ``blocks`` blocks failed (counted per block; one breaker
        failure per request)."""
        before = breaker.opens
        breaker.failure()
        self._n.add(errors=blocks,
                    timeouts=blocks * int(isinstance(exc, self._glide.TimeoutError)))
        report_failure(self.spec, "store", self._shards.name_of(breaker), exc)
        if breaker.opens != before:
            if self.spec.cluster:  # a fresh slot map; glide's cluster client follows the
                self._shards.refresh(force=True)  # failover itself, the others' too
            else:  # the one server: new clients (connected anew once it is back)
                self._clients.renew()

    @staticmethod
    def _refused(reply: object) -> None:
        """The server answered a put with an error (``OOM`` under ``noeviction``, a
        read-only replica, ...): one WARNING per interval with its text."""
        text = " ".join(str(reply).split())[:300]
        rlog.warning("put_refused", "kvshm remote tier: the server refused a put: %s "
                     "(counted: put_refused)", text)

    # ------------------------------------------------------------------ parts

    def _parts(self, keys: Sequence[str], views: Sequence[memoryview],
               idx: Sequence[int], limit: int, alone: int | None = None,
               ) -> list[tuple[CircuitBreaker, list[int]]]:
        """``idx`` in requests: the one server's blocks (a cluster: each slot's, so in
        practice one block a request) cut into runs of at most ``limit`` bytes of
        payload (at least one block), in the caller's order within a part; a block of
        ``alone`` bytes or more (None: no such limit) is a part of its own. One part =
        one request = one round trip; the parts of a call run in parallel over the
        threads."""
        groups: dict[tuple[str, int], list[int]] = {}
        for i in idx:  # a cluster: one slot a part (see the module)
            slot = key_slot(keys[i]) if self.spec.cluster else 0
            groups.setdefault((self._shards.shard_of(keys[i]), slot), []).append(i)
        parts: list[tuple[CircuitBreaker, list[int]]] = []
        for (shard, _), members in groups.items():
            breaker = self._shards.breaker(shard)
            run: list[int] = []
            size = 0
            for i in members:
                big = alone is not None and views[i].nbytes >= alone
                if run and (big or size + views[i].nbytes > limit):
                    parts.append((breaker, run))
                    run, size = [], 0
                run.append(i)
                size += views[i].nbytes
                if big:
                    parts.append((breaker, run))
                    run, size = [], 0
            if run:
                parts.append((breaker, run))
        return parts

    def _allow(self, breaker: CircuitBreaker, blocks: int) -> bool:
        """Whether ``breaker`` lets a request through now (else counted per block)."""
        if breaker.allow():
            return True
        if breaker.state is BreakerState.OPEN:  # maybe the slots moved (failover)
            self._shards.refresh()
        self._n.add(rejected=blocks, errors=blocks)
        return False

    def _run_parts(self, parts: list[tuple[CircuitBreaker, list[int]]],
                   one: Callable[[CircuitBreaker, list[int]], list[Any]],
                   out: list[Any]) -> None:
        """``one(breaker, part)`` for every part, over the threads; its i-th result
        lands in ``out[part[i]]`` (a part that raised keeps ``out``'s values)."""
        def run(k: int) -> list[Any]:
            return one(*parts[k])
        def probe(k: int) -> bool:  # its shard's breaker is not closed: alone, in order
            return parts[k][0].state is not BreakerState.CLOSED
        results = self._fan.run(len(parts), run, None, probe)
        for (_, part), got in zip(parts, results, strict=True):
            if got is not None:
                for i, o in zip(part, got, strict=True):
                    out[i] = o

    # ------------------------------------------------------------------ put

    def put_many(self, keys: Sequence[str], views: Sequence[memoryview],
                 header: Sequence[BlockHeader], *, keep: bool = False) -> list[bool]:
        """Each part's blocks (see :meth:`_parts`) in one request, one round trip: one
        ``MSETEX`` of every block's header and payload (the pipeline of ``SET``s on a
        server without it, see :meth:`_put_part`); True = both stored."""
        n = len(keys)
        if self._closed or len(views) != n or len(header) != n:
            self._n.add(invalid_calls=1, put_failed=n)
            return [False] * n
        self._n.add(puts=n)
        out = [False] * n

        def put(breaker: CircuitBreaker, part: list[int]) -> list[bool]:
            return self._put_part(breaker, part, keys, views, header, keep)
        self._run_parts(self._parts(keys, views, range(n), self.part_bytes), put, out)
        self._n.add(put_failed=out.count(False))
        return out

    def _put_part(self, breaker: CircuitBreaker, part: list[int], keys: Sequence[str],
                  views: Sequence[memoryview], header: Sequence[BlockHeader],
                  keep: bool) -> list[bool]:
        """One part: the headers (checksums) on this thread, then one ``MSETEX`` --
        while the server knows it (Valkey 9.1+) -- else one pipeline of two ``SET``s a
        block. A block whose view does not match its header is refused alone."""
        raws: dict[int, bytes] = {}
        for i in part:  # the checksums, on this part's thread
            try:
                raws[i] = header[i].pack(views[i])  # a caller's error is no outage
            except (ConfigError, TypeError, ValueError, BufferError):  # (not contiguous)
                self._n.add(invalid_calls=1)
                rlog.warning("put_view", "remote put %s: the view does not match its "
                             "header", keys[i])
        if len(raws) < len(part):
            good = [i for i in part if i in raws]
            done = dict(zip(good, self._put_part(breaker, good, keys, views, header, keep)
                            if good else [], strict=True))
            return [done.get(i, False) for i in part]
        if not self._allow(breaker, len(part)):
            return [False] * len(part)
        if self._msetex:
            out = self._put_msetex(breaker, part, keys, views, raws, keep)
            if out is not None:
                return out
        return self._put_pipeline(breaker, part, keys, views, raws, keep)

    def _put_msetex(self, breaker: CircuitBreaker, part: list[int], keys: Sequence[str],
                    views: Sequence[memoryview], raws: dict[int, bytes],
                    keep: bool) -> list[bool] | None:
        """``MSETEX 2n {k0}h <h0> k0 <row0> ... EX ttl``: one command for the part (one
        dispatch on the server and one command for glide to build, where the pipeline
        costs two a block; atomic: every key of the part or none). None: the server
        does not know MSETEX (older than Valkey 9.1): from now on every put uses the
        pipeline (counted ``msetex_unsupported``)."""
        g = self._glide
        args: list[str | bytes | memoryview] = ["MSETEX", str(2 * len(part))]
        for i in part:
            args += (header_key(keys[i]), raws[i], keys[i], views[i])
        args += self._hold_args if keep else self._ttl_args
        try:
            if self.spec.cluster:  # one slot a part: to that slot's primary
                batch = g.ClusterBatch(is_atomic=False).custom_command(args)
                route = g.SlotKeyRoute(g.SlotType.PRIMARY, keys[part[0]])
                result = self._clients.get().exec(batch, raise_on_error=False,
                                             options=g.ClusterBatchOptions(route=route))
            else:
                batch = g.Batch(is_atomic=False).custom_command(args)
                result = self._clients.get().exec(batch, raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self._failed(breaker, exc, len(part))
            return [False] * len(part)
        breaker.success()
        reply = result[0] if result and len(result) == 1 else result
        if reply == 1:
            self._n.add(put_ok=len(part), bytes_put=sum(views[i].nbytes for i in part))
            return [True] * len(part)
        if isinstance(reply, g.RequestError) and "unknown command" in str(reply).lower():
            self._msetex = False
            self._n.add(msetex_unsupported=1)
            log.info("remote tier: the server has no MSETEX (Valkey < 9.1): puts go as "
                     "a pipeline of SETs")
            return None
        self._n.add(put_refused=len(part))  # a reply error, e.g. OOM: the whole part
        self._refused(reply)
        return [False] * len(part)

    def _put_pipeline(self, breaker: CircuitBreaker, part: list[int], keys: Sequence[str],
                      views: Sequence[memoryview], raws: dict[int, bytes],
                      keep: bool) -> list[bool]:
        """One non-atomic pipeline of ``SET key <row> EX ttl`` and ``SET {key}h <header>
        EX ttl`` a block (a server without MSETEX); each block judged on its own."""
        g = self._glide
        expiry = self._hold if keep else self._ttl
        batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
        for i in part:
            batch.set(keys[i], views[i], expiry=expiry)
            batch.set(header_key(keys[i]), raws[i], expiry=expiry)
        try:
            result = self._clients.get().exec(batch, raise_on_error=False)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            self._failed(breaker, exc, len(part))
            return [False] * len(part)
        breaker.success()
        if not result or len(result) != 2 * len(part):
            self._n.add(put_refused=len(part))
            self._refused(result)
            return [False] * len(part)
        out = []
        nbytes = refused = 0
        for k, i in enumerate(part):
            stored = all(r == "OK" or r == b"OK" for r in result[2 * k:2 * k + 2])
            if stored:
                nbytes += views[i].nbytes
            else:  # a reply error in the pipeline, e.g. OOM
                refused += 1
                self._refused(result[2 * k:2 * k + 2])
            out.append(stored)
        self._n.add(put_ok=len(part) - refused, put_refused=refused, bytes_put=nbytes)
        return out

    # ------------------------------------------------------------------ get

    def get_many_into(self, keys: Sequence[str], views: Sequence[memoryview],
                      header: Sequence[BlockHeader]) -> list[GetOutcome]:
        """One ``MGET h0 p0 h1 p1 ...`` per part (see :meth:`_parts`; a block of
        ``get_alone_bytes`` or more is a part alone): each header lands in a small
        buffer, each payload in its caller's view; then every block is checked on its
        own (a bad or missing block is BAD or MISS, the others HIT)."""
        n = len(keys)
        if self._closed or len(views) != n or len(header) != n:
            self._n.add(invalid_calls=1, errors=n)
            return [GetOutcome.ERROR] * n
        self._n.add(gets=n)
        out = [GetOutcome.ERROR] * n
        ok = []
        for i in range(n):
            if views[i].readonly or not views[i].c_contiguous:  # a caller's error
                self._n.add(invalid_calls=1, errors=1)
                rlog.warning("get_view", "remote get %s: the view is read-only or not "
                             "contiguous", keys[i])
            else:
                ok.append(i)

        def get(breaker: CircuitBreaker, part: list[int]) -> list[GetOutcome]:
            return self._get_part(breaker, part, keys, views, header)
        self._run_parts(self._parts(keys, views, ok, self.get_part_bytes,
                                    self.get_alone_bytes), get, out)
        return out

    def _get_part(self, breaker: CircuitBreaker, part: list[int], keys: Sequence[str],
                  views: Sequence[memoryview], header: Sequence[BlockHeader],
                  ) -> list[GetOutcome]:
        if not self._allow(breaker, len(part)):
            return [GetOutcome.ERROR] * len(part)
        hbuf = memoryview(bytearray(HEADER_BYTES * len(part)))
        hviews = [hbuf[k * HEADER_BYTES:(k + 1) * HEADER_BYTES] for k in range(len(part))]
        names: list[str] = []
        bufs: list[memoryview] = []
        for k, i in enumerate(part):
            names += (header_key(keys[i]), keys[i])
            bufs += (hviews[k], views[i])
        try:
            result = self._clients.get().mget(names, buffers=bufs)
        except Exception as exc:  # noqa: BLE001 - failure = miss: counted, never raised
            if too_long(exc, self._glide):
                breaker.success()  # the server answered: some value is longer than its
                if len(part) == 1:  # buffer (glide fails the whole call): find which
                    self._n.add(bad=1)
                    return [GetOutcome.BAD]
                self._n.add(split_retries=1)
                return [self._get_part(breaker, [i], keys, views, header)[0] for i in part]
            self._failed(breaker, exc, len(part))
            return [GetOutcome.ERROR] * len(part)
        breaker.success()
        tally = {"hits": 0, "misses": 0, "bad": 0, "checksum_refused": 0, "bytes_got": 0}
        out = [self._check(result[2 * k], result[2 * k + 1], hviews[k], views[i], header[i],
                           tally) for k, i in enumerate(part)]
        self._n.add(**tally)
        return out

    @staticmethod
    def _check(hlen: Any, plen: Any, hview: memoryview, view: memoryview,
               header: BlockHeader, tally: dict[str, int]) -> GetOutcome:
        """One block's outcome from its MGET lengths, header bytes and payload (counted
        in ``tally``, which the caller adds to the counters once a part)."""
        if plen is None or hlen is None:  # never stored, expired, or half evicted
            tally["misses"] += 1
            return GetOutcome.MISS
        if int(hlen) != HEADER_BYTES or int(plen) != view.nbytes \
                or not header.check(hview, view):
            cid = header_checksum_id(hview) if int(hlen) == HEADER_BYTES else None
            tally["bad"] += 1
            tally["checksum_refused"] += int(cid is not None and cid != header.checksum_id)
            return GetOutcome.BAD
        tally["hits"] += 1
        tally["bytes_got"] += view.nbytes
        return GetOutcome.HIT

    # ------------------------------------------------------------------ the rest

    def statistics(self) -> dict[str, Any]:
        stats: dict[str, Any] = self._n.snapshot()
        stats["breaker_opens"], stats["breaker_closes"] = self._shards.breakers.totals()
        now = self._shards.current()  # a failed-over primary's breaker is history
        states = {k: v for k, v in self._shards.states().items() if now is None or k in now}
        stats["breaker_state"] = worst(states.values()).value
        stats["breakers"] = {k: s.value for k, s in states.items()}
        stats["slot_map_refreshes"] = self._shards.refreshes
        return stats

    def warm(self) -> None:
        """Connect every thread's client now (best effort; a failure is only counted):
        the first job then costs a round trip, not a connection per thread."""
        def connect(_: int) -> None:
            try:
                self._clients.get()
            except Exception:  # noqa: BLE001 - a server down: the first job will tell
                self._n.add(errors=1)
        self._fan.run(self.spec.threads, connect, None)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fan.close()
        self._clients.close()
