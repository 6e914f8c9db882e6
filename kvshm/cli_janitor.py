"""``kvshm janitor``: demote the P/D hand-off manifests no decoder collected.

Scans a Valkey server (or every primary of a cluster) for hand-off manifests
(``kvshm:v1:pd:*``), decodes each with :class:`kvshm.offload.pd.manifest.Manifest` itself
(so a field the engine adds is read the same way here), and demotes every expired one
as an engine would: its blocks and readiness keys get the ordinary TTL, then the
manifest goes (:func:`kvshm.remote.janitor.sweep`, which states the order). Live
manifests are never touched; unreadable ones (another version, garbage) are counted and
left alone unless ``--delete-unreadable``.

Prints the counts (one line, or ``--json``) and exits 0; a bad URL, a server nobody
answers on, a missing client library or a server that fails mid-sweep: one line on
stderr and exit 2. Run it from cron (or by hand) with the engines' own URL, so that the
ordinary TTL (``ttl_s``) is theirs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["EXIT_ERROR", "add_janitor", "run_janitor"]

#: The exit status of a bad URL, an unreachable server, a failure mid-sweep.
EXIT_ERROR = 2


def add_janitor(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``janitor`` on ``kvshm``'s subparsers (``sub``: ``add_subparsers()``)."""
    p = sub.add_parser("janitor", help="demote the P/D hand-off manifests nobody "
                                       "collected (their blocks get the ordinary TTL)")
    p.add_argument("--url", required=True,
                   help="the engines' remote URL: valkey://host:port or "
                        "valkey+cluster://h1:p1,h2:p2 (its ttl_s is the ordinary TTL)")
    p.add_argument("--fingerprint", default=None,
                   help="only this layout fingerprint's manifests (default: all)")
    p.add_argument("--dry-run", action="store_true", help="count only, change nothing")
    p.add_argument("--delete-unreadable", action="store_true",
                   help="also delete manifests nobody can read (garbage, another "
                        "version); their blocks keep their own TTL")
    p.add_argument("--json", action="store_true", help="the counts as one JSON object")
    p.set_defaults(func=run_janitor)


def _decode(raw: bytes) -> Any:
    import msgspec

    from kvshm.offload.pd.manifest import Manifest

    return msgspec.json.decode(raw, type=Manifest)


def run_janitor(args: argparse.Namespace) -> int:
    """``kvshm janitor``: 0 with the counts on stdout; 2 with one line on stderr."""
    from kvshm.errors import KvshmError
    from kvshm.remote.janitor import sweep
    from kvshm.remote.tier import RemoteSpec

    try:
        report = sweep(RemoteSpec.parse(args.url), _decode, dry_run=args.dry_run,
                       delete_unreadable=args.delete_unreadable,
                       fingerprint=args.fingerprint)
    except KvshmError as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"kvshm janitor: {text}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(report.as_dict(), sort_keys=True))
    else:
        print(f"kvshm janitor {report.url}: {report.summary()}")
    return 0
