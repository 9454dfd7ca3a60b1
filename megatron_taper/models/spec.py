"""FamilySpec: everything the framework needs to know about one model family, in one object.

Each `models/<family>.py` ends with a `SPEC = FamilySpec(...)`; `models/__init__.py` registers
the specs, and config.py (the family's options section), flops.py (per-layer costs),
parallel/tp_plan.py (tensor-parallel plan) and preflight.py (layout preconditions) all read that
one registry. Adding a family = one new file + one registry line + recipes.

The TP plan is a description, not parallel code: a function that names, for one block, which
linears split by columns or rows and which parameters are replicated, through the `TPBuilder`
it is handed (parallel/tp_plan.py); the model classes themselves stay single-device code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import nn

    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.models.costs import Cost
    from megatron_taper.parallel.tp_plan import TPBuilder


@dataclass(frozen=True)
class FamilySpec:
    name: str  # the value of model.arch
    # uninitialised single-device model with init_value(name, full shape, seed) and init_weights(seed)
    build: Callable[[ModelConfig], nn.Module]
    layer_cost: Callable[[ModelConfig, int, bool], Cost]  # (cfg, MLP width, causal) -> one block's cost
    # (cfg, block index, causal) -> what the family adds to that block beyond layer_cost (e.g. the
    # memory bridge held by the middle block); None = nothing. flops.model_costs adds it per block.
    block_extra_cost: Callable[[ModelConfig, int, bool], Cost] | None = None
    # (block, parameter-name prefix, cfg, builder): shard one block in place; None = no TP plan
    tp_block_plan: Callable[[nn.Module, str, ModelConfig, TPBuilder], None] | None = None
    # (model cfg, parallel cfg) -> raise ConfigError for layouts only this family refuses
    check_layout: Callable[[ModelConfig, ParallelConfig], None] | None = None
    section: str = ""  # attribute of ModelConfig holding this family's options (model.<section>)
    positions: tuple[str, ...] = ("rope",)  # values of model.position it accepts; the first is its default
    options: type | None = None  # dataclass of those options, with validate(prefix)
    # other families' option sections this family also reads (kept in ModelConfig.architecture_dict)
    reads_sections: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert bool(self.section) == (self.options is not None), f"{self.name}: section and options go together"
        assert self.positions, f"{self.name}: name at least one position encoding"
