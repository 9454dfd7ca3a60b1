#!/usr/bin/env bash
# Installs what is missing (see launch/install.sh), lints (ruff, ruff.toml) and runs the whole test suite.
# Extra arguments go to pytest, e.g. `bash tests/run.sh -k taper`. Test files run on
# PYTEST_WORKERS pytest-xdist workers (default 3: on 2 cores the suite often waits on subprocesses, and 3 measured
# 466 s against 508 s for 2; a file's tests stay on one worker; 0 = no xdist).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/launch/install.sh"
cd "$root"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The suite starts ~200 interpreters besides its workers (torchrun, Slurm jobs, tools): with bytecode
# caches (__pycache__, git-ignored) each imports the package compiled once, not from source (~0.25 s
# of CPU each); an environment that sets PYTHONDONTWRITEBYTECODE would make every one compile it again
unset PYTHONDONTWRITEBYTECODE
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"
py="${VENV:-$root/.venv}/bin/python"
"$py" -m ruff check --quiet . || { echo "[tests] ruff found problems (fix: $py -m ruff check --fix .)" >&2; exit 1; }
workers="${PYTEST_WORKERS:-3}"
parallel=()
# --no-loadscope-reorder: hand out files in tests/conftest.py's order (costliest first); xdist's
# default re-sorts them by their number of tests, which puts the long one-test files last
[ "$workers" = 0 ] || parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
exec "$py" -m pytest -q -ra --durations=25 "${parallel[@]}" tests "$@"
