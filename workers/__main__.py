"""``kvshm-workers`` / ``python -m workers``: standalone worker processes (one per TP x PP
rank); see :mod:`workers.loop` for both command-line forms."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.loop import cli_main


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code."""
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
