"""FamilyCard and FamilySpec: everything the framework needs to know about one model family.

A family has two halves. Its `FamilyCard` is torch-free (name, options section and dataclass,
position encodings, the overrides the standard tests build it with, and the module holding its
code): config.py, `--print-config` and every config error read only cards. Its `FamilySpec`
(card + behaviour) lives in a tuple `SPECS` in the family's module (a built-in family's package
`models/<family>/__init__.py`; one module may define several families, as models/memory_caching/
does); `models/__init__.py` imports that module only when the spec is first asked for. A
built-in family's SPECS load no torch: they name the model code through `lazy` (imported on first
call), and the cost terms, TP plan and layout checks they hold directly are torch-free modules.
cost/flops.py (per-layer costs), parallel/tp/plan.py (tensor-parallel plan), preflight.py (layout
preconditions), inference/generation.py (decoding state) and inference/hf.py (Hugging Face
adapter) read the spec; none of them names a family class.

Adding a built-in family = its package (code, SPECS in its __init__.py) + its options dataclass
and card in models/cards.py, listed in BUILTIN_CARDS. From outside the package: one module holding card,
options, code and SPECS, named in MEGATRON_TAPER_FAMILIES (tests/helpers/toy_family.py is one).

The TP plan is a description, not parallel code: a function that names, for one block, which
linears split by columns or rows and which parameters are replicated, through the `TPBuilder`
it is handed (parallel/tp/plan.py); the model classes themselves stay single-device code.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.cost.block import Cost
    from megatron_taper.cost.cp import CPMessage
    from megatron_taper.parallel.tp.plan import TPBuilder


def lazy(module: str, name: str) -> Callable[..., Any]:
    """A callable that imports `module` on its first call and calls its attribute `name` with the
    same arguments (a family's SPECS name their torch code through it)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), name)(*args, **kwargs)

    call.__qualname__ = call.__name__ = f"lazy({module}.{name})"
    return call


@dataclass(frozen=True)
class FamilyCard:
    name: str  # the value of model.arch
    module: str  # importable module whose SPECS holds this family's FamilySpec
    section: str = ""  # attribute of ModelConfig holding this family's options (model.<section>)
    options: type | None = None  # dataclass of those options, with validate(prefix); torch-free
    positions: tuple[str, ...] = ("rope",)  # values of model.position it accepts; the first is its default
    # other families' option sections this family also reads (kept in ModelConfig.architecture_dict)
    reads_sections: tuple[str, ...] = ()
    # the standard family tests (tests/models/families.py): case name -> overrides that make the
    # suite's small test shape a valid, representative model of this family ("" = the family's name)
    test_cases: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: {"": ()})
    # layouts this family refuses by design (e.g. "pp": the tree has one layer); the standard tests skip them
    refuses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert bool(self.section) == (self.options is not None), f"{self.name}: section and options go together"
        assert self.positions, f"{self.name}: name at least one position encoding"


class Decoder(Protocol):
    """Incremental decoding state of one model: each call takes the next tokens [B, T] and returns
    their logits [B, T, V], exactly what the full forward gives at those positions."""

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class HFAdapter:
    """How a family maps to a Hugging Face transformers architecture (inference/hf.py runs the files)."""

    model_types: tuple[str, ...]  # config.json model_type values it imports
    # (model cfg) -> the architecture fields of config.json (model_type, sizes, ...)
    export_config: Callable[[ModelConfig], dict[str, Any]]
    # (HF config.json, where) -> our model section; ValueError naming `where` if not representable
    import_config: Callable[[dict[str, Any], str], dict[str, Any]]
    export_name: Callable[[str], str]  # our parameter name -> the HF one; KeyError for a name with no HF place
    # HF parameter name -> ours, or None for a name to skip (e.g. a saved buffer); KeyError if unknown
    import_name: Callable[[str], str | None]
    # (our name, tensor, model cfg) -> the tensor as HF stores it (e.g. rows reordered), and back
    export_tensor: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]
    import_tensor: Callable[[str, torch.Tensor, ModelConfig], torch.Tensor]
    # (model cfg) -> files to copy next to the export (remote modelling code), by path
    extra_files: Callable[[ModelConfig], tuple[str, ...]] = lambda cfg: ()


@dataclass(frozen=True)
class CarriedState:
    """A state a model carries from one window of a batch row to that row's next window (e.g. the
    memory bridge's state along a document). The trainer holds one per row across steps on the
    rows' device, hands it in before each micro-batch's forward, takes the new one after its
    backward, saves it with the data position, and serves each row consecutive windows
    (data.row_streams); the model code sees only `put` and `take`."""

    # (model cfg) -> whether this configuration carries a state at all
    enabled: Callable[[ModelConfig], bool]
    # (model, state from the row's previous window or None = none yet, continues [B] bool): the
    # next forward starts row b from `state[b]` where continues[b], else from the model's initial state
    put: Callable[[nn.Module, torch.Tensor | None, torch.Tensor], None]
    # (model) -> the state after the last forward's window (detached), and no state handed in any more
    take: Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class FamilySpec:
    card: FamilyCard
    # uninitialised single-device model with init_value(name, full shape, seed) and init_weights(seed)
    build: Callable[[ModelConfig], nn.Module]
    layer_cost: Callable[[ModelConfig, int, bool], Cost]  # (cfg, MLP width, causal) -> one block's cost
    # (cfg, block index, causal) -> what the family adds to that block beyond layer_cost (e.g. the
    # memory bridge held by the middle block); None = nothing. cost.flops.model_costs adds it per block.
    block_extra_cost: Callable[[ModelConfig, int, bool], Cost] | None = None
    # (block, parameter-name prefix, cfg, builder): shard one block in place; None = no TP plan
    tp_block_plan: Callable[[nn.Module, str, ModelConfig, TPBuilder], None] | None = None
    # (model cfg, parallel cfg) -> raise ConfigError for layouts only this family refuses
    check_layout: Callable[[ModelConfig, ParallelConfig], None] | None = None
    # (model, batch, max positions) -> incremental decoding state, or None where this model instance
    # has none (e.g. ALiBi); None here = generation recomputes the whole prefix for every token
    decoder: Callable[[nn.Module, int, int], Decoder | None] | None = None
    hf: HFAdapter | None = None  # None = no Hugging Face export / import
    carried_state: CarriedState | None = None  # None = every window starts from the model's initial state
    # whether the model splits a sequence over parallel.cp ranks: its modules with a `context`
    # attribute take a parallel/cp/split.py SequenceSplit; False = refused
    context_parallel: bool = False
    # the split: True = load-balanced causal (attention only), False = contiguous, for families whose
    # state passes from one slice to the next in sequence order (parallel/cp/state.py)
    cp_balanced: bool = True
    # (cfg, block index, its MLP width, micro_batch, cp, activation dtype bytes, parallel.cp_attention) ->
    # the messages that block exchanges per micro-batch under context parallelism (cost/cp.py CPMessage,
    # from the same counting functions the family's cp code is checked against); None = the
    # Transformer's attention (its K and V all-gathered or passed around the ring, or Ulysses' all-to-alls)
    cp_messages: Callable[[ModelConfig, int, int, int, int, int, str], tuple[CPMessage, ...]] | None = None
    # (cfg, block index, its MLP width, micro_batch, cp, activation dtype bytes, parallel.cp_attention) -> what
    # data.document_mask adds to that block's cp_messages besides the all-gather of doc_start (cost/cp.py
    # document_messages)
    cp_document_messages: Callable[[ModelConfig, int, int, int, int, int, str], tuple[CPMessage, ...]] | None = None
    # data.document_mask: the model's forward takes doc_start ([B, S] bool, True where a document of a
    # packed window begins) and keeps every token inside its document; False = refused by preflight
    document_mask: bool = False
    # ... also under parallel.cp > 1 with parallel.cp_attention allgather or ring; False = refused by preflight
    document_mask_cp: bool = False
    # ... also under parallel.cp > 1 with parallel.cp_attention=ulysses; False = refused by preflight
    document_mask_ulysses: bool = False
    # (model cfg, parallel cfg) -> raise ConfigError where data.document_mask is refused for one of the
    # family's variants though the flags above keep it for the family (called by preflight)
    check_documents: Callable[[ModelConfig, ParallelConfig], None] | None = None

    @property
    def name(self) -> str:
        return self.card.name

    @property
    def section(self) -> str:
        return self.card.section

    @property
    def options(self) -> type | None:
        return self.card.options

    @property
    def positions(self) -> tuple[str, ...]:
        return self.card.positions
