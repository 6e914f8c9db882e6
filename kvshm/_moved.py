"""Old module paths kept for one release (0.2) after the subpackage layout; removed in 0.3.

Each old module replaces itself in ``sys.modules`` with its new home, so ``import
kvshm.manager`` and ``from kvshm.manager import OffloadManager`` keep working (the very
same module object, private names and monkeypatching included) after one
``DeprecationWarning`` that names the new path.
"""

from __future__ import annotations

import importlib
import sys
import warnings

#: Old path -> new path, for every module a user may have imported directly.
MOVED: dict[str, str] = {
    "kvshm.manager": "kvshm.offload.manager",
    "kvshm.pool": "kvshm.offload.pool",
    "kvshm.protocol": "kvshm.ipc.protocol",
}


def _importer_stacklevel() -> int:
    """The stacklevel of the first frame outside the import machinery."""
    frame = sys._getframe(2)
    level = 3
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level


def redirect(old: str) -> None:
    """Warn once, then make ``old`` the same module object as its new home."""
    new = MOVED[old]
    warnings.warn(f"{old} is deprecated: import {new} (the old path goes in kvshm 0.3)",
                  DeprecationWarning, stacklevel=_importer_stacklevel())
    module = importlib.import_module(new)
    sys.modules[old] = module
    parent, _, leaf = old.rpartition(".")
    setattr(sys.modules[parent], leaf, module)
