"""A P/D prefill engine that dies mid-publish: ``python tests/remote/pd_prefill_proc.py
URL SEED``. An engine with two embedded ranks serves the ``do_remote_decode`` request
``req-k`` (the prompt of ``SEED``), finishes it, prints its transfer params as one JSON
line and SIGKILLs itself before any store or PUT of the request completed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).parent)]

from engine_rig import Client, embedded_engine  # noqa: E402
from remote_engine_rig import MODEL, prompt  # noqa: E402
from test_pd_handoff import prefill  # noqa: E402


async def main(url: str, seed: int) -> None:
    async with embedded_engine(remote_url=url, model_id=MODEL) as (eng, gpu, _, ranks):
        ranks.paused = True  # no copy runs: the store never completes
        params, _ = await prefill(Client(eng, gpu), "req-k", prompt(seed))
        print(json.dumps(params), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
