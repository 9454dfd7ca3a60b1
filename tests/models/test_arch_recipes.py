"""Every recipe in configs/ loads and builds on the meta device, with the parameter count it states."""
import re
from pathlib import Path

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.models import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
STATED = re.compile(r"#\s*params:\s*([\d,]+)")
FAMILIES = ("transformer", "gated_attention", "titans", "hope_attention")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_recipe_builds_on_meta_with_its_stated_parameter_count(path):
    cfg = load_config(str(path))
    with torch.device("meta"):
        model = build_model(cfg.model)
    real = sum(p.numel() for p in model.parameters())
    assert real == model_costs(cfg.model).total_params
    stated = STATED.search(path.read_text())
    if stated:
        assert real == pytest.approx(int(stated.group(1).replace(",", "")), rel=0.015)


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("size", ["125m", "350m", "760m", "1.3b"])
def test_paper_scale_twins_exist_with_equal_parameters(arch, size):
    root = CONFIGS[0].parent
    taper, uniform = root / f"{arch}_{size}_taper.yaml", root / f"{arch}_{size}_uniform.yaml"
    assert taper.exists() and uniform.exists()
    t, u = load_config(str(taper)).model, load_config(str(uniform)).model
    assert t.taper.schedule == "cosine" and u.taper.schedule == "uniform"
    assert model_costs(t).total_params == model_costs(u).total_params == model_costs(uniform_twin(t)).total_params
