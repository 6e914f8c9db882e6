#!/usr/bin/env bash
# kvshm's vLLM quick start with `vllm serve`: a prompt's KV comes back from kvshm's CPU
# tier after vLLM's own prefix cache lost it. Run it from the repository root, in a venv
# with kvshm (pip install -e .) and vLLM (bash tools/vllm_install.sh .venv/bin/python):
#
#     bash examples/vllm_serve_quickstart.sh            # MODEL=/tmp/tiny-llama PORT=8000
#
# The connector is one line: '{"kv_connector":"KvshmConnector","kv_role":"kv_both"}';
# every other setting has a default (the CPU tier takes a quarter of the available
# memory; the server's start-up log says how much). --max-model-len 512 and
# --kv-cache-memory-bytes 327680 (5 blocks of 128 tokens, 64 KiB each for the tiny
# model's bfloat16 KV) make vLLM's device pool hold one 400-token prompt at a time:
# the first request's prompt B evicts its prompt A from vLLM's prefix cache, kvshm
# keeps both, and the second request's A is served from kvshm: /metrics then says
# `kvshm_hit_tokens_total{...} 384.0`. examples/vllm_quickstart.py is the same offline,
# with the same numbers; tests/vllm/test_quickstarts.py runs both as they are.
set -euo pipefail
MODEL=${MODEL:-/tmp/tiny-llama}
PORT=${PORT:-8000}

python examples/tiny_llama.py "$MODEL"   # a random 2-layer Llama; no hub, no network
vllm serve "$MODEL" --port "$PORT" --max-model-len 512 --kv-cache-memory-bytes 327680 \
  --kv-transfer-config '{"kv_connector":"KvshmConnector","kv_role":"kv_both"}' &
server=$!
trap 'kill -INT "$server" 2>/dev/null; wait "$server"' EXIT   # Ctrl-C to it at the end
until curl -sf "localhost:$PORT/health" >/dev/null; do kill -0 "$server"; sleep 1; done

A=$(seq -f 'w%g' 0 399 | paste -sd' ')     # 400 tokens: the tiny model's words are
B=$(seq -f 'w%g' 100 499 | paste -sd' ')   # one token each
curl -s "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": [\"$A\", \"$B\"], \"max_tokens\": 8, \"temperature\": 0}"
echo
sleep 1   # kvshm hands vLLM its counters at most once a second, on an engine step
curl -s "localhost:$PORT/v1/completions" -H 'Content-Type: application/json' \
  -d "{\"model\": \"$MODEL\", \"prompt\": \"$A\", \"max_tokens\": 8, \"temperature\": 0}"
echo
curl -s "localhost:$PORT/metrics" | grep '^kvshm_hit_tokens_total'
