"""The slab files of a disk directory, by name alone: which engine, rank and world each
belongs to, and whether that engine's name is a generated one whose process is gone.

A slab file is ``kvshm-<engine>.rank<r>-of-<world>.slab`` (written by
:func:`kvshm.disk.slab_path`; this module reads the name back and stays light: ``kvshm
sweep`` imports it without the slab module). A generated engine name is
``e<pid>-<16 hex digits>`` (:func:`kvshm.config.default_name`): no later start can take
such a name, so its slabs serve no warm restart once that pid no longer runs.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["SlabFileRow", "generated_pid", "list_slabs"]

#: (matched whole with ``fullmatch``: ``$`` also matches before a final newline, and a
#: file named so was listed, and printed by ``kvshm sweep`` with the newline raw)
_SLAB_RE: Final = re.compile(r"kvshm-(?P<engine>[A-Za-z0-9._-]+)\.rank(?P<rank>[0-9]+)"
                             r"-of-(?P<world>[0-9]+)\.slab")
_GENERATED_RE: Final = re.compile(r"^e(?P<pid>[1-9][0-9]{0,9})-[0-9a-f]{16}$")


@dataclass(frozen=True)
class SlabFileRow:
    """One slab file: its path, engine, rank, world size and bytes on disk."""

    path: str
    engine: str
    rank: int
    world: int
    bytes: int


def list_slabs(directory: str) -> list[SlabFileRow]:
    """Every regular file named like a slab in ``directory``, sorted by name (links and
    other kinds skipped). OSError for an unreadable directory."""
    out: list[SlabFileRow] = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        m = _SLAB_RE.fullmatch(entry.name)
        if m is None or not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        out.append(SlabFileRow(entry.path, m["engine"], int(m["rank"]), int(m["world"]),
                               st.st_blocks * 512))
    return out


def generated_pid(engine: str) -> int | None:
    """The pid in a generated engine name (``e<pid>-<16 hex>``), else None."""
    m = _GENERATED_RE.fullmatch(engine)
    return None if m is None else int(m["pid"])

