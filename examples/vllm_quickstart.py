"""kvshm as vLLM's KV connector, offline, on the tiny model: a prompt, vLLM's prefix cache
dropped, the same prompt again -- its KV comes back from kvshm's CPU tier.

Run (after ``bash tools/vllm_install.sh .venv/bin/python`` and ``pip install -e .``):

    python examples/tiny_llama.py /tmp/tiny-llama
    OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1 python examples/vllm_quickstart.py /tmp/tiny-llama

It prints each answer's ``num_cached_tokens`` (vLLM counts the tokens kvshm loaded there
too) and the connector's statistics (``stats_path``, written when the engine shuts
down): ``lookup_hit_tokens`` > 0 is the CPU tier at work. While it runs, ``kvshm stats
--name quickstart`` asks the engine from another shell.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

PROMPT = " ".join(f"w{i}" for i in range(300))  # 300 tokens with the tiny model


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
    stats_path = Path(tempfile.mkdtemp(prefix="kvshm-quickstart-")) / "stats.json"
    llm = LLM(model=model, enable_prefix_caching=True, max_model_len=2048, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20,  # the tiny model needs little; a real one: omit
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvshmConnector",
                  kv_connector_module_path="kvshm.integrations.vllm",
                  kv_role="kv_both", kv_load_failure_policy="recompute",
                  kv_connector_extra_config={"cpu_bytes": 1 << 30, "name": "quickstart",
                                             "stats_path": str(stats_path)}))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = llm.generate([PROMPT], params)[0]
    # vLLM's own prefix cache would serve the repeat; drop it. False while kvshm still
    # stores the finished request's blocks (pinned in vLLM's pool): retry.
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            print("reset_prefix_cache() stayed False for 30 s", file=sys.stderr)
            return 1
        llm.generate(["w1"], SamplingParams(max_tokens=1))  # steps the engine
    second = llm.generate([PROMPT], params)[0]
    print(f"first:  cached {first.num_cached_tokens} tokens, {first.outputs[0].text!r}")
    print(f"second: cached {second.num_cached_tokens} tokens, {second.outputs[0].text!r}")
    llm.llm_engine.engine_core.shutdown(timeout=30)  # writes stats_path
    counters = json.loads(stats_path.read_text())["counters"]
    print(f"kvshm: lookup_hit_tokens={counters['lookup_hit_tokens']}, "
          f"stored_blocks={counters.get('stored_blocks')}, "
          f"loaded_blocks={counters.get('loaded_blocks')}")
    return 0 if counters["lookup_hit_tokens"] > 0 else 1


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: keep the guard
    sys.exit(main())
