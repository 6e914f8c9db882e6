"""kvshm: a KV-cache offload engine for LLM serving (CPU-memory tier over shared memory).

The public API is exported lazily (PEP 562) so that importing a leaf module such as
``kvshm.ipc.protocol`` from a worker process loads no manager, pool or engine code.

``kvshm.shared_tensor`` makes the device caches a custom server hands to
``Engine.launch`` (CPU tensors in shared memory the worker processes can map);
``kvshm.chain_hashes`` names a prompt's full blocks the way the engine does.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    "Engine": "kvshm.engine",
    "SyncClient": "kvshm.engine",
    "WorkerMode": "kvshm.engine",
    "EngineState": "kvshm.engine",
    "SPAWN": "kvshm.engine",
    "ATTACH": "kvshm.engine",
    "EngineConfig": "kvshm.config",
    "StoreMode": "kvshm.types",
    "OffloadManager": "kvshm.offload.manager",
    "BlockPool": "kvshm.offload.pool",
    "RequestView": "kvshm.types",
    "ScheduledRequest": "kvshm.types",
    "KVGroup": "kvshm.types",
    "StepInput": "kvshm.types",
    "StepPlan": "kvshm.types",
    "LoadResult": "kvshm.types",
    "errors": "kvshm.errors",
    "shared_tensor": "kvshm.shm",
    "chain_hashes": "kvshm.hashing",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvshm' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.endswith(name) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
