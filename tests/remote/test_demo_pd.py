"""``kvshm demo --pd --quick --json``: a prefill engine and a decode engine in separate
processes (two worker ranks each) hand KV over an embedded Valkey; the decode side's
logits equal the prefill side's bit for bit and the last line carries the figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_pd_quick_is_bit_exact(valkey: object) -> None:
    del valkey  # only for the fixture's skip where the remote extra is missing
    out = subprocess.run([sys.executable, "-m", "kvshm.cli", "demo", "--pd", "--quick",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["bit_exact"] is True and last["prompts"] == 3
    assert {"pd_ttft_ratio", "publish_ms_p50", "bytes_per_request"} <= set(last)
    assert "a prefill engine (its own process)" in out.stdout


def test_demo_pd_refuses_plot() -> None:
    out = subprocess.run([sys.executable, "-m", "kvshm.cli", "demo", "--pd", "--plot",
                          "x.png"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--pd" in out.stderr


def test_demo_pd_stopped_by_sigterm_leaves_no_server_folder(valkey: object,
                                                            tmp_path: Path) -> None:
    """The hazard: ``kvshm demo --pd`` stopped with SIGTERM died at once (the default
    action): its Valkey server died too (its parent-death signal), but the server's
    temporary folder with its log stayed behind. SIGTERM now unwinds like Ctrl-C
    (exit 143): the ``with`` blocks close the server and remove the folder."""
    import os
    import signal
    import time

    del valkey
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the server's folder goes here
    proc = subprocess.Popen([sys.executable, "-m", "kvshm.cli", "demo", "--pd", "--quick"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(tmp_path.glob("kvshm-valkey-*")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    assert not any(tmp_path.glob("kvshm-valkey-*")), list(tmp_path.iterdir())
