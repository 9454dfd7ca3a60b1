import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import mfu, model_costs, uniform_twin
from megatron_taper.models import build_model

SMALL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.mlp_width=192",
         "model.vocab_size=512", "model.seq_len=48", "model.taper.multiple=16"]


@pytest.mark.parametrize("extra", [[], ["model.n_kv_heads=2"], ["model.tie_embeddings=true"],
                                   ["model.taper.schedule=sigmoid", "model.taper.start=1.8"]])
def test_cost_model_matches_module_and_flop_counter(extra):
    cfg = load_config(None, SMALL + extra)
    model = build_model(cfg.model)
    costs = model_costs(cfg.model, causal=False)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
    for layer, cost in zip(model.layers.values(), costs.layers):
        assert cost.params == sum(p.numel() for p in layer.parameters())

    seq = cfg.model.seq_len
    counter = FlopCounterMode(display=False)
    # the math backend runs attention as matmuls the counter sees (the fused CPU kernel is not counted)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, cfg.model.vocab_size, (2, seq)))
    assert counter.get_total_flops() / (2 * seq) == pytest.approx(costs.total_flops, rel=1e-9)


def test_causal_attention_counts_half_the_context():
    cfg = load_config(None, SMALL)
    full, causal = model_costs(cfg.model, causal=False), model_costs(cfg.model, causal=True)
    m, s = cfg.model, cfg.model.seq_len
    per_layer = 4 * m.n_heads * m.head_dim * (s - (s + 1) / 2)
    assert full.total_flops - causal.total_flops == pytest.approx(m.n_layers * per_layer)


def test_tapered_and_uniform_twin_have_equal_totals():
    cfg = load_config(None, ["model.n_layers=12", "model.mlp_width=2048"])
    tapered, uniform = model_costs(cfg.model), model_costs(uniform_twin(cfg.model))
    assert tapered.widths != uniform.widths and sum(tapered.widths) == sum(uniform.widths)
    assert tapered.total_params == uniform.total_params
    assert tapered.total_flops == uniform.total_flops
    assert tapered.layers[0].flops > tapered.layers[-1].flops


def test_mfu():
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(1000.0, 1e9, 3e12) == pytest.approx(1.0)
