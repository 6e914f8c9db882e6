"""A real ``vllm serve`` with kvshm's connector, for the tests of what an operator sees.

:func:`vllm_serve` starts ``python -m vllm.entrypoints.cli.main serve`` over the tiny
model in its own session and process group (like a job started from a terminal, whose
Ctrl-C signals the whole group), its output (every process's) in a log file, and waits
for ``/health``. :class:`Serve` speaks HTTP to it (completions, ``/metrics``), stops it
like Ctrl-C (:meth:`Serve.interrupt`: SIGINT to the group) or like ``kill``
(:meth:`Serve.terminate`: SIGTERM to the API server only) and says which of its
processes are still running. On exit anything left is stopped (SIGINT, then SIGKILL to
the group after a grace period). Not a test module: imported by
``tests/vllm/test_vllm_serve.py`` (``tests`` is on pytest's path).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Serve:
    """One running ``vllm serve`` (see the module docstring)."""

    proc: subprocess.Popen[bytes]
    port: int
    model: str
    name: str
    log_path: Path
    stats_path: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def complete(self, prompt: str, max_tokens: int = 4, timeout: float = 300.0) -> Any:
        """POST /v1/completions (greedy, ``ignore_eos``); the JSON answer."""
        body = json.dumps({"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url("/v1/completions"), data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as resp:
            text: str = resp.read().decode()
            return text

    def metrics(self) -> dict[str, Any]:
        """``/metrics`` parsed: family name -> prometheus-client ``Metric``."""
        return {f.name: f for f in text_string_to_metric_families(self.metrics_text())}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def interrupt(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """Ctrl-C: SIGINT to the whole process group; the API server's exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout)

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM to the API server only (``kill``, systemd, ``docker stop``); its
        exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def group_alive(self) -> list[int]:
        """Pids of the group's processes still running (zombies excluded)."""
        psutil = importlib.import_module("psutil")
        out: list[int] = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                continue
        return out


def _wait_healthy(serve: Serve, deadline: float) -> None:
    while time.monotonic() < deadline:
        if serve.proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({serve.proc.returncode}):\n"
                                 f"{serve.log()[-6000:]}")
        try:
            with urllib.request.urlopen(serve.url("/health"), timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise AssertionError(f"vllm serve not healthy in time:\n{serve.log()[-6000:]}")


def _stop(serve: Serve) -> None:
    if serve.proc.poll() is None:
        try:
            serve.interrupt(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.monotonic() + 10.0
    while serve.group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    if serve.group_alive():
        os.killpg(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait(10)


@contextmanager
def vllm_serve(model_path: Path, tmp: Path, *, name: str, cpu_bytes: int = 64 << 20,
               kv_cache_bytes: int = 16 << 20, max_model_len: int = 2048,
               max_num_seqs: int = 8, args: Sequence[str] = ()) -> Iterator[Serve]:
    """``vllm serve`` of the tiny model with kvshm's connector named ``name`` (its
    ``stats_path`` in ``tmp``); ``args``: more ``vllm serve`` arguments."""
    port = free_port()
    stats_path = tmp / f"{name}-stats.json"
    extra = {"cpu_bytes": cpu_bytes, "name": name, "stats_path": str(stats_path)}
    kvt = {"kv_connector": "KvshmConnector", "kv_connector_module_path":
           "kvshm.integrations.vllm", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_path),
           "--port", str(port), "--host", "127.0.0.1", "--enable-prefix-caching",
           "--dtype", "float32",
           "--block-size", "32", "--max-model-len", str(max_model_len), "--enforce-eager",
           "--max-num-seqs", str(max_num_seqs), "--kv-cache-memory-bytes",
           str(kv_cache_bytes), "--kv-transfer-config", json.dumps(kvt), *args]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH"))
                                        if p)
    for key, value in (("OMP_NUM_THREADS", "1"), ("TORCH_COMPILE_DISABLE", "1"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("HF_HUB_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1")):
        env.setdefault(key, value)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    log_path = tmp / f"{name}-serve.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=str(tmp), start_new_session=True)
    serve = Serve(proc, port, str(model_path), name, log_path, stats_path)
    try:
        _wait_healthy(serve, time.monotonic() + START_TIMEOUT_S)
        yield serve
    finally:
        _stop(serve)
