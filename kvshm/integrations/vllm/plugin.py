"""vLLM's general plugin for kvshm: registers ``KvshmConnector`` by name.

kvshm's package metadata names :func:`register` under the entry-point group
``vllm.general_plugins``; vLLM calls every function of that group once in each process
it starts (the API server or ``LLM`` process, EngineCore, every worker: vLLM 0.32's
``vllm/plugins/__init__.py``, ``load_general_plugins``), before it resolves a connector.
So ``--kv-transfer-config '{"kv_connector":"KvshmConnector","kv_role":"kv_both"}'`` needs
no ``kv_connector_module_path``. A ``VLLM_PLUGINS`` list that leaves out ``kvshm`` turns
this off (then give ``"kv_connector_module_path": "kvshm.integrations.vllm"``).

Invariants: idempotent (a second call in one process does nothing); cheap: loading
the entry point imports this package's pure-Python config (no torch, no vLLM), and
:func:`register` imports vLLM's connector factory, which every vLLM process imports
anyway (``vllm.entrypoints.llm`` does, EngineCore's scheduler and the workers do); the
connector module itself (torch, vLLM's connector base) is imported by the factory when a
connector is first built, and only if ``kv_connector`` names it. Never raises into
vLLM's plugin loader for a name taken by someone else (it logs that and leaves their
registration in place).
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]

#: The name ``kv_connector`` takes.
CONNECTOR_NAME: Final = "KvshmConnector"
#: Where vLLM's factory finds the class when the connector is first built.
CONNECTOR_MODULE: Final = "kvshm.integrations.vllm.connector"
CONNECTOR_CLASS: Final = "KvshmConnector"

log = logging.getLogger("kvshm.vllm")
_done = False


def register() -> None:
    """Register ``KvshmConnector`` with vLLM's ``KVConnectorFactory`` (once a process)."""
    global _done
    if _done:
        return
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE,
                                              CONNECTOR_CLASS)
    except ValueError:  # vLLM's "already registered": keep theirs, say so
        log.warning("kvshm: a connector named %r is already registered with vLLM; kvshm's "
                    "plugin left it in place (set kv_connector_module_path="
                    "'kvshm.integrations.vllm' to use kvshm's)", CONNECTOR_NAME)
    _done = True
