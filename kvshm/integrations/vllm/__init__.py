"""kvshm as a vLLM KV connector (vLLM is optional).

One line enables it: kvshm's package registers ``KvshmConnector`` with vLLM through the
``vllm.general_plugins`` entry point (:mod:`~kvshm.integrations.vllm.plugin`), so no
module path is needed and every other setting has a default::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"KvshmConnector","kv_role":"kv_both"}'

    from vllm import LLM
    from vllm.config import KVTransferConfig

    llm = LLM(model=..., kv_transfer_config=KVTransferConfig(
        kv_connector="KvshmConnector", kv_role="kv_both"))

(``examples/vllm_quickstart.py`` and ``examples/vllm_serve_quickstart.sh`` show a
kvshm hit; :func:`engine_stats` reads kvshm's statistics from the ``LLM``'s process,
:func:`hit_tokens` the number ``/metrics`` calls ``kvshm_hit_tokens_total``.) With
``VLLM_PLUGINS`` set to a list without ``kvshm``, add
``"kv_connector_module_path": "kvshm.integrations.vllm"``, which loads it the old way.

Importing this module does not import vLLM: ``KvshmConnector`` and ``KvshmMetadata``
are resolved on first attribute access (PEP 562), which imports
:mod:`kvshm.integrations.vllm.connector` and vLLM with it. The configuration keys are
documented in :mod:`kvshm.integrations.vllm.config`; the scheduler side in
:mod:`~kvshm.integrations.vllm.scheduler`, the worker side in
:mod:`~kvshm.integrations.vllm.worker`.

Pinned vLLM version: 0.32 (``VLLM_VERSION``); every hook the connector overrides
exists there (``CONNECTOR_HOOKS``; tests/vllm checks both).

Operating it (issue 14): an idle engine answers ``kvshm stats --name`` through the
scheduler side's service thread (:mod:`~kvshm.integrations.vllm.service`); the file at
``stats_path`` holds the engine as it served, not its teardown
(:mod:`~kvshm.integrations.vllm.final_stats`); kvshm's log lines go through vLLM's
handler (:mod:`~kvshm.integrations.vllm.logs`); its counters reach vLLM's stats log and
``/metrics`` as ``kvshm_*`` series (:mod:`~kvshm.integrations.vllm.metrics`).

What the package may import: the scheduler side (connector, config, scheduler, listing,
records, blocks, service, final_stats, logs, metrics) builds on ``kvshm.engine`` and
never imports ``workers``; only
:mod:`~kvshm.integrations.vllm.worker` embeds a ``workers`` Worker in vLLM's worker
process, and it never plans (``tests/unit/test_imports.py``). The invariant a change
keeps: no scheduler hook raises into vLLM for bad input or a dead rank; a refused or
failed load becomes a failed load that vLLM recomputes.
"""

from __future__ import annotations

import importlib
from typing import Any, Final

from kvshm.integrations.vllm.config import ConnectorConfig, engine_name, parse_config
from kvshm.integrations.vllm.query import engine_stats, hit_tokens

__all__ = [
    "CONNECTOR_HOOKS",
    "ConnectorConfig",
    "KvshmConnector",
    "KvshmMetadata",
    "VLLM_VERSION",
    "engine_name",
    "engine_stats",
    "hit_tokens",
    "parse_config",
]

#: The vLLM release the connector is built and tested against.
VLLM_VERSION: Final = "0.32"

#: Every ``KVConnectorBase_V1`` / ``SupportsHMA`` method ``KvshmConnector`` overrides.
CONNECTOR_HOOKS: Final = (
    "__init__",
    "bind_gpu_block_pool",
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "requires_piecewise_for_cudagraph",
    "take_events",
    "has_pending_push_work",
    "reset_cache",
    "register_kv_caches",
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "clear_connector_metadata",
    "shutdown",
    "requires_kv_delivery",
    "get_kv_connector_stats",
    "build_kv_connector_stats",
    "build_prom_metrics",
)

_LAZY: Final = frozenset({"KvshmConnector", "KvshmMetadata"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod = importlib.import_module("kvshm.integrations.vllm.connector")
        value = getattr(mod, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
