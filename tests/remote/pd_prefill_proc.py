"""A P/D prefill engine in its own process: ``python tests/remote/pd_prefill_proc.py URL
SEED MODE``. An engine with two embedded ranks serves the ``do_remote_decode`` request
``req-k`` (the prompt of ``SEED``) and finishes it. ``MODE`` ``kill``: it prints its
transfer params as one JSON line and SIGKILLs itself before any store or PUT of the
request completed. ``publish``: it steps until the manifest is on the server, prints
``{"params": .., "sha256": [each rank's blocks]}`` and exits cleanly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]),
                str(Path(__file__).resolve().parents[2])]

from engine_rig import Client, embedded_engine  # noqa: E402
from remote_engine_rig import (  # noqa: E402
    BLOCKS,
    MODEL,
    digest,
    prefill,
    prompt,
    settle_published,
)


async def main(url: str, seed: int, mode: str) -> None:
    async with embedded_engine(remote_url=url, model_id=MODEL) as (eng, gpu, ks, ranks):
        c = Client(eng, gpu)
        if mode == "kill":
            ranks.paused = True  # no copy runs: the store never completes
        params, table = await prefill(c, "req-k", prompt(seed))
        if mode == "kill":
            print(json.dumps(params), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        await settle_published(c)
        print(json.dumps({"params": params,
                          "sha256": [digest(k[table[:BLOCKS]]) for k in ks]}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
