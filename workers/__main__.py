"""``kvshm-workers`` / ``python -m workers``: standalone worker processes (one per TP x PP
rank); see :mod:`workers.loop` for both command-line forms."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.stop_signals import EarlyStop

EarlyStop.install()  # first: a stop signal during the imports below is a clean stop

from workers.loop import cli_main  # noqa: E402 - after the stop signals' handler


def main(argv: Sequence[str] | None = None) -> int:
    """Console-script entry point; returns the exit code (a rank's process ends at once
    after its clean close instead: :func:`workers.loop.exit_at_once`)."""
    return cli_main(argv, exit_rank_at_once=True)


if __name__ == "__main__":
    sys.exit(main())
