"""A SPAWN engine with a disk tier in its own process, for the test that SIGKILLs the
scheduler mid-write: ``python tests/disk_sched_proc.py NAME DISK_DIR OUT_DIR``.

tp=2 over :func:`engine_rig.shards`, a CPU tier of 8 blocks and a disk tier in
``DISK_DIR``. It stores 12 prompts of 4 full blocks (17 tokens, seeds 60..71), saving
each prompt's rows of both ranks to ``OUT_DIR/<i>.pt`` (by rename: whole or absent)
before it finishes it, prints ``GO`` after the sixth once every block of prompt 0 (evicted
from the CPU tier by then, and so written down) is indexed on disk -- both ranks acked its
WRITE: its slots' headers and payloads are in the files, whatever the load -- and keeps
storing and stepping (write-back running) until it is killed.
"""

from __future__ import annotations

import asyncio
import os
import sys

import torch
from engine_rig import BS, Client, spawned_engine, tokens

from kvshm.hashing import chain_hashes
from kvshm.offload.remote_puts import remote_hash

SLOTS = 64
DISK = 4096 + SLOTS * 2 * 4096


async def main(name: str, disk_dir: str, out: str) -> None:
    async with spawned_engine(name=name, num_cpu_blocks=8, disk_path=disk_dir,
                              disk_bytes_per_rank=DISK) as (eng, gpu, ks):
        c = Client(eng, gpu)
        for i in range(12):
            toks = tokens(4 * BS + 1, seed=60 + i)
            table, _ = c.compute(f"k{i}", toks)
            # atomically (rename): a SIGKILL mid-save leaves no truncated <i>.pt, and
            # prompt i is finished (stored) only after its file exists
            torch.save([k[table].clone() for k in ks], f"{out}/{i}.pt.tmp")
            os.replace(f"{out}/{i}.pt.tmp", f"{out}/{i}.pt")
            c.finish(f"k{i}", table, len(toks))
            c.step()
            await asyncio.sleep(0.002)
            if i == 5:
                book = eng._core.manager.disk  # type: ignore[union-attr]
                assert book is not None
                first = [remote_hash(h) for h in chain_hashes(tokens(4 * BS + 1, seed=60), BS)]
                while not all(book.slots.is_cached(h) for h in first):
                    c.step()  # no sleep decides it: the acks of prompt 0's WRITEs do
                    await c.settle()
                print("GO", flush=True)
        while True:
            c.step()
            await asyncio.sleep(0.001)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
