"""Titans (Behrouz et al. 2024, arXiv 2501.00663): attention plus a neural long-term memory.

Neural memory, per head (H heads of size E), for tokens t = 1..T:
    k_t = l2norm(silu(W_k x_t)), v_t = l2norm(silu(W_v x_t)), q_t = l2norm(silu(W_q x_t))
    theta_t = max_lr * sigmoid(.), eta_t = sigmoid(. + logit(momentum_init)),
    alpha_t = sigmoid(. + logit(forget_init))                  (one linear map x_t -> [H, 3])
    S_t = eta_t S_{t-1} - theta_t grad_M ||M_{t-1}(k_t) - v_t||^2        (surprise, momentum)
    M_t = (1 - alpha_t) M_{t-1} + S_t                                      (forgetting)
    y_t = M_t(q_t)                                                         (read after writing)
M is an MLP E -> (expansion * E) -> ... -> E of `memory_depth` weight matrices with SiLU
between them, its initial weights M_0 are parameters; S_0 = 0.

Chunked parallel form (`chunk_size` C): inside a chunk every gradient is taken at the chunk's
starting state W, grad_i = a_i delta_i^T per memory layer (a_i the layer input, delta_i the
backpropagated error). The two linear recurrences then unroll to
    M_t = B_t W + (sum_j P_tj E_j) S - sum_i c_ti a_i delta_i^T,    c_ti = theta_i (P Q)_ti,
with P_tj = prod_{j<l<=t} (1 - alpha_l), Q_ji = prod_{i<l<=j} eta_l (from log-space cumsums),
B_t = prod_{l<=t} (1 - alpha_l), E_j = prod_{l<=j} eta_l. Reading M_t(q_t) layer by layer is
then attention-like: r M_t = B_t (r W) + D_t (r S) - ((c * r a^T) delta), never materialising
per-token weights. C = 1 is the exact token-by-token recurrence (tests compare both with a torch.func reference).

Blocks (the MLP after the mixer has this layer's tapered width, as in the Transformer):
    MAG  x~ = [P, norm(x)];  o = SWA(x~) * sigmoid(M(x~))                 (memory as a gate)
    MAL  x = x + M([P, norm(x)]);  x = x + SWA([P, norm(x)])             (memory as a layer)
    MAC  per segment s of `window` tokens: h = M_{s-1}(q(norm(x)_s)) (no write);
         y = Attn([P, h, norm(x)_s]) (causal over h and x); o = y * sigmoid(M_t(y_t)) while M
         writes y                                                          (memory as context)
P are `persistent_tokens` learnable tokens, visible to every query; SWA is causal attention over
the last `window` tokens plus P. Deviations from the paper: no depthwise convolution on q, k, v;
the output combination is a plain sigmoid gate; values are l2-normalised like keys (bounded
targets keep the chunked inner optimisation of a deep memory stable); each head's read is
RMS-normalised with its own gains before wo.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.costs import Cost, swiglu_cost
from megatron_taper.models.init import init_tensor
from megatron_taper.models.layers import Attention, RMSNorm, rope_tables
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer, TransformerBlock, tp_plan_transformer_block
from megatron_taper.validation import ConfigError, check_choice, check_range

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder



@dataclass
class TitansConfig:
    """model.titans"""

    variant: str = "mag"  # mac (memory as context) | mag (memory as gate) | mal (memory as layer)
    window: int = 64  # sliding-window attention span (MAG, MAL); segment length (MAC)
    persistent_tokens: int = 4  # learnable tokens prepended to the block's sequence
    memory_depth: int = 2  # layers of the memory MLP (1 = a linear memory)
    memory_expansion: int = 2  # hidden width of a deep memory, in multiples of head_dim
    chunk_size: int = 16  # tokens whose memory gradients are taken at the chunk's starting state
    max_lr: float = 0.005  # upper bound of the data-dependent inner learning rate theta_t; the chunked
    # updates stay stable for max_lr * chunk_size**2 <~ 1 (measured: 0.1 and 0.01 at chunk 16 diverge)
    momentum_init: float = 0.9  # eta_t at initialisation (a fixed logit offset)
    forget_init: float = 0.01  # alpha_t at initialisation (a fixed logit offset)

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.variant", self.variant, ("mac", "mag", "mal"))
        for key in ("window", "memory_depth", "memory_expansion", "chunk_size"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.persistent_tokens", self.persistent_tokens, 0, None)
        check_range(f"{prefix}.max_lr", self.max_lr, 0.0, None, open_low=True)
        check_range(f"{prefix}.momentum_init", self.momentum_init, 0.0, 1.0, open_low=True, open_high=True)
        check_range(f"{prefix}.forget_init", self.forget_init, 0.0, 1.0, open_low=True, open_high=True)


State = tuple[list[torch.Tensor], list[torch.Tensor]]  # (memory weights, surprise), each [B, H, i, o]


def memory_dims(head_dim: int, depth: int, expansion: int) -> list[int]:
    return [head_dim] + [expansion * head_dim] * (depth - 1) + [head_dim]


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(z)
    return s * (1 + z * (1 - s))


class NeuralMemory(nn.Module):
    """Per-head MLP memory written and read inside the forward pass (see the module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t, d, h, e = cfg.titans, cfg.d_model, cfg.n_heads, cfg.head_dim
        self.head_dim, self.chunk_size, self.max_lr = e, t.chunk_size, t.max_lr
        self.eta_offset = math.log(t.momentum_init / (1 - t.momentum_init))
        self.alpha_offset = math.log(t.forget_init / (1 - t.forget_init))
        self.wq = nn.Linear(d, h * e, bias=False)
        self.wk = nn.Linear(d, h * e, bias=False)
        self.wv = nn.Linear(d, h * e, bias=False)
        self.gates = nn.Linear(d, h * 3, bias=True)  # head-major [H, (theta, eta, alpha)]
        dims = memory_dims(e, t.memory_depth, t.memory_expansion)
        self.mem_w = nn.ParameterList(nn.Parameter(torch.empty(h, i, o)) for i, o in zip(dims[:-1], dims[1:]))
        self.out_norm_weight = nn.Parameter(torch.ones(h * e))  # RMSNorm of each head's read, per-head gains
        self.wo = nn.Linear(h * e, d, bias=False)
        self.eps = cfg.norm_eps

    def heads(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """[B, T, D] -> silu(proj x) as [B, H, T, E]."""
        return F.silu(proj(x)).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def queries(self, x_q: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.heads(self.wq, x_q), dim=-1)

    def project(self, x_kv: torch.Tensor, x_q: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """k, v, q: [B, H, T, E]; theta, log eta, log (1 - alpha): [B, H, T]."""
        k = F.normalize(self.heads(self.wk, x_kv), dim=-1)
        v = F.normalize(self.heads(self.wv, x_kv), dim=-1)
        g = self.gates(x_kv).unflatten(-1, (-1, 3)).permute(3, 0, 2, 1)  # [3, B, H, T]
        theta = self.max_lr * torch.sigmoid(g[0])
        log_eta = F.logsigmoid(g[1] + self.eta_offset)
        log_keep = F.logsigmoid(-(g[2] + self.alpha_offset))
        return k, v, self.queries(x_q), theta, log_eta, log_keep

    def init_state(self, batch: int) -> State:
        weights = [w.unsqueeze(0).expand(batch, -1, -1, -1) for w in self.mem_w]
        return weights, [torch.zeros_like(w) for w in weights]

    def output(self, reads: torch.Tensor) -> torch.Tensor:
        """reads [B, H, T, E] -> [B, T, D]."""
        r = F.rms_norm(reads.transpose(1, 2), (self.head_dim,), eps=self.eps)  # [B, T, H, E]
        return self.wo((r * self.out_norm_weight.view(-1, self.head_dim)).flatten(2))

    def read(self, x_q: torch.Tensor, state: State) -> torch.Tensor:
        """M(q) with the memory frozen at `state` (no writes): [B, H, T, E]."""
        r = self.queries(x_q)
        for layer, w in enumerate(state[0]):
            r = r @ w
            r = F.silu(r) if layer < len(state[0]) - 1 else r
        return r

    def scan(self, x_kv: torch.Tensor, x_q: torch.Tensor, state: State,
             chunk_size: int | None = None) -> tuple[torch.Tensor, State]:
        """Write k_t, v_t and read M_t(q_t) for every token, chunk by chunk: ([B, H, T, E], state)."""
        k, v, q, theta, log_eta, log_keep = self.project(x_kv, x_q)
        size = chunk_size or self.chunk_size
        reads = []
        for s in range(0, k.shape[2], size):
            c = slice(s, s + size)
            read, state = self.chunk(state, k[:, :, c], v[:, :, c], q[:, :, c], theta[..., c], log_eta[..., c],
                                     log_keep[..., c])
            reads.append(read)
        return torch.cat(reads, dim=2), state

    def chunk(self, state: State, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, theta: torch.Tensor,
              log_eta: torch.Tensor, log_keep: torch.Tensor) -> tuple[torch.Tensor, State]:
        """One chunk of C tokens; k, v, q [B, H, C, E]; theta, log_eta, log_keep [B, H, C]."""
        weights, surprise = state
        n = len(weights)
        acts, pre, h = [], [], k  # forward of M_0 (the chunk's starting state) on the keys
        for layer, w in enumerate(weights):
            acts.append(h)
            h = h @ w
            if layer < n - 1:
                pre.append(h)
                h = F.silu(h)
        delta = 2.0 * (h - v)  # d ||M(k) - v||^2 / d out
        deltas = [delta] * n
        for layer in range(n - 1, 0, -1):
            delta = (delta @ weights[layer].transpose(-1, -2)) * silu_grad(pre[layer - 1])
            deltas[layer - 1] = delta

        size = k.shape[2]
        causal = torch.ones(size, size, dtype=torch.bool, device=k.device).tril()
        lb, le = log_keep.cumsum(-1), log_eta.cumsum(-1)  # [B, H, C]
        decay = (lb[..., :, None] - lb[..., None, :]).masked_fill(~causal, -math.inf).exp()  # P [B, H, C, C]
        momentum = (le[..., :, None] - le[..., None, :]).masked_fill(~causal, -math.inf).exp()  # Q
        coef = (decay @ momentum) * theta[..., None, :]  # c_ti
        keep_w = lb.exp()[..., None]  # B_t [B, H, C, 1]
        keep_s = decay @ le.exp()[..., None]  # sum_j P_tj E_j [B, H, C, 1]

        r = q
        for layer in range(n):
            a, d = acts[layer], deltas[layer]
            r = keep_w * (r @ weights[layer]) + keep_s * (r @ surprise[layer]) - (coef * (r @ a.transpose(-1, -2))) @ d
            r = F.silu(r) if layer < n - 1 else r

        last = coef[..., -1, :, None]  # [B, H, C, 1]
        s_coef = (theta * (le[..., -1:] - le).exp())[..., None]
        new_w, new_s = [], []
        for layer in range(n):
            a_t, d = acts[layer].transpose(-1, -2), deltas[layer]
            new_w.append(keep_w[..., -1:, :] * weights[layer] + keep_s[..., -1:, :] * surprise[layer]
                         - a_t @ (last * d))
            new_s.append(le[..., -1:, None].exp() * surprise[layer] - a_t @ (s_coef * d))
        return r, (new_w, new_s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.scan(x, x, self.init_state(x.shape[0]))[0])


class MaskedAttention(Attention):
    """Attention under an explicit boolean mask [S, S] (True = may attend)."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                start: int = 0) -> torch.Tensor:
        """x [B, S, D] -> [B, S - start, D]: the outputs of rows start.. only."""
        return self.wo(self.attend(x, cos, sin, mask)[:, start:].flatten(2))


def window_mask(prefix: int, seq: int, window: int, device: torch.device) -> torch.Tensor:
    """[P + S, P + S]: every row sees the prefix; token i sees tokens j with i - window < j <= i."""
    i = torch.arange(prefix + seq, device=device)
    dist = i[:, None] - i[None, :]
    return (i[None, :] < prefix) | ((dist >= 0) & (dist < window))


def context_mask(prefix: int, seg: int, device: torch.device) -> torch.Tensor:
    """[P + 2L, P + 2L] over [P, h, x]: h_i sees h_<=i, x_i sees h_<=i and x_<=i, all see P."""
    pos = torch.arange(seg, device=device)
    pos = torch.cat((torch.full((prefix,), -1, device=device), pos, pos))
    is_x = torch.arange(prefix + 2 * seg, device=device) >= prefix + seg
    seen = (pos[None, :] <= pos[:, None]) & (is_x[:, None] | ~is_x[None, :])
    return seen | (pos[None, :] < 0)


class TitansBlock(TransformerBlock):
    """Shared parts: memory, persistent tokens, masked attention; the variant defines `mix`."""

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.memory = NeuralMemory(cfg)
        self.persistent = nn.Parameter(torch.empty(cfg.titans.persistent_tokens, cfg.d_model))
        self.window = cfg.titans.window
        self.head_dim, self.rope_theta = cfg.head_dim, cfg.rope_theta

    def build_attention(self, cfg: ModelConfig) -> nn.Module:
        return MaskedAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim)

    def with_prefix(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.persistent.to(x.dtype).expand(x.shape[0], -1, -1), x), dim=1)

    def window_attention(self, xp: torch.Tensor) -> torch.Tensor:
        """Sliding-window attention over [P, x] ([B, P + S, D]); outputs of x only: [B, S, D]."""
        prefix = self.persistent.shape[0]
        cos, sin = rope_tables(xp.shape[1], self.head_dim, self.rope_theta, xp.device)
        mask = window_mask(prefix, xp.shape[1] - prefix, self.window, xp.device)
        return self.attn(xp, cos, sin, mask, prefix)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class MAGBlock(TitansBlock):
    def mix(self, xn: torch.Tensor) -> torch.Tensor:
        xp, prefix = self.with_prefix(xn), self.persistent.shape[0]
        reads, _ = self.memory.scan(xp, xp, self.memory.init_state(xn.shape[0]))
        return self.window_attention(xp) * torch.sigmoid(self.memory.output(reads[:, :, prefix:]))


class MALBlock(TitansBlock):
    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__(cfg, mlp_width)
        self.mem_norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        prefix = self.persistent.shape[0]
        xp = self.with_prefix(self.mem_norm(x))
        reads, _ = self.memory.scan(xp, xp, self.memory.init_state(x.shape[0]))
        x = x + self.memory.output(reads[:, :, prefix:])
        x = x + self.window_attention(self.with_prefix(self.attn_norm(x)))
        return x + self.mlp(self.mlp_norm(x))


class MACBlock(TitansBlock):
    def mix(self, xn: torch.Tensor) -> torch.Tensor:
        prefix, state, outs = self.persistent.shape[0], self.memory.init_state(xn.shape[0]), []
        for s in range(0, xn.shape[1], self.window):
            seg = xn[:, s:s + self.window]  # [B, L, D]
            size = seg.shape[1]
            h = self.memory.output(self.memory.read(seg, state))  # retrieval with M_{s-1}
            ctx = self.with_prefix(torch.cat((h, seg), dim=1))  # [B, P + 2L, D]
            cos, sin = rope_tables(ctx.shape[1], self.head_dim, self.rope_theta, xn.device)
            y = self.attn(ctx, cos, sin, context_mask(prefix, size, xn.device), prefix + size)  # [B, L, D]
            reads, state = self.memory.scan(y, y, state)
            outs.append(y * torch.sigmoid(self.memory.output(reads)))
        return torch.cat(outs, dim=1)


TITANS_BLOCKS = {"mac": MACBlock, "mag": MAGBlock, "mal": MALBlock}


class Titans(Transformer):
    def __init__(self, cfg: ModelConfig):
        self.block_class = TITANS_BLOCKS[cfg.titans.variant]
        super().__init__(cfg)

    def init_value(self, name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
        """The common rule, except memory weights M_0 ~ N(0, 1 / fan_in)."""
        std = shape[-2] ** -0.5 if ".mem_w." in name else self.cfg.init_std
        return init_tensor(name, shape, seed, std, self.cfg.n_layers)


# ---------------------------------------------------------------------------------------------
# Cost model: counts exactly the matmuls above (FLOPs per real token, 2 per multiply-add).


def memory_params(cfg: ModelConfig) -> int:
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    return 4 * d * h * e + 3 * d * h + 3 * h + h * sum(i * o for i, o in zip(dims[:-1], dims[1:])) + h * e


def scan_flops(cfg: ModelConfig, tokens: int) -> float:
    """Projections, chunked writes and reads of `tokens` tokens, output projection included."""
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    io = [i * o for i, o in zip(dims[:-1], dims[1:])]
    total = tokens * 2 * (4 * d * h * e + 3 * d * h)  # wq, wk, wv, wo, gates
    for s in range(0, tokens, t.chunk_size):
        c = min(t.chunk_size, tokens - s)
        per_head = 2 * c * (sum(io) + sum(io[1:]))  # forward on keys, backward of deltas
        per_head += 2 * c**3 + 2 * c**2  # coefficients P Q, P E
        per_head += sum(2 * c * (2 * x) + 2 * c * c * (i + o) for x, i, o in zip(io, dims[:-1], dims[1:]))  # reads
        per_head += sum(2 * c * 2 * x for x in io)  # new weights and surprise
        total += h * per_head
    return total


def masked_attention_flops(cfg: ModelConfig, rows: int, visible: float, out_rows: int) -> float:
    """Projections of `rows` rows, SDPA over `visible` (query, key) pairs, wo on `out_rows` rows."""
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    return 2 * rows * d * (h * e + 2 * k * e) + 4 * h * e * visible + 2 * out_rows * h * e * d


def titans_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    d, h, k, e, t, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.titans, cfg.seq_len
    p = t.persistent_tokens
    attn_params = d * h * e + 2 * d * k * e + h * e * d
    params = attn_params + memory_params(cfg) + p * d + 2 * d + (d if t.variant == "mal" else 0)
    if t.variant in ("mag", "mal"):
        rows = p + s
        visible = rows * rows if not causal else p * p + sum(p + min(i + 1, t.window) for i in range(s))
        flops = masked_attention_flops(cfg, rows, visible, s) + scan_flops(cfg, rows)
        flops -= 2 * p * h * e * d  # the memory's output projection runs on the real tokens only
    else:
        flops = 0.0
        for start in range(0, s, t.window):
            seg = min(t.window, s - start)
            rows = p + 2 * seg
            visible = rows * rows if not causal else p * p + sum(2 * p + 3 * (i + 1) for i in range(seg))
            dims = memory_dims(e, t.memory_depth, t.memory_expansion)
            read = seg * (2 * d * h * e + h * sum(2 * i * o for i, o in zip(dims[:-1], dims[1:])) + 2 * h * e * d)
            flops += masked_attention_flops(cfg, rows, visible, seg) + read + scan_flops(cfg, seg)
    mlp = swiglu_cost(cfg, width)
    # saved for backward, per token (approximate): attention as in the Transformer, the memory's
    # projections and gates, and per memory layer its activations on keys, queries and deltas
    acts = 2 * (2 * d + 4 * h * e + 2 * k * e + 4 * h * e + 3 * h + 3 * h * (t.memory_expansion * e) * t.memory_depth)
    return Cost(params + width * 3 * d, flops / s + mlp.flops, acts + mlp.act_bytes)


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: attention and MLP as in the Transformer; the neural memory is split by head
# (each rank runs the memories of its heads: wq/wk/wv/gates column-parallel, each entering the tp
# region itself, M_0 and the per-head read-norm gains sliced along the head dimension, wo
# row-parallel). Persistent tokens are replicated.


def tp_plan_titans_block(block: TitansBlock, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    tp_plan_transformer_block(block, prefix, cfg, tp)
    if isinstance(block, MALBlock):
        tp.replicated(block.mem_norm, f"{prefix}.mem_norm")
    memory, mp, e = block.memory, f"{prefix}.memory", cfg.head_dim
    rows = tp.head_rows(cfg.n_heads, e)
    for attr in ("wq", "wk", "wv"):
        tp.column(memory, attr, mp, rows, input_mode="copy")
    tp.column(memory, "gates", mp, tp.head_rows(cfg.n_heads, 3), input_mode="copy")
    tp.row(memory, "wo", mp, tp.head_columns(cfg.n_heads, e))
    for i in range(len(memory.mem_w)):
        tp.shard_parameter(memory.mem_w, str(i), f"{mp}.mem_w", tp.head_rows(cfg.n_heads, 1))
    tp.shard_parameter(memory, "out_norm_weight", mp, rows)


def check_titans_layout(mcfg: ModelConfig, pcfg: ParallelConfig) -> None:
    if pcfg.tp > 1 and pcfg.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='titans' (the memory "
                          "and the persistent tokens need the whole sequence); set it to false")


SPEC = FamilySpec(name="titans", build=Titans, layer_cost=titans_layer_cost, tp_block_plan=tp_plan_titans_block,
                  check_layout=check_titans_layout, section="titans", options=TitansConfig)
