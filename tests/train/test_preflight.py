"""preflight(cfg, world_size): every cross-section rule, refused before any process group exists,
with one ConfigError naming the keys (and nothing else depends on these rules being re-checked)."""
import warnings

import pytest

from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.preflight import preflight

# widths 45/30/15 at multiple 5 (3 layers, cosine 1.5 -> 0.5 of 30)
TINY = ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=75",
        "model.taper.multiple=5", "model.vocab_size=101", "model.seq_len=16", "train.global_batch=8",
        "train.micro_batch=2"]


def _check(world: int, *overrides: str):
    return preflight(load_config(None, TINY + list(overrides)), world)


@pytest.mark.parametrize("world, overrides, message", [
    (6, ["parallel.tp=2", "parallel.pp=2"], r"parallel.tp=2 x parallel.pp=2 = 4 does not divide the world size 6"),
    (3, ["parallel.tp=3"], r"parallel.tp=3 must divide model.n_heads=4"),
    (2, ["parallel.tp=2", "model.n_heads=6", "model.n_kv_heads=3", "model.d_model=96"],
     r"model.n_kv_heads=3: one must divide the other"),
    (4, ["parallel.tp=4", "model.mlp_width=30"],
     r"layer 2 has MLP width 15 = 3 unit\(s\) of model.taper.multiple=5, fewer than parallel.tp=4"),
    (4, ["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=18"],
     "model.seq_len=18 divisible by parallel.tp=4"),
    (2, ["parallel.tp=2", "model.vocab_size=1"], "model.vocab_size=1 is smaller than parallel.tp=2"),
    (4, ["parallel.pp=4"], r"parallel.pp=4 = 4 stages is more than model.n_layers=3"),
    (4, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
     r"parallel.pp=2 x parallel.pp_virtual=2 = 4 stages is more than model.n_layers=3"),
    (2, ["parallel.pp=2", "model.tie_embeddings=true"], "model.tie_embeddings=true with parallel.pp>1"),
    (2, ["parallel.pp=2", "model.n_layers=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_memory_gb=1"],
     "per-stage memory limits are only modelled for non-interleaved"),
    (2, ["parallel.pp=2", "parallel.microbatches=1", "train.global_batch=2"],
     "parallel.microbatches=1 is fewer than parallel.pp=2 stages"),
    (2, ["parallel.pp=2", "parallel.microbatches=3"], "parallel.microbatches=3 must divide the 8 sequences"),
    (2, ["parallel.zero=deepspeed", "parallel.pp=2"], "parallel.zero=deepspeed with parallel.pp=2"),
    (1, ["parallel.zero=deepspeed"], "parallel.zero=deepspeed needs more than one process"),
    (4, ["parallel.zero=deepspeed", "parallel.tp=2", "parallel.sequence_parallel=true"],
     "parallel.zero=deepspeed with parallel.sequence_parallel=true"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "model.n_layers=4", "parallel.microbatches=2"],
     r"parallel.microbatches=2: dualpipev needs at least 2 x parallel.pp = 4"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=dualpipev", "model.n_layers=4", "train.global_batch=4",
         "train.micro_batch=2"],  # the count derived from train: the error names those keys
     r"parallel.microbatches=2 \(train.global_batch / data-parallel size / train.micro_batch\): dualpipev"),
    (2, ["parallel.pp=2", "parallel.pp_schedule=zbv"],
     r"parallel.pp=2 x 2 chunks per rank \(zbv\) = 4 stages is more than model.n_layers=3"),
    (4, ["parallel.zero=fsdp2", "parallel.tp=2", "model.n_kv_heads=1"],
     r"parallel.zero=fsdp2 with parallel.tp=2 > model.n_kv_heads=1"),
    (2, ["parallel.zero=deepspeed", "parallel.tp=2", "model.n_kv_heads=1"],
     r"parallel.zero=deepspeed with parallel.tp=2 > model.n_kv_heads=1"),
    (3, [], r"train.global_batch=8 must be a multiple of train.micro_batch x data-parallel size = 2 x 3"),
    (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "model.arch=titans"],
     "parallel.sequence_parallel is not supported for model.arch='titans'"),
    (1, ["model.mlp_width=5", "model.taper.start=1.9"], r"below one alignment unit \(model.taper.multiple=5\)"),
])
def test_refused_with_the_keys_named(world, overrides, message):
    with pytest.raises(ConfigError if "alignment unit" not in message else ValueError, match=message):
        _check(world, *overrides)


def test_layouts_that_run():
    layout = _check(8, "parallel.tp=4")
    assert (layout.pp, layout.dp, layout.tp, layout.accumulation) == (1, 2, 4, 2)
    # fsdp2 with tp > kv heads is fine while there is nothing to shard (dp = 1)
    assert _check(2, "parallel.zero=fsdp2", "parallel.tp=2", "model.n_kv_heads=1").dp == 1
    layout = _check(4, "parallel.pp=2")
    assert (layout.dp, layout.pipeline_microbatches) == (2, 2)
    # several chunks per rank under fsdp2: each chunk is its own FSDP root
    for schedule in ("interleaved_1f1b", "interleaved_zero_bubble", "zbv"):
        assert _check(4, "parallel.zero=fsdp2", "parallel.pp=2", f"parallel.pp_schedule={schedule}",
                      "model.n_layers=4").dp == 2


def test_gpipe_with_few_microbatches_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(2, "parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.microbatches=1", "train.global_batch=2")
    assert any("mostly pipeline bubble" in str(w.message) for w in caught)


def test_section_rules_stay_in_load_config():
    with pytest.raises(ConfigError, match="parallel.deepspeed.offload_optimizer=nvme needs"):
        load_config(None, ["parallel.zero=deepspeed", "parallel.deepspeed.offload_optimizer=nvme"])
    with pytest.raises(ConfigError, match="train.micro_batch=3 must divide train.global_batch=8"):
        load_config(None, ["train.global_batch=8", "train.micro_batch=3"])
