"""An engine (two embedded ranks) that logs to stderr as a served process does, for the
refusal-flood test: ``python tests/refusal_flood_proc.py NAME``.

Logging goes to stderr at INFO (``logging.basicConfig``). Prints ``READY`` on stdout
once the engine is READY; then each stdin line ``ping N`` stores a prompt of seed N,
looks it up and prints ``pong N HIT`` (the lookup's answer in tokens); EOF closes the
engine and exits 0. Everything runs on the engine's event loop: a loop blocked in a
``write(2)`` to a full stderr pipe answers no ping.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from engine_rig import BS, Client, embedded_engine, tokens

from kvshm.hashing import chain_hashes
from kvshm.types import RequestView


async def main(name: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    async with embedded_engine(name=name) as (eng, gpu, _, _):
        c = Client(eng, gpu)
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            n = int(line.split()[1])
            toks = tokens(4 * BS + 1, seed=n)
            await c.store_only(f"p{n}", toks)
            hit = eng.lookup(RequestView(f"q{n}", chain_hashes(toks, BS), len(toks)), 0)
            print(f"pong {n} {hit}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
