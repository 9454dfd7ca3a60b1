#!/usr/bin/env bash
# Installs what is missing (see launch/install.sh) and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k taper`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/install.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"
exec "${VENV:-$root/.venv}/bin/python" -m pytest -q -ra tests "$@"
