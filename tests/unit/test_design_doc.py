"""docs/design.md cites a test for every hazard: each cited test must exist (a rename or a
move must not leave the table pointing at nothing), and so must each cited module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "design.md").read_text()
CITED_TEST = re.compile(r"`((?:unit/(?:\w+/)?|remote/)?test_\w+)::((?:Test|test_)\w+?)(\*)?`")
CITED_MODULE = re.compile(r"`((?:kvshm|workers)/[\w/]+\.py)`")


def test_every_cited_test_exists() -> None:
    cited = CITED_TEST.findall(DOC)
    assert len(cited) >= 20, "the hazards table lost its tests"
    missing = []
    for file, name, star in cited:
        path = ROOT / "tests" / f"{file}.py"
        src = path.read_text() if path.exists() else ""
        tail = r"\w*" if star else ""
        pattern = rf"^(async )?def {name}{tail}\(|^{name} = "
        if not re.search(pattern, src, re.MULTILINE):
            missing.append(f"{file}::{name}{star}")
    assert not missing, f"docs/design.md cites tests that do not exist: {missing}"


def test_every_cited_module_exists() -> None:
    cited = set(CITED_MODULE.findall(DOC))
    assert len(cited) >= 8
    assert not [m for m in cited if not (ROOT / m).exists()]
