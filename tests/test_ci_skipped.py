"""tools/ci_skipped.py: which test files CI's second stage runs. The report comes from a
real pytest run over a small tree with every kind of skip the suite has -- a module
skipped at collection (``importorskip``, as vLLM's tests are), a skipped method of a
class, a GPU skip the stage leaves out, a file that passed -- so a change in how pytest
names cases in JUnit XML fails here, not as a silently smaller CI run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools.ci_skipped import main

FILES = {
    "tests/sub/test_needs_pkg.py": (
        "import pytest\npytest.importorskip('no_such_package_kvshm')\n"
        "def test_a() -> None:\n    pass\n"),
    "tests/test_klass.py": (
        "import pytest\nclass TestK:\n    @pytest.mark.skip(reason='needs vLLM')\n"
        "    def test_b(self) -> None:\n        pass\n"
        "    def test_c(self) -> None:\n        pass\n"),
    "tests/test_gpu.py": (
        "import pytest\n@pytest.mark.skip(reason='needs CUDA (no GPU)')\n"
        "def test_d() -> None:\n    pass\n"),
    "tests/test_fine.py": "def test_e() -> None:\n    pass\n",
}


@pytest.fixture
def report(tmp_path: Path) -> Path:
    for rel, text in FILES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    out = tmp_path / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "--rootdir", str(tmp_path), f"--junitxml={out}", "tests"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    return out


def test_every_file_with_a_skip_is_named_except_the_left_out_reason(
        report: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(report), "--root", str(report.parent), "--except", "needs CUDA"]) == 0
    assert capsys.readouterr().out.split() == ["tests/sub/test_needs_pkg.py",
                                               "tests/test_klass.py"]
    assert main([str(report), "--root", str(report.parent)]) == 0
    assert "tests/test_gpu.py" in capsys.readouterr().out.split()


def test_a_missing_empty_or_unmappable_report_is_an_error(
        report: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "none.xml")]) == 2
    empty = tmp_path / "empty.xml"
    empty.write_text("<testsuites><testsuite/></testsuites>")
    assert main([str(empty)]) == 2
    # another root: the skipped cases name files that are not there
    assert main([str(report), "--root", str(tmp_path / "tests")]) == 2
    assert "no test file" in capsys.readouterr().err
