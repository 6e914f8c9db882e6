"""Print the test files in which the README's test run skipped something, for CI's second
stage to run where vLLM is installed (``.ci/run``).

Why: CI's first stage runs the README's test command in a venv with only what the
README installs, so every test that needs vLLM (or another package vLLM brings) skips
there; the second stage installs vLLM. Running the whole suite again there spent about
seven minutes on 2 cores re-running the 1,250-odd tests that had just passed. The second
stage runs just the files this script names: every file with a skipped test case, a
file skipped whole at collection (``pytest.importorskip`` at module level) included.
Files are the unit (not test ids) so module-scoped fixtures are set up once.

Input: the JUnit XML that ``--junitxml`` wrote for the first stage (CI passes the flag in
``PYTEST_ADDOPTS``, so the README's command runs verbatim). A test case maps to its file
by its ``classname`` (``tests.sub.test_x.TestK``: the longest dotted prefix naming a
``.py`` file under the root), or, for a collection skip, by its ``name``
(``tests.sub.test_x``).

Usage: ``python3 tools/ci_skipped.py JUNIT_XML [--root DIR] [--except REGEX]``; one
path a line, sorted; ``--except`` leaves out cases whose skip message matches (GPU tests
skip in both stages). Exit 2 if the XML is unreadable or holds no test case (a run that
did not happen must not read as "nothing skipped"). Standard library only.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["skipped_files", "file_of"]


def file_of(dotted: str, root: Path) -> str | None:
    """The ``.py`` file under ``root`` that the dotted name starts with (longest first),
    as a path relative to ``root``; None if no prefix names a file."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        rel = Path(*parts[:n]).with_suffix(".py")
        if (root / rel).is_file():
            return rel.as_posix()
    return None


def skipped_files(cases: Iterable[ET.Element], root: Path,
                  exclude: re.Pattern[str] | None = None) -> list[str]:
    """The sorted files of the skipped test cases among ``cases`` (``<testcase>``
    elements), leaving out those whose skip message matches ``exclude``. A skipped case
    whose file cannot be found is an error (a name the mapping does not understand must
    not drop tests silently)."""
    found: set[str] = set()
    for case in cases:
        skip = case.find("skipped")
        if skip is None:
            continue
        text = f"{skip.get('message', '')} {skip.text or ''}"
        if exclude is not None and exclude.search(text):
            continue
        dotted = case.get("classname") or case.get("name") or ""
        path = file_of(dotted, root)
        if path is None:
            raise ValueError(f"no test file under {root} for the skipped case {dotted!r}")
        found.add(path)
    return sorted(found)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path)
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("--except", dest="exclude", default=None,
                    help="leave out cases whose skip message matches this regex")
    args = ap.parse_args(argv)
    try:
        cases = list(ET.parse(args.junit).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as exc:
        print(f"ci_skipped: cannot read {args.junit}: {exc}", file=sys.stderr)
        return 2
    if not cases:
        print(f"ci_skipped: {args.junit} holds no test case", file=sys.stderr)
        return 2
    exclude = None if args.exclude is None else re.compile(args.exclude)
    try:
        files = skipped_files(cases, args.root, exclude)
    except ValueError as exc:
        print(f"ci_skipped: {exc}", file=sys.stderr)
        return 2
    print("\n".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
