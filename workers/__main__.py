"""``kvshm-workers``: standalone worker processes (one per TP x PP rank)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; replaced by the standalone launcher (workers/loop.py)."""
    try:
        from workers.loop import cli_main  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        print("kvshm-workers is not available yet in this version.", file=sys.stderr)
        return 2
    rc: int = cli_main(argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
