#!/usr/bin/env bash
# Train a larger demo model from scratch on one CUDA GPU in ten minutes of wall time, evaluate it with
# the interval table and compare it with builtin:demo (training/README.md, "Training a larger demo
# model on a GPU in ten minutes"). Needs the project installed (torch with CUDA):
#   bash training/gpu_train.sh                 # writes ${OUT:-./out}: checkpoint/, INTERVALS.md, COMPARISON.md, ...
#   SMOKE=1 bash training/gpu_train.sh         # the small CPU run that checks the path (a minute)
# Extra arguments go to `python -m training.gpu_run` (e.g. --budget-min 15). Run it again after an
# interruption: it resumes from the saved plan and state in $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
PYTHON=${PYTHON:-python}
SMOKE=${SMOKE:-0}
args=(--out "$OUT")
if [ "$SMOKE" = "1" ]; then
    args+=(--smoke)
elif ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_train.sh: no CUDA device is visible to torch; run it on a CUDA machine, or SMOKE=1 for the CPU smoke run" >&2
    exit 2
fi
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m training.gpu_run "${args[@]}" "$@" 2>&1 | tee -a "$OUT/train.log"
