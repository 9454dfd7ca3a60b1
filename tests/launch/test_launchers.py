"""launch/torchrun.sh runs the trainer's checks before torchrun (a bad layout: one line, exit 2,
no worker started); launch/train.sbatch --dry-run, outside Slurm, takes every override form,
validates and prints the resolved plan (tests/launch/test_slurm.py runs a job with the --key=value form)."""
import os
import subprocess
import sys

from tests.helpers.runner import REPO

ENV = {**os.environ, "VENV": sys.prefix, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}


def _bash(*argv, **env):
    return subprocess.run(["bash", *argv], cwd=REPO, env={**ENV, **env}, capture_output=True, text=True, timeout=120)


def test_torchrun_sh_checks_before_starting_workers(tmp_path):
    proc = _bash("launch/torchrun.sh", "3", "--config", "configs/tiny_taper.yaml", "--parallel.tp=3",
                 f"run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: parallel.tp=3 must divide model.n_heads=4"
    assert proc.stdout == "" and not (tmp_path / "run").exists()


def test_sbatch_dry_run_takes_every_override_form(tmp_path):
    proc = _bash("launch/train.sbatch", "--dry-run", "--config", "configs/tiny_taper.yaml", "--train.steps=100",
                 "--run.dir", str(tmp_path / "run"), "parallel.tp=2", NNODES="2", NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[:6] == [
        "[train.sbatch] dry run: 2 node(s) x 2 process(es)",
        "processes: 2 node(s) x 2 per node = 4: pp 1 x dp 2 x tp 2, zero none",
        "batch: global_batch 16 = dp 2 x micro_batch 8 x 1 accumulation",
        "model: transformer, 4 layers, d_model 128, vocab 4096, seq_len 128: 1.90M parameters",
        "train: 100 steps, lr 0.003, device auto; data.path=(built-in corpus)",
        f"run dir: {tmp_path / 'run'} (resume auto)",
    ]
    assert proc.stdout.splitlines()[6].startswith("would run on each node: srun --nodes=2 --ntasks-per-node=1 ")
    assert not (tmp_path / "run").exists()
    bad = _bash("launch/train.sbatch", "--dry-run", "--config", "configs/tiny_taper.yaml", "--train.stepz=100",
                NNODES="1", NPROC_PER_NODE="1")
    assert bad.returncode == 2 and bad.stderr == "error: unknown key 'train.stepz'; did you mean 'train.steps'?\n"


def test_sbatch_dry_run_with_layout_auto_prints_the_chosen_layout(tmp_path):
    """parallel.layout=auto: the dry run chooses as the workers will (plan.choose_layout at the job's
    world size) and prints the choice before the plan of that layout; nothing fits: one error."""
    args = ("launch/train.sbatch", "--dry-run", "--config", "configs/tiny_taper.yaml", "parallel.layout=auto",
            f"run.dir={tmp_path / 'run'}")
    proc = _bash(*args, "parallel.layout_memory_gb=0.05", NNODES="1", NPROC_PER_NODE="2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1].startswith("layout auto: ") and "parallel.layout_memory_gb=0.05" in lines[1]
    chosen = dict(kv.split("=") for kv in lines[1].split("(", 1)[1].split(")", 1)[0].split())
    tp, pp = int(chosen["parallel.tp"]), int(chosen["parallel.pp"])
    assert lines[2].startswith(f"processes: 1 node(s) x 2 per node = 2: pp {pp} x dp {2 // (tp * pp)} x ")
    assert f"micro_batch {chosen['train.micro_batch']} x" in lines[3]
    assert not (tmp_path / "run").exists()
    tiny = _bash(*args, "parallel.layout_memory_gb=0.001", NNODES="1", NPROC_PER_NODE="2")
    assert tiny.returncode == 2 and tiny.stdout.splitlines() == ["[train.sbatch] dry run: 1 node(s) x 2 process(es)"]
    assert tiny.stderr.startswith("error: parallel.layout=auto: no legal layout fits 2 x 0.001 GiB (cpu): the nearest")
