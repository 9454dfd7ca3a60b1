"""Every memory family's block traces into one graph (no graph break: what `train.compile` needs
to capture the whole scan) and, compiled through dynamo and AOT autograd (backend aot_eager: the
layer where a compiled scan's gradients went wrong in a prototype on torch 2.13), equals the eager
block in float64: outputs and every parameter's gradient within 1e-10 (measured ~1e-15); and
`train.compile` compiles a tapered stack of them into a bounded number of graphs. Inductor's code
generation is left to the GPU check (benchmarks/gpu_families.py's compiled rows)."""
import functools

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.models.layers import rope_tables
from tests.helpers.runner import REPO

SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
         "model.taper.multiple=16"]
RECIPES = {"titans": ["model.seq_len=20", "model.titans.chunk_size=8", "model.titans.window=8"],
           "hope_attention": ["model.seq_len=40"],
           "linear_memory_caching": ["model.seq_len=40", "model.memory_caching.segment=16",
                                     "model.memory_caching.linear_chunk=8"],
           "deep_memory_caching": ["model.seq_len=20", "model.memory_caching.segment=8",
                                   "model.titans.chunk_size=4"],
           "bridge": ["model.seq_len=40", "model.bridge.carry_state=false"]}


@pytest.mark.parametrize("family", list(RECIPES))
def test_block_compiles_whole_and_equals_eager_in_float64(family):
    cfg = load_config(str(REPO / f"configs/tiny_{family}.yaml"), SMALL + RECIPES[family]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(0)
    block = model.layers["0"].double()
    x = torch.randn(2, cfg.seq_len, cfg.d_model, dtype=torch.float64, requires_grad=True)
    cos, sin = (t.double() for t in rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x.device))
    torch._dynamo.reset()
    inputs = [x, *block.parameters()]
    eager = block(x, cos, sin)
    want = torch.autograd.grad(eager.square().sum(), inputs, allow_unused=True)
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)(x, cos, sin)  # fullgraph: a break fails
    got = torch.autograd.grad(compiled.square().sum(), inputs, allow_unused=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-10, atol=1e-12)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", list(RECIPES))
def test_per_block_compile_is_one_static_graph_per_block_shape_without_breaks(family, monkeypatch):
    """`train.compile` (parallel/block_options.py) over a tapered stack of 2 blocks of 2 widths:
    one static graph per distinct block shape, as for the Transformer (the bridge's model has its
    own bridge block among them); no graph break in the scans (dynamo's counters, the `eager`
    backend standing in for inductor, whose code generation is not what is counted)."""
    from torch._dynamo.utils import counters

    from megatron_taper.parallel.block_options import apply_block_options, block_signature

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    cfg = load_config(str(REPO / f"configs/tiny_{family}.yaml"), SMALL + RECIPES[family]).model
    model = build_model(cfg)
    model.init_weights(0)
    assert len(set(model.mlp_widths)) == 2
    shapes = apply_block_options(model, "none", 1, True)
    assert shapes == len({block_signature(b) for b in model.layers.values()}) == 2
    torch._dynamo.reset()
    counters.clear()
    out = model(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len)))
    (out if torch.is_tensor(out) else out[0]).float().mean().backward()
    assert counters["stats"]["unique_graphs"] == shapes
    assert not sum(counters["graph_break"].values())
    torch._dynamo.reset()
