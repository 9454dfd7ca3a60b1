#!/usr/bin/env bash
# The GPU check of docs/gpu.md on one CUDA GPU (an H200 is the target), in under 8 minutes:
# CPU-vs-CUDA fp32 parity on the tiny recipe, NCCL at world size 1 (every collective the trainer
# uses, and a Trainer step with a checkpoint), then a ~1.3B tapered model in bf16: step time,
# tokens/s, MFU (two conventions) and peak memory per variant (float8, activation checkpointing
# modes, the chunked loss, compile). Each part runs in its own try and the JSON is rewritten after
# each, so a crash or a kill keeps what finished: benchmarks/results/gpu_check.json (or $OUT/gpu_check.json).
# Python: $PYTHON, else $VENV/bin/python, else ./.venv/bin/python, else python3 on PATH. Nothing is
# installed when that Python already imports torch and this package; otherwise launch/install.sh
# is tried once, and if it fails (e.g. no package index) the script says so and exits 3.
#   bash benchmarks/gpu_check.sh [--smoke]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 3
source "$root/benchmarks/python_env.sh"
find_python gpu_check
out="${OUT:-$root/benchmarks/results}/gpu_check.json"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$py" benchmarks/gpu_check.py --out "$out" "$@"
