"""A custom server's view of kvshm in ~60 lines: store a request's KV, load it back.

Run: python examples/custom_server.py   (2 CPU worker processes, a few MiB of /dev/shm)
The full version (a toy transformer, a chat trace, TTFT) is `kvshm demo`.
"""

from __future__ import annotations

import asyncio

import torch
import uvloop

import kvshm

BLOCK = 16  # tokens per block
NUM_GPU_BLOCKS = 64


async def main() -> None:
    # The "GPU" KV cache: one shard per TP rank, blocks on dim 0, in shared memory so
    # the workers kvshm spawns can copy it.
    caches = [kvshm.shared_tensor((NUM_GPU_BLOCKS, 2, BLOCK, 128), torch.float16)
              for _ in range(2)]
    gpu = kvshm.BlockPool(NUM_GPU_BLOCKS)  # the server's own block pool (kvshm's fits)
    cfg = kvshm.EngineConfig(block_size=BLOCK, tp=2, num_cpu_blocks=256)
    async with kvshm.Engine.launch(cfg, workers=kvshm.SPAWN, gpu_blocks=gpu,
                                   device_caches=[[c] for c in caches]) as eng:
        prompt = list(range(100))
        hashes = kvshm.chain_hashes(prompt, BLOCK)

        # Request 1 computes the prompt (here: random KV) and kvshm stores its blocks.
        table = gpu.allocate(len(prompt) // BLOCK + 1)
        for c in caches:
            c[table] = torch.randn_like(c[table])
        eng.allocated("r1", [table], 0)
        r1 = kvshm.ScheduledRequest("r1", hashes, len(prompt), (tuple(table),),
                                    new_or_resumed=True, num_confirmed_tokens=len(prompt))
        eng.step(kvshm.StepInput(1, [r1]))
        stored = [c[table[:6]].clone() for c in caches]  # what the CPU tier must give back
        eng.finished("r1", len(prompt), [table])
        gpu.free(reversed(table))  # the blocks may be reused, even by r2 below
        while eng.has_pending_work():  # stores are acked by both ranks
            eng.step(kvshm.StepInput(2, []))
            await asyncio.sleep(0.001)

        # Request 2 shares the prompt; the GPU copy is gone, the CPU tier has it.
        gpu.drop_all_hashes()
        hit = eng.lookup(kvshm.RequestView("r2", hashes, len(prompt)), num_local_tokens=0)
        table2 = gpu.allocate(len(prompt) // BLOCK + 1)
        eng.allocated("r2", [table2], hit or 0)
        r2 = kvshm.ScheduledRequest("r2", hashes, len(prompt), (tuple(table2),),
                                    new_or_resumed=True)
        eng.step(kvshm.StepInput(3, [r2]))
        result = await eng.wait_loaded("r2")
        same = all(torch.equal(c[table2[:6]], want) for c, want in zip(caches, stored))
        print(f"hit {hit} tokens, load ok={result.ok}, bytes identical={same}")
        eng.finished("r2", len(prompt), [table2])
        gpu.free(reversed(table2))
        print(eng.statistics().as_dict()["counters"])


if __name__ == "__main__":
    uvloop.run(main())
