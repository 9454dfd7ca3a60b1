#!/usr/bin/env bash
# Training on one machine (or one node's share of a multi-node run) with torchrun.
#
#   bash launch/torchrun.sh NPROC --config configs/tiny_taper.yaml [key=value ...]
#
# NPROC is the number of worker processes on this machine, or "auto": the GPUs visible here
# (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), else 1. On one machine torchrun runs with
# --standalone; launch/train.sbatch runs this script once per node with the settings below.
#
# Before torchrun starts, the trainer's checks run once (python -m megatron_taper.launch_check:
# the layout at NPROC x NNODES processes, data.path, the tokenizer against model.vocab_size).
#
# Exit code: 0 finished (or stopped by train.exit_after); 2 bad input (the checks, or a worker's
# own); 3 stopped by SIGUSR1/SIGTERM after writing a checkpoint (run the same command again to
# resume); anything else is a failure.
# torchrun itself turns every worker failure into 1, so workers leave a marker file when they
# exit with 3 and this script reports 3 when one did.
#
# Stopping by hand: `kill -USR1 <pids of the python workers>` (torchrun ignores USR1, as under
# Slurm, where every process of the step gets it), or `kill -TERM <torchrun pid>`: torchrun
# forwards SIGTERM to the workers and kills them 30 s later, so use it only for quick saves.
#
# Environment:
#   VENV           virtual environment (default: .venv in the repository)
#   NNODES         nodes in the run (default 1: standalone)
#   RDZV_ENDPOINT  host:port of the c10d rendezvous store (required when NNODES > 1)
#   RDZV_ID        rendezvous id, the same on all nodes (default: megatron_taper)
#   RDZV_IS_HOST   1 on the node that hosts the store, 0 elsewhere; default under srun: node 0
#                  of the step hosts it, else torch decides by comparing host names
set -uo pipefail
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
root="$(dirname "$(dirname "$self")")"
py="${VENV:-$root/.venv}/bin/python"

if [[ ${1:-} == --worker ]]; then
  # One torchrun worker. Its exit code is all torchrun drops, so 3 leaves a marker. A trapped
  # TERM only runs after the trainer exits (it saves first); USR1 arrives ignored from the node
  # level and stays so here, while the trainer installs its own handler.
  shift
  trap ':' TERM
  "$py" -m megatron_taper.train "$@"
  rc=$?
  if [[ $rc == 3 && -n ${TAPER_STOP_MARKER:-} ]]; then : >"$TAPER_STOP_MARKER"; fi
  exit "$rc"
fi

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
  sed -n '2,/^set /p' "$self" | sed '$d; s/^# \{0,1\}//' >&2
  exit 2
fi
nproc="$1"
shift
if [[ $nproc == auto ]]; then
  nproc=0
  if [[ -n ${CUDA_VISIBLE_DEVICES:-} && ${CUDA_VISIBLE_DEVICES} != NoDevFiles ]]; then
    nproc=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nproc=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  fi
  [[ $nproc -ge 1 ]] || nproc=1
fi
if ! [[ $nproc =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NPROC must be a positive integer or 'auto', got '$nproc'" >&2
  exit 2
fi
if [[ ! -x $py ]]; then
  echo "torchrun.sh: no python at $py (run launch/install.sh or set VENV)" >&2
  exit 2
fi

nnodes="${NNODES:-1}"
if [[ $nnodes == 1 && -z ${RDZV_ENDPOINT:-} ]]; then
  rdzv=(--standalone)
else
  if [[ -z ${RDZV_ENDPOINT:-} ]]; then
    echo "torchrun.sh: NNODES=$nnodes needs RDZV_ENDPOINT=host:port" >&2
    exit 2
  fi
  is_host="${RDZV_IS_HOST:-}"
  if [[ -z $is_host && -n ${SLURM_STEP_ID:-} && -n ${SLURM_NODEID:-} ]]; then
    is_host=$([[ $SLURM_NODEID == 0 ]] && echo 1 || echo 0)
  fi
  rdzv=(--nnodes="$nnodes" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
        --rdzv-id="${RDZV_ID:-megatron_taper}")
  [[ -n $is_host ]] && rdzv+=(--rdzv-conf="is_host=$is_host")
fi

# The trainer's checks (the layout at this world size, data.path, the tokenizer) before torchrun
# starts: a run that cannot start is one line and exit 2, not a worker failure in torchrun's
# report. train.sbatch has run them for the whole job already (TAPER_PREFLIGHT_DONE=1).
if [[ -z ${TAPER_PREFLIGHT_DONE:-} ]]; then
  if ! [[ $nnodes =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: NNODES must be a positive integer, got '$nnodes'" >&2
    exit 2
  fi
  "$py" -m megatron_taper.launch_check --world-size $((nproc * nnodes)) --nodes "$nnodes" "$@"
  rc=$?
  [[ $rc == 0 ]] || exit "$rc"
fi

marker_dir="$(mktemp -d "${TMPDIR:-/tmp}/megatron_taper.XXXXXX")"
trap 'rm -rf "$marker_dir"' EXIT
# torchrun (and through it the workers) starts with USR1 ignored: USR1's default action would
# kill it, and under Slurm it gets the warning signal along with the workers. A trapped TERM
# keeps this script alive until torchrun has let the workers save.
trap '' USR1
trap ':' TERM
TAPER_STOP_MARKER="$marker_dir/stopped" "$py" -m torch.distributed.run \
  "${rdzv[@]}" --nproc-per-node="$nproc" --max-restarts=0 \
  --no-python bash "$self" --worker "$@"
rc=$?
if [[ -e $marker_dir/stopped ]]; then
  echo "[torchrun.sh] workers stopped by a signal after writing a checkpoint: exit 3 (torchrun's" \
       "report above is about that exit code); the same command resumes" >&2
  rc=3
fi
exit "$rc"
