"""Arithmetic of rules of the memory model (megatron_taper/cost/memory.py, docs/memory_model.md):
the step's first backward runs before the gradients it makes exist, which gradients those are per
engine, fsdp2's step-end copy of them, the head's weight-gradient moment without the unchunked
loss's freed log-softmax, and float8's uncast weights. The
measurements behind them are in docs/memory_model.md (benchmarks/layout_memory.py); these tests
pin the rules themselves, exactly (small integers, no tolerance needed)."""
from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.block import Split
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.memory import (
    MemorySetup,
    act_bytes_per_token,
    head_weight_grad_moment,
    largest_share,
    model_memory,
)
from megatron_taper.cost.stage_memory import MemoryModel, to_memory_model


def _two_layers(microbatches: int) -> MemoryModel:
    # layer 0 on stage 0 (2 micro-batches in flight), layer 1 + head on stage 1 (1 in flight);
    # each layer: 10 static bytes of which 4 are gradients made by the backward, keeps 3
    return MemoryModel(static=[10.0, 10.0], act=[3.0, 3.0], in_flight=[2, 1], limits=[math.inf] * 2,
                       peak=[5.0, 5.0], last_peak=4.0, fixed=[0.0, 0.0], grad_prefix=[0.0, 4.0, 8.0],
                       microbatches=microbatches)


@pytest.mark.parametrize("m, first_stage, last_stage", [
    # m > n: a forward comes before the second backward, which has the gradients and n in flight:
    # stage 0 (n - 1) x 3 + top 5 = 8; stage 1 top = max(5, 3 + 4) = 7
    (4, 8.0, 7.0),
    # m = n = 2 on stage 0: first backward 3 + 5 - 4 = 4, the second 0 x 3 + 5 = 5 with them
    (2, 5.0, 7.0),
    # one micro-batch: only the first backward, without its 4 bytes of gradients
    (1, 4.0, 3.0),
])
def test_first_backward_runs_without_the_gradients_it_makes(m, first_stage, last_stage):
    model = _two_layers(m)
    s_pre, a_pre = [0.0, 10.0, 20.0], [0.0, 3.0, 6.0]
    assert model.stage_parts(0, 2, 0, 1, s_pre, a_pre) == (10.0, first_stage, 0.0)
    assert model.stage_parts(1, 2, 1, 2, s_pre, a_pre) == (10.0, last_stage, 0.0)
    # without the gradient terms (grad_prefix empty): n - 1 kept + top, whatever m
    resident = dataclasses.replace(model, grad_prefix=())
    assert resident.stage_parts(0, 2, 0, 1, s_pre, a_pre) == (10.0, 8.0, 0.0)
    # fsdp2 with one chunk per rank: the step's end copies the stage's gradients once more (20 here)
    # while they are held, above the activations' 8
    large = dataclasses.replace(model, grad_prefix=[0.0, 20.0, 40.0])
    assert large.stage_parts(0, 2, 0, 1, s_pre, a_pre)[1] == {4: 8.0, 2: 5.0, 1: 0.0}[m]
    assert dataclasses.replace(large, reduce_copy=True).stage_parts(0, 2, 0, 1, s_pre, a_pre)[1] == 20.0


def test_which_gradients_a_step_makes():
    """Per parameter: zero=none without DDP 4 (set to None between steps), DDP 0 (bucket views);
    fsdp2 under pipelining the unsharded fp32 one (4), without it the sharded one (4 / dp_shard:
    HSDP 2 x 2 -> 2); DeepSpeed, an explicit bytes_per_param and no optimizer step: 0."""
    assert MemorySetup(zero="none").made_grad_bytes_per_param() == 4.0
    assert MemorySetup(zero="none", dp=2).made_grad_bytes_per_param() == 0.0
    assert MemorySetup(zero="none", cp=2).made_grad_bytes_per_param() == 0.0  # DDP over dp x cp
    assert MemorySetup(zero="fsdp2", dp=2, dp_shard=2, pipelined=True).made_grad_bytes_per_param() == 4.0
    assert MemorySetup(zero="fsdp2", dp=4, dp_shard=2).made_grad_bytes_per_param() == 2.0
    assert MemorySetup(zero="fsdp2").made_grad_bytes_per_param() == 4.0  # dp = 1: left as is
    assert MemorySetup(zero="deepspeed", dp=2).made_grad_bytes_per_param() == 0.0
    assert MemorySetup(bytes_per_param=6.0).made_grad_bytes_per_param() == 0.0
    assert MemorySetup(optimizer=False).made_grad_bytes_per_param() == 0.0
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512",
                             "model.seq_len=128"]).model
    mm = model_memory(cfg, MemorySetup(zero="fsdp2", dp=2, dp_shard=2, pipelined=True, microbatches=4))
    assert to_memory_model(mm, [2, 1], [math.inf] * 2).reduce_copy
    assert not to_memory_model(mm, [1] * 4, [math.inf] * 4, virtual=2).reduce_copy  # torch's REDUCE_GRAD action


def test_one_microbatch_per_rank_peaks_without_the_sharded_gradients():
    """HSDP 2 x 2 at one micro-batch per rank: the whole-model peak is that of two micro-batches
    less the sharded gradients (4 / dp_shard bytes per parameter), the loss's moment being the
    head's top in both (256 tokens against d_model 64)."""
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512",
                             "model.seq_len=128"]).model
    one = MemorySetup(zero="fsdp2", dp=4, dp_shard=2, micro_batch=2, microbatches=1)
    costs = model_costs(cfg)  # ~1 s of CPU: once
    mm = model_memory(cfg, one, costs)
    grads = sum(p.grads for p in [*mm.layers, mm.embedding, mm.head])
    params = sum(p.params for p in [*mm.layers, mm.embedding, mm.head])
    assert grads == pytest.approx(2.0 * params, rel=1e-12)
    two = model_memory(cfg, dataclasses.replace(one, microbatches=2), costs)
    layers = range(cfg.n_layers)
    assert two.stage(layers).total - mm.stage(layers).total == pytest.approx(grads, rel=1e-12)


@pytest.mark.parametrize("loss_chunk", [0, 64])
def test_head_weight_gradient_moment(loss_chunk):
    """What the head keeps, less the unchunked loss's saved fp32 [N, V] (freed before the
    projection's backward; the chunked loss saves the logits, kept anyway), plus the logits'
    gradient (compute dtype) and the new fp32 weight gradient [V, d]."""
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512",
                             "model.seq_len=128"]).model
    setup = MemorySetup(pipelined=True, micro_batch=2, microbatches=4, loss_chunk=loss_chunk)
    mm = model_memory(cfg, setup)
    shares = Split(whole=1.0, seq=1.0, heads=1.0, kv=1.0, width=1.0, vocab=largest_share(512, 1))
    tokens, v, d = 256, 512, 64
    head = dataclasses.replace(mm.head, kept=1000.0)
    saved = 0 if loss_chunk else 4 * tokens * v
    assert head_weight_grad_moment(cfg, shares, setup, head, tokens) == 1000.0 - saved + 4 * tokens * v + 4 * v * d
    assert act_bytes_per_token(Split(vocab=v), shares, setup) * tokens == 4 * tokens * v
    assert head_weight_grad_moment(cfg, shares, dataclasses.replace(setup, pipelined=False, microbatches=1), head,
                                   tokens) == 0.0


def test_float8_blocks_keep_no_bf16_weight_copy():
    """Under bf16 autocast the block linears train.float8 converts (torchao Float8Linear) save their
    fp32 weights uncast: 2 bytes fewer per parameter of theirs (here every linear: float8_min_dim
    16); the norms and the head keep their bf16 copies; the default rule converts nothing at d_model
    64, so nothing changes; fp32 has no copies either way (train.float8 and its rule reach the
    setup through from_config)."""
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512",
                             "model.seq_len=128", "train.float8=true", "train.float8_min_dim=16"])
    costs = model_costs(cfg.model)
    setup = MemorySetup.from_config(cfg.parallel, cfg.train, dp=1, bf16=True)
    assert setup.float8 and setup.float8_min_dim == 16
    with_f8 = model_memory(cfg.model, setup, costs)
    without = model_memory(cfg.model, dataclasses.replace(setup, float8=False), costs)
    for a, b, width in zip(with_f8.layers, without.layers, costs.widths):
        linears = 4 * 64 * 64 + 3 * 64 * width  # wq wk wv wo, w1 w3 w2
        assert b.static - a.static == pytest.approx(2.0 * linears, rel=1e-12) and linears < a.params
    assert with_f8.head.static == without.head.static
    default_rule = model_memory(cfg.model, dataclasses.replace(setup, float8_min_dim=4096), costs)
    assert [x.static for x in default_rule.layers] == [x.static for x in without.layers]
    fp32 = dataclasses.replace(setup, bf16=False)
    assert model_memory(cfg.model, fp32, costs).layers[0].static == model_memory(
        cfg.model, dataclasses.replace(fp32, float8=False), costs).layers[0].static
