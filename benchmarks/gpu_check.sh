#!/usr/bin/env bash
# The one prepared device check: Triton kernels vs their references at real K3.1 shapes, timed,
# and the compiled decode step (demo session; true-width layers against the memory roofline).
# Run it on a machine with a CUDA GPU (the environment must already have torch + triton):
#   bash benchmarks/gpu_check.sh            # prints a table, writes ${OUT:-.}/gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec timeout 540 python benchmarks/gpu_check.py "$@"
