#!/usr/bin/env bash
# Taper vs uniform at 125M on one CUDA GPU (an H200 is the target), offline, inside 9 minutes
# start-up included (issue 45): a corpus from the installed Python packages (held out by package),
# its tokenizer and shards with tools/train_tokenizer.py and tools/preprocess_data.py, then the
# cosine-tapered 125M Transformer, its uniform twin, the uniform twin at a second seed and (time
# allowing) the reverse taper, compiled in bf16, the same tokens in the same order; held-out loss at
# equal tokens, the paired difference and the seed noise in OUT/gpu_science.json, the curves in
# OUT/gpu_science.png (benchmarks/gpu_science.py says how). OUT: --out, else $OUT, else
# benchmarks/results/gpu_science. `--cpu` runs the same code at toy sizes on a CPU in under a minute.
# Python: as benchmarks/gpu_check.sh (benchmarks/python_env.sh); nothing is installed when it already
# imports torch and this package.
#   bash benchmarks/gpu_science.sh [--cpu] [--out DIR] [--budget-s S] [--steps N] ...
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root" || exit 3
source "$root/benchmarks/python_env.sh"
find_python gpu_science
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 exec "$py" benchmarks/gpu_science.py "$@"
