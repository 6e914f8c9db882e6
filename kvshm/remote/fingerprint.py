"""The layout fingerprint: what two engines must share to read each other's blocks.

Every remote key and every stored value's header carries it (``kvshm.remote.tier``), so
a block written by one deployment is never read by another whose bytes mean something
else. It covers:

* ``model_id``: the model and its dtype as the embedding engine names them (kvshm cannot
  see the weights; ``""`` when the caller gives none -- then only the layout protects);
* the block size in tokens and the KV groups (kind and window);
* the world size and every rank's layout (each region's shape, dtype, block dim and
  bytes per block), in rank order.

The value is a short hex digest (BLAKE2b, 16 bytes) so it fits a key; the readable
description is :func:`describe`'s, for logs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kvshm.ipc.protocol import LayoutSpec, RemoteSetup
from kvshm.types import KVGroup

__all__ = ["RemoteTarget", "describe", "layout_fingerprint"]


def describe(model_id: str, block_size: int, groups: Sequence[KVGroup],
             layouts: Mapping[int, LayoutSpec]) -> bytes:
    """The canonical bytes the fingerprint digests (msgspec JSON, rank order)."""
    doc = {
        "model": model_id,
        "block_size": block_size,
        "groups": [[g.kind.value, g.window_tokens] for g in groups],
        "world": len(layouts),
        "ranks": [layouts[r] for r in sorted(layouts)],
    }
    return msgspec.json.encode(doc)


def layout_fingerprint(model_id: str, block_size: int, groups: Sequence[KVGroup],
                       layouts: Mapping[int, LayoutSpec]) -> str:
    """32 hex characters naming (model, block size, groups, world, every rank's
    layout); equal inputs give equal fingerprints across processes and machines."""
    raw = describe(model_id, block_size, groups, layouts)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class RemoteTarget:
    """An engine's remote tier before its ranks are known: the URL and what the
    fingerprint covers besides the ranks' layouts (those come at provisioning)."""

    url: str
    model_id: str
    block_size: int
    groups: tuple[KVGroup, ...]

    def setup(self, layouts: Mapping[int, LayoutSpec]) -> RemoteSetup:
        """What ``Ready.remote`` tells every rank (same for all of them)."""
        return RemoteSetup(self.url, layout_fingerprint(self.model_id, self.block_size,
                                                        self.groups, layouts))
