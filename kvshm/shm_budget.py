"""How many bytes of shared memory a new segment may take.

A tmpfs page is charged three ways, and running out of any of them ends badly (ENOSPC
at best, the OOM killer or a SIGBUS at worst), so :func:`available_shm_bytes` is the
smallest of /dev/shm's free space (``statvfs``), ``MemAvailable`` and the memory
cgroup's headroom (v2 ``memory.max - memory.current`` or v1 ``limit - usage``, the least
over its cgroup and every ancestor's; a limit of 2**60 or more is none), less a margin
of ``min(256 MiB, limit // 8)``: a small /dev/shm (Docker's 64 MiB) stays usable while a
large machine keeps room for everything else. Read on every call (nothing cached: the
answer changes as segments come and go). Imported from here only;
:func:`~kvshm.shm.create_segment` checks it first.
"""

from __future__ import annotations

import os
from typing import Final

from kvshm.errors import ConfigError

__all__ = ["SHM_DIR", "available_shm_bytes", "memory_available_bytes", "shm_size_text",
           "statvfs_free"]

#: Where POSIX shared memory lives on Linux.
SHM_DIR: Final = "/dev/shm"
#: Upper bound of the safety margin kept free (see :func:`available_shm_bytes`).
_MARGIN_MAX: Final = 256 << 20
#: The margin is at most this fraction of the limiting resource (small /dev/shm mounts).
_MARGIN_DIVISOR: Final = 8
#: cgroup limits at or above this are "no limit" (cgroup v1 reports ~2**63 rounded down).
_CGROUP_UNLIMITED: Final = 1 << 60
#: Where this process's cgroups are named, and where the hierarchies are mounted (tests
#: point them at a tree of their own).
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_ROOT = "/sys/fs/cgroup"


def statvfs_free(path: str) -> int:
    """Bytes an unprivileged writer may still put under ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError as e:  # (out of fds, most likely: the start then fails in one line)
        raise ConfigError(f"cannot read /proc/meminfo to size shared memory: "
                          f"{e.strerror or e}") from e
    raise ConfigError("/proc/meminfo has no MemAvailable line; cannot size shared memory")


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_headroom() -> int | None:
    """Bytes the memory cgroups above this process still allow (tmpfs pages are charged
    to them): the least over its own cgroup and every ancestor that has a limit, None if
    none has. A limit on a parent (a systemd slice, ``docker --cgroup-parent``, nested
    cgroups in a container) binds as surely as one on the leaf: read only at the leaf,
    it was missed and the OOM killer ended the scheduler as it reserved the CPU tier (a
    hostile probe)."""
    try:
        with open(PROC_CGROUP, encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: int | None = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, files = CGROUP_ROOT, ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            base, files = f"{CGROUP_ROOT}/memory", ("memory.limit_in_bytes",
                                                     "memory.usage_in_bytes")
        else:
            continue
        for d in _ancestors(path):
            limit = _read_int(f"{base}{d}/{files[0]}")
            usage = _read_int(f"{base}{d}/{files[1]}")
            if limit is not None and usage is not None and limit < _CGROUP_UNLIMITED:
                room = max(0, limit - usage)
                best = room if best is None else min(best, room)
    return best


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["/a/b", "/a", ""]``: a cgroup's directory, then each parent's up to
    the hierarchy's root (as mounted here: in a cgroup namespace, the namespace's)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:k]) if k else "" for k in range(len(parts), -1, -1)]


def memory_available_bytes() -> int:
    """Memory this process's cgroup may still take: min(MemAvailable, cgroup headroom).

    Unlike :func:`available_shm_bytes` it ignores /dev/shm and keeps no margin: it is
    the base a share is taken of (the vLLM connector's default CPU tier).
    """
    limit = _meminfo_available()
    headroom = _cgroup_headroom()
    return limit if headroom is None else min(limit, headroom)


def available_shm_bytes() -> int:
    """Bytes a new segment may take: min(free /dev/shm, MemAvailable, cgroup headroom) - margin.

    The margin is ``min(256 MiB, limit // 8)`` so a small /dev/shm (Docker's 64 MiB
    default) is still usable while a large machine keeps room for everything else.
    """
    limit = min(statvfs_free(SHM_DIR), _meminfo_available())
    headroom = _cgroup_headroom()
    if headroom is not None:
        limit = min(limit, headroom)
    margin = min(_MARGIN_MAX, limit // _MARGIN_DIVISOR)
    return max(0, limit - margin)


def shm_size_text() -> str:
    """/dev/shm's size and free space, for error messages."""
    st = os.statvfs(SHM_DIR)
    return (f"{SHM_DIR} has {st.f_blocks * st.f_frsize / 2**20:.0f} MiB in all, "
            f"{st.f_bavail * st.f_frsize / 2**20:.0f} MiB free")
