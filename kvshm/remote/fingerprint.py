"""The layout fingerprint: what two engines must share to read each other's blocks.

Every remote key and every stored value's header carries it (``kvshm.remote.tier``), so
a block written by one deployment is never read by another whose bytes mean something
else. It covers:

* ``model_id``: the model and its dtype as the embedding engine names them (kvshm cannot
  see the weights; ``""`` when the caller gives none -- then only the layout protects);
* the block size in tokens and the KV groups (kind and window);
* the world size, its tensor- and pipeline-parallel degrees (a rank's shard of heads
  and a rank's stage of layers are other KV even where their shapes agree), and every
  rank's layout: each region's bytes per block, dtype and block shape (C order: what
  the bytes mean), in rank order.

Not covered: a region's device block count. It says nothing about what a block holds
(vLLM's moves with ``gpu_memory_utilization``, profiling and the GPU), and covering it
kept a fleet of such engines from sharing a server and wiped a disk tier at a restart
that only changed it (hazard "a layout fingerprint that missed the shape and covered
the device block count", docs/design.md). Before the block shape was covered, regions
of equal bytes per block but another shape (or another split over tp and pp) shared,
and loaded each other's KV.

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
             layouts: Mapping[int, LayoutSpec], parallel: tuple[int, int]) -> bytes:
    """The canonical bytes the fingerprint digests (msgspec JSON, rank order);
    ``parallel``: (tp, pp)."""
    doc = {
        "model": model_id,
        "block_size": block_size,
        "groups": [[g.kind.value, g.window_tokens] for g in groups],
        "world": len(layouts),
        "tp_pp": list(parallel),
        "ranks": [[[r.bytes_per_block, r.dtype, list(r.block_shape)]
                   for r in layouts[k].regions] for k in sorted(layouts)],
    }
    return msgspec.json.encode(doc)


def layout_fingerprint(model_id: str, block_size: int, groups: Sequence[KVGroup],
                       layouts: Mapping[int, LayoutSpec], parallel: tuple[int, int]) -> str:
    """32 hex characters naming (model, block size, groups, world, tp and pp, every
    rank's layout less its block count); equal inputs give equal fingerprints across
    processes and machines."""
    raw = describe(model_id, block_size, groups, layouts, parallel)
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


@dataclass(frozen=True)
class RemoteTarget:
    """An engine's remote tier before its ranks are known: the URL and what the
    fingerprint covers besides the ranks' layouts (those come at provisioning)."""

    url: str
    model_id: str
    block_size: int
    groups: tuple[KVGroup, ...]
    parallel: tuple[int, int]
    """(tp, pp)"""

    def setup(self, layouts: Mapping[int, LayoutSpec]) -> RemoteSetup:
        """What ``Ready.remote`` tells every rank (same for all of them)."""
        return RemoteSetup(self.url, layout_fingerprint(self.model_id, self.block_size,
                                                        self.groups, layouts, self.parallel))
