"""Whether a process still runs, by pid: how the sweeps (``kvshm sweep``, the CPU tier's
leftover segments, the disk tier's slabs of generated names) tell a dead owner from a
live one. A pid is only a hint (it may be reused): a sweep also takes the file's own
lock or checks its owner before it removes anything."""

from __future__ import annotations

import os

__all__ = ["pid_running"]


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
