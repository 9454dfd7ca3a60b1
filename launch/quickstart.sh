#!/usr/bin/env bash
# First run on a fresh machine: install, build data from the embedded corpus, train, evaluate.
#
#   bash launch/quickstart.sh [key=value ...]      (overrides go to the Trainer, e.g. train.steps=50)
#
# 1. makes/uses .venv through launch/install.sh (never replaces an installed torch wheel);
# 2. trains a byte-exact BPE tokenizer on the embedded corpus (the Python standard library's
#    sources, found through sysconfig) and writes MDS shards with a held-out split, into a cache
#    folder that later runs reuse;
# 3. trains configs/tiny_taper.yaml with 2 processes on CPU (torchrun, its rendezvous store on
#    127.0.0.1 only; gloo), parameters, gradients and AdamW state sharded over them (ZeRO-3,
#    parallel.zero=fsdp2), and prints the held-out loss. A second run finds the finished run
#    folder, resumes from its last checkpoint and only evaluates; pass run.resume=never or set
#    RUN_DIR for a new run.
#
# Environment: VENV (default .venv), MEGATRON_TAPER_CACHE (default ~/.cache/megatron_taper),
# RUN_DIR (default runs/quickstart), NPROC (default 2), QUICKSTART_INSTALL=0 (skip step 1 in an
# environment that is installed already; tests/launch/test_readme_examples.py runs it so).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="${VENV:-$root/.venv}"
py="$venv/bin/python"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

if [[ ${QUICKSTART_INSTALL:-1} != 0 ]]; then
  bash "$root/launch/install.sh"
fi

config="configs/tiny_taper.yaml"
# paths go to python as arguments, never into its code
vocab="$("$py" -c 'import sys; from megatron_taper.config import load_config; print(load_config(sys.argv[1]).model.vocab_size)' "$config")"
cache="${MEGATRON_TAPER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron_taper}/quickstart-v$vocab"
tok="$cache/tokenizer"
data="$cache/data"
run_dir="${RUN_DIR:-$root/runs/quickstart}"

if [ -f "$tok.model" ] && [ -f "$tok.json" ]; then
  echo "[quickstart] reusing tokenizer $tok.model"
else
  echo "[quickstart] training a tokenizer (vocab $vocab) on the Python standard library's sources"
  "$py" tools/train_tokenizer.py --embedded-corpus --vocab-size "$vocab" --output "$tok"
fi

if "$py" -c 'import sys; from megatron_taper.data import is_complete; sys.exit(0 if is_complete(sys.argv[1]) else 1)' "$data"; then
  echo "[quickstart] reusing MDS shards in $data"
else
  echo "[quickstart] writing MDS shards to $data"
  "$py" tools/preprocess_data.py --embedded-corpus --tokenizer "$tok.model" --output "$data" \
    --workers 2 --val-fraction 0.05 --overwrite
fi

echo "[quickstart] training $config with ${NPROC:-2} processes on CPU into $run_dir"
# torchrun through megatron_taper.torchrun: its rendezvous store listens on 127.0.0.1 only
"$py" -m megatron_taper.torchrun --standalone --nproc-per-node "${NPROC:-2}" -m megatron_taper.train --config "$config" \
  "data.path=$data" "run.dir=$run_dir" train.device=cpu parallel.zero=fsdp2 "$@"

"$py" - "$run_dir/metrics.jsonl" <<'PY'
import sys
from megatron_taper.training.metrics import read_metrics
records = read_metrics(sys.argv[1])
evals = [r for r in records if "eval_loss" in r]
if not evals:
    sys.exit("[quickstart] no held-out loss was logged")
last = evals[-1]
print(f"[quickstart] held-out loss {last['eval_loss']:.4f} (perplexity {last.get('eval_ppl', float('nan')):.1f}) "
      f"at step {last['step']}")
PY
