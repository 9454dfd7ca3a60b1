#!/usr/bin/env bash
# Creates .venv (if missing) and installs megatron_taper with everything the tests and the
# quickstart need (extras dev, hf, plot and wandb: pytest, ruff, transformers, matplotlib, wandb; and
# triton, the kernels extra, whose kernels the tests run on CPU under TRITON_INTERPRET=1), without
# ever letting a dependency replace the installed torch wheel. torch is not imported before numpy is
# installed (its version is read from the package metadata), so a first install prints no
# "Failed to initialize NumPy" warning. The lm_eval extra is not installed here: its
# dependency tree (datasets, pandas, pyarrow, scipy, scikit-learn, nltk, ...) is large.
#   TORCH_SPEC   what to install when torch is missing (default: torch==2.13.0)
#   VENV         virtual environment folder (default: .venv in the repository)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${VENV:-$root/.venv}"
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip() { "$py" -m pip --disable-pip-version-check -q "$@"; }

stamp="$venv/.megatron_taper_installed"
want="$(cat "$root/setup.py" "$root/launch/install.sh" "$root/launch/requirements-lean.txt" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$py" -c "import megatron_taper, importlib.util as u; assert all(map(u.find_spec, ('streaming', 'transformers', 'matplotlib', 'wandb', 'torchao', 'triton')))" 2>/dev/null; then
  exit 0
fi

echo "[install] preparing $venv" >&2
torch_version() { "$py" -c 'from importlib.metadata import version; print(version("torch").split("+")[0])' 2>/dev/null; }
torch_version >/dev/null || pip install "$torch_spec"
torch_version="$(torch_version)"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# transformers < 5 needs huggingface_hub < 1; saying so up front spares pip minutes of backtracking
# through datasets' releases (measured here: a dry run of the extras resolved in 135 s instead of 381 s)
printf 'torch==%s\nhuggingface_hub<1\n' "$torch_version" > "$constraints"

pip install -c "$constraints" -e "$root[dev,float8,hf,plot,wandb]"
# mosaicml-streaming and deepspeed declare dependencies that would pull a newer (CUDA) torch,
# torchvision and ~1 GB of cloud SDKs; install them without dependencies plus their real needs.
pip install -c "$constraints" -r "$root/launch/requirements-lean.txt"
pip install -c "$constraints" --no-deps mosaicml-streaming==0.13.0 deepspeed==0.19.8
# triton (setup.py's kernels extra) declares no dependencies; --no-deps keeps it so (~290 MB wheel)
pip install -c "$constraints" --no-deps triton==3.9.0
# the parquet and zstd readers of tools/preprocess_data.py (the rest of the data extra)
pip install -c "$constraints" "pyarrow>=14" "zstandard>=0.22"
"$py" -c "import torch, sys; assert torch.__version__.split('+')[0] == '$torch_version', 'torch was replaced'"
echo "$want" > "$stamp"
echo "[install] done (torch $torch_version)" >&2
