"""The command line of the standalone workers (``kvshm-workers`` / ``python -m workers``):
the one definition that the engine's launcher builds and the workers' parser reads.

A shared leaf (standard library only): the engine must never import ``workers`` and the
workers must never import ``kvshm.engine``, so both sides use this module instead.
:func:`rank_argv` builds the per-rank command line from the flags of :class:`Flag`;
:func:`add_arguments` declares the parser's options from the same flags, so what one
side writes the other reads by construction (a test parses :func:`rank_argv`'s output
with :func:`workers.loop.build_parser`). What the options mean, and the parent form
(``--tp`` without ``--rank``), is documented in :mod:`workers.loop`.
"""

from __future__ import annotations

import argparse
import sys
from enum import StrEnum
from typing import Final

__all__ = ["DEFAULT_CONNECT_TIMEOUT_S", "DEFAULT_SPIN_US", "ENGINE_PID_ENV", "MODULE", "Flag",
           "add_arguments", "rank_argv"]

#: The package the interpreter runs (``python -m workers``).
MODULE: Final = "workers"
#: Seconds a rank waits for the engine's Ready unless ``--connect-timeout`` says otherwise
#: (a rank the engine spawned: for its connection; then as long as the engine lives).
DEFAULT_CONNECT_TIMEOUT_S: Final = 60.0
#: Busy-wait before parking when idle, in microseconds, unless ``--spin-us`` says otherwise.
DEFAULT_SPIN_US: Final = 50.0
#: The environment variable an engine that spawns its ranks sets to its own pid: a rank
#: waiting for the engine's Ready gives up once that process is no longer its parent
#: (the engine died during its launch; after Ready the lifeline tells). A rank started
#: by hand (``kvshm-workers``) has none and waits its ``--connect-timeout``.
ENGINE_PID_ENV: Final = "KVSHM_ENGINE_PID"


class Flag(StrEnum):
    """Every option of the worker command line (the value is the flag as typed)."""

    NAME = "--name"
    TP = "--tp"
    PP = "--pp"
    RANK = "--rank"
    WORLD_SIZE = "--world-size"
    DEVICE = "--device"
    CONNECT_TIMEOUT = "--connect-timeout"
    SPIN_US = "--spin-us"


def rank_argv(name: str, rank: int, world_size: int, *, connect_timeout: float | None = None,
              spin_us: float | None = None, device: str | None = None) -> list[str]:
    """The per-rank command line: ``python -m workers --name NAME --rank R --world-size W``,
    then ``--device``, ``--connect-timeout`` and ``--spin-us`` where given (else the
    parser's defaults apply). Floats are written with ``repr`` so they parse back to the
    same value."""
    argv = [sys.executable, "-m", MODULE, Flag.NAME.value, name, Flag.RANK.value, str(rank),
            Flag.WORLD_SIZE.value, str(world_size)]
    if device is not None:
        argv += [Flag.DEVICE.value, device]
    if connect_timeout is not None:
        argv += [Flag.CONNECT_TIMEOUT.value, repr(connect_timeout)]
    if spin_us is not None:
        argv += [Flag.SPIN_US.value, repr(spin_us)]
    return argv


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Declare every :class:`Flag` on ``p`` (dests: name, tp, pp, rank, world_size,
    device, connect_timeout, spin_us). Range checks are the caller's."""
    p.add_argument(Flag.NAME.value, required=True, help="the engine's name (abstract socket "
                   "\\0kvshm.NAME)")
    p.add_argument(Flag.TP.value, type=int, default=None, help="tensor-parallel size")
    p.add_argument(Flag.PP.value, type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument(Flag.RANK.value, type=int, default=None,
                   help="run only this rank (per-rank form)")
    p.add_argument(Flag.WORLD_SIZE.value, type=int, default=None,
                   help="number of ranks (default: tp x pp)")
    p.add_argument(Flag.DEVICE.value, choices=("cpu", "cuda"), default="cpu",
                   help="where the engine's device caches live: cpu (shared memory) or "
                   "cuda (opened over CUDA IPC; default cpu)")
    p.add_argument(Flag.CONNECT_TIMEOUT.value, type=float, default=DEFAULT_CONNECT_TIMEOUT_S,
                   help="seconds to wait for the engine's Ready (default %(default)s)")
    p.add_argument(Flag.SPIN_US.value, type=float, default=DEFAULT_SPIN_US,
                   help="busy-wait before parking when idle, in microseconds (default 50)")
