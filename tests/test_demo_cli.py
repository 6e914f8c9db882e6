"""`kvshm demo` and the custom-server example, run the way a user runs them: as processes.

The demo's full trace takes minutes (it is the main job, measured in the README); here the
``--quick`` trace goes through the same path - toy model, 2 SPAWN workers, store/load
checksums, the replay-based logits check - and its JSON line must report exactness.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _kvshm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}


def test_demo_quick_is_bit_exact_and_leaves_nothing() -> None:
    before = _kvshm_segments()
    out = subprocess.run([sys.executable, "-m", "kvshm.cli", "demo", "--quick", "--json"],
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["bit_exact"] is True
    assert summary["checksums_bad"] == 0 and summary["checksums_ok"] > 0
    assert summary["logit_checks"] > 0
    assert summary["logit_checks_equal"] == summary["logit_checks"]
    assert summary["hit_rate"] > 0 and summary["pins_at_end"] == 0
    assert summary["load_failures"] == 0
    assert _kvshm_segments() <= before


def test_custom_server_example_restores_the_stored_bytes() -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "custom_server.py")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first == "hit 96 tokens, load ok=True, bytes identical=True", out.stdout
