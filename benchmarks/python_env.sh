# Sourced by the prepared GPU scripts (benchmarks/gpu_check.sh, benchmarks/gpu_science.sh):
# `find_python NAME` sets `py` to a Python that imports torch and this package: $PYTHON, else
# $VENV/bin/python, else ./.venv/bin/python, else python3 on PATH. Nothing is installed when that
# Python already imports them; otherwise launch/install.sh is tried once, and if it fails (e.g. no
# package index) NAME says so and the script exits 3. Expects `root` (the repository) to be set.
imports() { PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" -c "import numpy, torch, yaml, megatron_taper.training.trainer" >/dev/null 2>&1; }
find_python() {
  local name="$1"
  if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
  elif [ -n "${VENV:-}" ]; then py="$VENV/bin/python"
  elif [ -x "$root/.venv/bin/python" ]; then py="$root/.venv/bin/python"
  else py="$(command -v python3 || command -v python || echo python3)"
  fi
  imports && return 0
  echo "$name: $py cannot import torch / megatron_taper; trying bash launch/install.sh" >&2
  if ! bash "$root/launch/install.sh" >&2; then
    echo "$name: error: installing failed (no package index reachable?). Point PYTHON= or VENV= at an" \
         "environment that imports torch and megatron_taper, then run again." >&2
    exit 3
  fi
  py="${VENV:-$root/.venv}/bin/python"
  if ! imports; then
    echo "$name: error: $py still cannot import torch / megatron_taper after launch/install.sh" >&2
    exit 3
  fi
}
