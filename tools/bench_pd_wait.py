"""A P/D decoder waiting for manifests that never come: what the wait costs the server,
the index's thread and the engine (vLLM CPU, tiny Llama, a real Valkey).

A proxy that routes a decode request before its prefill published (or a prefill engine
that died) leaves the decoder asking for a manifest that is not there; it recomputes
after the consumer's 5 s bound. One in-process vLLM engine with kvshm's remote tier
serves ``n`` such requests at once (names of this deployment's form, never published),
for each ``n`` in ``--requests``: the manifest reads and readiness queries it sent, the
index's round trips, the engine's empty steps and the process's CPU time, per waiting
request and second.

    python -m tools.bench_pd_wait --json

Every request must end recomputed (``pd_manifest_missing`` = ``n``) with its answer
right (the bench checks only that each request produced its tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools import bench_pd_vllm as pv

#: Waiting requests per round (``--requests``).
REQUESTS = (1, 8)
PROMPT_TOKENS = 200


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _foreign_names(llm: Any, n: int) -> list[str]:
    """``n`` manifest names of this deployment's form that nobody publishes: the
    engine's own prefill request's name with another request part."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": [pv.SPECIALS + i % 500 for i in range(80)]}],
                       SamplingParams(max_tokens=1, extra_args={
                           "kv_transfer_params": {"do_remote_decode": True}}),
                       use_tqdm=False)[0]
    pv.settle(llm, lambda s: s["remote"].get("pd_manifests_written", 0) >= 1)
    name = out.kv_transfer_params["kvshm_manifest"]
    head = name.rsplit(":", 1)[0]
    return [f"{head}:never-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(n)]


def round_of(llm: Any, n: int) -> dict[str, Any]:
    """``n`` requests wait for manifests that never come, then recompute."""
    from vllm import SamplingParams

    names = _foreign_names(llm, n)
    prompts = [{"prompt_token_ids": [pv.SPECIALS + (7 * k + j) % 500
                                     for j in range(PROMPT_TOKENS)]} for k in range(n)]
    params = [SamplingParams(max_tokens=2, extra_args={"kv_transfer_params": {
        "do_remote_prefill": True, "do_remote_decode": False, "kvshm_manifest": name}})
        for name in names]
    before, cpu0, t0 = pv.counters(llm), _cpu_s(), time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.monotonic() - t0, _cpu_s() - cpu0
    d = pv.delta(before, pv.counters(llm))
    per = n * wall
    return {
        "requests": n, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
        "answered": sum(1 for o in outs if len(o.outputs[0].token_ids) == 2),
        "manifest_missing": d.get("remote.pd_manifest_missing", 0),
        "manifest_reads": d.get("remote.index_values_got", 0),
        "readiness_queries": d.get("remote.index_queries", 0),
        "readiness_keys": d.get("remote.index_keys_queried", 0),
        "index_round_trips": d.get("remote.index_round_trips", 0),
        "engine_steps": d.get("steps", 0),
        "reads_per_request_s": round(d.get("remote.index_values_got", 0) / per, 1),
        "queries_per_request_s": round(d.get("remote.index_queries", 0) / per, 1),
    }


def run(requests: tuple[int, ...]) -> dict[str, Any]:
    from kvshm.remote.server import ValkeyServer

    pv._env()
    with tempfile.TemporaryDirectory(prefix="kvshm-pdwait-") as tmp:
        folder = Path(tmp)
        pv.build_model(folder / "model")
        server = ValkeyServer(maxmemory="256mb", workdir=folder).start()
        try:
            llm = pv.make_llm({"model": str(folder / "model"), "url": server.url})
            try:
                pv.warm_up(llm)
                rounds = [round_of(llm, n) for n in requests]
            finally:
                llm.llm_engine.engine_core.shutdown(timeout=30.0)
        finally:
            server.close()
    return {"rounds": rounds, "loadavg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON line last")
    ap.add_argument("--requests", default=",".join(map(str, REQUESTS)),
                    help="comma-separated waiting requests per round (1,8)")
    args = ap.parse_args(argv)
    requests = tuple(int(x) for x in args.requests.split(","))
    out = run(requests)
    for r in out["rounds"]:
        print(f"{r['requests']} waiting: {r['wall_s']} s, CPU {r['cpu_s']} s, manifest reads "
              f"{r['manifest_reads']} ({r['reads_per_request_s']}/request/s), readiness "
              f"queries {r['readiness_queries']} ({r['readiness_keys']} keys), index round "
              f"trips {r['index_round_trips']}, engine steps {r['engine_steps']}",
              file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(out))
    logging.shutdown()
    ok = all(r["answered"] == r["requests"] == r["manifest_missing"] for r in out["rounds"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
