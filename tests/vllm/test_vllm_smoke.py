"""A real vLLM engine on the CPU with a do-nothing connector loaded by module path.

Baseline for the kvshm connector (no offload): a prompt, ``reset_prefix_cache()``, the
same prompt again -> no cached tokens and bitwise-equal logprobs (float32; also bfloat16),
then once more -> vLLM's own prefix cache hits 96 tokens. The recording connector
(``null_connector.py``) shows which hooks ran, in which process, in what order, with
which engine id; the tests pin the facts the kvshm connector is built on.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

from vllm import SamplingParams

# Fixtures from conftest.py: tiny_llama (TinyModel), llm_factory, drain.
LLMFactory = Callable[..., AbstractContextManager[Any]]
Drain = Callable[[Any], int]

PROMPT_TOKENS = 100  # 3 full blocks of 32 tokens + 4
MAX_TOKENS = 8
NUM_LAYERS = 2

SCHEDULER_HOOKS = {
    "__init__",
    "bind_gpu_block_pool",
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "take_events",
    "shutdown",
}
WORKER_HOOKS = {
    "__init__",
    "register_kv_caches",
    "set_host_xfer_buffer_ops",
    "handle_preemptions",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "shutdown",
}
# Worker hooks of one step with model work, in vLLM 0.32's order (no sync loads).
WORKER_STEP_ORDER = [
    "handle_preemptions",
    "bind_connector_metadata",
    *["wait_for_layer_load", "save_kv_layer"] * NUM_LAYERS,
    "start_load_kv",
    "wait_for_save",
    "get_finished",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
    "clear_connector_metadata",
]


def _read_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _logprobs(output: Any) -> list[dict[int, float]]:
    return [{tok: lp.logprob for tok, lp in step.items()} for step in output.outputs[0].logprobs]


def _generate(llm: Any, prompt: str) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    return out


def _cold_reset_again(llm: Any, model: Any, drain: Drain | None = None) -> list[Any]:
    """Prompt, reset, same prompt, same prompt again; check caching and exactness."""
    prompt = model.prompt(PROMPT_TOKENS)
    cold = _generate(llm, prompt)
    if drain is not None:
        assert drain(llm) >= 1
    assert llm.reset_prefix_cache(), "reset_prefix_cache refused: blocks still held"
    again = _generate(llm, prompt)
    hit = _generate(llm, prompt)
    assert cold.num_cached_tokens == 0
    assert again.num_cached_tokens == 0  # the reset worked and the connector gave nothing
    assert hit.num_cached_tokens == 96  # vLLM's own prefix cache: 3 full blocks
    assert len(cold.outputs[0].token_ids) == MAX_TOKENS
    for out in (again, hit):
        assert out.outputs[0].token_ids == cold.outputs[0].token_ids
        assert _logprobs(out) == _logprobs(cold)  # bitwise: float == on every logprob
    return [cold, again, hit]


def _by_role(lines: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    roles: dict[str, list[dict[str, Any]]] = {"SCHEDULER": [], "WORKER": []}
    for line in lines:
        roles[line["role"]].append(line)
    return roles


def _check_common(lines: list[dict[str, Any]], llm_engine_id: str, dtype: str) -> None:
    """Facts that hold in both modes: engine id, KV tensors, step order, finish hook."""
    roles = _by_role(lines)
    inits = [ln for ln in lines if ln["hook"] == "__init__"]
    assert sorted(ln["role"] for ln in inits) == ["SCHEDULER", "WORKER"]
    assert {ln["engine_id"] for ln in inits} == {llm_engine_id}
    assert all(ln["kv_load_failure_policy"] == "recompute" for ln in inits)
    assert all(ln["async_scheduling"] is False for ln in inits)  # forced off on CPU
    # One OpenMP thread per process (2 on 2 cores makes each step ~60x slower under load).
    assert all(ln["torch_threads"] == 1 for ln in inits), inits
    init = inits[0]
    assert init["kv_cache_layout"] == "LBHNC" and init["block_size"] == 32
    (kv_tensor,) = init["kv_cache_tensors"]
    num_blocks = init["num_blocks"]

    (reg,) = [ln for ln in roles["WORKER"] if ln["hook"] == "register_kv_caches"]
    tensors = reg["tensors"]
    assert [t["name"] for t in tensors] == kv_tensor["layers"]
    elem = 4 if dtype == "float32" else 2
    for i, t in enumerate(tensors):
        # [blocks, kv heads, block_size, 2 * head_dim]: K and V inside each block.
        assert t["shape"] == [num_blocks, 2, 32, 64]
        assert t["dtype"] == f"torch.{dtype}" and t["contiguous"] and t["device"] == "cpu"
        assert t["stride"][0] * elem == kv_tensor["block_stride"]
        # All layers share one storage, layer-outermost.
        assert t["storage_ptr"] == tensors[0]["storage_ptr"]
        assert t["offset_in_storage"] == i * kv_tensor["layer_stride"]

    worker = [ln["hook"] for ln in roles["WORKER"]]
    first = worker.index("handle_preemptions")
    assert worker[first : first + len(WORKER_STEP_ORDER)] == WORKER_STEP_ORDER

    # A finished request's id reaches the worker's get_finished in a later step.
    finished = [ln for ln in roles["WORKER"] if ln["hook"] == "get_finished" and ln["finished"]]
    assert finished, "no step told the worker which requests finished"


def _check_finish_hook(lines: list[dict[str, Any]], hook: str, other: str) -> None:
    sched = [ln for ln in lines if ln["role"] == "SCHEDULER"]
    done = [ln for ln in sched if ln["hook"] == hook]
    assert done and not [ln for ln in sched if ln["hook"] == other]
    first = done[0]
    tokens = PROMPT_TOKENS + MAX_TOKENS
    # The last sampled token is never computed; its KV does not exist yet.
    assert first["num_tokens"] == tokens and first["num_computed_tokens"] == tokens - 1
    assert first["num_output_placeholders"] == 0
    block_ids = first["block_ids"][0] if hook == "request_finished_all_groups" else first[
        "block_ids"
    ]
    assert len(block_ids) == -(-(tokens - 1) // 32)


def test_in_process_hooks_and_exact_logprobs(
    llm_factory: LLMFactory, tiny_llama: Any, drain: Drain, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.jsonl"
    with llm_factory("NullConnector", log_path=str(log), push_work_steps=2) as llm:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        _cold_reset_again(llm, tiny_llama, drain)
    lines = _read_log(log)
    assert {ln["pid"] for ln in lines} == {os.getpid()}
    roles = _by_role(lines)
    hooks = Counter((ln["role"], ln["hook"]) for ln in lines)
    assert {h for r, h in hooks if r == "SCHEDULER"} == SCHEDULER_HOOKS | {
        "request_finished_all_groups",
        "has_pending_push_work",  # only from drain_in_process: generate() never asks
    }
    assert {h for r, h in hooks if r == "WORKER"} == WORKER_HOOKS
    _check_common(lines, engine_id, "float32")
    _check_finish_hook(lines, "request_finished_all_groups", "request_finished")
    # drain_in_process ran the finish-notification step and one more that the connector
    # asked for with has_pending_push_work, both with nothing scheduled.
    metas = [ln for ln in roles["SCHEDULER"] if ln["hook"] == "build_connector_meta"]
    empty = [m for m in metas if m["total_num_scheduled_tokens"] == 0]
    assert len(empty) == 2 and empty[0]["finished_req_ids"] and not empty[1]["finished_req_ids"]
    assert hooks[("SCHEDULER", "reset_cache")] == 0  # reset_prefix_cache() leaves it alone


def test_in_process_bfloat16_without_hma(
    llm_factory: LLMFactory, tiny_llama: Any, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.jsonl"
    with llm_factory("NullConnectorNoHMA", dtype="bfloat16", log_path=str(log)) as llm:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        _cold_reset_again(llm, tiny_llama)
    lines = _read_log(log)
    _check_common(lines, engine_id, "bfloat16")
    _check_finish_hook(lines, "request_finished", "request_finished_all_groups")
    # Without SupportsHMA vLLM turns its hybrid allocator off itself.
    assert all(ln["disable_hma"] for ln in lines if ln["hook"] == "__init__")


def _wait_for_idle(log: Path, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Lines once the EngineCore has polled has_pending_push_work with nothing pending."""
    deadline = time.monotonic() + timeout
    while True:
        lines = _read_log(log)
        polls = [ln for ln in lines if ln["hook"] == "has_pending_push_work"]
        if polls and polls[-1]["pending"] == 0:
            return lines
        assert time.monotonic() < deadline, "EngineCore never went idle"
        time.sleep(0.05)


@pytest.mark.slow
def test_multi_process_hooks_and_exact_logprobs(
    llm_factory: LLMFactory, tiny_llama: Any, tmp_path: Path
) -> None:
    log = tmp_path / "hooks.jsonl"
    with llm_factory(
        "NullConnector", multiprocess=True, log_path=str(log), push_work_steps=2
    ) as llm:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
        _cold_reset_again(llm, tiny_llama)
        lines = _wait_for_idle(log)
    lines = _read_log(log)
    roles = _by_role(lines)
    sched_pids = {ln["pid"] for ln in roles["SCHEDULER"]}
    worker_pids = {ln["pid"] for ln in roles["WORKER"]}
    assert len(sched_pids) == 1 and len(worker_pids) == 1
    assert sched_pids != worker_pids and os.getpid() not in sched_pids | worker_pids
    hooks = {(ln["role"], ln["hook"]) for ln in lines}
    assert {h for r, h in hooks if r == "SCHEDULER"} == SCHEDULER_HOOKS | {
        "request_finished_all_groups",
        "has_pending_push_work",  # the EngineCore's busy loop polls it while idle
    }
    assert {h for r, h in hooks if r == "WORKER"} == WORKER_HOOKS
    _check_common(lines, engine_id, "float32")
    _check_finish_hook(lines, "request_finished_all_groups", "request_finished")
    # After the last request: the finish-notification step, then one more step because
    # has_pending_push_work said so, both with nothing scheduled.
    metas = [ln for ln in roles["SCHEDULER"] if ln["hook"] == "build_connector_meta"]
    assert [m["total_num_scheduled_tokens"] for m in metas[-2:]] == [0, 0]
    assert metas[-2]["finished_req_ids"] and not metas[-1]["finished_req_ids"]
