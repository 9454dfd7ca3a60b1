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
