"""model_memory's cache (megatron_taper/cost/memory.py): the blocks' activation bytes kept by the
setup's ACTIVATION_FIELDS and their parameters by tp, which the layout planner shares across a
search, give bitwise the same ModelMemory as computing every setup afresh, whatever field of
MemorySetup differs between the setups that share it, and the same search result."""
from __future__ import annotations

import dataclasses

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost import memory, plan
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.memory import ACTIVATION_FIELDS, MemorySetup, model_memory
from tests.helpers.families import one_case_per_family

# every MemorySetup field -> values other than the default (a new field must be named here, so that
# the cache key is checked against it)
OTHER_VALUES = {
    "tp": (2,), "sequence_parallel": (True,), "dp": (4,), "cp": (2,), "cp_attention": ("ring", "ulysses"),
    "zero": ("fsdp2", "deepspeed"), "dp_shard": (2,), "pipelined": (True,), "bf16": (True,), "float8": (True,),
    "activation_checkpointing": ("selective", "full", "op"), "ac_every": (3,), "loss_chunk": (8,),
    "micro_batch": (2,), "microbatches": (4,), "bytes_per_param": (6.0,), "optimizer": (False,),
    "offload_optimizer": (True,), "offload_param": (True,), "reduce_bucket": (1000.0,), "prefetch_bucket": (1e6,),
    "float8_min_dim": (16,), "float8_recipe": ("rowwise",), "ep": (2,), "ep_imbalance": (1.5,), "documents": (True,),
    "flex": (True,),
}
CASES = {**one_case_per_family(), "moe": ["model.moe.experts=4", "model.moe.top_k=2"]}
BASES = (MemorySetup(dp=2), MemorySetup(tp=2, dp=2, cp=2, zero="fsdp2", activation_checkpointing="selective"))
SMALL = ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.mlp_width=256", "model.taper.multiple=16",
         "model.vocab_size=512", "model.seq_len=64"]


def _setups() -> list[MemorySetup]:
    """Each base, and each base with one field changed to each of its other values."""
    return [*BASES, *(dataclasses.replace(base, **{name: value}) for base in BASES
                      for name, values in OTHER_VALUES.items() for value in values)]


def test_every_setup_field_is_varied_and_the_key_names_real_fields():
    fields = {f.name for f in dataclasses.fields(MemorySetup)}
    assert set(OTHER_VALUES) == fields
    assert set(ACTIVATION_FIELDS) < fields


@pytest.mark.parametrize("overrides", CASES.values(), ids=list(CASES))
def test_cached_model_memory_is_bitwise_the_uncached(overrides):
    cfg = load_config(None, [*SMALL, *overrides]).model
    setups = _setups()
    cache: dict = {}
    # in both orders, so that each setup reads entries another one made
    for setup in [*setups, *reversed(setups)]:
        assert model_memory(cfg, setup, cache=cache) == model_memory(cfg, setup), setup
    assert len(cache) < len(setups)  # shared between setups


def test_search_with_the_cache_predicts_what_fresh_model_memory_does(monkeypatch):
    cfg = load_config(None, [*SMALL, "model.n_layers=8", "train.global_batch=16"])
    space = (("parallel.tp", (1, 2)), ("parallel.pp", (1, 2)), ("parallel.zero", ("none", "fsdp2")),
             ("parallel.sequence_parallel", (False, True)), ("train.micro_batch", (1, 2)),
             ("train.activation_checkpointing", ("none", "selective", "full")))

    def predictions():
        result = plan.search(cfg, 8, 0.05, profiles()["h100"], space=space)
        return [(x.values, x.rank_peaks, x.step.total) for x in result.layouts], result.legal

    cached = predictions()
    monkeypatch.setattr(plan, "model_memory", lambda model, setup, costs=None, cache=None:
                        memory.model_memory(model, setup, costs))
    fresh = predictions()
    assert cached == fresh and cached[1] > 20
