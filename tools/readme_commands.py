"""Print one of the README's two commands, verbatim, for CI to run (``.ci/run``).

The marker, a contract between README.md and CI (keep it when the README is rewritten):

* the README has a level-2 heading that is exactly ``## Two commands``;
* under it (before the next level-2 heading) the first fenced block opened with
  ```` ```bash ```` is the *demo* command (install, then run ``kvshm demo``), and the
  second such block is the *test* command (install, then ``python -m pytest``);
* each of the two blocks holds exactly one command line (chain steps with ``&&``), so
  that running the line runs the whole command and its exit status is the command's.

Other fenced blocks under the heading (```` ```text ````, ```` ```console ````, ...) are
not commands and are skipped. Anything that breaks the marker is an error (exit 2, one
line naming what is missing), never a silently different command.

Usage: ``python3 tools/readme_commands.py {demo,test} [--quick] [--readme PATH]``.
``--quick`` appends ``--quick`` to the demo command's ``kvshm demo`` (CI runs the short
trace; the README's readers run the full one). Standard library only: CI runs it with
the system python before any venv exists.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from enum import StrEnum
from pathlib import Path
from typing import Final

__all__ = ["HEADING", "Command", "MarkerError", "command", "readme_commands"]

#: The heading the two commands live under (the whole line).
HEADING: Final = "## Two commands"
_FENCE: Final = re.compile(r"^(`{3,}|~{3,})\s*(\S*)")
_DEMO: Final = re.compile(r"(?<![\w-])kvshm demo(?![\w-])")
_README: Final = Path(__file__).resolve().parent.parent / "README.md"


class Command(StrEnum):
    """The two commands, in the README's order."""

    DEMO = "demo"
    TEST = "test"


#: What each command must contain to be the command it claims to be.
_MUST_CONTAIN: Final = {Command.DEMO: "kvshm demo", Command.TEST: "pytest"}


class MarkerError(ValueError):
    """README.md does not hold the two commands where the marker says (module doc)."""


def _section(lines: list[str]) -> list[str]:
    """The lines under :data:`HEADING`, up to the next level-2 (or level-1) heading;
    fenced blocks are skipped while looking for that heading."""
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip() == HEADING)
    except StopIteration:
        raise MarkerError(f"no heading {HEADING!r}") from None
    out: list[str] = []
    fence: str | None = None
    for line in lines[start + 1:]:
        m = _FENCE.match(line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = m.group(1) if fence is None else None
        elif fence is None and re.match(r"#{1,2} ", line):
            break
        out.append(line)
    return out


def _bash_blocks(section: list[str]) -> list[list[str]]:
    """The bodies of the fenced blocks opened with ``bash``, in order."""
    blocks: list[list[str]] = []
    fence: str | None = None
    body: list[str] | None = None
    for line in section:
        m = _FENCE.match(line)
        if fence is None and m:
            fence, body = m.group(1), ([] if m.group(2) == "bash" else None)
        elif fence is not None and m and m.group(1).startswith(fence) and not m.group(2):
            if body is not None:
                blocks.append(body)
            fence, body = None, None
        elif body is not None:
            body.append(line)
    if fence is not None:
        raise MarkerError(f"an unclosed fenced block under {HEADING!r}")
    return blocks


def readme_commands(text: str) -> dict[Command, str]:
    """Both commands, each its block's one line with surrounding blanks stripped."""
    blocks = _bash_blocks(_section(text.splitlines()))
    if len(blocks) < len(Command):
        raise MarkerError(f"{len(blocks)} ```bash block(s) under {HEADING!r}, need "
                          f"{len(Command)} (the demo command, then the test command)")
    out: dict[Command, str] = {}
    for which, body in zip(Command, blocks):
        lines = [line.strip() for line in body if line.strip()]
        if len(lines) != 1:
            raise MarkerError(f"the {which.value} command's block holds {len(lines)} lines, "
                              "need exactly one (chain the steps with &&)")
        if _MUST_CONTAIN[which] not in lines[0]:
            raise MarkerError(f"the {which.value} command does not contain "
                              f"{_MUST_CONTAIN[which]!r}: {lines[0]!r}")
        out[which] = lines[0]
    return out


def command(text: str, which: Command, *, quick: bool = False) -> str:
    """One command; ``quick`` appends ``--quick`` to the demo command's ``kvshm demo``
    (which must occur exactly once)."""
    line = readme_commands(text)[which]
    if quick and which is Command.DEMO:
        if len(_DEMO.findall(line)) != 1:
            raise MarkerError(f"--quick: 'kvshm demo' must occur once in {line!r}")
        line = _DEMO.sub("kvshm demo --quick", line)
    return line


def main(argv: Sequence[str] | None = None) -> int:
    """Print the command; exit 2 with one line on stderr if the marker is broken."""
    p = argparse.ArgumentParser(prog="readme_commands", description=__doc__.split("\n")[0])
    p.add_argument("which", choices=[c.value for c in Command])
    p.add_argument("--quick", action="store_true",
                   help="append --quick to the demo command's 'kvshm demo'")
    p.add_argument("--readme", type=Path, default=_README, help="default: the repo's")
    args = p.parse_args(argv)
    try:
        print(command(args.readme.read_text(), Command(args.which), quick=args.quick))
    except (MarkerError, OSError) as exc:
        print(f"readme_commands: {args.readme}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
