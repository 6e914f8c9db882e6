"""A kvshm engine in its own process, for tests that must kill or close the engine under
real standalone workers: ``python tests/engine_proc.py NAME TP``.

An ATTACH :class:`~kvshm.engine.Engine` with ``TP`` ranks over fresh shared-memory device
caches (the standalone workers get them in Ready). Prints ``READY`` on stdout once every
rank connected, then reads stdin: the line ``close`` closes the engine (Shutdown to every
rank) and prints its final statistics as one JSON line; EOF does the same. Killing the
process is the other way it ends.
"""

from __future__ import annotations

import asyncio
import json
import sys

from engine_rig import GPU_BLOCKS, config, shards

from kvshm.engine import ATTACH, Engine
from kvshm.offload.pool import BlockPool


async def main(name: str, tp: int) -> None:
    cfg = config(name=name, tp=tp, connect_timeout_s=60.0)
    async with Engine.launch(cfg, workers=ATTACH, gpu_blocks=BlockPool(GPU_BLOCKS),
                             device_caches=[[k] for k in shards(tp)]) as eng:
        print("READY", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        await eng.aclose()
        print(json.dumps(eng.statistics().as_dict()), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
