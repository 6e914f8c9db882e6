#!/usr/bin/env bash
# One command for a GPU machine: every check kvshm has that needs CUDA, one JSON summary.
#
# Usage: tools/gpu_check.sh [--dry-run] [--out DIR]
#   --dry-run  print the steps and their time limits; run nothing (works without a GPU)
#   --out DIR  where the logs and gpu_check.json go (default: $OUT if set, else ./gpu_check)
#
# Needs: python3 with torch and CUDA, pytest and hypothesis (a bare GPU image has them).
# kvshm's own dependencies that such an image lacks (msgspec, posix-ipc, pytest-asyncio)
# travel as wheels in ./.whl (see docs/benchmarks.md, "GPU"); they are installed into
# /tmp/kvshm-gpu-site, never into the system python. kvshm itself runs from this tree
# (PYTHONPATH), so the spawned `python -m workers` ranks import the same code.
#
# The steps, in order, each under its own time limit (at most 8 minutes together):
#   1. device:   nvidia-smi's name/driver, torch and CUDA versions          (30 s)
#   2. pytest:   pytest -m gpu (the CUDA copy engine, the CUDA IPC round trip in another
#                process, a tp=2 SPAWN engine whose `--device cuda` ranks store and load
#                bytes exactly)                                                (180 s)
#   3. copy:     python -m tools.bench_copy --json: H2D/D2H of 2 MiB blocks and 64 x 32 KiB
#                fragments against one large pinned copy                       (150 s)
#   4. demo:     kvshm demo --device cuda --quick --json: the toy model on the GPU, the
#                tp=2 workers over CUDA IPC, bit-exact logits                  (120 s)
# A step that fails or times out is recorded (rc, seconds, the log's tail) and the next
# one still runs; the script exits 1 if any step failed.
set -uo pipefail

cd "$(dirname "$0")/.."
dry=0
out="${OUT:-./gpu_check}"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) dry=1; shift ;;
        --out) out=$2; shift 2 ;;
        *) echo "usage: $0 [--dry-run] [--out DIR]" >&2; exit 2 ;;
    esac
done

STEPS=(device pytest copy demo)
declare -A LIMIT=([device]=30 [pytest]=180 [copy]=150 [demo]=120)
declare -A CMD=(
    [device]="nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name(0))'"
    [pytest]="python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_cuda_copy.py tests/test_cuda_ipc.py"
    [copy]="python3 -m tools.bench_copy --json --no-index"
    [demo]="python3 -m kvshm.demo --device cuda --quick --json"
)

if [[ $dry -eq 1 ]]; then
    total=0
    for s in "${STEPS[@]}"; do
        echo "step $s (limit ${LIMIT[$s]} s): ${CMD[$s]}"
        total=$((total + LIMIT[$s]))
    done
    echo "total limit: ${total} s"
    exit 0
fi

mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvshm-gpu-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/kvshm-gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export OMP_NUM_THREADS=1 TORCH_COMPILE_DISABLE=1

failed=0
results=()
for s in "${STEPS[@]}"; do
    start=$(date +%s.%N)
    timeout -k 10 "${LIMIT[$s]}" bash -c "${CMD[$s]}" > "$out/$s.log" 2>&1
    rc=$?
    secs=$(python3 -c "import time; print(round(time.time() - $start, 1))")
    [[ $rc -ne 0 ]] && failed=1
    echo "step $s: rc $rc, ${secs} s"
    results+=("$s $rc $secs")
done

python3 - "$out" "${results[@]}" <<'EOF'
import json
import re
import sys
from pathlib import Path

out = Path(sys.argv[1])
summary: dict[str, object] = {}
for item in sys.argv[2:]:
    name, rc, secs = item.split()
    text = (out / f"{name}.log").read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    step: dict[str, object] = {"rc": int(rc), "seconds": float(secs)}
    last = lines[-1] if lines else ""
    if name in ("copy", "demo") and last.startswith("{"):
        step["json"] = json.loads(last)
    elif name == "pytest":
        closing = [ln for ln in lines if re.search(r"\d+ (passed|failed)", ln)]
        step["result"] = closing[-1] if closing else last
    else:
        step["tail"] = lines[-12:]
    summary[name] = step
summary["ok"] = all(v["rc"] == 0 for v in summary.values() if isinstance(v, dict))
(out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
exit $failed
