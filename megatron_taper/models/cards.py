"""The torch-free half of every built-in model family: its options section (`model.<section>`)
and its FamilyCard (models/spec.py). config.py reads only this module and the registry
(models/__init__.py), so `--print-config`, `--list-keys` and every config error load no torch and
no model code; each family's code is imported the first time its FamilySpec is asked for.

BUILTIN_CARDS lists the built-in families in the order `model.arch` lists them.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_taper.models.spec import FamilyCard
from megatron_taper.validation import ConfigError, check_choice, check_range


@dataclass
class GatedAttentionConfig:
    """model.gated"""

    gate: str = "elementwise"  # elementwise (one gate per head dimension) | headwise

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.gate", self.gate, ("elementwise", "headwise"))


@dataclass
class TitansConfig:
    """model.titans"""

    variant: str = "mag"  # mac (memory as context) | mag (memory as gate) | mal (memory as layer)
    window: int = 64  # sliding-window attention span (MAG, MAL); segment length (MAC)
    persistent_tokens: int = 4  # learnable tokens prepended to the block's sequence
    memory_depth: int = 2  # layers of the memory MLP (1 = a linear memory)
    memory_expansion: int = 2  # hidden width of a deep memory, in multiples of head_dim
    chunk_size: int = 16  # tokens whose memory gradients are taken at the chunk's starting state
    conv_kernel: int = 4  # taps of the depthwise causal convolution on the memory's q, k, v (0 = none)
    max_lr: float = 0.003  # upper bound of the normalised inner step theta_t (the fraction of the error a
    # lone write corrects, over 2); byte-level training at 2048 tokens, chunk 64: 0.03 diverged, 0.01 lagged
    momentum_init: float = 0.9  # eta_t at initialisation (a fixed logit offset)
    forget_init: float = 1e-4  # alpha_t at initialisation (a fixed logit offset): retention 0.8 over 2048 tokens

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.variant", self.variant, ("mac", "mag", "mal"))
        for key in ("window", "memory_depth", "memory_expansion", "chunk_size"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.persistent_tokens", self.persistent_tokens, 0, None)
        check_range(f"{prefix}.conv_kernel", self.conv_kernel, 0, None)
        check_range(f"{prefix}.max_lr", self.max_lr, 0.0, None, open_low=True)
        check_range(f"{prefix}.momentum_init", self.momentum_init, 0.0, 1.0, open_low=True, open_high=True)
        check_range(f"{prefix}.forget_init", self.forget_init, 0.0, 1.0, open_low=True, open_high=True)


@dataclass
class HopeConfig:
    """model.hope"""

    levels: int = 2  # MLP levels of the Continuum Memory System after each attention
    chunk_size: int = 16  # C_0: tokens per update of the fastest level (online)
    chunk_growth: int = 4  # level l updates once per C_l = chunk_size * chunk_growth**l tokens
    online: bool = True  # levels learn inside the sequence (false: a plain chain of SwiGLUs, the ablation)
    online_lr: float = 0.1  # initial step size eta_l of every level (learnable: softplus(raw_step))

    def validate(self, prefix: str) -> None:
        for key in ("levels", "chunk_size", "chunk_growth"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.online_lr", self.online_lr, 0.0, None, open_low=True)


VARIANTS = ("none", "residual", "grm", "soup", "ssc")


WRITE_MODES = ("checkpoint", "independent")


@dataclass
class MemoryCachingConfig:
    """model.memory_caching (both memory families; deep_memory's memory itself is model.titans)"""

    variant: str = "grm"  # none | residual | grm | soup | ssc
    segment: int = 256  # S: tokens per cached segment
    top_k: int = 2  # ssc: cached segments each token reads
    write_mode: str = "checkpoint"  # checkpoint (continue the previous state) | independent (restart)
    linear_chunk: int = 64  # linear_memory: tokens per chunk of the parallel form (exact for any value)
    linear_conv_kernel: int = 4  # linear_memory: taps of the causal convolution on q, k, v (0 = none)
    linear_decay_init: float = 0.97  # linear_memory: the decay a_t at initialisation

    @property
    def continues(self) -> bool:
        """Whether a segment's writes start from the previous segment's end state (checkpoint
        writes, and the uncached base) rather than from the base's initial state."""
        return self.variant == "none" or self.write_mode == "checkpoint"

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.variant", self.variant, VARIANTS)
        check_choice(f"{prefix}.write_mode", self.write_mode, WRITE_MODES)
        for key in ("segment", "top_k", "linear_chunk"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.linear_conv_kernel", self.linear_conv_kernel, 0, None)
        check_range(f"{prefix}.linear_decay_init", self.linear_decay_init, 0.0, 1.0, open_low=True, open_high=True)


@dataclass
class TreeConfig:
    """model.tree"""

    cell_width: int = 0  # hidden width C of the cell's composition h; 0 = 2 * model.d_model

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.cell_width", self.cell_width, 0, None)


AUX_TARGETS = ("next_hidden", "random")


@dataclass
class BridgeConfig:
    """model.bridge"""

    slots: int = 8  # m: state slots of d_model each; 0 = no bridge (the plain Transformer)
    segment: int = 32  # tokens per segment: the state is written after each, read by the later ones
    aux_weight: float = 0.0  # auxiliary self-prediction loss weight; 0 = off
    aux_target: str = "next_hidden"  # next_hidden (the next segment's mean hidden state) | random
    # carry the state from one window of a batch row to the next window of the same document (reset at
    # a document's first window; detached: truncated backpropagation at window boundaries); the trainer
    # then serves each batch row consecutive windows (data.row_streams)
    carry_state: bool = False

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.slots", self.slots, 0, None)
        check_range(f"{prefix}.segment", self.segment, 1, None)
        check_range(f"{prefix}.aux_weight", self.aux_weight, 0.0, None)
        check_choice(f"{prefix}.aux_target", self.aux_target, AUX_TARGETS)
        if self.aux_weight > 0 and self.slots == 0:
            raise ConfigError(f"{prefix}.aux_weight={self.aux_weight} needs a bridge ({prefix}.slots > 0)")
        if self.carry_state and self.slots == 0:
            raise ConfigError(f"{prefix}.carry_state=true needs a bridge ({prefix}.slots > 0)")


# -- cards ---------------------------------------------------------------------------------------
# test_cases: what the standard family tests (tests/models/families.py) build on top of their small
# shape, one case per representative variant.

TRANSFORMER = FamilyCard(name="transformer", module="megatron_taper.models.transformer",
                         positions=("rope", "alibi"), test_cases={"": (), "alibi": ("model.position=alibi",)})
GATED_ATTENTION = FamilyCard(name="gated_attention", module="megatron_taper.models.gated_attention",
                             section="gated", options=GatedAttentionConfig,
                             test_cases={"elementwise": (), "headwise": ("model.gated.gate=headwise",)})
TITANS = FamilyCard(name="titans", module="megatron_taper.models.titans", section="titans", options=TitansConfig,
                    test_cases={"mag": ("model.titans.variant=mag",),
                                "mal": ("model.titans.variant=mal", "model.titans.memory_depth=1"),
                                "mac": ("model.titans.variant=mac",)})
HOPE_ATTENTION = FamilyCard(name="hope_attention", module="megatron_taper.models.hope_attention", section="hope",
                            options=HopeConfig,
                            test_cases={"": ("model.hope.levels=2", "model.hope.chunk_size=4",
                                             "model.hope.online_lr=2.0"),
                                        "offline": ("model.hope.levels=3", "model.hope.online=false")})
TREE = FamilyCard(name="tree", module="megatron_taper.models.tree", section="tree", options=TreeConfig,
                  positions=("none",), refuses=("pp",),
                  test_cases={"": ("model.n_layers=1", "model.tree.cell_width=130")})
BRIDGE = FamilyCard(name="bridge", module="megatron_taper.models.bridge", section="bridge",
                    options=BridgeConfig,
                    test_cases={"": ("model.bridge.segment=8", "model.bridge.slots=3", "model.bridge.aux_weight=0.1")})
LINEAR_MEMORY = FamilyCard(name="linear_memory", module="megatron_taper.models.memory_caching",
                           section="memory_caching", options=MemoryCachingConfig,
                           test_cases={"grm": ("model.memory_caching.segment=8", "model.memory_caching.linear_chunk=4"),
                                       "ssc": ("model.memory_caching.segment=8", "model.memory_caching.variant=ssc")})
DEEP_MEMORY = FamilyCard(name="deep_memory", module="megatron_taper.models.memory_caching",
                         reads_sections=("memory_caching", "titans"),
                         test_cases={"grm": ("model.memory_caching.segment=8",)})

BUILTIN_CARDS = (TRANSFORMER, GATED_ATTENTION, TITANS, HOPE_ATTENTION, TREE, BRIDGE, LINEAR_MEMORY, DEEP_MEMORY)
