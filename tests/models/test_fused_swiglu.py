"""model.fused_swiglu: SwiGLU's gate and up projections as one [2W, D] weight (models/layers.py),
against the unfused layout.

Model (as tests/parallel/test_tensor_parallel.py): 3 layers, d=64, MLP widths 115/75/35 = 23/15/7
units of 5, so every width splits unevenly over tp=2; vocab 101. Fused and unfused start from
the same function (models/init.py interleaves the gate and up weights' own initial values).
Tolerances (fp32): logits and loss within ATOL = 2e-5 absolute, every parameter's gradient
(the fused one split back into gate and up) within GRAD_RTOL = 1e-5 of its largest entry
(measured: logits 1.5e-7, loss 0, gradients 5e-7 to 6e-7 at tp=1 and tp=2, as for unfused tp=2
against tp=1: fp32 summation order).
Checkpoints: a run stopped after 3 of 6 steps in one layout resumes in the other (at another tp
size) and its losses match the uninterrupted unfused run within 5e-5, as for tp moves
(tests/checkpoint/test_tp_checkpoint.py).
"""
import json
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from megatron_taper.checkpoint.files import CheckpointReader, Piece, merge_index, write_pieces
from megatron_taper.config import ConfigError, load_config
from megatron_taper.models.layers import fuse_gate_up, split_gate_up
from megatron_taper.training.build import build_run
from tests.helpers.harness import run_distributed

TINY = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=101", "model.seq_len=16",
        "train.seed=7", "train.device=cpu", "train.precision=fp32"]
ATOL, GRAD_RTOL, RESUME_TOL = 2e-5, 1e-5, 5e-5


def _unfused_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith("w13.weight"):
            out[name.replace("w13", "w1")], out[name.replace("w13", "w3")] = split_gate_up(t)
        else:
            out[name] = t
    return out


def _measure(tp: int) -> dict:
    """Logits (vocabulary gathered), loss and logical gradients of one micro-batch, unfused and fused."""
    ctx, out = None, {}
    for fused in (False, True):
        cfg = load_config(None, TINY + [f"parallel.tp={tp}", f"model.fused_swiglu={fused}"])
        run = build_run(cfg, ctx)
        ctx, pm = run.ctx, run.model
        tokens = torch.randint(0, 101, (2, 17), generator=torch.Generator().manual_seed(0))
        logits = pm.module(tokens[:, :-1]).detach()
        if tp > 1:
            pieces = [torch.empty(0)] * tp
            torch.distributed.all_gather_object(pieces, logits, group=ctx.tp_group)
            logits = torch.cat(pieces, dim=-1)
        loss = pm.forward_backward([tokens], nullcontext).item()
        pm.reduce_gradients()
        grads = {n: pm.full_tensor(n, p.grad).clone() for n, p in pm.module.named_parameters()}
        out["fused" if fused else "unfused"] = {"logits": logits, "loss": loss, "grads": _unfused_names(grads)}
    return out


@pytest.mark.multiprocess
def test_fused_equals_unfused_at_tp1_and_tp2_with_uneven_widths():
    reference = _measure(1)["unfused"]
    for tp, got in ((1, _measure(1)), (2, run_distributed(_measure, 2, 2, timeout=120)[0])):
        for layout, rec in got.items():
            torch.testing.assert_close(rec["logits"], reference["logits"], atol=ATOL, rtol=0)
            assert abs(rec["loss"] - reference["loss"]) < ATOL
            assert sorted(rec["grads"]) == sorted(reference["grads"])
            errors = {name: ((rec["grads"][name] - want).abs().max() / want.abs().max()).item()
                      for name, want in reference["grads"].items()}
            assert max(errors.values()) < GRAD_RTOL, (tp, layout, errors)
            print(f"tp={tp} {layout}: logits {(rec['logits'] - reference['logits']).abs().max():.1e}, "
                  f"loss {abs(rec['loss'] - reference['loss']):.1e}, gradients {max(errors.values()):.1e}")


def test_fused_weight_interleaves_gate_and_up_rows_and_is_refused_where_no_block_builds_it():
    w1, w3 = torch.randn(3, 4), torch.randn(3, 4)
    fused = fuse_gate_up(w1, w3)
    assert torch.equal(fused[0::2], w1) and torch.equal(fused[1::2], w3)
    assert all(torch.equal(a, b) for a, b in zip(split_gate_up(fused), (w1, w3)))
    with pytest.raises(ConfigError, match="model.fused_swiglu=true: model.arch='titans'"):
        load_config(None, ["model.arch=titans", "model.fused_swiglu=true"])


def test_reader_serves_either_layout_at_any_box(tmp_path):
    """A checkpoint's records read as the other layout, for boxes that start on an odd (up) row
    (FSDP2's shards of a tp-local fused weight may) and for AdamW's scalar step."""
    w1, w3 = torch.randn(5, 3), torch.randn(5, 3)
    for stored in ({"model/mlp.w1.weight": w1, "model/mlp.w3.weight": w3},
                   {"model/mlp.w13.weight": fuse_gate_up(w1, w3)}):
        folder = tmp_path / str(len(stored))
        pieces = [Piece(key, tuple(t.shape), (0, 0), t) for key, t in stored.items()]
        pieces += [Piece(f"optim/{key[6:]}/step", (), (), torch.tensor(3.0)) for key in stored]
        index, files = write_pieces(str(folder), 0, pieces)
        reader = CheckpointReader(str(folder), merge_index([index]), files)
        for rows in ((0, 10), (3, 4), (1, 1), (7, 3)):
            box = reader.read("model/mlp.w13.weight", (rows[0], 0), (rows[1], 3))
            assert torch.equal(box, fuse_gate_up(w1, w3)[rows[0]: rows[0] + rows[1]]), (stored.keys(), rows)
        assert torch.equal(reader.read("model/mlp.w3.weight", (2, 1), (2, 2)), w3[2:4, 1:3])
        assert {k for k in reader.keys("optim/") if k.endswith("/step")} == {
            "optim/mlp.w1.weight/step", "optim/mlp.w3.weight/step", "optim/mlp.w13.weight/step"}
        assert reader.read("optim/mlp.w13.weight/step", (), ()).item() == 3.0


MODEL = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
         "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=256", "model.seq_len=16"]
TRAIN = ["train.steps=6", "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3",
         "train.warmup_steps=2", "train.log_interval=1", "train.eval_batches=1", "train.device=cpu",
         "train.precision=fp32", "run.tensorboard=false", "checkpoint.keep=0"]


def _fit(overrides):
    from megatron_taper.training.trainer import Trainer

    return Trainer(load_config(None, overrides)).fit()


def _run(tp, fused, run_dir, data, *extra):
    args = MODEL + TRAIN + [f"parallel.tp={tp}", f"model.fused_swiglu={fused}", f"run.dir={run_dir}",
                            f"data.path={data}", *extra]
    assert run_distributed(_fit, tp, args, timeout=240) == [0] * tp


def _losses(run_dir):
    with open(Path(run_dir) / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.mark.multiprocess
def test_checkpoints_move_between_fused_and_unfused_layouts(tmp_path, byte_tokens):
    _run(1, False, tmp_path / "ref", byte_tokens)
    ref = _losses(tmp_path / "ref")
    for first, second in (((2, False), (1, True)), ((1, True), (2, False))):
        run_dir = tmp_path / f"tp{first[0]}_fused{first[1]}_to_tp{second[0]}_fused{second[1]}"
        _run(*first, run_dir, byte_tokens, "train.exit_after=3")
        _run(*second, run_dir, byte_tokens)
        got = _losses(run_dir)
        assert sorted(got) == sorted(ref) == list(range(1, 7))
        diff = max(abs(got[s] - ref[s]) for s in ref)
        print(f"{first} -> {second}: max |loss - uninterrupted unfused| over 6 steps = {diff:.1e}")
        assert diff < RESUME_TOL, (first, second, got, ref)
    _exports_of_a_fused_checkpoint(tmp_path / "tp1_fusedTrue_to_tp2_fusedFalse" / "checkpoints" / "step-3", tmp_path)


def _exports_of_a_fused_checkpoint(fused: Path, tmp_path: Path) -> None:
    """A fused checkpoint exports gate_proj / up_proj to Hugging Face, and converts to an unfused
    folder (tools/convert_checkpoint.py --swiglu unfused) whose model computes the same logits."""
    import importlib.util

    from safetensors.torch import load_file

    from megatron_taper.inference.hf import export_hf
    from megatron_taper.inference.load import load_model, open_checkpoint
    from tests.helpers.runner import REPO

    ref = open_checkpoint(str(fused))
    assert ref.config.model.fused_swiglu and "layers.0.mlp.w1.weight" in ref.names()
    w13 = ref.tensor("layers.0.mlp.w13.weight")
    export_hf(str(fused), str(tmp_path / "hf"))
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    gate, up = split_gate_up(w13)
    assert torch.equal(hf["model.layers.0.mlp.gate_proj.weight"], gate)
    assert torch.equal(hf["model.layers.0.mlp.up_proj.weight"], up)
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.convert(str(fused), str(tmp_path / "unfused"), swiglu="unfused")
    unfused = open_checkpoint(str(tmp_path / "unfused"))
    assert not unfused.config.model.fused_swiglu and "layers.0.mlp.w13.weight" not in unfused.names()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(load_model(unfused)(tokens), load_model(ref)(tokens), atol=ATOL, rtol=0)
