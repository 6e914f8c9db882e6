"""Copy-engine throughput against one large contiguous copy of the same bytes.

``python -m tools.bench_copy --json``. One torch thread. Jobs of 64 (src, dst) pairs with
random block ids; every case times the engine (submit + wait of one job, stores and loads
alternating) interleaved with the reference copy of the same total bytes in the same run,
so machine noise hits both alike; medians over ``--reps`` repetitions.

* CPU: whole 2 MiB blocks (1 region) and 64 regions x 32 KiB fragments; the reference is
  ``dst.copy_(src)`` of one contiguous tensor. The ``index`` method is shown for context.
* CUDA (when available): H2D (loads) and D2H (stores) of 2 MiB blocks, 64 x 32 KiB and
  64 x 8 KiB fragments into/from a pinned host pool, with each copy method (``batch``:
  one ``cuMemcpyBatchAsync`` per job, where the driver has it; ``indexed``: one
  ``cudaMemcpyAsync`` per piece); the reference is one large copy between a pinned
  tensor and the device. The JSON reports the engine's default method.

Last line with ``--json``:
``{"cpu_ratio_block": r, "cpu_ratio_frag": r, "cuda": null | {"method": m, "h2d_ratio": r,
"d2h_ratio": r, "h2d_gbps": g, "d2h_gbps": g, "frag_h2d_gbps": g, "frag_d2h_gbps": g}}``
(ratio = engine GB/s / reference GB/s; ``frag`` = 64 x 32 KiB).
Targets (docs/design.md, README "Measured"): CPU ratios >= 0.7, CUDA ratios >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvshm.ipc.protocol import Direction
from kvshm.layout import KVLayout
from workers.copy_engine import CopyEngine, CopyJob
from workers.cpu_copy import CpuCopyEngine, CpuCopyMethod
from workers.host_pool import HostPool

PAIRS = 64
BLOCK = 2 << 20
FRAG = 32 << 10
FRAG_REGIONS = 64
ROWS = 2 * PAIRS  # device and host rows per region: room for random ids


@dataclass
class Row:
    case: str
    engine_gbps: float
    ref_gbps: float

    @property
    def ratio(self) -> float:
        return self.engine_gbps / self.ref_gbps


def _timed(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _nosync() -> None:
    pass


def _job(job_id: int, direction: Direction, g: torch.Generator) -> CopyJob:
    src = torch.randperm(ROWS, generator=g)[:PAIRS]
    dst = torch.randperm(ROWS, generator=g)[:PAIRS]
    return CopyJob(job_id, direction, src, dst)


def _run_case(case: str, eng: CopyEngine, ref: Callable[[], object], nbytes: int, reps: int,
              directions: tuple[Direction, ...], sync: Callable[[], None]) -> list[Row]:
    """Engine job times per direction and reference times, interleaved; medians -> rows."""
    g = torch.Generator().manual_seed(0)
    times: dict[Direction, list[float]] = {d: [] for d in directions}
    ref_times: list[float] = []
    job_id = 0
    for rep in range(reps + 2):  # two warm-up rounds
        for d in directions:
            job_id += 1
            job = _job(job_id, d, g)

            def one(j: CopyJob = job) -> None:
                eng.submit(j)
                (done,) = eng.wait([j.job_id])
                assert done.ok, done.error

            t = _timed(one, sync)
            if rep >= 2:
                times[d].append(t)
        t = _timed(ref, sync)
        if rep >= 2:
            ref_times.append(t)
    ref_gbps = nbytes / statistics.median(ref_times) / 1e9
    return [Row(f"{case} {d.name.lower()}", nbytes / statistics.median(times[d]) / 1e9, ref_gbps)
            for d in directions]


def _layout(regions: int, nbytes: int, device: str) -> KVLayout:
    tensors = [torch.randint(0, 256, (ROWS, nbytes), dtype=torch.uint8, device=device)
               for _ in range(regions)]
    return KVLayout.from_tensors(tensors)


def _filled_pool(layout: KVLayout) -> HostPool:
    host = HostPool.for_tests(layout, ROWS)
    for r in host.regions:  # fault every page in before timing
        r.fill_(1)
    return host


def cpu_rows(reps: int, method: CpuCopyMethod, cases: tuple[str, ...]) -> list[Row]:
    rows: list[Row] = []
    shapes = {"block": (1, BLOCK), "frag": (FRAG_REGIONS, FRAG)}
    for case in cases:
        regions, nbytes = shapes[case]
        layout = _layout(regions, nbytes, "cpu")
        total = PAIRS * regions * nbytes
        src = torch.randint(0, 256, (total,), dtype=torch.uint8)
        dst = torch.ones(total, dtype=torch.uint8)
        with _filled_pool(layout) as host, CpuCopyEngine(0, layout, host, method=method) as eng:
            rows += _run_case(f"cpu {method.value} {case}", eng, partial(dst.copy_, src), total,
                              reps, (Direction.STORE, Direction.LOAD), _nosync)
    return rows


def cuda_rows(reps: int) -> list[Row]:
    """Both copy methods (batch where the driver has it) on 2 MiB blocks, 64 x 32 KiB and
    64 x 8 KiB fragments, loads (H2D) and stores (D2H)."""
    from workers.cuda_batch import load_batch_memcpy
    from workers.cuda_copy import CudaCopyEngine, CudaCopyMethod

    methods = [CudaCopyMethod.INDEXED]
    if load_batch_memcpy(torch.cuda.current_device()) is not None:
        methods.insert(0, CudaCopyMethod.BATCH)
    rows: list[Row] = []
    sync = torch.cuda.synchronize  # timing only; the engine itself never does this
    shapes = {"block": (1, BLOCK), "frag": (FRAG_REGIONS, FRAG),
              "frag8k": (FRAG_REGIONS, FRAG // 4)}
    for case, (regions, nbytes) in shapes.items():
        layout = _layout(regions, nbytes, "cuda")
        total = PAIRS * regions * nbytes
        pinned = torch.ones(total, dtype=torch.uint8, pin_memory=True)
        dev = torch.ones(total, dtype=torch.uint8, device="cuda")
        h2d_ref = partial(dev.copy_, pinned, non_blocking=True)
        d2h_ref = partial(pinned.copy_, dev, non_blocking=True)
        for method in methods:
            with _filled_pool(layout) as host, \
                    CudaCopyEngine(0, layout, host, method=method) as eng:
                name = f"cuda {method.value} {case}"
                (h2d,) = _run_case(name, eng, h2d_ref, total, reps, (Direction.LOAD,), sync)
                (d2h,) = _run_case(name, eng, d2h_ref, total, reps, (Direction.STORE,), sync)
                assert eng.stats()["batch_fallbacks"] == 0, "the driver refused a batch"
            rows += [Row(h2d.case + " (h2d)", h2d.engine_gbps, h2d.ref_gbps),
                     Row(d2h.case + " (d2h)", d2h.engine_gbps, d2h.ref_gbps)]
    return rows


def cuda_summary(rows: list[Row]) -> dict[str, Any]:
    """The JSON's ``cuda`` object, for the engine's default method (the first one run)."""
    method = rows[0].case.split()[1]

    def row(case: str, d: str) -> Row:
        return next(r for r in rows if r.case == f"cuda {method} {case} {d}")

    h2d, d2h = row("block load", "(h2d)"), row("block store", "(d2h)")
    return {"method": method, "h2d_ratio": round(h2d.ratio, 3), "d2h_ratio": round(d2h.ratio, 3),
            "h2d_gbps": round(h2d.engine_gbps, 2), "d2h_gbps": round(d2h.engine_gbps, 2),
            "frag_h2d_gbps": round(row("frag load", "(h2d)").engine_gbps, 2),
            "frag_d2h_gbps": round(row("frag store", "(d2h)").engine_gbps, 2)}


def _median_ratio(rows: list[Row], prefix: str) -> float:
    return round(statistics.median(r.ratio for r in rows if r.case.startswith(prefix)), 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions per case")
    ap.add_argument("--no-index", action="store_true", help="skip the (slow) index method")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = cpu_rows(args.reps, CpuCopyMethod.MEMMOVE, ("block", "frag"))
    if not args.no_index:
        rows += cpu_rows(max(2, args.reps // 5), CpuCopyMethod.INDEX, ("block", "frag"))
    cuda: dict[str, Any] | None = None
    if torch.cuda.is_available():
        crows = cuda_rows(args.reps)
        rows += crows
        cuda = cuda_summary(crows)
    print(f"{'case':<32} {'engine GB/s':>11} {'1 copy GB/s':>11} {'ratio':>6}")
    for r in rows:
        print(f"{r.case:<32} {r.engine_gbps:>11.2f} {r.ref_gbps:>11.2f} {r.ratio:>6.2f}")
    if args.json:
        print(json.dumps({"cpu_ratio_block": _median_ratio(rows, "cpu memmove block"),
                          "cpu_ratio_frag": _median_ratio(rows, "cpu memmove frag"),
                          "cuda": cuda}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
