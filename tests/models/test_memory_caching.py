"""Memory Caching (models/memory_caching/) over the linear and the deep memory: the chunked form
against the token-by-token reference for every variant and write mode, reduction to the base with
one segment, soup = GRM for a linear memory, causality, the cost model against torch's FLOP
counter and the module, the activation estimate, option validation."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.models import build_model
from megatron_taper.models.layers import rope_tables
from tests.helpers.memory_caching_reference import reference_reads
from tests.helpers.runner import REPO, saved_elements

SEQ, SEGMENT = 26, 6  # segments 6, 6, 6, 6, 2: up to 4 cached states, top_k=2 selects among them
SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
         f"model.seq_len={SEQ}", "model.taper.multiple=16", f"model.memory_caching.segment={SEGMENT}",
         "model.memory_caching.top_k=2", "model.memory_caching.linear_chunk=4", "model.titans.chunk_size=1"]
VARIANTS = ["none", "residual", "grm", "soup", "ssc"]
ARCHS = ["linear_memory", "deep_memory"]


def build(arch: str, variant: str, *extra: str):
    cfg = load_config(None, SMALL + [f"model.arch={arch}", f"model.memory_caching.variant={variant}", *extra]).model
    model = build_model(cfg)
    model.init_weights(0)
    return cfg, model


def mixer_case(arch: str, variant: str, *extra: str):
    """Layer 0's mixer in float64 with sharpened scores and gates (so that the softmax weights and
    the top-k choice are far from uniform) and inputs x [2, SEQ, D]."""
    torch.manual_seed(0)
    cfg, model = build(arch, variant, *extra)
    mixer = model.layers["0"].mixer.double()
    with torch.no_grad():
        if mixer.wu is not None:
            mixer.wu.weight.mul_(100.0)
        mixer.memory.gates.weight.mul_(50.0)
    return mixer, torch.randn(2, SEQ, cfg.d_model, dtype=torch.float64)


# Float64. The linear memory's chunked form is exact at any chunk (4 here, not aligned with the
# segments of 6); the deep memory's chunked gradients are exact at chunk 1 (model.titans.chunk_size
# above). Measured max |chunked - reference|: ~1e-16 (linear), ~1e-17 (deep).
@pytest.mark.parametrize("write_mode", ["checkpoint", "independent"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_matches_token_by_token_reference(arch, variant, write_mode):
    if variant == "none" and write_mode == "independent":
        pytest.skip("the base has one segment: nothing is written anew")
    mixer, x = mixer_case(arch, variant, f"model.memory_caching.write_mode={write_mode}")
    with torch.no_grad():
        torch.testing.assert_close(mixer.reads(x), reference_reads(mixer, x), rtol=1e-10, atol=1e-12)


# The deep memory chunked by 4 takes its inner gradients at each chunk's start (Titans' parallel
# form): first order in the inner learning rate; measured relative error ~6e-6 at the default
# max_lr=0.003 for both variants (the residual q_t is most of each read's norm).
@pytest.mark.parametrize("variant", ["grm", "soup"])
def test_deep_memory_chunked_by_four_stays_near_the_reference(variant):
    mixer, x = mixer_case("deep_memory", variant, "model.titans.chunk_size=4")
    with torch.no_grad():
        out, ref = mixer.reads(x), reference_reads(mixer, x)
    assert ((out - ref).norm() / ref.norm()).item() < 5e-5


@pytest.mark.parametrize("variant", VARIANTS[1:])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_segment_is_the_base_memory(arch, variant):
    mixer, x = mixer_case(arch, variant, f"model.memory_caching.segment={SEQ}")
    base = mixer.memory
    with torch.no_grad():
        plain = base.scan_features(base.project(x, x)[0], base.init_state(2))[0]
        assert torch.equal(mixer.reads(x), plain)  # the one weight is softmax of one score: exactly 1


def test_soup_of_linear_memories_equals_grm():
    soup, x = mixer_case("linear_memory", "soup")
    grm, _ = mixer_case("linear_memory", "grm")
    grm.load_state_dict(soup.state_dict())
    with torch.no_grad():
        a, b = soup.reads(x), grm.reads(x)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    deep_soup, _ = mixer_case("deep_memory", "soup", "model.titans.max_lr=0.03")  # writes that move the memory
    deep_grm, _ = mixer_case("deep_memory", "grm", "model.titans.max_lr=0.03")
    deep_grm.load_state_dict(deep_soup.state_dict())
    with torch.no_grad():  # a deep memory is not linear in its parameters: soup and grm differ
        assert (deep_soup.reads(x) - deep_grm.reads(x)).abs().max() > 1e-4


# the deep memory: its base, the soup (its own read path) and ssc (grm's reads, top-k); the other
# variants' combination code is the linear memory's
FEWER = [("linear_memory", v) for v in VARIANTS] + [("deep_memory", v) for v in ("none", "soup", "ssc")]


@pytest.mark.parametrize("arch, variant", FEWER)
def test_causal(arch, variant):
    cfg, model = build(arch, variant)
    x = torch.randint(0, cfg.vocab_size, (2, SEQ))
    cut = 14  # inside the third segment
    changed = x.clone()
    changed[:, cut + 1:] = torch.randint(0, cfg.vocab_size, (2, SEQ - cut - 1))
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :cut + 1], b[:, :cut + 1], rtol=0, atol=1e-5)
    assert (a[:, cut + 1:] - b[:, cut + 1:]).abs().max() > 1e-4


@pytest.mark.parametrize("arch, variant", FEWER)
def test_cost_model_matches_module_and_flop_counter(arch, variant):
    cfg, model = build(arch, variant, "model.titans.chunk_size=4")
    costs = model_costs(cfg, causal=False)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
    for layer, cost in zip(model.layers.values(), costs.layers):
        assert cost.params == sum(p.numel() for p in layer.parameters())
        assert cost.params_split.total == cost.params
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (2, SEQ)))
    assert counter.get_total_flops() / (2 * SEQ) == pytest.approx(costs.total_flops, rel=1e-12)
    assert model_costs(cfg, causal=True).total_flops == costs.total_flops


def test_cached_reads_grow_as_length_squared_over_segment():
    """GRM over the linear memory adds W_u (2 D H E per token) and, per token, reads of every one of
    the n - 1 cached states (2 E^2 per head; those the token may not read yet weigh 0), n - 1 scores
    and n - 1 weighted reads (2 E each): O(L + L^2 / S) in all."""
    d, h, e = 32, 2, 16
    for seq, segment in ((256, 32), (1024, 32), (1024, 128)):
        cfgs = [load_config(None, SMALL + ["model.arch=linear_memory", f"model.seq_len={seq}",
                                           f"model.memory_caching.segment={segment}",
                                           f"model.memory_caching.variant={v}"]).model for v in ("grm", "none")]
        grm, base = (model_costs(c).layers[0].flops * seq for c in cfgs)
        n = seq // segment
        expected = 2 * d * h * e * seq + h * seq * (n - 1) * (2 * e * e + 4 * e)
        assert grm - base == pytest.approx(expected, rel=1e-12)


# the estimate's constants are fitted (models/memory_caching/cost.py mixer_act); measured within 6% of
# torch's saved tensors over both bases, every variant, both write modes, E 16-32, L 64-128
@pytest.mark.parametrize("arch, variant, write_mode", [
    ("linear_memory", "grm", "checkpoint"), ("linear_memory", "soup", "independent"),
    ("deep_memory", "ssc", "independent"), ("deep_memory", "soup", "checkpoint")])
def test_activation_estimate_is_near_saved_tensors(arch, variant, write_mode):
    cfg, model = build(arch, variant, "model.titans.chunk_size=4", f"model.memory_caching.write_mode={write_mode}")
    x = torch.randn(2, SEQ, cfg.d_model, requires_grad=True)
    cos, sin = rope_tables(SEQ, cfg.head_dim, cfg.rope_theta, x.device)
    saved = saved_elements(model, lambda: model.layers["0"](x, cos, sin))
    cost = model_costs(cfg).layers[0]
    assert cost.act.total - cost.act.input_copies == pytest.approx(saved / (2 * SEQ), rel=0.10)


@pytest.mark.parametrize("arch", ARCHS)
def test_tapered_and_uniform_twins_have_equal_parameters(arch):
    cfg, model = build(arch, "grm")
    uniform = build_model(uniform_twin(cfg))
    assert model.mlp_widths != uniform.mlp_widths
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in uniform.parameters())


def test_outer_gradients_reach_every_parameter():
    cfg, model = build("deep_memory", "ssc")
    model(torch.randint(0, cfg.vocab_size, (2, SEQ))).logsumexp(-1).mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert model.layers["1"].mixer.wu.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("override, message", [
    ("model.memory_caching.variant=gmr", "did you mean 'grm'"),
    ("model.memory_caching.write_mode=checkpoints", "did you mean 'checkpoint'"),
    ("model.memory_caching.segmnt=8", "did you mean 'model.memory_caching.segment'"),
    ("model.memory_caching.top_k=0", "model.memory_caching.top_k=0"),
])
def test_bad_options_name_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.arch=linear_memory", override])


def test_architecture_keeps_the_sections_the_family_reads():
    arch = load_config(None, ["model.arch=deep_memory"]).model.architecture_dict()
    assert "memory_caching" in arch and "titans" in arch
    assert "memory_caching" not in load_config(None, []).model.architecture_dict()


@pytest.mark.parametrize("base", ["linear", "deep"])
@pytest.mark.parametrize("size", ["760m", "1.3b"])
def test_paper_scale_twins_exist_with_equal_parameters(base, size):
    root = REPO / "configs"
    taper, uniform = (load_config(str(root / f"{base}_memory_caching_{size}_{kind}.yaml")).model
                      for kind in ("taper", "uniform"))
    assert taper.taper.schedule == "cosine" and uniform.taper.schedule == "uniform"
    assert taper.memory_caching.segment == 256 and taper.seq_len == 4096  # the paper's setting
    assert model_costs(taper).total_params == model_costs(uniform).total_params
