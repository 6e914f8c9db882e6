"""The vLLM quick-start's parts work as the README tells it (issue 14, point 10): the
tiny-model builder runs offline, the ``vllm`` command of a venv made by
tools/vllm_install.sh runs, and every connector config the README shows is one kvshm
and vLLM accept. The quick-start files themselves (examples/vllm_quickstart.py and
examples/vllm_serve_quickstart.sh) run as shipped in tests/vllm/test_quickstarts.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_HF = all(importlib.util.find_spec(m) is not None for m in ("transformers", "tokenizers"))
_VLLM_SPEC = importlib.util.find_spec("vllm")
HAVE_VLLM = _VLLM_SPEC is not None and _VLLM_SPEC.origin is not None
#: No hub, no network, one thread (the builder must not need any of it).
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TORCH_COMPILE_DISABLE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "PYTHONPATH": str(ROOT)}


def _run(*argv: str, timeout: float,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, env={**OFFLINE, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, check=False)


def _build(folder: Path) -> None:
    proc = _run(sys.executable, "examples/tiny_llama.py", str(folder), timeout=240)
    assert proc.returncode == 0, proc.stderr
    assert f"tiny Llama written to {folder}" in proc.stdout


@pytest.mark.skipif(not HAVE_HF, reason="transformers/tokenizers not installed (come with vLLM)")
def test_tiny_llama_builds_offline(tmp_path: Path) -> None:
    """The folder holds a 2-layer Llama config, safetensors weights and a word-level
    tokenizer whose words are one token each."""
    folder = tmp_path / "tiny"
    _build(folder)
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"],
            config["num_key_value_heads"], config["vocab_size"]) == ("llama", 2, 128, 2, 512)
    assert (folder / "model.safetensors").stat().st_size > 0
    transformers = importlib.import_module("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tok("w0 w1 w507", add_special_tokens=False)["input_ids"] == [4, 5, 511]


@pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (see tools/vllm_install.sh)")
def test_vllm_console_script_runs() -> None:
    """vllm-cpu's ``vllm`` command died with PackageNotFoundError: vllm; the install
    script's metadata alias makes it run, with the CPU build's version."""
    import vllm

    proc = _run(str(Path(sys.executable).parent / "vllm"), "--version", timeout=120)
    assert "PackageNotFoundError" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{vllm.__version__}+cpu"


def test_readme_connector_configs_are_valid() -> None:
    """Every ``--kv-transfer-config`` JSON README.md and docs/vllm.md show names kvshm's
    connector with kv_role kv_both, is a KVTransferConfig vLLM accepts, and has only extra
    keys kvshm knows, with good values (whatever else it sets: the one-line form needs nothing)."""
    from kvshm.integrations.vllm.config import check_extra_config

    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "vllm.md").read_text()
    raws = [part.split("'", 1)[0] for part in text.split("--kv-transfer-config '")[1:]]
    assert raws, "the README and docs/vllm.md show no --kv-transfer-config"
    for raw in raws:
        cfg = json.loads(raw)
        assert (cfg["kv_connector"], cfg["kv_role"]) == ("KvshmConnector", "kv_both"), raw
        check_extra_config(cfg.get("kv_connector_extra_config", {}))
        if HAVE_VLLM:
            from vllm.config import KVTransferConfig

            KVTransferConfig(**cfg)  # every field is one vLLM knows
