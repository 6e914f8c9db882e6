"""A SPAWN engine whose disk fills up while it runs, for the ENOSPC test:
``python tests/disk_full_proc.py DISK_DIR`` with ``DISK_DIR`` a small filesystem of its
own (the test mounts a size-limited tmpfs in a private mount namespace). Prints one JSON
line of what it saw.

tp=2 over :func:`engine_rig.shards`, a CPU tier of 8 blocks, a disk tier in ``DISK_DIR``
with ``disk_io=buffered`` (tmpfs refuses O_DIRECT). The story:

1. Once the engine is READY, every slot of both slabs gives back its allocation
   (``fallocate(PUNCH_HOLE)``): the slab is then like one on a copy-on-write or
   thin-provisioned filesystem, where overwriting a preallocated slot needs new blocks
   -- the one way a preallocated slab meets ENOSPC at write time. Nothing else is faked:
   the workers' own ``pwritev`` gets the kernel's ENOSPC.
2. Prompts 0-3 (4 full blocks each) are stored: write-back writes the evicted ones to
   disk (there is room).
3. Another file fills the filesystem (``ballast``, written until ENOSPC).
4. Prompts 4-11 are stored: their WRITEs fail on the ranks with ENOSPC.
5. Lookups of every prompt (each asked until it answers) and the loads of the hits:
   prompts 11 and 10 first (the CPU tier's), then 4-9 (evicted, never written: misses),
   then 0-3 (on disk: read back), then the engine settles.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import sys
from typing import Any

from engine_rig import BS, Client, spawned_engine, tokens

from kvshm.config import DiskIO
from kvshm.engine import Engine
from kvshm.hashing import chain_hashes
from kvshm.types import RequestView, ScheduledRequest

SLOTS = 64
PAGE = 4096
DISK = PAGE + SLOTS * 2 * PAGE
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2


def punch_slots(path: str) -> None:
    """Give back the allocation of every slot of the slab at ``path`` (its header stays)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDWR)
    try:
        mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
        if libc.fallocate(fd, mode, ctypes.c_long(PAGE), ctypes.c_long(DISK - PAGE)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
    finally:
        os.close(fd)


def fill(directory: str) -> int:
    """Write a file in ``directory`` until the filesystem is full; its bytes."""
    n = 0
    chunk = b"\xee" * PAGE
    with open(os.path.join(directory, "ballast"), "wb", buffering=0) as f:
        while True:
            try:
                n += f.write(chunk) or 0
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                return n


async def slabs(directory: str) -> list[str]:
    """Both ranks' slab files, once each rank has made its own (a rank opens its slab
    when its Ready arrives: the engine may be READY a moment before)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        paths = [os.path.join(directory, n) for n in sorted(os.listdir(directory))
                 if n.endswith(".slab")]
        if len(paths) == 2 and all(os.stat(p).st_blocks * 512 >= DISK for p in paths):
            return paths
        assert loop.time() < deadline, f"the slabs never appeared: {paths}"
        await asyncio.sleep(0.01)


async def store(c: Client, i: int) -> None:
    toks = tokens(4 * BS + 1, seed=80 + i)
    table, _ = c.compute(f"p{i}", toks)
    c.finish(f"p{i}", table, len(toks))
    await c.settle()
    c.gpu.drop_all_hashes()
    for _ in range(3):  # write-back happens at plans
        c.step()
        await c.settle()


async def lookup(c: Client, i: int) -> int:
    """Prompt ``i``'s hit in tokens ("ask again" asked again), its blocks loaded."""
    toks = tokens(4 * BS + 1, seed=80 + i)
    hashes = chain_hashes(toks, BS)
    rid = f"q{i}"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while (hit := c.eng.lookup(RequestView(rid, hashes, len(toks)), 0)) is None:
        assert loop.time() < deadline, "a lookup never answered"
        c.step()
        await asyncio.sleep(0.005)
    table = c.gpu.allocate(len(toks) // BS)
    c.eng.allocated(rid, [table], hit)
    c.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True,
                            num_confirmed_tokens=0))
    if hit:
        assert (await c.loaded(rid)).ok
    c.finish(rid, table, 0)
    return hit


def snapshot(eng: Engine) -> dict[str, Any]:
    st = eng.statistics()
    return {"disk": st.disk, "counters": dict(st.counters), "state": st.state,
            "pins_held": st.pins_held, "quarantined_cpu_blocks": st.quarantined_cpu_blocks}


async def main(directory: str) -> None:
    out: dict[str, Any] = {}
    async with spawned_engine(num_cpu_blocks=8, disk_path=directory,
                              disk_bytes_per_rank=DISK, disk_io=DiskIO.BUFFERED) as (eng, gpu, _):
        c = Client(eng, gpu)
        for path in await slabs(directory):
            punch_slots(path)
        for i in range(4):
            await store(c, i)
        out["before"] = snapshot(eng)
        out["ballast"] = fill(directory)
        for i in range(4, 12):
            await store(c, i)
        out["full"] = snapshot(eng)
        order = [11, 10, *range(4, 10), *range(4)]  # CPU hits first: disk reads evict
        out["hits"] = {i: await lookup(c, i) for i in order}
        await c.settle()
        for _ in range(3):
            c.step()
            await c.settle()
        out["after"] = snapshot(eng)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
