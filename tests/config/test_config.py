import copy

import pytest

from megatron_taper.config import ConfigError, all_keys, load_config
from megatron_taper.recipe import merge_recipe
from tests.helpers.runner import REPO


def test_defaults_recipe_and_overrides(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  n_layers: 6\n  taper:\n    start: 1.25\ntrain:\n  lr: 1.0e-3\n")
    cfg = load_config(str(recipe), ["model.d_model=512", "model.n_heads=8", "train.steps=7", "run.tensorboard=false",
                                    "model.taper.schedule=linear", "train.lr=2e-4"])
    assert cfg.model.n_layers == 6 and cfg.model.d_model == 512 and cfg.train.steps == 7
    assert cfg.model.taper.start == 1.25 and cfg.model.taper.schedule == "linear"
    assert cfg.train.lr == 2e-4 and isinstance(cfg.train.lr, float)
    assert cfg.run.tensorboard is False


def test_int_given_to_float_key_is_coerced():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize("override, fragment", [
    ("model.n_layer=4", "did you mean 'model.n_layers'"),
    ("trian.steps=4", "did you mean 'train.steps'"),
    ("model.taper.shedule=cosine", "did you mean 'model.taper.schedule'"),
])
def test_unknown_key_suggests_nearest(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, [override])


@pytest.mark.parametrize("override, fragment", [
    ("train.steps=abc", "train.steps must be an integer"),
    ("train.steps=1.5", "train.steps must be an integer"),
    ("train.lr=fast", "train.lr must be a number"),
    ("run.tensorboard=maybe", "run.tensorboard must be a boolean"),
    ("model.taper.start=2.0", r"model.taper.start=2.0 is outside the allowed range \(0.0, 2.0\)"),
    ("model.taper.start=0", r"model.taper.start=0.0 is outside the allowed range \(0.0, 2.0\)"),
    ("model.taper.schedule=exp", "model.taper.schedule='exp' is not one of"),
    ("train.steps=0", r"train.steps=0 is outside the allowed range \[1, inf\)"),
    ("data.download_timeout_s=0", r"data.download_timeout_s=0.0 is outside the allowed range \[1.0, inf\)"),
    ("model.n_heads=5", "model.n_heads=5 must divide model.d_model=768"),
    ("train.micro_batch=3", "train.micro_batch=3 must divide train.global_batch=8"),
    ("model=3", "model is a section"),
    ("train.steps", "not of the form key=value"),
])
def test_bad_values_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, [override])


def test_recipe_errors_name_the_key(tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model:\n  d_modle: 64\n")
    with pytest.raises(ConfigError, match="did you mean 'model.d_model'"):
        load_config(str(recipe))
    recipe.write_text("train: [1, 2]\n")
    with pytest.raises(ConfigError, match="section train must be a mapping"):
        load_config(str(recipe))
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_contract_keys_exist():
    keys = set(all_keys())
    for key in ("model.arch", "model.n_layers", "model.d_model", "model.n_heads", "model.n_kv_heads",
                "model.mlp_width", "model.vocab_size", "model.seq_len", "model.taper.schedule",
                "model.taper.start", "model.taper.multiple", "parallel.tp", "parallel.pp", "parallel.zero",
                "parallel.pp_balance", "parallel.microbatches", "train.steps", "train.global_batch",
                "train.micro_batch", "train.lr", "train.seed", "train.exit_after", "data.path",
                "data.tokenizer", "checkpoint.interval", "checkpoint.keep", "run.dir"):
        assert key in keys, key


CONFIGS = REPO / "configs"


def test_base_recipe_merges_nested_sections_and_overrides_win(tmp_path):
    (tmp_path / "base.yaml").write_text(
        "model:\n  n_layers: 6\n  d_model: 512\n  n_heads: 8\n  taper:\n    schedule: cosine\n    start: 1.5\n"
        "train:\n  steps: 10\n  lr: 1.0e-3\nrun:\n  dir: runs/base\n")
    (tmp_path / "sub").mkdir()
    child = tmp_path / "sub" / "child.yaml"
    child.write_text("base: ../base.yaml\nmodel:\n  taper:\n    schedule: uniform\n    start: 1.0\n"
                     "train:\n  lr: 2.0e-4\nrun:\n  dir: runs/child\n")
    cfg = load_config(str(child))
    assert cfg.model.n_layers == 6 and cfg.model.d_model == 512 and cfg.model.n_heads == 8  # from the base
    assert cfg.model.taper.schedule == "uniform" and cfg.model.taper.start == 1.0  # nested keys overridden
    assert cfg.model.taper.multiple == 64  # untouched nested key keeps its default
    assert cfg.train.steps == 10 and cfg.train.lr == 2e-4 and cfg.run.dir == "runs/child"
    cfg = load_config(str(child), ["train.lr=5e-5", "model.n_layers=4", "model.taper.schedule=linear"])
    assert cfg.train.lr == 5e-5 and cfg.model.n_layers == 4 and cfg.model.taper.schedule == "linear"
    assert cfg.train.steps == 10 and cfg.model.taper.start == 1.0
    # an absolute base path works too
    child.write_text(f"base: {tmp_path / 'base.yaml'}\ntrain:\n  steps: 3\n")
    cfg = load_config(str(child))
    assert cfg.train.steps == 3 and cfg.train.lr == 1e-3 and cfg.run.dir == "runs/base"


def test_base_chain_and_lists_replace(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  n_layers: 6\n  d_model: 512\n  n_heads: 8\ntrain:\n  steps: 1\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\nmodel:\n  n_layers: 4\ntrain:\n  steps: 2\n")
    (tmp_path / "c.yaml").write_text("base: b.yaml\ntrain:\n  steps: 3\n")
    cfg = load_config(str(tmp_path / "c.yaml"))
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.train.steps) == (512, 4, 3)
    base = {"s": {"x": [1, 2], "y": {"p": 1, "q": 2}}, "t": 1}
    over = {"s": {"x": [3], "y": {"q": 5}}}
    original = copy.deepcopy(base)
    assert merge_recipe(base, over) == {"s": {"x": [3], "y": {"p": 1, "q": 5}}, "t": 1}
    assert base == original


def test_base_cycle_is_an_error_naming_the_files(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle") as e:
        load_config(str(tmp_path / "a.yaml"))
    assert str(e.value).count("a.yaml") == 2 and "b.yaml" in str(e.value)
    (tmp_path / "self.yaml").write_text("base: self.yaml\n")
    with pytest.raises(ConfigError, match="cycle.*self.yaml -> .*self.yaml"):
        load_config(str(tmp_path / "self.yaml"))


def test_missing_or_bad_base_is_an_error_naming_the_files(tmp_path):
    child = tmp_path / "child.yaml"
    child.write_text("base: nowhere/gone.yaml\n")
    with pytest.raises(ConfigError, match="child.yaml: base file not found: .*nowhere/gone.yaml"):
        load_config(str(child))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    child.write_text("base: list.yaml\n")
    with pytest.raises(ConfigError, match=r"list.yaml \(base of .*child.yaml\): the top level must be a mapping"):
        load_config(str(child))
    child.write_text("base: [a.yaml]\n")
    with pytest.raises(ConfigError, match="child.yaml: base must be the path of a YAML recipe"):
        load_config(str(child))
    (tmp_path / "typo.yaml").write_text("model:\n  d_modle: 64\n")
    child.write_text("base: typo.yaml\n")
    with pytest.raises(ConfigError, match="did you mean 'model.d_model'.*typo.yaml"):
        load_config(str(child))


@pytest.mark.parametrize("uniform", sorted(CONFIGS.glob("*_uniform.yaml")), ids=lambda p: p.stem)
def test_uniform_recipe_is_its_taper_twin_but_for_the_schedule(uniform):
    taper = uniform.with_name(uniform.name.replace("_uniform.yaml", "_taper.yaml"))
    u, t = load_config(str(uniform)).to_dict(), load_config(str(taper)).to_dict()
    assert t["model"]["taper"]["schedule"] == "cosine"
    assert u["model"]["taper"]["schedule"] == "uniform" and u["model"]["taper"]["start"] == 1.0
    assert u["run"]["dir"] == f"runs/{uniform.stem}" and t["run"]["dir"] == f"runs/{taper.stem}"
    for d in (u, t):
        del d["model"]["taper"]["schedule"], d["model"]["taper"]["start"], d["run"]["dir"]
    assert u == t


def test_removed_key_in_a_saved_config_is_ignored_with_a_warning():
    import warnings

    from megatron_taper.config import from_dict

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = from_dict({"data": {"num_workers": 2, "path": "x"}}, source="meta.json")
    assert cfg.data.path == "x" and any("data.num_workers is no longer a setting" in str(w.message) for w in caught)
