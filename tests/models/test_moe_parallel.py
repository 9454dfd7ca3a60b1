"""The mixture of experts (model.moe) through the Trainer: data, tensor, pipeline and expert
parallelism against one process, bitwise resume, resume across ep, and the tiny recipe on the
built-in corpus.

Every parity run: 8 steps of a 3-layer d=64 Transformer, layer 0 dense, layers 1-2 with 4 SwiGLU
experts, top-2, a shared expert, tapered expert widths (48, 16), load-balancing and z-losses on,
and the auxiliary-loss-free bias balancing at a rate (0.05) that changes the routing within the
run; byte tokens of real text, 4 sequences per step, fp32, gradient clipping.

- Two processes, 2 micro-batches of 2 sequences per step (one process: 2 x 2 accumulated): dp=2
  (DDP, parallel.zero=none; the expert loads summed over dp for the bias and the metrics), fsdp2
  at dp=2 (experts, router and routing biases sharded; each rank moves its shard of the biases),
  ep=2 (2 experts per rank, tokens exchanged by all-to-all, the experts' gradients summed over the
  ranks' tokens and scaled by 1/dp; also under full activation checkpointing, whose recompute
  repeats the exchanges inside backward), ep=2 x fsdp2 at dp=2 (non-expert weights sharded over
  dp, each rank's 2 experts whole, outside the shards), tp=2 (attention and dense MLP split, the
  MoE replicated over tp; also with sequence parallelism, the MoE gathering the whole sequence)
  and pp=2 (1F1B; the routing losses' gradients scaled with the
  pipeline's 1 / micro-batches).
- Four processes, micro-batches of one sequence (the routing losses are per micro-batch, so the
  one-process reference accumulates 4 of one sequence): dp=4 with ep=2 through DDP (experts
  copied over 2 groups, their gradients all-reduced over the copies) and fsdp2 (the copies shard
  them: a DTensor over 2 ranks; also under full activation checkpointing), pp=2 x dp=2 with ep=2
  (the stage's dp group is the ep group; DDP and fsdp2; and with the V-shaped zero-bubble schedule
  zbv, 2 chunks per rank, fsdp2, on 4 layers against a 4-layer reference), tp=2 x dp=2 with ep=2
  (DDP with sequence parallelism, and fsdp2).
  Every layout gives the one-process losses and per-layer load metrics within LOSS_ATOL = 2e-5 and
  grad norms within NORM_RTOL = 1e-4 relative (float32 sums in another order: measured at most
  4.8e-7 and 6.2e-7; a bias step of 0.05 flips a token's choice only on a near tie, so the runs
  route alike); the weights after the 8 steps (experts and routing biases included, the logical
  tensors of the checkpoint) within WEIGHT_ATOL = 1e-5 (AdamW's steps of lr 3e-3 normalise
  gradient differences of ~1e-7 relative into weight differences well below it; measured at
  most 4.0e-6, under tp).
- Where the experts live at dp=4 (placements read from the built model, same spawn).
- A run stopped after step 4 (train.exit_after=4, which writes a checkpoint holding the routing
  biases) and resumed logs bitwise the losses and expert loads of steps 5-8 of the uninterrupted run.
  Stopped at ep=1 and resumed at ep=2 x fsdp2 (dp=2), and back, and ep=1 -> ep=2 x fsdp2 at dp=4
  (each rank reading its shard of its experts' rows): the runs match one process within LOSS_ATOL.
- --to hf refuses an MoE checkpoint with one clear error; the tiny recipe trains on the built-in corpus.
The two-process layouts run one after another in one 2-process session, the four-process ones in
one 4-process session.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO, train_in_process
from tests.helpers.trainer_records import fit_all, logged

pytestmark = pytest.mark.multiprocess

LOSS_ATOL, NORM_RTOL, WEIGHT_ATOL = 2e-5, 1e-4, 1e-5
MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.mlp_width=64", "model.vocab_size=256",
         "model.seq_len=32", "model.taper.multiple=16", "model.moe.experts=4", "model.moe.top_k=2",
         "model.moe.expert_width=32", "model.moe.shared_width=16", "model.moe.first_dense=1",
         "model.moe.aux_loss_weight=0.1", "model.moe.z_loss_weight=0.01", "model.moe.bias_balance=true",
         "model.moe.bias_rate=0.05", "train.device=cpu", "train.precision=fp32"]
TRAIN = ["train.steps=8", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=2",
         "train.grad_clip=0.5", "train.log_interval=1", "train.eval_batches=1", "run.tensorboard=false",
         "checkpoint.interval=0", "checkpoint.keep=0"]
LAYOUTS = {"dp2": [], "fsdp2": ["parallel.zero=fsdp2"], "pp2": ["parallel.pp=2"], "ep2": ["parallel.ep=2"],
           "ep2_recompute": ["parallel.ep=2", "train.activation_checkpointing=full"],
           "ep2_fsdp2": ["parallel.ep=2", "parallel.zero=fsdp2"], "tp2": ["parallel.tp=2"],
           "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"]}
# four processes, each rank one sequence per micro-batch: the routing losses are per micro-batch, so
# their one-process reference runs micro-batches of one sequence too (ONE_SEQUENCE)
ONE_SEQUENCE = ["train.micro_batch=1"]
LAYOUTS_4 = {"dp4_ep2": ["parallel.ep=2"], "dp4_ep2_fsdp2": ["parallel.ep=2", "parallel.zero=fsdp2"],
             "dp4_ep2_fsdp2_recompute": ["parallel.ep=2", "parallel.zero=fsdp2", "train.activation_checkpointing=full"],
             "pp2_ep2": ["parallel.ep=2", "parallel.pp=2"],
             "pp2_ep2_fsdp2": ["parallel.ep=2", "parallel.pp=2", "parallel.zero=fsdp2"],
             "tp2_sp_ep2": ["parallel.ep=2", "parallel.tp=2", "parallel.sequence_parallel=true"],
             "tp2_ep2_fsdp2": ["parallel.ep=2", "parallel.tp=2", "parallel.zero=fsdp2"],
             # a V-shaped zero-bubble schedule needs 2 chunks per pp rank: 4 layers (its own reference)
             "pp2_zbv_ep2_fsdp2": ["parallel.ep=2", "parallel.pp=2", "parallel.pp_schedule=zbv", "parallel.zero=fsdp2",
                                   "model.n_layers=4"]}
LOAD_KEYS = tuple(f"moe/{layer}/{key}" for layer in (1, 2) for key in ("load_min", "load_max", "load_entropy",
                                                                          "balance_loss", "z_loss"))


def _fit_all(runs: list[list[str]]) -> list[dict]:
    return [dict(r, **_loads(o)) for r, o in zip(fit_all([MODEL + TRAIN + overrides for overrides in runs]), runs)]


def _fit_all_and_placements(runs: list[list[str]], layouts: list[list[str]]) -> tuple[list[dict], list[dict]]:
    """_fit_all(runs), then per layout where this rank's pieces of layer 2's expert w1 [4, 64, 16] and
    router [4, 64] live: (DTensor mesh size or 0 for a plain tensor, local shape)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from megatron_taper.config import load_config
    from megatron_taper.training.build import build_run

    results, placements = _fit_all(runs), []
    for overrides in layouts:
        module = build_run(load_config(None, MODEL + TRAIN + ONE_SEQUENCE + overrides)).model.module
        placements.append({name: (p.device_mesh.size() if isinstance(p, DTensor) else 0,
                                  tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape))
                           for name, p in module.named_parameters() if name.startswith("layers.2.mlp.")
                           and name.endswith(("experts.w1", "router"))})
        dist.barrier()
    return results, placements


def _loads(overrides: list[str]) -> dict:
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.dir="))
    return logged(run_dir, LOAD_KEYS) if Path(run_dir, "metrics.jsonl").exists() else {}


@pytest.fixture(scope="module")
def one_process(byte_tokens, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_one")
    common = [f"data.path={byte_tokens}"]
    straight, _, resumed, _, one_sequence, _, four_layers = _fit_all([
        common + [f"run.dir={root / 'straight'}"],
        common + [f"run.dir={root / 'stopped'}", "train.exit_after=4"],
        common + [f"run.dir={root / 'stopped'}"],
        common + [f"run.dir={root / 'to_ep2'}", "train.exit_after=4"],
        common + ONE_SEQUENCE + [f"run.dir={root / 'one_sequence'}"],
        common + ONE_SEQUENCE + [f"run.dir={root / 'to_dp4'}", "train.exit_after=4"],
        common + ONE_SEQUENCE + [f"run.dir={root / 'four_layers'}", "model.n_layers=4"]])
    return {"straight": straight, "resumed": resumed, "one_sequence": one_sequence, "four_layers": four_layers,
            "root": root,
            "to_ep2": root / "to_ep2", "to_dp4": root / "to_dp4"}


@pytest.fixture(scope="module")
def two_processes(byte_tokens, tmp_path_factory, one_process) -> dict:
    root = tmp_path_factory.mktemp("moe_two")
    data = f"data.path={byte_tokens}"
    runs = [[data, f"run.dir={root / name}", *layout] for name, layout in LAYOUTS.items()]
    fsdp2_ep2 = ["parallel.ep=2", "parallel.zero=fsdp2"]
    runs += [[data, f"run.dir={one_process['to_ep2']}", *fsdp2_ep2],  # resumed from one process at ep=2 x fsdp2
             [data, f"run.dir={root / 'to_ep1'}", *fsdp2_ep2, "train.exit_after=4"]]
    results = run_distributed(_fit_all, 2, runs, timeout=300)[0]
    return {**dict(zip(LAYOUTS, results)), "ep1_to_ep2": results[-2], "to_ep1": root / "to_ep1", "root": root}


@pytest.fixture(scope="module")
def four_processes(byte_tokens, tmp_path_factory, one_process) -> dict:
    root = tmp_path_factory.mktemp("moe_four")
    data = f"data.path={byte_tokens}"
    runs = [[data, f"run.dir={root / name}", *ONE_SEQUENCE, *layout] for name, layout in LAYOUTS_4.items()]
    runs += [[data, f"run.dir={one_process['to_dp4']}", *ONE_SEQUENCE, *LAYOUTS_4["dp4_ep2_fsdp2"]]]
    placed = [LAYOUTS_4["dp4_ep2"], LAYOUTS_4["dp4_ep2_fsdp2"], ["parallel.ep=4", "parallel.zero=fsdp2"]]
    ranks = run_distributed(_fit_all_and_placements, 4, runs, placed, timeout=300)
    results, placements = ranks[0][0], [[rank[1][i] for rank in ranks] for i in range(len(placed))]
    return {**dict(zip(LAYOUTS_4, results)), "ep1_to_dp4": results[-1], "root": root, "placements": placements}


def _weights(run_dir: Path) -> dict:
    from megatron_taper.inference.load import open_checkpoint

    return dict(open_checkpoint(str(run_dir / "checkpoints" / "step-8")).tensors())


@pytest.mark.parametrize("layout", [*LAYOUTS, *LAYOUTS_4])
def test_layout_matches_one_process(request, one_process, layout):
    runs = request.getfixturevalue("two_processes" if layout in LAYOUTS else "four_processes")
    overrides = {**LAYOUTS, **LAYOUTS_4}[layout]
    reference = "straight" if layout in LAYOUTS else "four_layers" if "model.n_layers=4" in overrides else \
        "one_sequence"
    ref, got = one_process[reference], runs[layout]
    assert sorted(got["loss"]) == sorted(ref["loss"]) == list(range(1, 9))
    diffs = {key: max(abs(got[key][s] - ref[key][s]) for s in ref["loss"]) for key in ("loss", *LOAD_KEYS)}
    norm = max(abs(got["grad_norm"][s] / ref["grad_norm"][s] - 1) for s in ref["loss"])
    print(f"{layout}: max |loss - one process| {diffs['loss']:.1e}, load metrics {max(diffs.values()):.1e}, "
          f"grad norm rel {norm:.1e}")
    assert max(diffs.values()) < LOSS_ATOL, diffs
    assert norm < NORM_RTOL
    # the bias moved the routing: the loads differ from step to step
    assert len({round(ref["moe/2/load_max"][s], 6) for s in ref["loss"]}) > 1
    # the weights after 8 steps, experts and routing biases included (the logical tensors)
    mine, theirs = _weights(runs["root"] / layout), _weights(one_process["root"] / reference)
    assert mine.keys() == theirs.keys() and "layers.2.mlp.experts.w2" in mine
    weight_diff = max((mine[k] - theirs[k]).abs().max().item() for k in mine)
    print(f"{layout}: max |weight - one process| {weight_diff:.1e}")
    assert weight_diff < WEIGHT_ATOL


def test_resume_after_exit_is_bitwise(one_process):
    straight, resumed = one_process["straight"], one_process["resumed"]
    assert sorted(resumed["loss"]) == list(range(1, 9))
    for key in ("loss", *LOAD_KEYS):
        assert [resumed[key][s] for s in range(5, 9)] == [straight[key][s] for s in range(5, 9)], key


def test_resume_across_expert_parallel_sizes(byte_tokens, one_process, two_processes, four_processes):
    """ep=1 -> ep=2 x fsdp2 at dp=2 and back, and ep=1 -> ep=2 x fsdp2 at dp=4 (each rank reading its
    shard of its experts' rows): the checkpoint holds the logical [N, ...] experts."""
    ep2_to_ep1 = _fit_all([[f"data.path={byte_tokens}", f"run.dir={two_processes['to_ep1']}"]])[0]
    for got, ref in ((two_processes["ep1_to_ep2"], one_process["straight"]), (ep2_to_ep1, one_process["straight"]),
                     (four_processes["ep1_to_dp4"], one_process["one_sequence"])):
        assert sorted(got["loss"]) == list(range(1, 9))
        diff = max(abs(got[key][s] - ref[key][s]) for s in range(1, 9) for key in ("loss", *LOAD_KEYS))
        print(f"resumed across ep: max difference to one process {diff:.1e}")
        assert diff < LOSS_ATOL


def test_hf_export_is_refused_clearly(one_process, tmp_path):
    from megatron_taper.inference.hf import export_hf

    with pytest.raises(ValueError, match="model.moe .* has no Hugging Face export yet"):
        export_hf(str(one_process["root"] / "straight" / "checkpoints" / "step-8"), str(tmp_path / "hf"))
    assert not (tmp_path / "hf").exists()


def test_tiny_recipe_trains_on_the_builtin_corpus(tmp_path):
    run = tmp_path / "tiny_moe"
    train_in_process(["--config", str(REPO / "configs/tiny_moe_taper.yaml"), f"run.dir={run}", "train.steps=3",
                      "train.log_interval=1", "train.eval_interval=0", "train.eval_batches=1", "model.seq_len=64",
                      "train.global_batch=4", "train.micro_batch=4", "run.tensorboard=false"])
    records = logged(str(run), ("loss", "moe/3/load_entropy"))
    assert sorted(records["loss"]) == [1, 2, 3] and records["loss"][3] < records["loss"][1]
    assert all(0 < e <= 1 for e in records["moe/3/load_entropy"].values())


def test_experts_are_split_over_ep_and_sharded_over_their_copies(four_processes):
    """dp=4: each rank holds the rows of its ep rank's 2 experts; with fsdp2 and ep=2 each pair of
    copies shards them (a DTensor over 2 ranks: 1 expert each), with ep=4 = dp they stay whole
    (plain tensors); the router is sharded over the dp group of 4 by fsdp2 as before."""
    w1, router = "layers.2.mlp.experts.w1", "layers.2.mlp.router"
    ddp, fsdp2_ep2, fsdp2_ep4 = four_processes["placements"]
    assert all(rank[w1] == (0, (2, 64, 16)) and rank[router] == (0, (4, 64)) for rank in ddp)
    assert all(rank[w1] == (2, (1, 64, 16)) and rank[router] == (4, (1, 64)) for rank in fsdp2_ep2)
    assert all(rank[w1] == (0, (1, 64, 16)) and rank[router] == (4, (1, 64)) for rank in fsdp2_ep4)
