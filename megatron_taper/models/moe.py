"""Mixture of experts: token-choice top-k routing over SwiGLU experts (model.moe), single-device code.

Shapes: T tokens (B x S flattened), D d_model, N routed experts, k top_k, W the layer's expert
width (tapered across depth, taper.py), A = T x k token-expert assignments.

    x [T, D] -> router logits [T, N] in fp32 -> probabilities p = softmax(logits)
    choice    top-k of p + expert_bias (the bias moves the choice only, DeepSeek-V3); gates: the
              chosen p, renormalised to sum to 1 per token when k > 1 (top-1: p itself, as Switch)
    dispatch  the A assignments sorted by expert (stable), x gathered into that order [A, D]
    experts   SwiGLU of every expert on its contiguous rows (dropless: no capacity, no token
              dropped): one grouped GEMM per projection (torch's grouped_mm) where the kernel
              takes the operands, else a loop over the experts (GroupedExperts)
    combine   rows scaled by their gate and summed back per token [T, D] (+ the shared expert)

Losses, added to the training objective through the backward pass (AuxLoss: the layer's output
is returned unchanged, its backward adds the losses' gradients, scaled by `aux_scale`, the
weight of one micro-batch in the step's mean loss), so the reported loss stays the cross entropy:
    load balance  Switch Transformer's (Fedus et al. 2021, eq. 4), counted over the k choices:
                  N * sum_i f_i * P_i, f_i = assignments to expert i / A, P_i = mean_t p_ti
                  (1 when perfectly balanced); weight model.moe.aux_loss_weight
    router z-loss ST-MoE's (Zoph et al. 2022): mean_t logsumexp(logits_t)^2; weight z_loss_weight

Counters (device tensors, no host read): in a training forward (grad enabled and not a
recompute inside backward) each layer adds its assignments per expert to `load_step` (read and
cleared by balance_experts after the optimizer step) and `load_log` (read and cleared by
load_metrics at log intervals), and its two losses to `loss_log`.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.layers import SwiGLU

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def grouped_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes x [A, K] @ weight [N, K, M]: rows of 16 bytes' multiples
    (K and M), and on CUDA or under torch.compile bf16 operands (its kernel's and its meta
    function's only unscaled dtype), on the CPU in eager mode (torch 2.13 has a reference kernel
    there) float32 or float64."""
    if x.dtype != weight.dtype or any(n * x.element_size() % 16 for n in (x.shape[-1], weight.shape[-1])):
        return False
    if x.device.type == "cuda" or torch.compiler.is_compiling():  # compiled: its meta kernel takes bf16 only
        return x.dtype == torch.bfloat16
    return x.dtype in (torch.float32, torch.float64)


class GroupedExperts(nn.Module):
    """N SwiGLU experts of width W: w1, w3 [N, D, W] (gate, up), w2 [N, W, D]."""

    def __init__(self, d_model: int, n_experts: int, width: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d_model, width))
        self.w3 = nn.Parameter(torch.empty(n_experts, d_model, width))
        self.w2 = nn.Parameter(torch.empty(n_experts, width, d_model))
        self.use_grouped_mm = True  # False: always the loop (the reference the tests compare with)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [A, D] sorted by expert, counts [N] rows per expert -> [A, D]."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if torch.is_autocast_enabled(x.device.type):  # grouped_mm is not on autocast's lists
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w3, w2 = x.to(dtype), w1.to(dtype), w3.to(dtype), w2.to(dtype)
        if self.use_grouped_mm and grouped_mm_fits(x, w1) and grouped_mm_fits(x, w2.transpose(1, 2)):
            offsets = counts.cumsum(0).to(torch.int32)  # end row of each expert
            hidden = F.silu(F.grouped_mm(x, w1, offs=offsets)) * F.grouped_mm(x, w3, offs=offsets)
            return F.grouped_mm(hidden, w2, offs=offsets)
        outputs = []
        for expert, rows in enumerate(x.split(counts.tolist())):  # (a host read of the counts)
            outputs.append((F.silu(rows @ w1[expert]) * (rows @ w3[expert])) @ w2[expert])
        return torch.cat(outputs)


class AuxLoss(torch.autograd.Function):
    """Returns a copy of `out`; backward also gives `loss` the gradient `scale` (the loss joins the
    objective with that weight without touching the loss the trainer computes)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.clone()  # not a view: torch.compile regenerates views of inputs without this backward

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_full((), ctx.scale, dtype=torch.float32), None


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[N] int64: how many of `chosen` (expert ids) name each expert (bincount with a static shape,
    which torch.compile traces without a break)."""
    return chosen.new_zeros(n_experts).scatter_add_(0, chosen, torch.ones_like(chosen))


def routing_losses(logits: torch.Tensor, probs: torch.Tensor,
                   chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(load-balancing loss, router z-loss) of one layer (module doc): logits, probs [T, N] fp32,
    chosen [T, k] expert ids."""
    n_experts = probs.shape[-1]
    counts = expert_counts(chosen.flatten(), n_experts).to(probs.dtype)
    fraction = counts / chosen.numel()  # f_i
    balance = n_experts * (fraction * probs.mean(0)).sum()
    z_loss = torch.logsumexp(logits, dim=-1).square().mean()
    return balance, z_loss


class MoE(nn.Module):
    """The MLP of an MoE layer: router, N routed SwiGLU experts of width W, an optional shared one."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, width: int, shared_width: int = 0,
                 aux_loss_weight: float = 0.0, z_loss_weight: float = 0.0):
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_weight, self.z_loss_weight = aux_loss_weight, z_loss_weight
        # [N, D]; a bare parameter, no nn.Linear: ZeRO's bf16 gathers of linears (parallel/dp/fsdp2.py)
        # would round it, and the router runs in fp32
        self.router = nn.Parameter(torch.empty(n_experts, d_model))
        # routing bias of the auxiliary-loss-free balance: no gradient; balance_experts moves it
        self.expert_bias = nn.Parameter(torch.zeros(n_experts), requires_grad=False)
        self.experts = GroupedExperts(d_model, n_experts, width)
        self.shared = SwiGLU(d_model, shared_width) if shared_width else None
        self.aux_scale = 1.0  # weight of this micro-batch's losses in the step (ParallelModel sets it)
        self.counting = True  # False: forwards that are no training (a pipeline's shape inference) count nothing
        # None: every expert here; else (experts, rows, counts) -> rows, run where the experts live
        # (expert parallelism sets it: parallel/ep.py)
        self.dispatch = None
        self.load_step: torch.Tensor | None = None  # [N] assignments since the last optimizer step
        self.load_log: torch.Tensor | None = None  # [N] assignments since the last log record
        self.loss_log: torch.Tensor | None = None  # [3]: balance loss sum, z-loss sum, forwards

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (logits [T, N] fp32, probs [T, N] fp32, chosen [T, k], gates [T, k] fp32)."""
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.router.float())
        probs = logits.softmax(dim=-1)
        chosen = (probs + self.expert_bias.float()).topk(self.top_k, dim=-1).indices
        gates = probs.gather(-1, chosen)
        if self.top_k > 1:  # top-1 keeps its probability (Switch), else the gate would be 1 and the router untrained
            gates = gates / gates.sum(-1, keepdim=True)
        return logits, probs, chosen, gates

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        logits, probs, chosen, gates = self.route(x)
        flat = chosen.flatten()  # [A]: token t's choices at rows t*k .. t*k + k - 1
        order = flat.argsort(stable=True)
        counts = expert_counts(flat, self.n_experts)  # [N]
        token = order // self.top_k  # the token of each sorted row
        if self.dispatch is None:
            rows = self.experts(x[token], counts)  # [A, D]
        else:
            rows = self.dispatch(self.experts, x[token], counts)
        rows = rows * gates.flatten()[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros(x.shape, dtype=rows.dtype, device=x.device).index_add_(0, token, rows)
        if self.shared is not None:
            out = out + self.shared(x)
        if torch.is_grad_enabled():
            balance, z_loss = routing_losses(logits, probs, chosen)
            if self.counting and not in_backward():  # a recompute inside backward counts nothing twice
                self.count(counts, balance, z_loss)
            weighted = self.aux_loss_weight * balance + self.z_loss_weight * z_loss
            if weighted.requires_grad:
                out = AuxLoss.apply(out, weighted, self.aux_scale)
        return out.reshape(shape)

    @torch.no_grad()
    def count(self, counts: torch.Tensor, balance: torch.Tensor, z_loss: torch.Tensor) -> None:
        if self.load_step is None:
            self.load_step = torch.zeros(self.n_experts, device=counts.device)
            self.load_log = torch.zeros(self.n_experts, device=counts.device)
            self.loss_log = torch.zeros(3, device=counts.device)
        self.load_step += counts
        self.load_log += counts
        self.loss_log += torch.stack((balance.detach(), z_loss.detach(), torch.ones_like(balance)))


def in_backward() -> bool:
    """Whether this runs inside an autograd backward pass (activation checkpointing's recompute)."""
    return torch._C._current_graph_task_id() != -1


def build_mlp(cfg: ModelConfig, width: int, moe: bool) -> nn.Module:
    """A block's MLP: the dense SwiGLU of `width`, or with `moe` a mixture of experts of that width."""
    if not moe:
        return SwiGLU(cfg.d_model, width, fused=cfg.fused_swiglu)
    m = cfg.moe
    return MoE(cfg.d_model, m.experts, m.top_k, width, m.shared_width, m.aux_loss_weight, m.z_loss_weight)


def moe_modules(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's MoE layers, by module name (empty for a dense model)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoE)]


def uncounted(fn, model: nn.Module):
    """`fn` with the counters of `model`'s MoE layers off while it runs."""

    def call(*args, **kwargs):
        modules = [module for _, module in moe_modules(model)]
        for module in modules:
            module.counting = False
        try:
            return fn(*args, **kwargs)
        finally:
            for module in modules:
                module.counting = True

    return call


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """The weight of the next micro-batches' routing losses (1 / micro-batches of the step)."""
    for _, module in moe_modules(model):
        module.aux_scale = scale


@torch.no_grad()
def balance_experts(model: nn.Module, rate: float, stepped: torch.Tensor | bool = True,
                    reduce=None, add=None) -> None:
    """The auxiliary-loss-free balance (DeepSeek-V3), after an optimizer step: each expert's routing
    bias moves by `rate` toward the mean load, bias_i += rate * sign(mean load - load_i), over the
    assignments since the last call (summed over the data-parallel ranks by `reduce`, an in-place
    all-reduce, when given), and only where `stepped` (a skipped step moves nothing). No host read.
    `add(bias, step)`: how a step reaches a bias held as shards (default: in place)."""
    for _, module in moe_modules(model):
        if module.load_step is None:
            continue
        load = module.load_step
        if reduce is not None:
            reduce(load)
        step = rate * torch.sign(load.mean() - load) * torch.as_tensor(stepped, device=load.device)
        step = step.to(module.expert_bias.dtype)
        if add is None:
            module.expert_bias.add_(step)
        else:
            add(module.expert_bias, step)
        load.zero_()


@torch.no_grad()
def load_metrics(model: nn.Module, reduce=None) -> dict[str, torch.Tensor]:
    """Per MoE layer, over the training forwards since the last call (all data-parallel ranks' when
    `reduce`, an in-place sum all-reduce, is given): the least and the most loaded expert's share of
    the assignments over the fair share 1/N (both 1 when balanced), the entropy of the shares over
    log N (1 when balanced), and the mean balance and z-loss. Device tensors, read at log time."""
    out: dict[str, torch.Tensor] = {}
    for name, module in moe_modules(model):
        if module.load_log is None:
            continue
        load, loss_log = module.load_log.clone(), module.loss_log.clone()
        module.load_log.zero_()
        module.loss_log.zero_()
        if reduce is not None:
            reduce(load)
            reduce(loss_log)
        share = load / load.sum().clamp(min=1)
        layer = name.split(".")[1] if name.startswith("layers.") else (name or "mlp")
        n = module.n_experts
        entropy = -(share * share.clamp(min=1e-30).log()).sum()
        out[f"moe/{layer}/load_min"] = share.min() * n
        out[f"moe/{layer}/load_max"] = share.max() * n
        out[f"moe/{layer}/load_entropy"] = entropy / math.log(n) if n > 1 else torch.ones_like(entropy)
        out[f"moe/{layer}/balance_loss"] = loss_log[0] / loss_log[2].clamp(min=1)
        out[f"moe/{layer}/z_loss"] = loss_log[1] / loss_log[2].clamp(min=1)
    return out
