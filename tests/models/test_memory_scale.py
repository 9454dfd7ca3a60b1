"""The neural memories keep their scale at the long-context recipes' own lengths (issue 27): at
initialisation the output of every memory layer (what `memory.wo` returns: the input of the gate,
the residual or the mixer's sum) has a mean norm over the last 256 positions of at least 0.1x its
mean over the first 64. Each recipe runs at its seq_len with its memory settings (head_dim,
chunk, max_lr, gates, Memory Caching's segments), d_model cut to one head and one layer."""
from pathlib import Path

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.models import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
MEMORY_ARCHS = ("titans", "deep_memory", "linear_memory")
LONG = [p for p in CONFIGS if (m := load_config(str(p)).model).arch in MEMORY_ARCHS and m.seq_len >= 1024]


def test_every_long_context_memory_recipe_is_covered():
    assert {load_config(str(p)).model.arch for p in LONG} == set(MEMORY_ARCHS)


@pytest.mark.parametrize("path", LONG, ids=lambda p: p.stem)
def test_memory_output_keeps_its_scale_over_the_recipe_length(path):
    head_dim = load_config(str(path)).model.head_dim
    cfg = load_config(str(path), [f"model.d_model={head_dim}", "model.n_heads=1", "model.n_kv_heads=0",
                                  "model.n_layers=1", "model.vocab_size=256", "model.mlp_width=64",
                                  "model.taper.schedule=uniform", "model.taper.start=1.0",
                                  "model.taper.multiple=8"]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(0)
    norms = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: norms.append(out[0].norm(dim=-1)))
             for name, m in model.named_modules() if name.endswith("memory.wo")]
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (1, cfg.seq_len), generator=torch.Generator().manual_seed(0)))
    assert len(norms) == len(hooks) == cfg.n_layers
    for n in norms:
        assert n.shape == (cfg.seq_len,)
        ratio = (n[-256:].mean() / n[:64].mean()).item()
        assert ratio >= 0.1, (path.stem, ratio)


def test_a_write_is_read_back_hundreds_of_tokens_later():
    """The write-then-read probe (benchmarks/memory_probe.py) on the Titans 125M recipe's memory
    (head_dim 64, chunk 64, its gates) at init: the pair (kappa, nu) written at token 100 of 600,
    kappa queried at token 500; recall = <r1 - r0, nu - r0> / |nu - r0|^2 with r1 / r0 the reads
    with / without the write. Measured 0.013 (before issue 27: 1.5e-7; the forget gate emptied the
    memory within a few hundred tokens)."""
    path = next(p for p in CONFIGS if p.stem == "titans_125m_taper")
    cfg = load_config(str(path), ["model.d_model=64", "model.n_heads=1", "model.n_layers=1", "model.vocab_size=256",
                                  "model.mlp_width=64", "model.taper.schedule=uniform", "model.taper.start=1.0",
                                  "model.taper.multiple=8"]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    model.init_weights(0)
    memory = model.layers["0"].memory.double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 600, cfg.d_model, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        k, v, q, *gates = (f.clone() for f in memory.project(x, x)[0])
        kappa, nu = (torch.nn.functional.normalize(torch.randn(1, 64, generator=gen, dtype=torch.float64), dim=-1)
                     for _ in range(2))
        q[0, :, 500] = kappa
        r0 = memory.scan_features((k, v, q, *gates), memory.init_state(1))[0][0, :, 500]
        k[0, :, 100], v[0, :, 100] = kappa, nu
        r1 = memory.scan_features((k, v, q, *gates), memory.init_state(1))[0][0, :, 500]
    recall = ((r1 - r0) * (nu - r0)).sum() / (nu - r0).square().sum()
    assert recall > 0.005, recall.item()
