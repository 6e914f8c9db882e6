"""tools/gpu_check.sh, the one command for a GPU machine, checked where there is none.

Its syntax (``bash -n``), its dry run (the four steps, each command and limit, at most
8 minutes together, nothing executed), and the demo's refusal of ``--device cuda``
without a GPU (exit 2 with one line, before any worker starts). The real run needs CUDA:
its figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "gpu_check.sh"


def test_gpu_check_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_gpu_check_dry_run_lists_every_step_within_eight_minutes(tmp_path: Path) -> None:
    out = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    steps = re.findall(r"^step (\w+) \(limit (\d+) s\): (.+)$", out, re.M)
    assert [s[0] for s in steps] == ["device", "pytest", "copy", "demo"]
    assert "-m gpu" in steps[1][2] and "tools.bench_copy --json" in steps[2][2]
    assert "--device cuda" in steps[3][2]
    total = int(re.findall(r"^total limit: (\d+) s$", out, re.M)[0])
    assert total == sum(int(s[1]) for s in steps) <= 480
    assert not (tmp_path / "o").exists()  # a dry run writes nothing


def test_gpu_check_refuses_unknown_flags() -> None:
    res = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 2 and "usage" in res.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_demo_on_cuda_without_a_gpu_is_refused_in_one_line() -> None:
    res = subprocess.run([sys.executable, "-m", "kvshm.demo", "--device", "cuda", "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "kvshm demo: --device cuda needs a GPU torch can see "
        "(torch.cuda.is_available() is False)"]
