"""Whether a process still runs, by pid: how the sweeps (``kvshm sweep``, the CPU tier's
leftover segments, the disk tier's slabs of generated names) tell a dead owner from a
live one. A pid is only a hint (it may be reused): a sweep also takes the file's own
lock or checks its owner before it removes anything, and :func:`process_start` tells a
reused pid from the original (a process that started after the file was last written
is not the one that wrote it)."""

from __future__ import annotations

import os

__all__ = ["pid_running", "process_start"]


def pid_running(pid: int) -> bool:
    """Whether a process ``pid`` runs in this pid namespace (any user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it runs, as another user
    except OverflowError:
        return False  # no such pid can run
    return True


def process_start(pid: int) -> float | None:
    """When the process ``pid`` started (seconds since the epoch, to about a second),
    or None when no process has that pid: none runs, or it is the id of a thread of
    another process (``kill(tid, 0)`` succeeds for those: a container restarted after a
    kill numbers its threads from 1 again, and an old engine's pid was often one of
    them). None too where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            tgid = next((int(line.split()[1]) for line in f if line.startswith("Tgid:")),
                        None)
        if tgid != pid:
            return None
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat", encoding="ascii") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")
