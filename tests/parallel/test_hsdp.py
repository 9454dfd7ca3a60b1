"""HSDP (parallel.zero=fsdp2 with parallel.dp_replicate x parallel.dp_shard): parity, resharding, errors.

The model, data and schedule of test_zero.py (10 Trainer steps of a 3-layer d=64 tapered model
on gloo, fp32, gradient clipping at 1.0 active in every step, tensors whose first dimension does
not divide by 2). HSDP 2 x 2 at 4 processes: the 10 losses and the logged gradient norms (the
norm clipping uses, summed over dp_shard only: replicas hold the same shard) within TOL = 5e-5 of
one process (zero=none), as every ZeRO layout in test_zero.py; the final parameters (the step-10
checkpoint) within WEIGHT_TOL = 1e-5 (fp32 reduction orders differ by ~1e-7 per step and the
AdamW updates of lr 3e-3 carry that over 10 steps). Its step-5 checkpoint (written by the first
replica alone) resumes at plain fsdp2 dp=2 and in one process with that run's losses for steps
6-10 (TOL). A NaN gradient on one rank makes every rank skip that step (the non-finite policy),
and the shard groups are the ones the rank layout of parallel/context.py names.

Launches: the one-process reference runs in this process; the HSDP 2 x 2 run, tp=2 x HSDP and the
NaN steps share one 4-process launch (tests/helpers/sessions.py).
"""
import pytest
import torch

from megatron_taper.checkpoint.files import CheckpointReader, iter_full_tensors
from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.validation import ConfigError
from tests.helpers.sessions import run_cases
from tests.parallel.test_zero import MODEL, TOL, TRAIN, _args, _fit, _losses, _max_diff, _run, one_process_reference

pytestmark = pytest.mark.multiprocess

HSDP = ["parallel.zero=fsdp2", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
WEIGHT_TOL = 1e-5


def _norms(run_dir):
    import json

    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r["grad_norm"] for r in map(json.loads, f) if "grad_norm" in r}


def _weights(step_dir):
    import json

    meta = json.loads((step_dir / "meta.json").read_text())
    return dict(iter_full_tensors(CheckpointReader(str(step_dir), meta["tensors"], meta["files"])))


@pytest.fixture(scope="module")
def hsdp_runs(tmp_path_factory, byte_tokens):
    """The one-process reference (in this process); then in one 4-process launch the HSDP 2 x 2 run,
    tp=2 x HSDP 2 x 1, and 3 HSDP steps with a NaN gradient on the last rank."""
    root = tmp_path_factory.mktemp("hsdp")
    one_process_reference(root, byte_tokens)
    hsdp, with_tp, nan = run_cases(4, [
        (_fit, (_args(root / "hsdp", byte_tokens, *HSDP),)),
        (_fit, (_args(root / "tp_hsdp", byte_tokens, "parallel.zero=fsdp2", "parallel.tp=2",
                      "parallel.dp_replicate=2"),)),
        (_nan_gradients_on_rank3, (_args(root / "nan", byte_tokens, *HSDP, "train.steps=3"),))], timeout=300)
    assert hsdp == with_tp == [0] * 4
    return {"root": root, "data": byte_tokens, "nan": nan}


def test_hsdp_2x2_matches_one_process(hsdp_runs):
    root = hsdp_runs["root"]
    ref, got = _losses(root / "ref"), _losses(root / "hsdp")
    diff, norm_diff = _max_diff(got, ref), _max_diff(_norms(root / "hsdp"), _norms(root / "ref"))
    ref_w, got_w = (_weights(root / run / "checkpoints" / "step-10") for run in ("ref", "hsdp"))
    assert sorted(ref_w) == sorted(got_w) and ref_w
    weight_diff = max((ref_w[k] - got_w[k]).abs().max().item() for k in ref_w)
    print(f"HSDP 2 x 2: max |loss - one process| = {diff:.1e}, |grad norm - one process| = {norm_diff:.1e}, "
          f"final weights {weight_diff:.1e}")
    assert len(got) == 10 and diff < TOL and norm_diff < TOL and weight_diff < WEIGHT_TOL
    assert min(_norms(root / "ref").values()) > 1.0  # clipping was active: the norm's value mattered


@pytest.mark.parametrize("nproc", [2, 1])
def test_hsdp_checkpoint_resumes_into_plain_fsdp2(hsdp_runs, tmp_path, nproc):
    import json

    saved = hsdp_runs["root"] / "hsdp"
    meta = json.loads((saved / "checkpoints" / "step-5" / "meta.json").read_text())
    writers = {r["file"] for entry in meta["tensors"].values() for r in entry["records"]}
    assert writers == {"shards/rank-00000.safetensors", "shards/rank-00001.safetensors"}  # the first replica's ranks
    _run(nproc, tmp_path / "run", hsdp_runs["data"], "parallel.zero=fsdp2",
         f"run.resume={saved / 'checkpoints' / 'step-5'}")
    got = _losses(tmp_path / "run")
    assert sorted(got) == list(range(6, 11))
    diff = _max_diff(got, _losses(saved))
    print(f"HSDP 2 x 2 -> fsdp2 dp={nproc}: max |loss - uninterrupted| over steps 6-10 = {diff:.1e}")
    assert diff < TOL


def test_hsdp_composes_with_tp(hsdp_runs):
    """tp=2 x HSDP (dp_replicate=2 x dp_shard=1) at 4 processes: the 2-D dp mesh unflattened between
    pp and tp, FSDP2's replica all-reduce over tp-local (uneven) shards, within TOL of one process.
    (2 x 2 x tp=2 needs 8 processes; it was run by hand, see docs/zero.md.)"""
    got = _losses(hsdp_runs["root"] / "tp_hsdp")
    diff = _max_diff(got, _losses(hsdp_runs["root"] / "ref"))
    print(f"tp=2 x HSDP 2 x 1: max |loss - one process| = {diff:.1e}")
    assert len(got) == 10 and diff < TOL


def _nan_gradients_on_rank3(overrides):
    """3 HSDP steps; in step 2 the last rank's loss (another replica and shard than rank 0) is
    multiplied by NaN, so its gradients are NaN and only reach the others through FSDP2's
    reduce-scatter and replica all-reduce: every rank must skip that step and no other."""
    import torch.distributed as dist

    from megatron_taper.parallel.model import local_part
    from megatron_taper.training.trainer import Trainer

    trainer = Trainer(load_config(None, overrides))
    pm, calls, loss_fn = trainer.pm, [0], trainer.pm.loss_fn

    def poisoned(logits, target):
        calls[0] += 1
        loss = loss_fn(logits, target)
        return loss * float("nan") if dist.get_rank() == 3 and calls[0] == 2 else loss

    pm.loss_fn = poisoned
    changed = []
    for _ in range(3):
        before = [local_part(p).detach().clone() for p in pm.module.parameters()]
        trainer.train_step()
        changed.append(any(not torch.equal(b, local_part(p)) for b, p in zip(before, pm.module.parameters())))
    ctx = trainer.ctx
    mesh = (tuple(ctx.dp_mesh.get_coordinate()), (ctx.dp_replicate_rank, ctx.dp_shard_rank),
            dist.get_process_group_ranks(ctx.dp_shard_group), dist.get_process_group_ranks(ctx.dp_group))
    return trainer.skipped, changed, mesh


def test_hsdp_mesh_follows_the_rank_layout_and_a_nan_gradient_skips_the_step_everywhere(hsdp_runs):
    for rank, (skipped, changed, mesh) in enumerate(hsdp_runs["nan"]):
        assert skipped == 1 and changed == [True, False, True]
        coordinate, from_rank, shard_group, dp_group = mesh
        # dp_shard the faster dimension: ranks 0, 1 and 2, 3 share shards; the flat dp group is all
        assert coordinate == from_rank == (rank // 2, rank % 2)
        assert shard_group == [rank // 2 * 2, rank // 2 * 2 + 1] and dp_group == [0, 1, 2, 3]


@pytest.mark.parametrize("overrides,world,message", [
    (["parallel.zero=fsdp2", "parallel.dp_replicate=2", "parallel.dp_shard=3"], 4,
     "parallel.dp_replicate=2 x parallel.dp_shard=3 = 6 must equal the data-parallel size 4"),
    (["parallel.zero=fsdp2", "parallel.dp_replicate=3"], 4,
     "parallel.dp_replicate=3 x parallel.dp_shard=0 (= 4 // 3 = 1) = 3 must equal the data-parallel size 4"),
    (["parallel.zero=fsdp2", "parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=2"], 4,
     "must equal the data-parallel size 2 (world size / (parallel.tp=2 x parallel.pp=1))"),
    (["parallel.zero=none", "parallel.dp_replicate=2"], 4, "(HSDP) need parallel.zero=fsdp2, not 'none'"),
    (["parallel.zero=deepspeed", "parallel.dp_shard=2"], 4, "(HSDP) need parallel.zero=fsdp2, not 'deepspeed'"),
])
def test_bad_hsdp_layouts_are_refused(overrides, world, message):
    cfg = load_config(None, MODEL + TRAIN + overrides)
    with pytest.raises(ConfigError) as e:
        preflight(cfg, world)
    assert message in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.dp_replicate=0"], "parallel.dp_replicate"), (["parallel.dp_shard=-1"], "parallel.dp_shard")])
def test_bad_hsdp_values_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, MODEL + TRAIN + overrides)


def test_launch_plan_names_shard_groups_that_cross_nodes():
    from megatron_taper.launch_check import plan_lines

    cfg = load_config(None, MODEL + TRAIN + ["parallel.zero=fsdp2", "parallel.dp_replicate=2", "train.global_batch=8"])
    inside, across = plan_lines(cfg, preflight(cfg, 8), 8, 2), plan_lines(cfg, preflight(cfg, 8), 8, 4)
    assert "HSDP dp_replicate 2 x dp_shard 4" in inside[0] and not any("cross nodes" in x for x in inside)
    assert "parallel.tp x parallel.dp_shard = 4 consecutive ranks, which do not fit the 2 per node" in across[-1]


def test_hsdp_rank_layout_and_memory_model():
    from megatron_taper.cost.memory import MemorySetup
    from megatron_taper.parallel.context import ParallelContext

    cfg = load_config(None, MODEL + TRAIN + HSDP)
    assert preflight(cfg, 4).dp == 4  # the accepted 2 x 2 layout
    # tp fastest, then dp_shard, then dp_replicate, pp slowest: pp=1, dp_replicate=2, dp_shard=2, tp=2
    coords = [(c.dp_replicate_rank, c.dp_shard_rank, c.tp_rank)
              for c in (ParallelContext(8, r, r, 1, 4, 2, torch.device("cpu"), None, 2) for r in range(8))]
    assert coords == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    hsdp = MemorySetup.from_config(cfg.parallel, cfg.train, 4, False)
    flat = MemorySetup.from_config(load_config(None, MODEL + TRAIN + ["parallel.zero=fsdp2"]).parallel, cfg.train, 4,
                                   False)
    assert (hsdp.dp_shard, flat.dp_shard) == (2, 4)
    assert hsdp.state_bytes_per_param() == 16 / 2 and flat.state_bytes_per_param() == 16 / 4
