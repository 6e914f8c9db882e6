"""What the vLLM adapter pays per step to list every running request (no vLLM needed).

``python -m tools.bench_listing [--json]``

A decode step at 1k / 4k / 16k running requests, every one announced and listed, 64 of
them with a new block, given to ``SchedulerSide._listing`` as a SchedulerOutput-shaped
object (vLLM 0.32's field names; requests with vLLM's ``Request`` attributes). Reported:
median µs per listed request, against a floor that only builds the same
``ScheduledRequest`` objects from the same fields in a bare list comprehension (what any
adapter must pay). Last line with ``--json``: ``{"us_per_request": {"1000": .., ...},
"floor_us_per_request": {...}}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from types import SimpleNamespace as NS
from typing import Any

from kvshm.integrations.vllm.config import ConnectorConfig
from kvshm.integrations.vllm.scheduler import SchedulerSide
from kvshm.types import KVGroup, ScheduledRequest, StoreMode, no_new_blocks

SIZES = (1000, 4000, 16000)
CHANGED = 64


def _side_and_output(n: int) -> tuple[SchedulerSide, Any]:
    cfg = ConnectorConfig("bench", 1, 1, 16, (KVGroup.full(),), StoreMode.EAGER, None, 64,
                          None, 30.0, 5.0, 0)
    side = SchedulerSide(cfg)
    rids = [f"req-{i}" for i in range(n)]
    for i, rid in enumerate(rids):
        side._requests[rid] = NS(block_hashes=[], num_tokens=100 + i,
                                 num_computed_tokens=99 + i, num_output_placeholders=1,
                                 kv_transfer_params=None)
    side._announced.update(rids)
    new_blocks: list[Any] = [None] * n
    for i in range(0, n, n // CHANGED)[:CHANGED]:
        new_blocks[i] = ([i + 1],)
    cached = NS(req_ids=rids, resumed_req_ids=set(), new_block_ids=new_blocks,
                num_computed_tokens=[99] * n)
    so = NS(scheduled_new_reqs=[], scheduled_cached_reqs=cached, preempted_req_ids=set(),
            kv_connector_block_state=None)
    return side, so


def _floor(side: SchedulerSide, so: Any) -> None:
    no_new = no_new_blocks(1)
    reqs = side._requests
    [ScheduledRequest(rid, r.block_hashes, r.num_tokens, no_new, False,
                      r.num_computed_tokens - r.num_output_placeholders, False,
                      r.kv_transfer_params)
     for rid in so.scheduled_cached_reqs.req_ids for r in (reqs[rid],)]


def _medians_us(fns: tuple[Any, Any], n: int, reps: int) -> tuple[float, float]:
    """Median µs per request of each of two listings, timed alternately (so the
    machine's drift hits both alike)."""
    times: tuple[list[float], list[float]] = ([], [])
    gc.disable()
    try:
        for _ in range(reps):
            for fn, ts in zip(fns, times):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
    finally:
        gc.enable()
    a, b = (statistics.median(ts) / n * 1e6 for ts in times)
    return a, b


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--reps", type=int, default=40, help="timed listings per size")
    args = ap.parse_args(argv)
    listing: dict[str, float] = {}
    floor: dict[str, float] = {}
    print(f"{'running':>8} {'adapter us/req':>15} {'floor us/req':>13} {'ratio':>6}")
    for n in SIZES:
        side, so = _side_and_output(n)
        out, _ = side._listing(so)
        assert len(out) == n and side.counters.requests_unknown == 0
        a, f = _medians_us((lambda side=side, so=so: side._listing(so),
                            lambda side=side, so=so: _floor(side, so)), n,
                           args.reps)
        listing[str(n)], floor[str(n)] = round(a, 3), round(f, 3)
        print(f"{n:>8} {a:>15.3f} {f:>13.3f} {a / f:>6.2f}")
    if args.json:
        print(json.dumps({"us_per_request": listing, "floor_us_per_request": floor}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
