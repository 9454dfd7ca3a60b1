"""Tensor parallelism against one process, on a tapered model whose widths do not divide by tp.

Model: 3 layers, d=64, 4 query heads, 2 kv heads (GQA; at tp=4 each kv head is held by two
ranks), MLP widths 115/75/35 = 23/15/7 units of 5 (odd: no width divides by 2 or 4, shards are
uneven), vocab 101 (uneven vocab shards). Each rank also builds the one-process model from the
same seed and compares: logits (its vocabulary slice), loss, every parameter's gradient (gathered
to the logical tensor), then 10 AdamW steps with gradient clipping (losses and grad norms).

Tolerances (fp32): absolute 2e-5 on logits and loss, 1e-5 relative to the largest gradient
entry of each parameter; over 10 steps 1e-5 on the losses and 1e-4 relative on the gradient norms
(Adam amplifies fp32 rounding: measured ~1e-6 and ~1e-5).
"""
from contextlib import nullcontext

import pytest
import torch
from harness import run_distributed

from megatron_taper.config import ConfigError, ModelConfig, ParallelConfig, load_config
from megatron_taper.models import build_model
from megatron_taper.parallel import ParallelModel, parallelize
from megatron_taper.parallel.context import ParallelContext, check_degrees, init_parallel
from megatron_taper.parallel.tensor import split_sizes
from megatron_taper.taper import layer_widths

TINY = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.mlp_width=75", "model.taper.multiple=5", "model.vocab_size=101", "model.seq_len=16",
        "train.seed=7"]
ATOL, GRAD_RTOL, STEP_ATOL, NORM_RTOL = 2e-5, 1e-5, 1e-5, 1e-4


def _tokens(cfg, step, batch=2):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, cfg.model.vocab_size, (batch, cfg.model.seq_len + 1), generator=g)


def _compare(tp, overrides):
    """Runs on every rank; returns measured max differences."""
    cfg = load_config(None, TINY + [f"parallel.tp={tp}"] + list(overrides))
    ctx = init_parallel(cfg.parallel, cfg.model, device="cpu")
    ref = build_model(cfg.model)
    ref.init_weights(cfg.train.seed)
    model = build_model(cfg.model)
    model.init_weights(cfg.train.seed)
    pm = parallelize(model, ctx, cfg)
    ref_pm = ParallelModel(ref, ParallelContext(1, 0, 0, 1, 1, 1, ctx.device, None))  # one process
    out = {}

    # init: every logical tensor equals the one-process one
    ref_params = dict(ref.named_parameters())
    out["init"] = max((pm.full_tensor(n, p.detach()) - ref_params[n]).abs().max().item()
                      for n, p in model.named_parameters())

    # logits (this rank's vocabulary slice), loss, gradients
    tokens = _tokens(cfg, 0)
    ref_logits = ref(tokens[:, :-1])
    logits = model(tokens[:, :-1])
    start = pm.loss_fn.keywords["vocab_start"]
    out["logits"] = (logits - ref_logits[..., start:start + logits.shape[-1]]).abs().max().item()
    ref_loss = ref_pm.forward_backward([tokens], nullcontext)
    loss = pm.forward_backward([tokens], nullcontext)
    pm.reduce_gradients()
    out["loss"] = abs(loss.item() - ref_loss.item())
    grads = {}
    for n, p in model.named_parameters():
        full, want = pm.full_tensor(n, p.grad), ref_params[n].grad
        assert full.shape == want.shape, (n, full.shape, want.shape)
        grads[n] = ((full - want).abs().max() / want.abs().max()).item()
    out["grad_rel"] = max(grads.values())
    out["worst_grad"] = max(grads, key=grads.get)
    out["grad_norm"] = abs(pm.clip_gradients(1e9).item() - ref_pm.clip_gradients(1e9).item())

    # 10 AdamW steps with clipping that bites (max_norm below the norms seen)
    steps = []
    batch = _tokens(cfg, 1)  # the same batch each step, so the loss must fall
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1) for m in (model, ref)]
    for step in range(10):
        row = []
        for p_m, opt in zip((pm, ref_pm), opts):
            opt.zero_grad(set_to_none=True)
            loss = p_m.forward_backward([batch[:1], batch[1:]], nullcontext)  # 2 micro-batches
            p_m.reduce_gradients()
            norm = p_m.clip_gradients(0.5)
            opt.step()
            row.append((loss.item(), norm.item()))
        steps.append(row)
    out["steps"] = steps
    out["step_loss"] = max(abs(a[0] - b[0]) for a, b in steps)
    out["step_norm"] = max(abs(a[1] - b[1]) / b[1] for a, b in steps)
    out["final"] = max(((pm.full_tensor(n, p.detach()) - ref_params[n]).abs().max().item()
                        for n, p in model.named_parameters()))
    return out


def _check(results):
    for r in results:
        assert r["init"] == 0.0
        assert r["logits"] < ATOL, r["logits"]
        assert r["loss"] < ATOL, r["loss"]
        assert r["grad_rel"] < GRAD_RTOL, (r["worst_grad"], r["grad_rel"])
        assert r["grad_norm"] < ATOL, r["grad_norm"]
        assert r["step_loss"] < STEP_ATOL, r["steps"]
        assert r["step_norm"] < NORM_RTOL, r["steps"]
        assert r["final"] < 1e-4, r["final"]
    losses = [s[0][0] for s in results[0]["steps"]]
    assert losses[-1] < losses[0]  # it trains
    print({k: v for k, v in results[0].items() if k != "steps"})


def test_widths_do_not_divide_by_tp():
    mcfg = load_config(None, TINY).model
    widths = layer_widths(mcfg)
    assert widths == [115, 75, 35] and all(w % 2 and w % 4 for w in widths)
    assert split_sizes(35, 4, 5) == [10, 10, 10, 5] and split_sizes(115, 2, 5) == [60, 55]


@pytest.mark.parametrize("tp,overrides", [
    (2, []),
    (2, ["parallel.sequence_parallel=true", "model.tie_embeddings=true"]),
    (4, []),
    (4, ["parallel.sequence_parallel=true"]),
])
def test_tp_matches_one_process(tp, overrides):
    _check(run_distributed(_compare, tp, tp, overrides, timeout=120))


# ---------------------------------------------------------------------------------------------
# Must-show 4: bad inputs, one clear error each (before any process group work)


def _model(**kw):
    return load_config(None, TINY + [f"model.{k}={v}" for k, v in kw.items()]).model


def test_degrees_must_divide_world():
    with pytest.raises(ConfigError, match=r"parallel.tp=2 x parallel.pp=2 = 4 does not divide the world size 6"):
        check_degrees(6, ParallelConfig(tp=2, pp=2), _model())


def test_heads_must_divide_by_tp():
    with pytest.raises(ConfigError, match=r"parallel.tp=3 must divide model.n_heads=4"):
        check_degrees(3, ParallelConfig(tp=3), _model())
    with pytest.raises(ConfigError, match=r"model.n_kv_heads=3: one must divide the other"):
        check_degrees(2, ParallelConfig(tp=2), _model(n_heads=6, n_kv_heads=3, d_model=96))


def test_width_smaller_than_tp_units():
    # widths 45/30/15 at multiple 5: the last layer has 3 units, fewer than tp=4
    with pytest.raises(ConfigError, match=r"layer 2 has MLP width 15 = 3 unit\(s\) of model.taper.multiple=5, "
                                          r"fewer than parallel.tp=4"):
        check_degrees(4, ParallelConfig(tp=4), _model(mlp_width=30))
    with pytest.raises(ValueError, match="fewer than parallel.tp=4"):
        split_sizes(15, 4, 5)


def test_sequence_parallel_needs_divisible_seq():
    with pytest.raises(ConfigError, match="model.seq_len=18 divisible by parallel.tp=4"):
        check_degrees(4, ParallelConfig(tp=4, sequence_parallel=True), _model(seq_len=18))


def test_model_config_ok_for_tp():
    assert check_degrees(8, ParallelConfig(tp=4), _model()) == 2
    assert isinstance(_model(), ModelConfig)
