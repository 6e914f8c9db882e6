"""vLLM's general plugin for kvshm: registers ``KvshmConnector`` by name.

kvshm's package metadata names :func:`register` under the entry-point group
``vllm.general_plugins``; vLLM calls every function of that group once in each process
it starts (the API server or ``LLM`` process, EngineCore, every worker: vLLM 0.32's
``vllm/plugins/__init__.py``, ``load_general_plugins``), before it resolves a connector.
So ``--kv-transfer-config '{"kv_connector":"KvshmConnector","kv_role":"kv_both"}'`` needs
no ``kv_connector_module_path``. A ``VLLM_PLUGINS`` list that leaves out ``kvshm`` turns
this off (then give ``"kv_connector_module_path": "kvshm.integrations.vllm"``).

The same call also makes the process that builds vLLM's config check kvshm's
``kv_connector_extra_config`` first (:func:`check_before_engine_start`): vLLM builds the
connector only inside EngineCore and its workers, where an error surfaces as vLLM's
"Engine core initialization failed" after the workers' tracebacks; checked in the
front end, a typo is the first line of what ``LLM(...)`` or ``vllm serve`` raises,
before any process starts. vLLM offers no hook there, so this wraps
``EngineArgs.create_engine_config`` (the one call every entry point makes to turn its
arguments into a config; ``load_general_plugins`` runs from ``EngineArgs`` itself, so the
module is loaded by then). The wrapper checks only configs that name kvshm and then
calls vLLM's method unchanged; where vLLM lacks the method it installs nothing (the
connector still checks the same keys when it is built). Once vLLM's method returns,
the wrapper also checks what kvshm needs of the resolved config (``kv_role``, prefix
caching as vLLM left it -- its CPU platform turns it off for MLA models --, no context
parallelism): refused there too, not in EngineCore.

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

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any, Final

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME",
           "check_before_engine_start", "register"]

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
    check_before_engine_start()  # idempotent; a first call may precede vLLM's arg_utils
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


def check_before_engine_start() -> bool:
    """Wrap vLLM's ``EngineArgs.create_engine_config`` so it first checks a kvshm
    ``kv_connector_extra_config`` (module docstring). True when the wrapper is in place
    (now or before); False where this process has not loaded ``vllm.engine.arg_utils``
    (EngineCore, workers: the connector checks there) or vLLM has no such method."""
    module = sys.modules.get("vllm.engine.arg_utils")
    engine_args = getattr(module, "EngineArgs", None)
    original = getattr(engine_args, "create_engine_config", None)
    if engine_args is None or original is None:
        return False
    if getattr(original, "_kvshm_checked", False):
        return True
    wrapper = _checked(original)
    engine_args.create_engine_config = wrapper
    return True


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` preceded by kvshm's extra-config check and followed by its check of
    the resolved config, where the args name kvshm."""

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        extra = _kvshm_extra_config(getattr(self, "kv_transfer_config", None))
        if extra is None:
            return original(self, *args, **kwargs)
        from kvshm.integrations.vllm.config import (
            check_extra_config,
            check_paths,
            check_vllm_config,
        )

        world = (getattr(self, "tensor_parallel_size", 1) or 1) * (
            getattr(self, "pipeline_parallel_size", 1) or 1)
        check_paths(check_extra_config(extra, world_size=world))
        config = original(self, *args, **kwargs)
        check_vllm_config(config)  # kv_role, prefix caching as vLLM resolved them
        return config

    create_engine_config._kvshm_checked = True  # type: ignore[attr-defined]
    return create_engine_config


def _kvshm_extra_config(kv: Any) -> Any:
    """The ``kv_connector_extra_config`` of ``kv`` (a KVTransferConfig, a dict or None)
    when it names kvshm's connector (by name or module path), else None."""
    if kv is None:
        return None
    get = kv.get if isinstance(kv, dict) else lambda k, d=None: getattr(kv, k, d)
    module = get("kv_connector_module_path") or ""
    ours = (get("kv_connector") == CONNECTOR_NAME and not module) or (
        module.startswith("kvshm.integrations.vllm"))
    return (get("kv_connector_extra_config") or {}) if ours else None
