"""KV cache groups as the manager sees them: kinds, windows in blocks, CPU index keys.

Keys: the CPU index holds one entry per (hash, group). Group 0 uses the plain chained
hash; group ``g > 0`` appends a fixed suffix naming ``g`` (:meth:`GroupSet.key`), so a
hybrid model's full-attention and sliding-window copies of one position never collide
and a single-group model pays nothing. Every part that reads or writes the CPU index
qualifies hashes here: the hit search (:mod:`kvshm.offload.hits`) and the store planner
(:mod:`kvshm.offload.stores`).

Windows: a sliding-window group of ``window_tokens`` needs the
``cdiv(window_tokens - 1, block_size)`` blocks before a position (the hit rule of
:mod:`kvshm.offload.hits`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshm.errors import ConfigError
from kvshm.hashing import BlockHash
from kvshm.types import GroupKind, KVGroup

__all__ = ["GroupSet", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division (blocks needed for ``a`` tokens of ``b`` per block)."""
    return -(-a // b)


class GroupSet:
    """The manager's KV groups: kinds, windows in blocks, CPU index keys.

    ``full``: the full-attention group numbers; ``sw``: (group, window in blocks) of each
    sliding-window group; ``is_sw[g]`` and ``window_blocks[g]`` the same by group;
    ``single``: one full-attention group only, whose keys are the plain hashes (the hot
    paths take a shortcut there).
    """

    def __init__(self, groups: Sequence[KVGroup], block_size: int) -> None:
        if type(block_size) is not int or block_size < 1:
            raise ConfigError(f"block_size must be an int >= 1, got {block_size!r}")
        if not groups:
            raise ConfigError("at least one KV group is needed")
        if len(groups) > 0xFFFF:
            raise ConfigError(f"too many KV groups: {len(groups)}")
        for kv in groups:
            if not isinstance(kv, KVGroup):
                raise ConfigError(f"a KV group must be a KVGroup, got {kv!r}")
        self.groups = tuple(groups)
        self.n = len(self.groups)
        self.full = [g for g, kv in enumerate(self.groups) if kv.kind is GroupKind.FULL]
        self.sw: list[tuple[int, int]] = []
        for g, kv in enumerate(self.groups):
            if kv.kind is GroupKind.SLIDING_WINDOW:
                assert kv.window_tokens is not None
                self.sw.append((g, cdiv(kv.window_tokens - 1, block_size)))
        self.is_sw = tuple(kv.kind is GroupKind.SLIDING_WINDOW for kv in self.groups)
        self.window_blocks = {g: n for g, n in self.sw}
        self.single = self.n == 1 and not self.sw
        self._suffix = [b""] + [b"\x00kvshm.g" + g.to_bytes(2, "little") for g in range(1, self.n)]

    def key(self, h: BlockHash, g: int) -> bytes:
        """CPU index key of hash ``h`` in group ``g``."""
        return h + self._suffix[g] if g else h

    def keys(self, hashes: Sequence[BlockHash], start: int, end: int) -> list[bytes]:
        """CPU index keys of positions ``start..end``, position-major (every group's key
        of a position before the next position's: the order of a remote job's keys)."""
        key, n = self.key, self.n
        return [key(hashes[p], g) for p in range(start, end) for g in range(n)]
