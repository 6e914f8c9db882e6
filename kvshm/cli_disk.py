"""The disk tier in the ``kvshm`` command: its section of ``kvshm stats`` as text
(:func:`format_disk`) and the slab files ``kvshm sweep --disk-path DIR`` lists
(:func:`gone_slabs`, :func:`remove_slabs`).

A slab file is ``kvshm-<engine>.rank<r>-of-<world>.slab`` (``kvshm.disk.slab.slab_path``).
One whose engine no longer listens on this machine (``kvshm ls`` does not list it) is
*gone*, but not garbage: it is the warm-restart cache of an engine started again under
the same name. Sweep lists such files and keeps them unless asked to remove them
(``--remove-slabs``); a file whose lock a process still holds (a worker that outlived
its engine) is never removed.
"""

from __future__ import annotations

from typing import Any

from kvshm.slab_files import SlabFileRow, list_slabs

__all__ = ["format_disk", "gone_slabs", "remove_slabs"]


def _mib(n: Any) -> str:
    return f"{n / 2**20:.1f} MiB" if isinstance(n, int) else "?"


def format_disk(disk: dict[str, Any]) -> str:
    """``kvshm stats --disk``: the ``disk`` section of an engine's statistics
    (``EngineStats.disk``) as a few lines; "no disk tier" when it is empty."""
    if not disk:
        return "no disk tier"

    def g(key: str) -> Any:
        return disk.get(key, "?")

    lines = [f"disk tier: {g('path')} ({g('io')} I/O, {_mib(disk.get('bytes_per_rank'))} "
             f"per rank)"]
    if "slots" not in disk:  # the engine is not READY yet
        return "\n".join(lines)
    lines += [
        f"  slots: {g('slots_used')} used / {g('slots')} (pinned {g('slots_pinned')}, "
        f"quarantined {g('quarantined_slots')}, warm at start {g('warm_slots')})",
        f"  reads: {g('lookup_hits')} hits / {g('lookups')} lookups, {g('hit_blocks')} "
        f"blocks ({_mib(disk.get('read_bytes'))}); failed: {g('get_failed_jobs')} jobs, "
        f"{g('dropped_slots')} slots dropped",
        f"  writes: {g('written_blocks')} blocks ({_mib(disk.get('write_bytes'))}); "
        f"failed: {g('write_failed_jobs')} jobs; declined (no slot): "
        f"{g('write_declined_no_slot')}; paused: {g('writes_paused')}",
        f"  evicted from the CPU tier: {g('evicted_on_disk')} on disk, "
        f"{g('evicted_written')} written down at eviction, {g('evicted_lost')} lost",
    ]
    return "\n".join(lines)


def gone_slabs(directory: str, live: set[str]) -> list[SlabFileRow]:
    """The slab files in ``directory`` whose engine is not in ``live`` (the running
    engines' names), sorted by name. OSError for an unreadable directory."""
    return [r for r in list_slabs(directory) if r.engine not in live]


def remove_slabs(rows: list[SlabFileRow]) -> list[tuple[SlabFileRow, str]]:
    """Remove each file that no process holds locked; (row, what happened) each:
    "removed", "in use" (its lock is held) or the error."""
    from kvshm.disk import remove_unheld  # the slab module is heavy for the other commands

    out: list[tuple[SlabFileRow, str]] = []
    for r in rows:
        try:
            out.append((r, "removed" if remove_unheld(r.path) else "in use"))
        except OSError as exc:
            out.append((r, exc.strerror or str(exc)))
    return out
