"""kvshm as vLLM's KV connector, offline, on the tiny model: a prompt's KV comes back from
kvshm's CPU tier after vLLM's own prefix cache lost it.

Run from the repository root (after ``pip install -e .`` and
``bash tools/vllm_install.sh .venv/bin/python``)::

    python examples/tiny_llama.py /tmp/tiny-llama
    python examples/vllm_quickstart.py /tmp/tiny-llama

The connector is one line, ``KVTransferConfig(kv_connector="KvshmConnector",
kv_role="kv_both")``: every other setting has a default (the CPU tier takes a quarter
of the available memory; the start-up log says how much). The device KV pool is made
small on purpose (``max_model_len=512``, ``kv_cache_memory_bytes=327680``: 5 blocks of
128 tokens, 64 KiB each for this model's bfloat16 KV), so it holds one 400-token prompt
at a time. The first call runs prompts A and B: B evicts A from vLLM's prefix cache,
kvshm keeps both. The second call runs A again: its three full blocks come back from
kvshm. It prints::

    first call:  A cached 0 tokens, B cached 0 tokens
    second call: A cached 384 tokens, same answer: True
    kvshm: 384 hit tokens (kvshm_hit_tokens_total), 3 blocks loaded

``examples/vllm_serve_quickstart.sh`` is the same with ``vllm serve``;
tests/vllm/test_quickstarts.py runs both files as they are.
"""

from __future__ import annotations

import sys

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

from kvshm.integrations.vllm import engine_stats, hit_tokens

PROMPT_A = " ".join(f"w{i}" for i in range(400))  # 400 tokens with the tiny model
PROMPT_B = " ".join(f"w{i}" for i in range(100, 500))


def main() -> int:
    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny-llama"
    llm = LLM(model=model, max_model_len=512, kv_cache_memory_bytes=327680,
              kv_transfer_config=KVTransferConfig(kv_connector="KvshmConnector",
                                                  kv_role="kv_both"))
    params = SamplingParams(max_tokens=8, temperature=0.0)
    try:
        a, b = llm.generate([PROMPT_A, PROMPT_B], params)
        again = llm.generate([PROMPT_A], params)[0]
        stats = engine_stats(llm)  # what `kvshm stats --name` prints
    finally:
        llm.llm_engine.engine_core.shutdown(timeout=30)  # vLLM 0.32's LLM has no close()
    same = again.outputs[0].text == a.outputs[0].text
    print(f"first call:  A cached {a.num_cached_tokens} tokens, "
          f"B cached {b.num_cached_tokens} tokens")
    print(f"second call: A cached {again.num_cached_tokens} tokens, same answer: {same}")
    hits = hit_tokens(stats)
    print(f"kvshm: {hits} hit tokens (kvshm_hit_tokens_total), "
          f"{stats['counters']['loaded_blocks']} blocks loaded")
    return 0 if hits > 0 and same else 1


if __name__ == "__main__":  # vLLM starts its engine processes with spawn: keep the guard
    sys.exit(main())
