import pytest

from megatron_taper.config import ConfigError, all_keys, load_config


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
