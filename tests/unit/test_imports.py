"""Import rules between the parts, as a table of imports that must never exist.

Two checks: a static one over every ``import`` statement of every module under
``kvshm/`` and ``workers/`` (function-level and ``TYPE_CHECKING`` imports included: a
type-only dependency is still a dependency), and a dynamic one that imports each part in
a fresh interpreter and lists what it actually loaded (catches an import hidden behind
another module, such as a leaf that pulls torch in).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The shared leaves: any part may import them; they import only each other and the
#: wire structs. ``kvshm`` itself resolves its exports lazily (by string), like _moved.
LEAVES = {"kvshm", "kvshm.errors", "kvshm.config", "kvshm.types", "kvshm.hashing",
          "kvshm.layout", "kvshm.shm", "kvshm.shm_budget", "kvshm.stats", "kvshm._moved",
          "kvshm.series",  # the table of Prometheus series (stdlib only)
          "kvshm.worker_cli",
          "kvshm.cuda_ipc",
          # the remote tier's interface (protocols, keys, header; stdlib only): the
          # config parses its URLs, the manager's remote book calls its ReadyIndex
          "kvshm.remote", "kvshm.remote.tier"}
#: The wire structs: the one module of ``kvshm.ipc`` that offload and the leaves may use.
PROTOCOL = "kvshm.ipc.protocol"

#: part -> the parts (or external top-level packages) it must never import.
FORBIDDEN: dict[str, set[str]] = {
    "ipc": {"offload", "engine", "workers", "integrations", "demo", "app", "vllm"},
    "offload": {"ipc", "engine", "workers", "integrations", "demo", "app", "vllm",
                "torch", "asyncio", "threading", "socket"},
    "workers": {"offload", "engine", "integrations", "demo", "app", "vllm"},
    "engine": {"workers", "integrations", "demo", "app", "vllm"},
    "integrations": {"workers", "demo", "app"},
    # the vLLM worker side embeds a Worker in vLLM's worker process; it never plans
    "integrations-worker": {"offload", "engine", "demo", "app"},
    "leaf": {"ipc", "offload", "engine", "workers", "integrations", "demo", "app", "vllm"},
    # the remote tier (Valkey): leaves and its client packages; workers and engine use it
    "remote": {"ipc", "offload", "engine", "workers", "integrations", "demo", "app",
               "vllm", "torch"},
}


def part_of(module: str) -> str:
    """The part a dotted module name belongs to (external packages: their top name)."""
    if module in LEAVES:
        return "leaf"
    if module == PROTOCOL:
        return "protocol"
    head, _, rest = module.partition(".")
    if head == "workers":
        return "workers"
    if head != "kvshm":
        return head
    sub = rest.split(".")[0]
    if sub == "integrations" and module.endswith(".worker"):
        return "integrations-worker"
    if sub in ("offload", "ipc", "engine", "integrations", "demo", "remote"):
        return sub
    return "app"  # kvshm.cli and the deprecated aliases: entry points, not a part


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module an ``import`` statement in ``path`` names, with its line."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                pkg = module.rsplit(".", node.level)[0]
                base = f"{pkg}.{base}" if base else pkg
            # ``from kvshm.ipc import protocol`` names the submodule, not the package
            out.extend((node.lineno, f"{base}.{a.name}") if f"{base}.{a.name}" in ALL
                       else (node.lineno, base) for a in node.names)
    return out


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for top in ("kvshm", "workers"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


ALL = _modules()


def test_the_parts_exist() -> None:
    """The table names real modules (a rename must not make it vacuous)."""
    parts = {part_of(m) for m in ALL}
    assert {"ipc", "offload", "workers", "engine", "integrations", "leaf",
            "protocol", "remote"} <= parts
    assert all(m in ALL for m in LEAVES - {"kvshm.worker_cli"})


@pytest.mark.parametrize("module", sorted(ALL))
def test_no_forbidden_import(module: str) -> None:
    src = part_of(module)
    forbidden = FORBIDDEN.get(src, set())
    bad = [f"line {line}: {target} ({part_of(target)})"
           for line, target in imports_of(ALL[module], module)
           if part_of(target) in forbidden]
    assert not bad, f"{module} ({src}) imports what it must not: {bad}"


def test_the_static_check_can_fail(tmp_path: Path) -> None:
    """A planted violation is reported (the scanner sees function-level imports)."""
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    import torch\n    from kvshm.engine.runtime import Runtime\n")
    found = {part_of(t) for _, t in imports_of(bad, "kvshm.offload.m")}
    assert {"torch", "engine"} <= found & FORBIDDEN["offload"]


PROBE = """
import importlib, json, sys
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(sys.modules)))
"""


def loaded_by(module: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", PROBE, module], capture_output=True,
                         text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


#: Package modules whose ``__init__`` is a docstring (importing a submodule loads them).
_BARE_PACKAGES = {"kvshm.ipc", "kvshm.offload", "kvshm.integrations"}


def _kvshm_parts(mods: set[str]) -> set[str]:
    return {part_of(m) for m in mods
            if m.split(".")[0] in ("kvshm", "workers") and m not in _BARE_PACKAGES}


def test_the_manager_loads_no_torch_no_asyncio_no_transport() -> None:
    mods = loaded_by("kvshm.offload.manager")
    assert not {"torch", "asyncio", "vllm"} & mods
    assert _kvshm_parts(mods) <= {"offload", "leaf", "protocol"}


def test_the_embedded_worker_loads_only_ipc_and_leaves() -> None:
    """... and the remote tier's interface (its mover's types), not a remote client:
    glide loads only where Ready names a remote tier."""
    mods = loaded_by("workers.worker")
    assert "vllm" not in mods
    assert not [m for m in mods if m.split(".")[0] in ("glide", "glide_sync", "redis")]
    assert _kvshm_parts(mods) <= {"workers", "ipc", "protocol", "leaf", "remote"}


def test_the_scheduler_side_loads_neither_workers_nor_vllm() -> None:
    for module in ("kvshm.engine", "kvshm.cli", "kvshm.integrations.vllm"):
        mods = loaded_by(module)
        assert not {"workers", "vllm"} & {m.split(".")[0] for m in mods}, module


def test_package_exports_resolve_lazily() -> None:
    import kvshm

    assert kvshm.Engine.__name__ == "Engine" and kvshm.SPAWN.value == "spawn"
    assert kvshm.EngineConfig(block_size=16).world_size == 1


@pytest.mark.parametrize("old,new", [("kvshm.manager", "kvshm.offload.manager"),
                                     ("kvshm.pool", "kvshm.offload.pool"),
                                     ("kvshm.protocol", "kvshm.ipc.protocol")])
def test_old_paths_warn_and_alias_the_new_module(old: str, new: str) -> None:
    code = (f"import warnings, importlib; warnings.simplefilter('error')\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print(w)\n"
            f"warnings.simplefilter('ignore'); import {old} as a, {new} as b\n"
            f"assert a is b, (a, b)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == f"{old} is deprecated: import {new} (the old path goes " \
                                 f"in kvshm 0.3)"
