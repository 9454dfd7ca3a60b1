#!/usr/bin/env bash
# The GPU check of docs/gpu.md on one CUDA GPU (an H200 is the target), in under 8 minutes:
# CPU-vs-CUDA fp32 parity on the tiny recipe, then a ~1.3B tapered model in bf16: step time,
# tokens/s, MFU and peak memory with and without activation checkpointing and compile.
# Installs what is missing (launch/install.sh); writes benchmarks/results/gpu_check.json
# (or $OUT/gpu_check.json when OUT is set) and prints the same JSON. Exit 1 when parity fails.
#   bash benchmarks/gpu_check.sh [--smoke]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${VENV:-$root/.venv}/bin/python"
bash launch/install.sh >&2  # a no-op when the environment is current
out="${OUT:-$root/benchmarks/results}/gpu_check.json"
PYTHONUNBUFFERED=1 exec "$py" benchmarks/gpu_check.py --out "$out" "$@"
