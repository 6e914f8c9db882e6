"""Import direction: the scheduler side never pulls in the worker side or vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import kvshm, kvshm.engine, kvshm.engine.runtime, kvshm.offload.manager, kvshm.cli, kvshm.integrations.vllm
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('workers', 'vllm'))))
"""


def test_scheduler_side_imports_neither_workers_nor_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_package_exports_resolve_lazily() -> None:
    import kvshm

    assert kvshm.Engine.__name__ == "Engine" and kvshm.SPAWN.value == "spawn"
    assert kvshm.EngineConfig(block_size=16).world_size == 1
