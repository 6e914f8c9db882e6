"""A decode engine's memory of the P/D manifests it collected (deleted from the server).

The children of one request under vLLM's parallel sampling share its hand-off: the first
to load the blocks collects the manifest, and a later sibling that needs the server
would find it gone. :class:`CollectedManifests` keeps the bytes of what this engine
collected so that such a sibling is judged from memory -- by the same checks as a read
from the server (:func:`kvshm.offload.pd.manifest.check_manifest`), never trusted for a
request whose prefix does not match, nor once expired.

Invariants: ``nbytes`` is the sum of :func:`entry_size` over the entries (keys, values
and a fixed per-entry overhead, so many small manifests cannot exceed the bound by
their bookkeeping); it never exceeds ``limit`` after a call returns (the oldest go
first). :meth:`CollectedManifests.add` answers False only when these very bytes are
remembered under the key: a sibling's second collection does nothing, while a *new*
publication under a reused name is collected again (deleted and demoted).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

__all__ = ["COLLECTED_BYTES", "ENTRY_OVERHEAD", "CollectedManifests", "entry_size"]

#: Bytes of collected manifests a decoder remembers for their siblings (newest kept).
COLLECTED_BYTES: Final = 8 << 20
#: What one entry costs beyond its key and value (dict slot, two objects' headers).
ENTRY_OVERHEAD: Final = 160


def entry_size(key: str, raw: bytes) -> int:
    """One entry's share of the bound."""
    return len(key) + len(raw) + ENTRY_OVERHEAD


class CollectedManifests:
    """See the module docstring. ``limit``: the bound on :attr:`nbytes`."""

    def __init__(self, limit: int = COLLECTED_BYTES) -> None:
        self.limit = limit
        self.nbytes = 0
        self._m: OrderedDict[str, bytes] = OrderedDict()

    def keys(self) -> list[str]:
        """The remembered names, oldest first."""
        return list(self._m)

    def get(self, key: str) -> bytes | None:
        """The manifest collected under ``key``, if remembered."""
        return self._m.get(key)

    def add(self, key: str, raw: bytes) -> bool:
        """Remember ``raw`` as collected under ``key`` (newest); False, changing
        nothing, when exactly these bytes are remembered there already."""
        old = self._m.get(key)
        if old == raw:
            return False
        if old is not None:
            self.discard(key)
        self._m[key] = raw
        self.nbytes += entry_size(key, raw)
        while self.nbytes > self.limit and self._m:
            k, v = self._m.popitem(last=False)
            self.nbytes -= entry_size(k, v)
        return True

    def discard(self, key: str) -> None:
        """Forget ``key`` (an expired entry: a fresh publication may follow)."""
        old = self._m.pop(key, None)
        if old is not None:
            self.nbytes -= entry_size(key, old)
