"""Two vLLM CPU engines with kvshm and one remote tier, for the tests that hand KV from
one to the other (``test_vllm_remote``: a shared cache; ``test_vllm_pd``: P/D).

One engine runs in the test's process (vLLM in-process mode; vLLM is imported already),
the other is the test file run as a script, started first so that its vLLM import
(~14 s of CPU here) overlaps the first engine's work. Both use the tiny Llama of
``tests/vllm/conftest`` with the same ``PYTHONHASHSEED`` (it seeds vLLM's prefix hashes:
without it the two engines' block hashes differ). Not a test module: imported by them
(``tests`` is on pytest's path; :func:`spawn` puts it on the script's).
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK = 32
PROMPTS = 3
PROMPT_TOKENS = 200  # 6 full blocks + 8 tokens
MAX_TOKENS = 4
FULL_BLOCKS = PROMPT_TOKENS // BLOCK
ROOT = Path(__file__).resolve().parents[1]


def llm(cfg: dict[str, Any]) -> Any:
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
               seed=cfg["seed"], kv_cache_memory_bytes=cfg.get("kv_bytes", 16 << 20),
               kv_transfer_config=kv)


def scheduler_side(engine: Any) -> Any:
    """kvshm's scheduler side inside an in-process vLLM engine."""
    return engine.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side


def step_until(engine: Any, done: Callable[[dict[str, Any]], bool],
               timeout_s: float = 30.0) -> None:
    """Step the in-process engine (nothing scheduled) until ``done(stats)``."""
    core = engine.llm_engine.engine_core.engine_core
    side = scheduler_side(engine)
    deadline = time.monotonic() + timeout_s
    while True:
        _, executed = core.step_fn()
        core.post_step(model_executed=executed)
        if not core.scheduler.has_requests() and done(side.statistics()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; stats: {side.statistics().get('remote')}")
        time.sleep(0.01)


def warm_up(engine: Any) -> None:
    """kvshm's worker rank attaches at the first step that runs the model: a request
    shorter than a block (nothing stored, nothing looked up), then READY."""
    from vllm import SamplingParams

    engine.generate(["w500 w501 w502"], SamplingParams(max_tokens=1), use_tqdm=False)
    step_until(engine, lambda stats: stats["state"] == "ready")


def greedy(**kw: Any) -> Any:
    """Greedy sampling of ``MAX_TOKENS`` tokens with the top-3 logprobs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          logprobs=3, **kw)


def record(out: Any) -> dict[str, Any]:
    """Cached tokens, token ids, top-3 logprobs (JSON: floats exact) and the
    ``kv_transfer_params`` of one output."""
    return {"cached": out.num_cached_tokens, "tokens": list(out.outputs[0].token_ids),
            "logprobs": [[[t, lp.logprob] for t, lp in sorted(pos.items())]
                         for pos in out.outputs[0].logprobs],
            "params": out.kv_transfer_params}


def spawn(script: str, cfg: dict[str, Any], log: Path, hash_seed: str
          ) -> subprocess.Popen[str]:
    """``script`` run as the other engine (its ``child(cfg)``), stdin a pipe."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "TORCH_COMPILE_DISABLE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                       os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, script, json.dumps(cfg)], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)


@contextmanager
def in_process_engine(cfg: dict[str, Any], hash_seed: str) -> Iterator[Any]:
    """The engine of the test's process (vLLM in-process mode), shut down on exit. What
    ``_run_llm`` of conftest does, but for its check that no child process is left:
    Valkey and the other engine are children of this process and must outlive it."""
    import torch
    import vllm.envs

    set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": hash_seed}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # vLLM reads both when it builds the engine
    vllm.envs.disable_envs_cache()
    engine = None
    try:
        engine = llm(cfg)
        yield engine
    finally:
        if engine is not None:
            engine.llm_engine.engine_core.shutdown(timeout=30.0)
            del engine
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
