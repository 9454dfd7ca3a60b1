"""Per-layer MLP widths from a taper schedule under a fixed total budget.

Layer l of L (t = l / (L - 1)) gets the multiplier m(t) of the uniform width W, with m(0) = start
and m(1) = 2 - start. Every schedule satisfies m(t) + m(1 - t) = 2, so the mean multiplier is 1
and the tapered model has the parameters and FLOPs of its uniform twin.

Rounding: widths are whole multiples of the alignment unit u. The budget in units is
T = L * W / u (rounded to the nearest unit when it is not whole; the difference is reported).
Ideal unit counts are scaled to sum to T exactly, floored, and the units left over go to the
layers with the largest remainders (ties: the larger ideal width, then the earlier layer).
A reverse taper (start < 1) is computed as the mirror image of the forward one (2 - start), so
mirrored settings give exactly mirrored widths.

Mixture of experts (model.moe): the layers from model.moe.first_dense on hold experts, the ones
before it a dense MLP. Each group is tapered on its own over its own depth: the dense layers
around model.mlp_width, the MoE layers' expert width around model.moe.expert_width (the number
of experts and top_k stay fixed). Each group's widths sum to its budget, so the total parameters
(experts x widths) and the active FLOPs (top_k x widths) both equal the uniform twin's.

The config sections of both (model.taper: TaperConfig, model.moe: MoEConfig) live here, beside the
rules they set; config.py's ModelConfig holds them. Torch-free, like config.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_taper.validation import ConfigError, check_choice, check_range

TAPER_SCHEDULES = ("uniform", "linear", "cosine", "sigmoid")


@dataclass(frozen=True)
class TaperResult:
    widths: list[int]
    budget: int  # n_layers * mlp_width
    shortfall: int  # budget - sum(widths); 0 whenever the budget is a multiple of the unit


def multipliers(n_layers: int, schedule: str, start: float, sharpness: float = 10.0) -> list[float]:
    """m_l for each layer; first = start, last = 2 - start, mean = 1."""
    end = 2.0 - start
    out = []
    for layer in range(n_layers):
        t = layer / (n_layers - 1) if n_layers > 1 else 0.5
        if schedule == "uniform":
            frac = 0.0
            start = end = 1.0
        elif schedule == "linear":
            frac = t
        elif schedule == "cosine":
            frac = (1.0 - math.cos(math.pi * t)) / 2.0
        elif schedule == "sigmoid":
            lo, hi = _sigmoid(-sharpness / 2), _sigmoid(sharpness / 2)
            frac = (_sigmoid(sharpness * (t - 0.5)) - lo) / (hi - lo)
        else:
            raise AssertionError(f"unknown schedule {schedule!r} (config.TaperConfig validates it)")
        out.append(start + (end - start) * frac)
    return out


def taper_widths(n_layers: int, mlp_width: int, schedule: str = "cosine", start: float = 1.5,
                 multiple: int = 64, sharpness: float = 10.0) -> TaperResult:
    # ranges are validated by config.py (ModelConfig, TaperConfig); here they are invariants
    assert 0.0 < start < 2.0 and n_layers >= 1 and mlp_width >= 1 and multiple >= 1, (start, n_layers, mlp_width)
    if start < 1.0 and schedule != "uniform":
        mirrored = taper_widths(n_layers, mlp_width, schedule, 2.0 - start, multiple, sharpness)
        return TaperResult(mirrored.widths[::-1], mirrored.budget, mirrored.shortfall)

    budget = n_layers * mlp_width
    total_units = max(1, round(budget / multiple))
    ideal = [m * mlp_width / multiple for m in multipliers(n_layers, schedule, start, sharpness)]
    scale = total_units / sum(ideal)
    ideal = [x * scale for x in ideal]
    units = [math.floor(x) for x in ideal]
    order = sorted(range(n_layers), key=lambda i: (-(ideal[i] - units[i]), -ideal[i], i))
    for i in order[: total_units - sum(units)]:
        units[i] += 1
    smallest = min(range(n_layers), key=lambda i: units[i])
    if units[smallest] < 1:
        raise ValueError(
            f"model.taper: layer {smallest} would get an MLP width of {ideal[smallest] * multiple:.1f}, below one "
            f"alignment unit (model.taper.multiple={multiple}); raise model.mlp_width, lower "
            f"model.taper.multiple or use a gentler model.taper.start"
        )
    widths = [u * multiple for u in units]
    return TaperResult(widths, budget, budget - sum(widths))


def layer_widths(model_cfg) -> list[int]:
    """Widths for a `ModelConfig` (its `taper` section): each layer's MLP width, or for an MoE
    layer (moe_layers) the width of each of its experts."""
    t = model_cfg.taper
    moe = model_cfg.moe
    if not moe.enabled:
        return taper_widths(model_cfg.n_layers, model_cfg.mlp_width, t.schedule, t.start, t.multiple,
                            t.sigmoid_sharpness).widths
    dense = (taper_widths(moe.first_dense, model_cfg.mlp_width, t.schedule, t.start, t.multiple,
                          t.sigmoid_sharpness).widths if moe.first_dense else [])
    experts = taper_widths(model_cfg.n_layers - moe.first_dense, expert_width(model_cfg), t.schedule, t.start,
                           t.multiple, t.sigmoid_sharpness).widths
    return dense + experts


def moe_layers(model_cfg) -> list[bool]:
    """Whether each layer holds a mixture of experts (model.moe) rather than a dense MLP."""
    moe = model_cfg.moe
    return [moe.enabled and layer >= moe.first_dense for layer in range(model_cfg.n_layers)]


def expert_width(model_cfg) -> int:
    """The uniform width of one expert (the expert budget): model.moe.expert_width, else model.mlp_width."""
    return model_cfg.moe.expert_width or model_cfg.mlp_width


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# ---------------------------------------------------------------------------------------------
# The config sections that size the MLPs (config.py's ModelConfig holds them as model.taper, model.moe)


@dataclass
class TaperConfig:
    schedule: str = "cosine"  # uniform | linear | cosine | sigmoid
    start: float = 1.5  # multiplier of the first layer; the last one gets 2 - start
    multiple: int = 64  # alignment unit of every width
    sigmoid_sharpness: float = 10.0  # slope of the sigmoid schedule

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.schedule", self.schedule, TAPER_SCHEDULES)
        check_range(f"{prefix}.start", self.start, 0.0, 2.0, open_low=True, open_high=True)
        check_range(f"{prefix}.multiple", self.multiple, 1, None)
        check_range(f"{prefix}.sigmoid_sharpness", self.sigmoid_sharpness, 0.0, None, open_low=True)


@dataclass
class MoEConfig:
    """model.moe: a token-choice top-k mixture of SwiGLU experts in place of the MLP of every layer
    from `first_dense` on (models/moe.py); experts=0 = a dense model. The taper sets each MoE
    layer's expert width (taper.py layer_widths): the number of experts and top_k stay fixed, so
    total parameters and active FLOPs both equal the uniform twin's."""

    experts: int = 0  # routed experts per MoE layer; 0 = no MoE (every layer a dense SwiGLU)
    top_k: int = 2  # experts each token is sent to (gates renormalised to sum to 1; top-1: the probability)
    expert_width: int = 0  # uniform SwiGLU width of one expert, the expert budget (0 = model.mlp_width)
    shared_width: int = 0  # width of a shared SwiGLU expert every token passes through; 0 = none
    first_dense: int = 0  # the first layers keep a dense SwiGLU of model.mlp_width (DeepSeek-V3 keeps 3)
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch form, models/moe.py); 0 = off
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE: mean logsumexp(logits)^2); 0 = off
    # auxiliary-loss-free balancing (DeepSeek-V3): a per-expert bias added to the routing scores for
    # the choice only, moved by bias_rate * sign(mean load - load) after every optimizer step
    bias_balance: bool = False
    bias_rate: float = 0.001

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def validate(self, prefix: str) -> None:
        for key in ("experts", "expert_width", "shared_width", "first_dense"):
            check_range(f"{prefix}.{key}", getattr(self, key), 0, None)
        check_range(f"{prefix}.top_k", self.top_k, 1, None)
        check_range(f"{prefix}.aux_loss_weight", self.aux_loss_weight, 0.0, None)
        check_range(f"{prefix}.z_loss_weight", self.z_loss_weight, 0.0, None)
        check_range(f"{prefix}.bias_rate", self.bias_rate, 0.0, None)
        if self.enabled and self.top_k > self.experts:
            raise ConfigError(f"{prefix}.top_k={self.top_k} must be at most {prefix}.experts={self.experts}")
