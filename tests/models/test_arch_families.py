"""Every registered family (tests/helpers/families.py): causality, parameter/FLOP models against
the real modules, tapered twins with equal parameters; the Titans memory against its
token-by-token reference, Gated Attention's gate, Hope's online updates."""
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.models import build_model
from tests.helpers.families import family_cases, one_case_per_family
from tests.helpers.runner import TINY, assert_resumes_exactly
from tests.helpers.titans_reference import reference_scan

SEQ = 40
SMALL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
         "model.vocab_size=256", f"model.seq_len={SEQ}", "model.taper.multiple=16",
         "model.titans.window=16", "model.titans.chunk_size=6", "model.titans.persistent_tokens=3"]
# every registered family's standard cases (tests/helpers/families.py), and the variants only this file checks
CASES = {**family_cases(),
         "titans_mac_depth3": ["model.arch=titans", "model.titans.variant=mac", "model.titans.memory_depth=3"],
         "hope_online": ["model.arch=hope_attention", "model.hope.online=true", "model.hope.chunk_size=4",
                         "model.hope.chunk_growth=2", "model.hope.online_lr=0.5"]}


def build(case: str, *extra: str):
    cfg = load_config(None, SMALL + CASES[case] + list(extra)).model
    model = build_model(cfg)
    model.init_weights(0)
    return cfg, model


@pytest.mark.parametrize("case", CASES)
def test_causal(case):
    torch.manual_seed(0)
    cfg, model = build(case)
    x = torch.randint(0, cfg.vocab_size, (2, SEQ))
    cut = 21  # inside the second MAC segment and a Titans chunk, between Hope update periods
    changed = x.clone()
    changed[:, cut + 1:] = torch.randint(0, cfg.vocab_size, (2, SEQ - cut - 1))
    with torch.no_grad():
        a, b = model(x), model(changed)
    torch.testing.assert_close(a[:, :cut + 1], b[:, :cut + 1], rtol=0, atol=1e-5)
    assert (a[:, cut + 1:] - b[:, cut + 1:]).abs().max() > 1e-3  # later positions do see the change


@pytest.mark.parametrize("case", CASES)
def test_cost_model_matches_module_and_flop_counter(case):
    cfg, model = build(case)
    costs = model_costs(cfg, causal=False)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
    for layer, cost in zip(model.layers.values(), costs.layers):
        assert cost.params == sum(p.numel() for p in layer.parameters())
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randint(0, cfg.vocab_size, (2, SEQ)))
    assert counter.get_total_flops() / (2 * SEQ) == pytest.approx(costs.total_flops, rel=1e-9)
    # the causal/windowed count is never larger: only the (query, key) pairs a mask lets through
    # (Titans counts what its banded kernels compute, masked pairs included; the tree has no attention)
    causal_flops = model_costs(cfg, causal=True).total_flops
    assert causal_flops <= costs.total_flops
    if case.startswith(("transformer", "gated_attention", "hope_attention")):
        assert causal_flops < costs.total_flops


@pytest.mark.parametrize("case", CASES)
def test_tapered_and_uniform_twins_have_equal_parameters(case):
    cfg, model = build(case)
    twin = uniform_twin(cfg)
    uniform = build_model(twin)
    assert model.mlp_widths != uniform.mlp_widths or cfg.n_layers == 1  # one layer: nothing to taper
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in uniform.parameters())
    assert model_costs(cfg).total_params == model_costs(twin).total_params


@pytest.mark.parametrize("case", one_case_per_family())
def test_trains_and_resumes_exactly(case, byte_tokens, tmp_path):
    """Stopped after 3 of 5 steps and resumed: the loss sequence is bitwise the uninterrupted one's."""
    recipe = ["--config", "configs/tiny_taper.yaml", *TINY, *one_case_per_family()[case], f"data.path={byte_tokens}",
              "train.steps=5", "train.eval_interval=4", "train.eval_batches=1", "checkpoint.interval=0"]
    assert_resumes_exactly(recipe, tmp_path)


def test_gated_attention_gate_is_applied_per_head():
    cfg, model = build("gated_attention_headwise")
    attn = model.layers["0"].attn
    x = torch.randn(2, 8, cfg.d_model)
    cos, sin = torch.ones(8, cfg.head_dim // 2), torch.zeros(8, cfg.head_dim // 2)
    with torch.no_grad():
        attn.wg.weight.zero_()  # every gate = 1/2
        torch.testing.assert_close(attn(x, cos, sin), 0.5 * attn.wo(attn.attend(x, cos, sin).flatten(2)))


# Titans memory: the chunked parallel form against the token-by-token recurrence (float64).
# Measured relative error of the reads at the default max_lr=0.003 on these inputs (depth 1/2/3):
# ~3e-16 at C=1; 1.3-2.1e-4 at C=2; 3.3-5.9e-4 at C=4; 0.8-1.3e-3 at C=8; 1.5-2.4e-3 at C=16.
# It is first order in theta (at max_lr=0.3: ~0.2-0.6 at C=8; at 0.03: 0.8-1.9e-2).
CHUNK_TOLERANCE = {1: 1e-12, 2: 5e-4, 4: 1.5e-3, 8: 3e-3, 16: 6e-3}


def memory_case(depth: int, *extra: str):
    torch.manual_seed(0)
    cfg, model = build("titans_mag", f"model.titans.memory_depth={depth}", *extra)
    memory = model.layers["0"].memory.double()
    x_kv, x_q = (torch.randn(2, 24, cfg.d_model, dtype=torch.float64) for _ in range(2))
    state = memory.init_state(2)
    state = (state[0], [torch.randn_like(w) * 0.01 for w in state[0]])  # a non-zero surprise carried in
    return memory, x_kv, x_q, state


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_titans_chunked_memory_matches_token_by_token_reference(depth):
    memory, x_kv, x_q, state = memory_case(depth)
    ref, (ref_w, ref_s) = reference_scan(memory, x_kv, x_q, state)
    errors = {}
    for chunk, tol in CHUNK_TOLERANCE.items():
        out, (w, s) = memory.scan(x_kv, x_q, state, chunk_size=chunk)
        errors[chunk] = ((out - ref).norm() / ref.norm()).item()
        assert errors[chunk] <= tol, (chunk, errors)
        if chunk == 1:
            for a, b in zip(w + s, ref_w + ref_s):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert errors[2] < errors[4] < errors[8] < errors[16]


def test_titans_chunk_error_vanishes_with_the_inner_learning_rate():
    errs = []
    for lr in (0.1, 0.005):
        memory, x_kv, x_q, state = memory_case(2, f"model.titans.max_lr={lr}")
        ref, _ = reference_scan(memory, x_kv, x_q, state)
        out, _ = memory.scan(x_kv, x_q, state, chunk_size=8)
        errs.append(((out - ref).norm() / ref.norm()).item())
    assert errs[1] < errs[0] / 10


def test_titans_outer_gradients_reach_the_memory():
    cfg, model = build("titans_mac_depth3")
    x = torch.randint(0, cfg.vocab_size, (2, SEQ))
    model(x).float().logsumexp(-1).mean().backward()
    block = model.layers["1"]
    for name in ("memory.mem_w.0", "memory.gates.weight", "memory.wk.weight", "persistent"):
        grad = block.get_parameter(name).grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_hope_online_updates_change_later_chunks_only():
    _, online = build("hope_online")
    cfg, offline = build("hope_online", "model.hope.online=false")
    x = torch.randint(0, cfg.vocab_size, (2, SEQ))
    with torch.no_grad():
        a, b = online(x), offline(x)
    first = cfg.hope.chunk_size  # nothing has been written before the first update period ends
    torch.testing.assert_close(a[:, :first], b[:, :first])
    assert (a[:, first:] - b[:, first:]).abs().max() > 1e-4
