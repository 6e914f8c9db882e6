"""The vLLM quick starts as shipped (issue 28, "First contact"), and the plugin under them.

* ``examples/vllm_quickstart.py`` runs as a user runs it and prints exactly the lines
  its docstring shows: prompt A's repeat is served from kvshm's CPU tier (384 hit
  tokens) after prompt B evicted it from vLLM's small device pool. In the default set
  with vLLM's engine in the script's own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
  ~30 s less on 2 cores); with the multi-process engine a user gets by default, slow.
* ``examples/vllm_serve_quickstart.sh`` runs as shipped (slow): it builds the tiny
  model, starts ``vllm serve`` with the one-line connector config on a free port
  (``PORT``), sends its two completions, prints ``kvshm_hit_tokens_total`` from
  ``/metrics`` -- the same 384 -- and stops the server with SIGINT; no process and no
  kvshm segment is left.
* kvshm's ``vllm.general_plugins`` entry point is installed; vLLM's plugin loader
  finds it and it registers ``KvshmConnector`` by name, idempotently, leaving a name
  someone else registered first in place.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.distributed.kv_transfer.kv_connector.factory",
    reason="vLLM is not installed (see tools/vllm_install.sh)",
)

import kvshm.integrations.vllm.plugin as plugin

# Fixture from conftest.py: tiny_llama (a TinyModel: ``.path`` is the model's folder).
TinyModel = Any

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vllm_quickstart.py"
SERVE = ROOT / "examples" / "vllm_serve_quickstart.sh"
#: Prompt tokens of A's repeat that kvshm serves (3 full 128-token blocks of 400).
HIT_TOKENS = 384
#: How the example's own output lines start (vLLM's log lines start otherwise).
_OWN_LINES = ("first call:", "second call:", "kvshm:")


def _env(**extra: str) -> dict[str, str]:
    """The test's environment (conftest's thread settings) with this tree first on
    PYTHONPATH and this venv's commands (python, vllm) first on PATH."""
    env = dict(os.environ)
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not old else f"{ROOT}{os.pathsep}{old}"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def _docstring_output() -> list[str]:
    """The lines the example's docstring says it prints (the block after "It prints::")."""
    text = EXAMPLE.read_text()
    block = text.split("It prints::\n\n", 1)[1].split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines()]


def _kvshm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if "kvshm" in n.lower()}


def _run_example(model: TinyModel, **env: str) -> list[str]:
    before = _kvshm_segments()
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(model.path)], cwd=ROOT,
                          env=_env(**env), capture_output=True, text=True, timeout=420,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert _kvshm_segments() - before == set()
    # vLLM logs to stdout too: keep the example's own lines
    return [line for line in proc.stdout.splitlines() if line.startswith(_OWN_LINES)]


def test_example_prints_what_its_docstring_shows(tiny_llama: TinyModel) -> None:
    """A and B miss, A's repeat has 384 tokens cached, all from kvshm (the device pool
    lost them), the answer is the same; the numbers are the docstring's."""
    printed = _run_example(tiny_llama, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    assert printed == _docstring_output()
    assert f"kvshm: {HIT_TOKENS} hit tokens" in printed[-1]


@pytest.mark.slow
def test_example_with_the_multiprocess_engine(tiny_llama: TinyModel) -> None:
    """The same as a user gets it by default: EngineCore and worker in their own
    processes (kvshm's counters are read from the LLM's process)."""
    assert _run_example(tiny_llama) == _docstring_output()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _session_processes(sid: int) -> list[int]:
    """Processes still alive in the session the script led (not zombies)."""
    psutil = pytest.importorskip("psutil")
    alive = []
    for proc in psutil.process_iter(["pid", "status"]):
        try:
            if os.getsid(proc.pid) == sid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (ProcessLookupError, PermissionError):
            continue
    return alive


@pytest.mark.slow
def test_serve_script_shows_the_hit_in_metrics(tmp_path: Path) -> None:
    """The shell quick start as shipped, on a free port: both completions answer, A's
    two answers agree, it prints kvshm_hit_tokens_total 384.0, and after its
    SIGINT no process of its session and no kvshm segment is left."""
    before = _kvshm_segments()
    proc = subprocess.Popen(["bash", str(SERVE)], cwd=ROOT, start_new_session=True,
                            env=_env(MODEL=str(tmp_path / "tiny"), PORT=str(_free_port())),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"the serve quick start did not finish: {out[-2000:]}{err[-4000:]}")
    assert proc.returncode == 0, out[-2000:] + err[-6000:]
    answers = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [len(a["choices"]) for a in answers] == [2, 1], out
    assert answers[1]["choices"][0]["text"] == answers[0]["choices"][0]["text"]
    # vLLM logs to stdout too (its shutdown after the metrics line included)
    series = [ln for ln in out.splitlines() if ln.startswith("kvshm_hit_tokens_total")]
    assert len(series) == 1, out[-3000:]
    match = re.fullmatch(r"kvshm_hit_tokens_total\{.*\} (\d+\.\d+)", series[0])
    assert match is not None, series
    assert float(match.group(1)) == HIT_TOKENS
    assert f"kvshm_hit_tokens_total{{...}} {HIT_TOKENS}.0" in SERVE.read_text()
    deadline = time.monotonic() + 15
    while _session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _session_processes(proc.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind by the serve quick start: {left}"
    assert _kvshm_segments() - before == set()


# ----------------------------------------------------------------------- the plugin


def test_entry_point_is_installed() -> None:
    """kvshm's metadata names its plugin (after ``pip install -e .`` of this tree: an
    older install of kvshm lacks it, and then only kv_connector_module_path works)."""
    ours = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "kvshm"]
    assert [ep.value for ep in ours] == ["kvshm.integrations.vllm.plugin:register"], (
        "kvshm's vllm.general_plugins entry point is not installed: pip install -e . again")


def test_vllm_plugin_loader_finds_register_and_it_registers_the_class() -> None:
    """vLLM's loader resolves kvshm's entry point to :func:`plugin.register`, which makes
    ``KvshmConnector`` a name vLLM's factory resolves (the example above runs it in every
    process of a real engine: its config has no module path); a second call is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    from kvshm.integrations.vllm.connector import KvshmConnector

    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["kvshm"] is plugin.register
    plugin.register()
    plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name("KvshmConnector") is KvshmConnector


def test_register_leaves_a_name_taken_by_another_in_place(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A connector of the same name registered first stays; kvshm says so and does not
    raise into vLLM's plugin loader."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    plugin.register()  # ours, or a no-op if this process already registered it
    before = KVConnectorFactory._registry["KvshmConnector"]
    monkeypatch.setattr(plugin, "_done", False)
    with caplog.at_level(logging.WARNING, logger="kvshm.vllm"):
        plugin.register()
    assert KVConnectorFactory._registry["KvshmConnector"] is before
    assert "already registered with vLLM" in caplog.text


def test_hit_tokens_reads_what_metrics_exports() -> None:
    """``hit_tokens`` reads the snapshot through the exporters' own flattening
    (kvshm.series.scalars), so the example prints the number /metrics shows as
    kvshm_hit_tokens_total; a missing counter reads 0."""
    from kvshm.integrations.vllm import hit_tokens
    from kvshm.series import scalars

    stats: dict[str, Any] = {"counters": {"hit_tokens": 7, "lookups": 9}}
    assert scalars(stats)[0]["kvshm_hit_tokens"] == 7
    assert hit_tokens(stats) == 7
    assert hit_tokens({}) == 0
