"""kvshm's public surface and its one import path per name: the list of names
``kvshm`` exports, every package ``__init__`` declaring ``__all__``, and no ordinary
module listing in its ``__all__`` a name it imports from elsewhere (a re-export: a
second path to the name). Static checks over the source, plus the names resolving."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvshm

ROOT = Path(__file__).resolve().parents[2]

#: kvshm's public names (``kvshm.__all__``); a change here is an API change.
PUBLIC = ["ATTACH", "BlockPool", "Engine", "EngineConfig", "EngineState", "KVGroup",
          "LoadResult", "OffloadManager", "RequestView", "SPAWN", "ScheduledRequest",
          "StepInput", "StepPlan", "StoreMode", "SyncClient", "WorkerMode", "chain_hashes",
          "errors", "shared_tensor"]


def _modules() -> list[tuple[str, ast.Module, bool]]:
    """(dotted name, parsed source, is a package ``__init__``) of every kvshm module."""
    out = []
    for path in sorted((ROOT / "kvshm").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        init = rel.name == "__init__"
        name = ".".join(rel.parent.parts if init else rel.parts)
        out.append((name, ast.parse(path.read_text(), str(path)), init))
    return out


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        value: ast.expr | None
        if isinstance(node, ast.Assign):
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and target.id == "__all__":
            if isinstance(value, (ast.List, ast.Tuple)):
                return [str(e.value) for e in value.elts if isinstance(e, ast.Constant)]
            return []  # computed (kvshm's own, from its lazy table)
    return None


def _imported(tree: ast.Module) -> set[str]:
    return {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
            for a in node.names}


def test_kvshm_exports_exactly_the_public_names() -> None:
    assert sorted(kvshm.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(kvshm, name) is not None


def test_every_package_declares_its_public_surface() -> None:
    missing = [name for name, tree, init in _modules() if init and _all_of(tree) is None]
    assert not missing, f"packages without __all__: {missing}"


def _aliases(tree: ast.Module) -> set[str]:
    """Names a module binds at top level to an imported name or an imported module's
    attribute (``X = Y``, ``X = mod.Y``): a second path to a name listed elsewhere."""
    imported = _imported(tree) | {a.asname or a.name.split(".")[0] for node in tree.body
                                  if isinstance(node, ast.Import) for a in node.names}
    out = set()
    for node in tree.body:
        target, value = ((node.targets[0], node.value) if isinstance(node, ast.Assign) else
                         (node.target, node.value) if isinstance(node, ast.AnnAssign) else
                         (None, None))
        root = value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(target, ast.Name) and isinstance(root, ast.Name) and root.id in imported:
            out.add(target.id)
    return out


def test_no_ordinary_module_re_exports_a_name() -> None:
    """A listed name imported from elsewhere, or bound to another module's name
    (``SHM_DIR = shm_budget.SHM_DIR``, ``RemoteState = FetchState`` were), is a second
    import path for one thing."""
    found = {}
    for name, tree, init in _modules():
        names = _all_of(tree) or []
        again = sorted(set(names) & (_imported(tree) | _aliases(tree)))
        if again and not init:
            found[name] = again
    assert not found, f"names re-exported from ordinary modules: {found}"


def test_kvshm_resolves_each_name_from_where_it_is_defined() -> None:
    """``kvshm.X`` comes from the module that defines X (or the package that lists it),
    never through an ordinary module that only imports it (``StoreMode`` came through
    ``kvshm.config``)."""
    for name, module in kvshm._LAZY.items():
        mod = importlib.import_module(module)
        if module.endswith(name):
            continue
        value = getattr(mod, name)
        home = getattr(value, "__module__", None)
        if home is None or not isinstance(value, type) and not callable(value):
            continue  # a constant (SPAWN): listed by its package
        assert home == module or home.startswith(module + "."), (name, module, home)


def test_every_listed_name_resolves() -> None:
    for name, tree, _ in _modules():
        names = _all_of(tree)
        if not names or name.startswith(("kvshm.integrations.vllm", "kvshm.demo")):
            continue  # vLLM / torch-heavy parts: imported by their own tests
        mod = importlib.import_module(name)
        assert all(hasattr(mod, n) for n in names), name
