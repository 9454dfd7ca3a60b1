#!/usr/bin/env bash
# Training on one machine (or one node's share of a multi-node run) with torchrun.
#
#   bash launch/torchrun.sh NPROC --config configs/tiny_taper.yaml [key=value ...]
#
# NPROC is the number of worker processes on this machine, or "auto": the GPUs visible here
# (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`), else 1. On one machine torchrun runs with
# --standalone through python -m megatron_taper.torchrun, whose rendezvous store listens on
# 127.0.0.1 only (torch's own --standalone store listens on every interface); launch/train.sbatch
# runs this script once per node with the settings below (c10d rendezvous, see docs/cluster.md).
#
# Before torchrun starts, the trainer's checks run once (python -m megatron_taper.launch_check:
# the layout at NPROC x NNODES processes, data.path, the tokenizer against model.vocab_size and
# the data's own tokenizer, a writable run.dir and checkpoints/).
#
# In-job restarts: when a worker fails (killed, an exception, a hang the watchdog detected: exit 4)
# torchrun stops the others and starts all workers again, up to MAX_RESTARTS times (default 3);
# they resume from the newest valid checkpoint of run.dir (run.resume=auto).
#
# Exit code: 0 finished (or stopped by train.exit_after); 2 bad input (the checks, or a worker's
# own); 3 stopped by SIGUSR1/SIGTERM after writing a checkpoint (run the same command again to
# resume); 4 the restarts are used up and a worker exited with 4 (a hang: resubmit, ideally on
# other nodes; train.sbatch requeues); anything else is a failure.
# torchrun itself turns every worker failure into 1, so workers leave a marker file when they
# exit with 2, 3 or 4 and this script reports that code. Workers that exit with 2 or 3 report
# success to torchrun, so that it does not restart them (a restart cannot fix bad input, and 3
# is a requested stop).
#
# Stopping by hand: `kill -USR1 <pids of the python workers>` (torchrun ignores USR1, as under
# Slurm, where every process of the step gets it), or `kill -TERM <torchrun pid>`: torchrun
# forwards SIGTERM to the workers and kills them 30 s later, so use it only for quick saves.
#
# Environment:
#   VENV           virtual environment (default: .venv in the repository)
#   MAX_RESTARTS   in-job restarts of the workers after a failure (default 3; 0: none)
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
  # One torchrun worker. Its exit code is all torchrun drops, so 2, 3 and 4 leave a marker. A trapped
  # TERM only runs after the trainer exits (it saves first); USR1 arrives ignored from the node
  # level and stays so here, while the trainer installs its own handler.
  shift
  trap ':' TERM
  attempt="${TORCHELASTIC_RESTART_COUNT:-0}"
  [[ -n ${TAPER_MARKER_DIR:-} ]] && : >"$TAPER_MARKER_DIR/attempt-$attempt"
  "$py" -m megatron_taper.train "$@"
  rc=$?
  if [[ $rc == [234] && -n ${TAPER_MARKER_DIR:-} ]]; then : >"$TAPER_MARKER_DIR/exit-$rc-$attempt"; fi
  [[ $rc == [23] ]] && exit 0
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
max_restarts="${MAX_RESTARTS:-3}"
if ! [[ $max_restarts =~ ^[0-9]+$ ]]; then
  echo "torchrun.sh: MAX_RESTARTS must be a non-negative integer, got '$max_restarts'" >&2
  exit 2
fi
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
TAPER_MARKER_DIR="$marker_dir" "$py" -m megatron_taper.torchrun \
  "${rdzv[@]}" --nproc-per-node="$nproc" --max-restarts="$max_restarts" \
  --no-python bash "$self" --worker "$@"
rc=$?
# the markers of the last attempt (torchrun's restart count) decide
last=$(find "$marker_dir" -name 'attempt-*' | sed 's/.*attempt-//' | sort -n | tail -n1)
if [[ -e $marker_dir/exit-2-$last ]]; then
  rc=2
elif [[ -e $marker_dir/exit-3-$last ]]; then
  echo "[torchrun.sh] workers stopped by a signal after writing a checkpoint: exit 3; the same command resumes" >&2
  rc=3
elif [[ $rc != 0 && -e $marker_dir/exit-4-$last ]]; then
  echo "[torchrun.sh] a hang was detected (exit 4) and the $max_restarts restart(s) are used up; stacks and" \
       "heartbeats are in RUN/logs; the same command resumes from the last checkpoint" >&2
  rc=4
fi
exit "$rc"
