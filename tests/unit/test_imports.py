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
#: wire structs. ``kvshm`` itself resolves its exports lazily (by string).
LEAVES = {"kvshm", "kvshm.errors", "kvshm.config", "kvshm.types", "kvshm.hashing",
          "kvshm.layout", "kvshm.shm", "kvshm.shm_budget", "kvshm.stats", "kvshm.ratelog",
          "kvshm.series",  # the table of Prometheus series (stdlib only)
          "kvshm.pids", "kvshm.slab_files",  # a pid's liveness, slab names (stdlib only)
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
    # the local disk tier's slab files (stdlib, leaves, the remote tier's checksum table):
    # the workers move bytes with it, the scheduler side scans and checks directories
    "disk": {"ipc", "offload", "engine", "workers", "integrations", "demo", "app", "vllm",
             "torch", "remote"},
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
    if sub in ("offload", "ipc", "engine", "integrations", "demo", "remote", "disk"):
        return sub
    return "app"  # kvshm.cli and its commands: entry points, not a part


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
            "protocol", "remote", "disk"} <= parts
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


#: The P/D package (``kvshm.offload.pd``) inside offload: it imports the rest of offload
#: one way. The rest of offload reaches it only through this seam: pd module -> the
#: offload modules (outside pd) that may import it; None: any (stateless: the manifest
#: record and the pure predicates on a request's params). The remote book holds the P/D
#: side (composition); no other pd module is imported from offload.
PD = "kvshm.offload.pd"
PD_SEAM: dict[str, set[str] | None] = {
    f"{PD}.manifest": None,
    f"{PD}.handoffs": {"kvshm.offload.remote"},
    f"{PD}.side": {"kvshm.offload.remote"},
}
#: pd modules that import nothing else of offload (the seam's stateless part included).
PD_LEAVES = {f"{PD}.manifest", f"{PD}.collected"}


def _in_pd(module: str) -> bool:
    return module == PD or module.startswith(PD + ".")


def _offload_imports(module: str) -> set[str]:
    """The kvshm.offload modules ``module`` imports."""
    return {t for _, t in imports_of(ALL[module], module) if t.startswith("kvshm.offload.")}


def test_the_pd_package_exists_with_its_seam() -> None:
    assert all(m in ALL for m in PD_SEAM.keys() | PD_LEAVES)


@pytest.mark.parametrize("module", sorted(m for m in ALL if part_of(m) == "offload"
                                          and not _in_pd(m)))
def test_offload_reaches_pd_only_through_the_seam(module: str) -> None:
    def allowed(target: str) -> bool:
        importers = PD_SEAM.get(target, set())
        return importers is None or module in importers

    bad = sorted(t for t in _offload_imports(module) if _in_pd(t) and not allowed(t))
    assert not bad, f"{module} imports pd modules outside the seam: {bad}"


@pytest.mark.parametrize("module", sorted(m for m in ALL if _in_pd(m)))
def test_pd_imports_offload_one_way(module: str) -> None:
    """A pd module imports no offload module that imports pd back (no cycle through the
    seam); its leaves import nothing of offload outside pd's leaves."""
    outside = {t for t in _offload_imports(module) if not _in_pd(t)}
    back = sorted(t for t in outside if t in ALL and any(_in_pd(u)
                                                          for u in _offload_imports(t)))
    assert not back, f"{module} imports what imports pd: {back}"
    if module in PD_LEAVES:
        assert _offload_imports(module) <= PD_LEAVES, module


def test_the_seam_checks_can_fail(tmp_path: Path) -> None:
    """A planted offload -> pd import outside the seam is seen (the scanner resolves
    ``from kvshm.offload.pd import consume`` to the submodule)."""
    bad = tmp_path / "m.py"
    bad.write_text("from kvshm.offload.pd import consume\nfrom kvshm.offload.pd.side import "
                   "HandoffSide\n")
    found = {t for _, t in imports_of(bad, "kvshm.offload.stores")}
    assert {f"{PD}.consume", f"{PD}.side"} <= found
    assert f"{PD}.consume" not in PD_SEAM and "kvshm.offload.stores" not in (
        PD_SEAM[f"{PD}.side"] or set())


def test_the_pd_manifest_loads_no_other_offload_module() -> None:
    """What the manager and its input checks import of pd loads nothing else of it."""
    mods = loaded_by(f"{PD}.manifest")
    assert {m for m in mods if m.startswith("kvshm.offload.")} - _BARE_PACKAGES == {
        f"{PD}.manifest"}


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
_BARE_PACKAGES = {"kvshm.ipc", "kvshm.offload", "kvshm.offload.pd", "kvshm.integrations"}


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
    assert _kvshm_parts(mods) <= {"workers", "ipc", "protocol", "leaf", "remote", "disk"}


def test_the_disk_tier_loads_no_torch_and_no_transport() -> None:
    """kvshm.disk (the slab format, scan, check_directory) is stdlib plus leaves: the
    scheduler side may call it without loading torch or the worker side."""
    mods = loaded_by("kvshm.disk")
    assert not {"torch", "asyncio", "vllm"} & mods
    assert _kvshm_parts(mods) <= {"disk", "leaf"}


def test_the_scheduler_side_loads_neither_workers_nor_vllm() -> None:
    for module in ("kvshm.engine", "kvshm.cli", "kvshm.integrations.vllm"):
        mods = loaded_by(module)
        assert not {"workers", "vllm"} & {m.split(".")[0] for m in mods}, module


def test_package_exports_resolve_lazily() -> None:
    import kvshm

    assert kvshm.Engine.__name__ == "Engine" and kvshm.SPAWN.value == "spawn"
    assert kvshm.EngineConfig(block_size=16).world_size == 1
