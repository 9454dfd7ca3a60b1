"""train.compile (parallel/block_options.py): one static graph per distinct block shape, and the
auto | true | false switch as the runtime, preflight and the planner resolve it.

The compile check runs the 1.3B recipe's structure narrowed (cost/op_count.py `narrowed`: 8 of its
blocks, d_model 64, its cosine taper 1.5 -> 0.5 in units of 16: MLP widths 192 192 160 144 112 96
64 64, so 6 distinct widths with repeats at both ends as in the 32-block recipe). Three AdamW steps
(lr 3e-3) compiled against eager from the same weights, fp32. Tolerances: each loss within
LOSS_RTOL = 5e-5 relative (measured 6e-6 at the third step: inductor's fused kernels reorder fp32
sums, and Adam's first steps turn near-zero gradient differences into whole updates; the first
step's loss is bit-identical), every first-step gradient within GRAD_RTOL = 1e-4 of its tensor's
largest entry. A wrong graph moves a loss by 1e-3 or more.
"""
import copy
import io
from contextlib import redirect_stdout

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from megatron_taper.cli import normalise_overrides
from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.op_count import narrowed
from megatron_taper.cost.preflight import compiles
from megatron_taper.models import build_model
from megatron_taper.parallel.block_options import block_signature
from megatron_taper.parallel.context import init_parallel
from megatron_taper.parallel.parallelize import parallelize
from megatron_taper.taper import layer_widths

LOSS_RTOL, GRAD_RTOL = 5e-5, 1e-4
RECIPE = "configs/transformer_1.3b_taper.yaml"
SMALL = ["parallel.pp=1", "train.device=cpu", "train.precision=fp32", "train.global_batch=2", "train.micro_batch=2"]


def _fit(module: torch.nn.Module, tokens: torch.Tensor, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step losses of `steps` AdamW steps, and the first step's gradients."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=3e-3)
    losses, grads = [], {}
    for _ in range(steps):
        logits = module(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        grads = grads or {name: p.grad.clone() for name, p in module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, grads


def test_tapered_stack_compiles_one_static_graph_per_distinct_block_shape():
    cfg = load_config(RECIPE, SMALL + ["train.compile=true"])
    cfg.model = narrowed(cfg.model, n_layers=8, seq_len=32)
    widths = layer_widths(cfg.model)
    assert len(widths) == 8 and len(set(widths)) == 6 and widths[0] == widths[1] and widths[-2] == widths[-1]
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    eager = copy.deepcopy(model)
    printed = io.StringIO()
    with redirect_stdout(printed):
        pm = parallelize(model, init_parallel(cfg.parallel, "cpu"), cfg.model, cfg.parallel, cfg.train)
    assert "compile: 6 static graph(s) for the 8 blocks" in printed.getvalue()
    assert len({block_signature(b) for b in pm.module.layers.values()}) == 6
    tokens = torch.randint(0, cfg.model.vocab_size, (2, cfg.model.seq_len + 1))
    torch._dynamo.reset()
    counters.clear()
    got, got_grads = _fit(pm.module, tokens, steps=3)
    assert counters["stats"]["unique_graphs"] == 6, dict(counters["stats"])  # the old dynamic compile made 2
    assert not counters["graph_break"], dict(counters["graph_break"])
    want, want_grads = _fit(eager, tokens, steps=3)
    assert got == pytest.approx(want, rel=LOSS_RTOL), (got, want)
    grad_error = max(((got_grads[n] - g).abs().max() / g.abs().max()).item() for n, g in want_grads.items())
    assert grad_error < GRAD_RTOL
    print(f"6 graphs for 8 blocks; losses: max |compiled - eager| / eager = "
          f"{max(abs(a - b) / abs(b) for a, b in zip(got, want)):.1e}; first gradients: {grad_error:.1e}")


def test_compile_switch_resolves_per_device_and_reads_old_booleans():
    t = load_config(None).train
    assert t.compile == "auto" and t.compiles("cuda") and not t.compiles("cpu")
    for value, want in (("true", "true"), ("True", "true"), ("false", "false"), ("auto", "auto")):
        assert load_config(None, [f"train.compile={value}"]).train.compile == want
    assert normalise_overrides(["--train.compile", "--train.steps", "5"]) == ["train.compile=true", "train.steps=5"]
    assert normalise_overrides(["--train.compile", "auto"]) == ["train.compile=auto"]
    t.compile = False  # a program (inference/evaluate.py) or a config saved before the switch
    assert not t.compiles("cuda")
    with pytest.raises(ConfigError, match="train.compile must be auto, true or false, got 'sometimes'"):
        load_config(None, ["train.compile=sometimes"])
    with pytest.raises(ConfigError, match="train.cuda_graphs=true needs train.compile"):
        load_config(None, ["train.cuda_graphs=true", "train.compile=false"])


def test_preflight_and_planner_read_the_resolved_compile():
    from megatron_taper.cost.devices import profiles
    from megatron_taper.cost.plan import Predictor

    cfg = load_config(RECIPE, ["parallel.pp=1", "train.global_batch=8", "train.micro_batch=1"])
    predictions = {name: Predictor(cfg, profiles()[name]).predict(cfg, 8, float("inf")) for name in ("h100", "cpu")}
    assert predictions["h100"].compiled and "compiled" in predictions["h100"].describe()
    assert not predictions["cpu"].compiled
    # auto leaves compile off where true is refused: cp with a family whose state passes between slices
    titans = load_config(None, ["model.arch=titans", "model.seq_len=64", "parallel.cp=2"])
    assert not compiles(titans.model, titans.parallel, titans.train, "cuda")
    assert compiles(cfg.model, cfg.parallel, cfg.train, "cuda") and not compiles(cfg.model, cfg.parallel, cfg.train,
                                                                                "cpu")


def test_preflight_warns_of_widths_off_the_tensor_core_unit_on_cuda():
    import warnings

    from megatron_taper.cost.preflight import TENSOR_CORE_UNIT, preflight

    for overrides, warns in ((["train.device=cuda", "model.taper.multiple=64"], True),
                             (["train.device=cpu", "model.taper.multiple=64"], False),
                             (["train.device=cuda"], False)):  # the recipe's own unit: 128
        cfg = load_config(RECIPE, ["parallel.pp=1", *overrides])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            preflight(cfg, 8)
        messages = [str(w.message) for w in caught if "tensor-core" in str(w.message)]
        assert bool(messages) == warns, (overrides, messages)
        if warns:  # the 1.3B recipe's former unit of 64 (the issue counted 18 such widths of 32)
            assert messages[0].startswith("18 of the 32 MLP widths are not multiples of 128")
        elif overrides == ["train.device=cuda"]:
            widths = layer_widths(cfg.model)
            assert all(w % TENSOR_CORE_UNIT == 0 for w in widths) and sum(widths) == 32 * cfg.model.mlp_width
