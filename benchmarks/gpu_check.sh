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
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ -n "${VENV:-}" ]; then py="$VENV/bin/python"
elif [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"
else py="$(command -v python3 || command -v python || echo python3)"
fi
imports() { PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import numpy, torch, yaml, megatron_taper.training.trainer" >/dev/null 2>&1; }
if ! imports; then
  echo "gpu_check: $py cannot import torch / megatron_taper; trying bash launch/install.sh" >&2
  if ! bash launch/install.sh >&2; then
    echo "gpu_check: error: installing failed (no package index reachable?). Point PYTHON= or VENV= at an" \
         "environment that imports torch and megatron_taper, then run again." >&2
    exit 3
  fi
  py="${VENV:-$root/.venv}/bin/python"
  if ! imports; then
    echo "gpu_check: error: $py still cannot import torch / megatron_taper after launch/install.sh" >&2
    exit 3
  fi
fi
out="${OUT:-$root/benchmarks/results}/gpu_check.json"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$py" benchmarks/gpu_check.py --out "$out" "$@"
