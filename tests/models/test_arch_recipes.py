"""Every recipe in configs/ loads and builds on the meta device, with the parameter count it states."""
import re

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs, uniform_twin
from megatron_taper.models import build_model
from tests.helpers.runner import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
STATED = re.compile(r"#\s*params:\s*([\d,]+)")


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


PAPER_TAPERS = [p for p in CONFIGS if re.fullmatch(r".+_(125m|350m|760m|1\.3b)_taper", p.stem)]


def test_every_family_with_paper_recipes_has_them_at_each_of_its_sizes():
    sizes: dict[str, set[str]] = {}
    for path in PAPER_TAPERS:
        arch, size, _ = path.stem.rsplit("_", 2)
        sizes.setdefault(arch, set()).add(size)
    assert {"transformer", "gated_attention", "titans", "hope_attention"} <= set(sizes)
    assert all(sizes[a] == {"125m", "350m", "760m", "1.3b"} for a in ("transformer", "gated_attention", "titans",
                                                                      "hope_attention")), sizes


@pytest.mark.parametrize("taper", PAPER_TAPERS, ids=lambda p: p.stem)
def test_paper_scale_twins_exist_with_equal_parameters(taper):
    uniform = taper.with_name(taper.name.replace("_taper.yaml", "_uniform.yaml"))
    assert uniform.exists()
    t, u = load_config(str(taper)).model, load_config(str(uniform)).model
    assert t.taper.schedule == "cosine" and u.taper.schedule == "uniform"
    assert model_costs(t).total_params == model_costs(u).total_params == model_costs(uniform_twin(t)).total_params
