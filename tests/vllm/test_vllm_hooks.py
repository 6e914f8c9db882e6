"""Every vLLM API the kvshm connector relies on exists in the installed vLLM, as expected.

Signature checks are by parameter names (and kinds), read with ``inspect.signature`` from
the installed classes; a vLLM upgrade that renames or drops a hook fails here first, with
the hook's name in the message. Data-class fields are checked with ``dataclasses.fields``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
    supports_hma,
)
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.core.sched.output import (
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor
from vllm.v1.outputs import KVConnectorOutput

# hook -> parameter names after ``self`` (for classmethods: after ``cls``).
CONNECTOR_HOOKS: dict[str, tuple[str, ...]] = {
    "__init__": ("vllm_config", "role", "kv_cache_config"),
    # scheduler side
    "bind_kv_cache_manager": ("kv_cache_manager",),
    "bind_gpu_block_pool": ("gpu_block_pool",),
    "on_new_request": ("request",),
    "get_num_new_matched_tokens": ("request", "num_computed_tokens"),
    "update_state_after_alloc": ("request", "blocks", "num_external_tokens"),
    "build_connector_meta": ("scheduler_output",),
    "update_connector_output": ("connector_output",),
    "request_finished": ("request", "block_ids"),
    "take_events": (),
    "has_pending_push_work": (),
    "reset_cache": (),
    "shutdown": (),
    # worker side
    "register_kv_caches": ("kv_caches",),
    "handle_preemptions": ("kv_connector_metadata",),
    "bind_connector_metadata": ("connector_metadata",),
    "start_load_kv": ("forward_context", "kwargs"),
    "wait_for_layer_load": ("layer_name",),
    "save_kv_layer": ("layer_name", "kv_layer", "attn_metadata", "kwargs"),
    "wait_for_save": (),
    "get_finished": ("finished_req_ids",),
    "get_transfer_results": ("finished_req_ids",),
    "get_block_ids_with_load_errors": (),
    "build_connector_worker_meta": (),
    "clear_connector_metadata": (),
}

# The abstract methods a connector must implement (vLLM 0.32).
ABSTRACT_HOOKS = {
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
}


def _param_names(func: Any) -> tuple[str, ...]:
    params = list(inspect.signature(func).parameters.values())
    assert params and params[0].name in ("self", "cls"), f"{func}: no self/cls first"
    return tuple(p.name for p in params[1:])


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("hook", sorted(CONNECTOR_HOOKS))
def test_connector_hook_signature(hook: str) -> None:
    func = getattr(KVConnectorBase_V1, hook, None)
    assert func is not None, f"KVConnectorBase_V1.{hook} is missing in this vLLM"
    assert _param_names(func) == CONNECTOR_HOOKS[hook], (
        f"KVConnectorBase_V1.{hook}{inspect.signature(func)} changed"
    )


def test_abstract_hooks_are_the_expected_set() -> None:
    assert set(KVConnectorBase_V1.__abstractmethods__) == ABSTRACT_HOOKS


def test_worker_hook_kinds() -> None:
    """``**kwargs`` really is a var-keyword parameter where vLLM passes extra arguments."""
    for hook in ("start_load_kv", "save_kv_layer"):
        last = list(inspect.signature(getattr(KVConnectorBase_V1, hook)).parameters.values())[-1]
        assert last.kind is inspect.Parameter.VAR_KEYWORD, hook


def test_supports_hma() -> None:
    func = SupportsHMA.request_finished_all_groups
    assert _param_names(func) == ("request", "block_ids")
    assert "request_finished_all_groups" in SupportsHMA.__abstractmethods__

    class Probe(SupportsHMA):  # type: ignore[misc, unused-ignore]
        def request_finished_all_groups(
            self, request: Any, block_ids: tuple[list[int], ...]
        ) -> tuple[bool, dict[str, Any] | None]:
            return False, None

    assert supports_hma(Probe) and supports_hma(Probe())
    assert not supports_hma(KVConnectorBase_V1)


def test_roles_and_metadata_bases() -> None:
    assert {r.name for r in KVConnectorRole} == {"SCHEDULER", "WORKER"}
    assert not KVConnectorMetadata.__abstractmethods__  # a plain marker base
    assert set(KVConnectorWorkerMetadata.__abstractmethods__) == {"aggregate"}
    assert _param_names(KVConnectorWorkerMetadata.aggregate) == ("other",)
    assert _field_names(KVConnectorTransferResults) == {
        "finished_sending",
        "finished_recving",
        "failed_recving",
    }


def test_kv_transfer_config_fields() -> None:
    names = _field_names(KVTransferConfig)
    for name in (
        "kv_connector",
        "engine_id",
        "kv_role",
        "kv_connector_module_path",
        "kv_connector_extra_config",
        "kv_load_failure_policy",
    ):
        assert name in names, f"KVTransferConfig.{name} is missing"
    cfg = KVTransferConfig(kv_connector="X", kv_role="kv_both")
    # vLLM 0.32 draws engine_id (uuid4) once, where the config is built; its default
    # failure policy aborts requests, so the connector must insist on "recompute".
    assert isinstance(cfg.engine_id, str) and len(cfg.engine_id) == 36
    assert cfg.engine_id != KVTransferConfig(kv_connector="X", kv_role="kv_both").engine_id
    assert cfg.kv_load_failure_policy == "fail"
    assert KVTransferConfig(
        kv_connector="X", kv_role="kv_both", kv_load_failure_policy="recompute"
    ).kv_load_failure_policy == "recompute"


def test_block_pool_api() -> None:
    """The GPU pool a scheduler-side connector receives in ``bind_gpu_block_pool``."""
    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=32)
    assert _param_names(BlockPool.touch) == ("blocks",)
    assert _param_names(BlockPool.free_blocks) == ("ordered_blocks",)
    assert _param_names(BlockPool.get_cached_block) == ("block_hash", "kv_cache_group_ids")
    assert _param_names(BlockPool.get_new_blocks) == ("num_blocks",)
    assert _param_names(BlockPool.get_num_free_blocks) == ()
    assert _param_names(FreeKVCacheBlockQueue.iter_blocks_after) == ("cursor",)
    # Block 0 is the null block; the others start free.
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 7
    assert isinstance(pool.cached_block_hashes_by_block, dict)
    blocks = pool.get_new_blocks(2)
    assert all(isinstance(b, KVCacheBlock) and b.ref_cnt == 1 for b in blocks)
    pool.touch(blocks)
    assert [b.ref_cnt for b in blocks] == [2, 2]
    pool.free_blocks(blocks)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 7
    # Unhashed freed blocks go to the head of the free queue (reused first).
    head = list(pool.free_block_queue.iter_blocks_after(None))[:2]
    assert {b.block_id for b in head} == {b.block_id for b in blocks}
    assert pool.blocks[blocks[0].block_id] is blocks[0]
    for attr in ("block_id", "ref_cnt", "block_hash", "is_null"):
        assert hasattr(blocks[0], attr), attr


def test_scheduler_output_fields() -> None:
    assert {
        "scheduled_new_reqs",
        "scheduled_cached_reqs",
        "num_scheduled_tokens",
        "finished_req_ids",
        "preempted_req_ids",
        "kv_connector_metadata",
        "has_sync_kv_loads",
    } <= _field_names(SchedulerOutput)
    assert {"req_id", "block_ids", "num_computed_tokens"} <= _field_names(NewRequestData)
    assert {
        "req_ids",
        "resumed_req_ids",
        "new_block_ids",
        "num_computed_tokens",
        "num_output_tokens",
    } <= _field_names(CachedRequestData)
    assert _param_names(KVCacheBlocks.get_block_ids) == ("allow_none", "group_ids")


def test_connector_output_fields() -> None:
    assert {
        "finished_sending",
        "finished_recving",
        "invalid_block_ids",
        "failed_recving",
        "kv_connector_worker_meta",
        "expected_finished_count",
    } <= _field_names(KVConnectorOutput)


def test_kv_cache_config_fields() -> None:
    assert {"num_blocks", "kv_cache_tensors", "kv_cache_groups", "kv_cache_layout"} <= (
        _field_names(KVCacheConfig)
    )
    assert {"size", "layers", "layer_stride", "block_stride", "offset"} <= _field_names(
        KVCacheTensor
    )


def test_request_fields() -> None:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=4, extra_args={"kv_transfer_params": {"do_remote_decode": True}}
    )
    req = Request("r0", list(range(70)), params, None)
    assert req.request_id == "r0" and req.num_tokens == 70
    assert req.num_computed_tokens == 0 and req.num_output_placeholders == 0
    assert req.kv_transfer_params == {"do_remote_decode": True}
    assert req.block_hashes == []  # filled by the engine's block hasher
    assert req.skip_reading_prefix_cache is False
