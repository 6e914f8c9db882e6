"""The local disk tier's benchmark (issue 32), one part per ``--part``.

``python -m tools.bench_disk --json`` (all parts). Parts:

* ``slab`` (a): slot write and read GB/s of the worker's disk mover
  (:class:`workers.disk_mover.DiskMover` over a :class:`kvshm.disk.SlabFile`, jobs of
  ``--job`` blocks as the scheduler posts them, host rows of a real host pool) at 128 KiB
  and 2 MiB blocks, against, in the same run and the same directory:

  - ``raw``: a plain O_DIRECT writer/reader of one preallocated file (one ``pwrite`` /
    ``pread`` per block, threads splitting the blocks), no header, no checksum;
  - ``vllm``: vLLM's fs tier's own ``batch_store_block`` / ``batch_load_block``
    (``vllm/v1/kv_offload/tiering/fs/io.py``; its native ``vllm.fs_io_C`` where built),
    one batch call per thread as its tier's pool runs one per job, one file per block
    (temp file + rename), with the O_DIRECT choice of its own probe (``probe_o_direct``);
    skipped with a note where vLLM is not installed.

  Every arm runs with 1..``--threads`` threads (the slab arm: ``--mover-threads`` if
  given) and keeps its best (the arms take turns at each thread count, so machine noise
  hits all alike); ``--runs`` runs give min / median / max. All arms move the same
  blocks between the same memory (``--memory pool``, the default: the raw and vLLM arms
  write from and read into the slab arm's host-pool region; ``--memory anon`` gives them
  private anonymous maps instead) and the same file system (``--scatter`` puts the
  slab's blocks in shuffled slots: the case where no slots of a job are neighbours);
  before each write the source memory holds the blocks, before each read the
  destination is zeroed and after it checked (untimed). All three bypass the page cache
  (O_DIRECT: kvshm's slab and raw always, vLLM's where its probe says so, reported as
  ``vllm_o_direct``), so a read measures the disk, not memory. The slab's bytes are
  payload bytes: its per-slot 4 KiB header page is extra I/O it pays.

  Targets: slab >= 0.8 x raw each way at both sizes; slab >= 1.5 x vLLM on stores at
  128 KiB and >= 1.0 x vLLM elsewhere.

Last line with ``--json``: ``{"slab": {"128KiB": {"write": {"slab": [min, med, max],
"raw": [...], "vllm": [...] | null, "slab_vs_raw": [...], "slab_vs_vllm": [...] | null,
"best_threads": {arm: median}, "by_threads": {arm: {threads: [min, med, max]}}},
"read": {...}}, "2MiB": {...}, "threads": [...], "mover_threads": [...], "memory":
"pool" | "anon", "scatter": bool, "vllm_o_direct": bool | null, "targets": {name:
bool}}, "e2e": {...}, "restart": {...}}`` (GB/s and ratios; parts (b) and (c):
:mod:`tools.disk_e2e`'s ``offload`` and ``restart``).

* ``e2e`` (b) and ``restart`` (c): vLLM end to end, :mod:`tools.disk_e2e` (its options
  are this tool's: ``--quick``, ``--offload-mode``, ``--restart-mode``, the model's
  shape; the slabs go under ``--dir``). (b): the chat and agentic workloads with the CPU
  tier at a quarter of the distinct blocks, without and with a disk tier holding the
  rest; target mean TTFT >= 1.5x. (c): an engine restarted mid-conversations on the
  previous one's slab against a cold start; target first-turn TTFT >= 2x.

* ``scan`` (d): the warm restart's header scan of a slab of ``--scan-slots`` slots of
  128 KiB, cold (the file's pages dropped from the page cache), with no read-ahead
  against the shipped window (:mod:`tools.disk_scan`; ``summary["scan"]``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import select
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from kvshm.ipc.protocol import Disk, DiskOp, DiskSetup, LayoutSpec, RegionSpec, pack_ids
from workers.disk_mover import DiskMover
from workers.host_pool import HostPool

#: The parts this tool knows (``--part``): (a) ``slab``, (b) ``e2e`` and (c) ``restart``
#: (:mod:`tools.disk_e2e`: vLLM end to end), (d) ``scan`` (:mod:`tools.disk_scan`).
PARTS = ("slab", "e2e", "restart", "scan")
KIB = 1024
OPS = ("write", "read")


# ---------------------------------------------------------------------------- arms


class Memory(Enum):
    """Which memory the raw and vLLM arms move bytes from and to (the slab arm always uses
    its host pool's rows: shared memory, as in a worker)."""

    #: The slab arm's host-pool region itself: every arm moves the same bytes between the
    #: same memory and the same file system (the default: the comparison the targets mean).
    POOL = "pool"
    #: Private anonymous mappings (a side measurement: O_DIRECT into 4 KiB shared-memory
    #: pages makes more, smaller device requests than into fresh anonymous pages).
    ANON = "anon"


@dataclass
class Case:
    """One block size's buffers and files: ``n`` blocks of ``block`` bytes. ``src`` holds
    the blocks' bytes (random); ``wbuf`` / ``rbuf`` are what the raw and vLLM arms write
    from and read into (the pool's region, or anonymous mappings: :class:`Memory`)."""

    directory: str
    block: int
    n: int
    src: mmap.mmap
    wbuf: memoryview
    rbuf: memoryview

    @property
    def total(self) -> int:
        return self.n * self.block


def _split(n: int, parts: int) -> list[range]:
    step = -(-n // parts)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


def _in_threads(fn: Callable[[range], None], n: int, threads: int) -> float:
    """Seconds to run ``fn`` over ``range(n)`` split across ``threads`` threads."""
    parts = _split(n, threads)
    errors: list[BaseException] = []

    def run(part: range) -> None:
        try:
            fn(part)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    ts = [threading.Thread(target=run, args=(p,)) for p in parts]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return dt


class RawArm:
    """One preallocated O_DIRECT file, one pwrite/pread per block at ``i * block``."""

    name = "raw"

    def __init__(self, case: Case) -> None:
        self.case = case
        path = os.path.join(case.directory, "raw.bin")
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(self.fd, 0, case.total)

    def run(self, op: str, threads: int) -> float:
        c, fd = self.case, self.fd
        src, dst = c.wbuf, c.rbuf

        def write(part: range) -> None:
            for i in part:
                os.pwrite(fd, src[i * c.block:(i + 1) * c.block], i * c.block)

        def read(part: range) -> None:
            for i in part:
                os.preadv(fd, [dst[i * c.block:(i + 1) * c.block]], i * c.block)

        return _in_threads(write if op == "write" else read, c.n, threads)

    def close(self) -> None:
        os.close(self.fd)


class VllmArm:
    """vLLM's fs tier's batch calls, one file per block (``<dir>/vllm/<xx>/<i>.kv``)."""

    name = "vllm"

    def __init__(self, case: Case) -> None:
        from vllm.v1.kv_offload.tiering.fs import io as fs_io

        self.case, self.io = case, fs_io
        self.root = os.path.join(case.directory, "vllm")
        self.o_direct = bool(fs_io.probe_o_direct(case.directory))
        self.paths = [os.path.join(self.root, f"{i % 256:02x}", f"{i}.kv") for i in range(case.n)]

    def _fresh(self) -> None:
        """No block file (a store skips a block whose file exists); its directories made
        (not timed)."""
        shutil.rmtree(self.root, ignore_errors=True)
        for d in {os.path.dirname(p) for p in self.paths}:
            os.makedirs(d, exist_ok=True)

    def run(self, op: str, threads: int) -> float:
        c = self.case
        if op == "write":
            self._fresh()
        view = c.wbuf if op == "write" else c.rbuf
        call = self.io.batch_store_block if op == "write" else self.io.batch_load_block

        def batch(part: range) -> None:
            call([self.paths[i] for i in part], view, [i * c.block for i in part], c.block,
                 self.o_direct)

        return _in_threads(batch, c.n, threads)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class SlabArm:
    """The worker's DiskMover over its slab file, rows in a real host pool; jobs of
    ``job`` blocks posted at once, as the scheduler does, then every Done awaited."""

    name = "slab"

    def __init__(self, case: Case, pool: HostPool, job: int, *, scatter: bool = False) -> None:
        self.case, self.job, self.pool = case, job, pool
        #: Block i's slot: i, or (``scatter``) a fixed shuffle, so no two blocks of a job
        #: are likely neighbours on disk (each slot then moves in a call of its own).
        self.slots = list(range(case.n))
        if scatter:
            random.Random(0).shuffle(self.slots)
        self.setup = DiskSetup(os.path.join(case.directory, "slab.kvslab"), case.n,
                               "bench-disk.fp", True)
        self.hashes = [i.to_bytes(8, "little") * 4 for i in range(case.n)]
        self._mover: DiskMover | None = None
        self._threads = 0

    def _mover_for(self, threads: int) -> DiskMover:
        if self._mover is None or self._threads != threads:
            if self._mover is not None:
                self._close_mover()
            self._mover = DiskMover(0, 1, self.setup, self.pool, threads=threads)
            self._threads = threads
        return self._mover

    def run(self, op: str, threads: int) -> float:
        mover = self._mover_for(threads)
        c = self.case
        dop = DiskOp.WRITE if op == "write" else DiskOp.READ
        jobs = [range(s, min(c.n, s + self.job)) for s in range(0, c.n, self.job)]
        t0 = time.perf_counter()
        for k, part in enumerate(jobs):
            ids = list(part)
            mover.submit(Disk(k, dop, pack_ids(ids), pack_ids([self.slots[i] for i in ids]),
                              b"".join(self.hashes[i] for i in ids), 32))
        left = len(jobs)
        while left:
            select.select([mover.notify_fd()], [], [], 5.0)
            for done in mover.poll():
                if not done.ok:
                    raise RuntimeError(f"slab {op} job failed: {done.error}")
                left -= 1
        return time.perf_counter() - t0

    def statistics(self) -> dict[str, Any]:
        return self._mover.statistics() if self._mover is not None else {}

    def _close_mover(self) -> None:
        assert self._mover is not None
        self._mover.close()
        self._mover.release()
        self._mover = None

    def close(self) -> None:
        if self._mover is not None:
            self._close_mover()


# ---------------------------------------------------------------------------- part (a)


Arm = RawArm | VllmArm | SlabArm


def _one(arm: Arm, op: str, case: Case, threads: int) -> float:
    """GB/s of one pass of ``op`` by ``arm`` with ``threads`` threads. Untimed around it:
    before a write the source memory holds the blocks, before a read the destination is
    zeroed, after a read it is checked against the blocks (every arm really read)."""
    into = _tensor(arm.pool.regions[0] if isinstance(arm, SlabArm) else None,
                   case.wbuf if op == "write" else case.rbuf, case)
    if op == "write":
        into.copy_(_tensor(None, memoryview(case.src), case))
    else:
        into.zero_()
    dt = arm.run(op, threads)
    if op == "read" and not torch.equal(into, _tensor(None, memoryview(case.src), case)):
        raise RuntimeError(f"{arm.name} read back different bytes")
    return case.total / dt / 1e9


def _region_view(region: torch.Tensor) -> memoryview:
    """A writable flat byte view over a contiguous uint8 tensor's memory (the tensor must
    outlive it)."""
    buf = (ctypes.c_char * region.numel()).from_address(region.data_ptr())
    return memoryview(buf).cast("B")


def _tensor(region: torch.Tensor | None, view: memoryview, case: Case) -> torch.Tensor:
    """``region``, else ``view`` as an (n, block) uint8 tensor over the same memory."""
    if region is not None:
        return region
    return torch.frombuffer(view, dtype=torch.uint8).view(case.n, case.block)


def _spread(xs: list[float]) -> list[float]:
    return [round(min(xs), 3), round(statistics.median(xs), 3), round(max(xs), 3)]


def _size_name(block: int) -> str:
    return f"{block // (1 << 20)}MiB" if block >= 1 << 20 else f"{block // KIB}KiB"


def part_slab(directory: str, sizes: Sequence[int], total: int, runs: int,
              threads: Sequence[int], job: int, with_vllm: bool,
              memory: Memory = Memory.POOL,
              mover_threads: Sequence[int] | None = None,
              scatter: bool = False) -> dict[str, Any]:
    """Part (a): see the module docstring. ``mover_threads``: the slab arm's thread
    counts (default: ``threads``); ``scatter``: the slab's blocks in shuffled slots."""
    slab_threads = list(mover_threads or threads)
    out: dict[str, Any] = {"threads": list(threads), "mover_threads": slab_threads,
                           "memory": memory.value, "scatter": scatter,
                           "vllm_o_direct": None}
    if with_vllm:
        try:
            import vllm.v1.kv_offload.tiering.fs.io  # noqa: F401
        except ImportError:
            with_vllm = False
            out["note"] = "vLLM is not installed: no vllm arm"
    for block in sizes:
        n = max(1, total // block)
        with tempfile.TemporaryDirectory(prefix="kvshm-bench-disk-", dir=directory) as d:
            src = mmap.mmap(-1, n * block)
            src[:] = os.urandom(n * block)
            pool = HostPool.for_tests(LayoutSpec((RegionSpec(block, n, "uint8"),)), n,
                                      pin=False)
            anon = [mmap.mmap(-1, n * block) for _ in range(2)]
            if memory is Memory.POOL:
                wbuf = rbuf = _region_view(pool.regions[0])
            else:
                wbuf, rbuf = memoryview(anon[0]), memoryview(anon[1])
            case = Case(d, block, n, src, wbuf, rbuf)
            arms: list[Arm] = [SlabArm(case, pool, job, scatter=scatter), RawArm(case)]
            if with_vllm:
                arms.append(VllmArm(case))
                out["vllm_o_direct"] = arms[-1].o_direct  # type: ignore[union-attr]
            got: dict[tuple[str, str], list[float]] = {}
            used: dict[tuple[str, str], list[int]] = {}
            each: dict[tuple[str, str, int], list[float]] = {}
            try:
                for _ in range(runs):
                    for op in OPS:  # arms interleaved per thread count: drift hits all
                        best: dict[str, tuple[float, int]] = {}
                        for k in range(max(len(threads), len(slab_threads))):
                            for arm in arms:
                                ts = slab_threads if isinstance(arm, SlabArm) else threads
                                if k < len(ts):
                                    gbps = _one(arm, op, case, ts[k])
                                    each.setdefault((arm.name, op, ts[k]), []).append(gbps)
                                    best[arm.name] = max(best.get(arm.name, (0.0, 0)),
                                                         (gbps, ts[k]))
                        for name, (gbps, t) in best.items():
                            got.setdefault((name, op), []).append(gbps)
                            used.setdefault((name, op), []).append(t)
                stats = arms[0].statistics()  # type: ignore[union-attr]
            finally:
                for arm in arms:
                    arm.close()
                del arms, wbuf, rbuf, case, anon  # the views go with them; the maps with GC
                pool.close()
        out[_size_name(block)] = _summary(got, used, runs, with_vllm, stats)
        for op in OPS:
            out[_size_name(block)][op]["by_threads"] = {
                name: {t: _spread(xs) for (a, o, t), xs in each.items() if a == name and o == op}
                for name in dict.fromkeys(a for a, _, _ in each)}
    out["targets"] = _targets(out, sizes, with_vllm)
    return out


def _summary(got: dict[tuple[str, str], list[float]], used: dict[tuple[str, str], list[int]],
             runs: int, with_vllm: bool, stats: dict[str, Any]) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for op in OPS:
        slab = got[("slab", op)]
        row: dict[str, Any] = {"slab": _spread(slab), "raw": _spread(got[("raw", op)]),
                               "slab_vs_raw": _spread([s / r for s, r in
                                                       zip(slab, got[("raw", op)])]),
                               "best_threads": {a: statistics.median(used[(a, op)])
                                                for a, o in used if o == op}}
        if with_vllm:
            row["vllm"] = _spread(got[("vllm", op)])
            row["slab_vs_vllm"] = _spread([s / v for s, v in zip(slab, got[("vllm", op)])])
        else:
            row["vllm"] = row["slab_vs_vllm"] = None
        res[op] = row
    res["bounce"] = stats.get("bounce", 0)
    res["runs"] = runs
    return res


def _targets(out: dict[str, Any], sizes: Sequence[int], with_vllm: bool) -> dict[str, bool]:
    """The issue's targets, each judged on the median of the runs."""
    t: dict[str, bool] = {}
    for block in sizes:
        name = _size_name(block)
        for op in OPS:
            row = out[name][op]
            t[f"{name}_{op}_vs_raw>=0.8"] = row["slab_vs_raw"][1] >= 0.8
            if with_vllm:
                need = 1.5 if (block == 128 * KIB and op == "write") else 1.0
                t[f"{name}_{op}_vs_vllm>={need}"] = row["slab_vs_vllm"][1] >= need
    return t


def _print_slab(res: dict[str, Any], sizes: Sequence[int]) -> None:
    print(f"{'block':>7} {'op':>5} {'slab GB/s':>20} {'raw GB/s':>20} {'vLLM fs GB/s':>20} "
          f"{'slab/raw':>8} {'slab/vLLM':>9}")
    for block in sizes:
        name = _size_name(block)
        for op in OPS:
            row = res[name][op]

            def f(x: list[float] | None) -> str:
                return "-" if x is None else f"{x[1]:.2f} [{x[0]:.2f}-{x[2]:.2f}]"

            vr = row["slab_vs_vllm"]
            print(f"{name:>7} {op:>5} {f(row['slab']):>20} {f(row['raw']):>20} "
                  f"{f(row['vllm']):>20} {row['slab_vs_raw'][1]:>8.2f} "
                  f"{'-' if vr is None else f'{vr[1]:.2f}':>9}")
    print(f"vLLM O_DIRECT: {res['vllm_o_direct']}; targets: {res['targets']}")


def _sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        p = part.strip().upper()
        mult = {"K": KIB, "M": 1 << 20}.get(p[-1], 1)
        out.append(int(p.rstrip("KM")) * mult)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=PARTS, action="append",
                    help="run this part (repeatable; default: all)")
    ap.add_argument("--json", action="store_true", help="end with the one-line JSON summary")
    ap.add_argument("--dir", default=tempfile.gettempdir(),
                    help="where the files go (a temp dir under it; default: /tmp)")
    ap.add_argument("--sizes", default="128K,2M", help="block sizes (part slab)")
    ap.add_argument("--total-mib", type=int, default=256, help="MiB of blocks per size")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=4, help="try 1..N threads per arm")
    ap.add_argument("--mover-threads", default=None,
                    help="the slab arm's thread counts, e.g. 4,8,16 (default: 1..--threads)")
    ap.add_argument("--memory", choices=[m.value for m in Memory], default=Memory.POOL.value,
                    help="the raw and vLLM arms' memory: the slab's host pool (default) or "
                         "anonymous mappings")
    ap.add_argument("--scatter", action="store_true",
                    help="the slab's blocks in shuffled slots (no neighbours to group)")
    ap.add_argument("--job", type=int, default=32, help="blocks per Disk job (slab arm)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier")
    ap.add_argument("--scan-slots", type=int, default=20000,
                    help="slots of the slab part scan scans (128 KiB each)")
    from tools import disk_e2e

    disk_e2e.add_arguments(ap)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    parts = args.part or list(PARTS)
    summary: dict[str, Any] = {}
    if "slab" in parts:
        sizes = _sizes(args.sizes)
        res = part_slab(args.dir, sizes, args.total_mib << 20, args.runs,
                        list(range(1, args.threads + 1)), args.job, not args.no_vllm,
                        Memory(args.memory),
                        [int(x) for x in args.mover_threads.split(",")]
                        if args.mover_threads else None, args.scatter)
        _print_slab(res, sizes)
        summary["slab"] = res
    if "scan" in parts:
        from tools import disk_scan

        summary["scan"] = disk_scan.run(args.dir, args.scan_slots, 128 * KIB, args.runs)
    e2e = [name for part, name in (("e2e", "offload"), ("restart", "restart"))
           if part in parts]
    if e2e:
        out = disk_e2e.run_parts(args, e2e, args.dir)
        if "offload" in out:
            summary["e2e"] = out["offload"]
        if "restart" in out:
            summary["restart"] = out["restart"]
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
