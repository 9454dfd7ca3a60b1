"""Titans' neural long-term memory (Behrouz et al. 2024, arXiv 2501.00663), the mixer of the Titans
blocks (titans/model.py) and the base of the deep Memory Caching family (models/memory_caching/).

Per head (H heads of size E), for tokens t = 1..T:
    k_t = l2norm(silu(conv_k(W_k x)_t)), likewise v_t (conv_v, W_v) and q_t (conv_q, W_q)
    conv(z)_t = sum_{j<K} w[:, K-1-j] * z_{t-j}     (depthwise causal, K = `conv_kernel` taps)
    theta_t = max_lr * sigmoid(.), eta_t = sigmoid(. + logit(momentum_init)),
    alpha_t = sigmoid(. + logit(forget_init))                  (one linear map x_t -> [H, 3])
    M(x) = x + f_W(x)                                          (residual memory, f an MLP)
    nu_t = sum_l ||a_l(k_t)||^2   (squared norms of every layer's input at k_t, M_{t-1}; >= ||k_t||^2 = 1)
    S_t = eta_t S_{t-1} - (theta_t / nu_t) grad_W ||M_{t-1}(k_t) - v_t||^2    (surprise, momentum)
    W_t = W_0 + (1 - alpha_t)(W_{t-1} - W_0) + S_t                           (forgetting toward W_0)
    y_t = M_t(q_t)                                                          (read after writing)
f is an MLP E -> (expansion * E) -> ... -> E of `memory_depth` weight matrices with SiLU between
them, its initial weights W_0 are parameters; S_0 = 0. Departures from eq. 13-14 of the paper,
for long sequences (docs/architectures.md): the residual path keeps the read's scale whatever W
holds; forgetting pulls W back to the learned W_0 instead of to 0 (with decay toward 0 a depth-2
memory's read shrank like (1 - alpha)^(2t): 2e-18 of its start at token 2047); the normalised
(NLMS-like) step makes theta_t the fraction of the error a lone write corrects, independent of
the activations' scale.

Chunked parallel form (`chunk_size` C): inside a chunk every gradient is taken at the chunk's
starting state W, grad_i = a_i delta_i^T per memory layer (a_i the layer input, delta_i the
backpropagated error), and nu_i too. The two linear recurrences then unroll to
    W_t = W_0 + B_t (W - W_0) + (sum_j P_tj E_j) S - sum_i c_ti a_i delta_i^T,   c_ti = (theta_i / nu_i) (P Q)_ti,
with P_tj = prod_{j<l<=t} (1 - alpha_l), Q_ji = prod_{i<l<=j} eta_l (from log-space cumsums),
B_t = prod_{l<=t} (1 - alpha_l), E_j = prod_{l<=j} eta_l. Reading f_t(q_t) layer by layer is
then attention-like: r W_t = (1 - B_t) r W_0 + B_t (r W) + D_t (r S) - ((P Q * r a^T) delta'),
delta' = (theta / nu) delta, never materialising per-token weights. C = 1 is the exact
token-by-token recurrence (tests compare both with a torch.func reference).

Evaluation (`scan_features`): everything that does not depend on the state is computed for all
chunks at once, batched over a chunk dimension: the cumsums, P, Q, P Q, B, D, the end-of-chunk
factors, and every term of the first memory layer that involves only q and k (q W_0, B q, D q,
-(P Q * q k^T), the update's -(last row of P Q * k)^T and -(E_C / E_i * k)^T). The loop keeps only
the recurrence, on [B*H, ...] tensors through bmm / baddbmm, as one autograd node (WriteLoop)
whose backward is written by hand: a reverse loop over the chunks carrying the state's gradient,
everything that does not feed it taken for all chunks at once. A depth-2 memory's chunk costs ~34
operators forward and ~34 backward (cost/op_count.py; 38 + 130 when autograd recorded the loop).
When MEGATRON_TAPER_KERNELS selects Triton (kernels/state_passing.py kernel_choice: by default CUDA
tensors with triton installed), the forward loop of a depth-1 or depth-2 memory is one kernel launch
instead, and so is the backward's reverse loop (kernels/memory_write_triton.py).
A trailing partial chunk is padded to C tokens that change nothing: keys of ones (so nu > 0),
theta = 0 (no write), keep = eta = 1, and the two end-of-chunk sums that would run over the
padding (sum_j P_Cj E_j and the last row of P Q) masked to the real tokens. Under autocast the
state stays in its own dtype (its update adds the bf16 matmul instead of fusing it into baddbmm;
the backward runs under the same autocast). The old one-chunk-at-a-time loop is the definition
of this math in tests/helpers/titans_reference.py (reference_chunked_scan).

Convolution: titans/convolution.py (causal_conv, on the memory's q, k, v after their projections).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.kernels import state_passing
from megatron_taper.models.titans.convolution import causal_conv
from megatron_taper.models.titans.cost import memory_dims
from megatron_taper.models.titans.documents import Packing

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


State = tuple[list[torch.Tensor], list[torch.Tensor]]  # (memory weights, surprise), each [B, H, i, o]
# k, v, q [B, H, T, E]; theta, log eta, log (1 - alpha) [B, H, T]
Features = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
ConvPast = tuple[torch.Tensor, ...] | None  # per convolved projection (k, v, q) its last K-1 inputs [B, K-1, H*E]
# (layer, that layer's input r [B, H, C, i], its read r M_t [B, H, C, o], positions=slice of the C tokens in
# the scan) -> the pre-activation that continues the read; Memory Caching's soup mixes cached memories in here
ReadMix = Callable[..., torch.Tensor]


ALL_HEADS = slice(None)  # every head of a memory (init_state, scan_features: `heads`)


def mlp_read(q: torch.Tensor, state: State) -> torch.Tensor:
    """f(q), the memory MLP with the weights of `state` (SiLU between layers) at q [B, H, T, E]."""
    r = q
    for layer, w in enumerate(state[0]):
        r = r @ w
        r = F.silu(r) if layer < len(state[0]) - 1 else r
    return r


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
        for name in ("conv_q", "conv_k", "conv_v"):  # depthwise taps [H*E, K], oldest first
            self.register_parameter(name, nn.Parameter(torch.empty(h * e, t.conv_kernel)) if t.conv_kernel else None)
        self.gates = nn.Linear(d, h * 3, bias=True)  # head-major [H, (theta, eta, alpha)]
        dims = memory_dims(e, t.memory_depth, t.memory_expansion)
        self.mem_w = nn.ParameterList(nn.Parameter(torch.empty(h, i, o)) for i, o in zip(dims[:-1], dims[1:]))
        self.out_norm_weight = nn.Parameter(torch.ones(h * e))  # RMSNorm of each head's read, per-head gains
        self.wo = nn.Linear(h * e, d, bias=False)
        self.eps = cfg.norm_eps

    def heads(self, proj: nn.Linear, conv: torch.Tensor | None, x: torch.Tensor,
              past: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T, D] -> l2norm(silu(conv(proj x))) as [B, H, T, E], and the convolution's past
        (`positions`: the rows' offsets in their documents, causal_conv)."""
        return self.conv_heads(proj(x), conv, past, positions)

    def conv_heads(self, z: torch.Tensor, conv: torch.Tensor | None, past: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Projections z [B, T, n E] of n heads (conv: their taps [n E, K]) -> l2norm(silu(conv(z)))
        as [B, n, T, E], and the convolution's past (`positions`: as in `heads`)."""
        z, past = causal_conv(z, conv, past, positions)
        return F.normalize(F.silu(z).unflatten(-1, (-1, self.head_dim)).transpose(1, 2), dim=-1), past

    def gate_features(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate pre-activations g [B, T, 3 n] (head-major: per head theta, eta, alpha) -> theta,
        log eta, log (1 - alpha), each [B, n, T]."""
        g = g.unflatten(-1, (-1, 3)).permute(3, 0, 2, 1)  # [3, B, n, T]
        theta = self.max_lr * torch.sigmoid(g[0])
        return theta, F.logsigmoid(g[1] + self.eta_offset), F.logsigmoid(-(g[2] + self.alpha_offset))

    def project(self, x_kv: torch.Tensor, x_q: torch.Tensor, past: ConvPast = None,
                positions: torch.Tensor | None = None) -> tuple[Features, ConvPast]:
        """k, v, q, theta, log eta, log (1 - alpha) of x_kv / x_q [B, T, D], which continue the
        sequences whose convolution inputs `past` holds (None = they start here); and the new past.
        `positions` [B, T]: the rows' offsets in their documents (the convolutions see nothing of
        an earlier document; titans/documents.py)."""
        pk, pv, pq = past or (None, None, None)
        k, pk = self.heads(self.wk, self.conv_k, x_kv, pk, positions)
        v, pv = self.heads(self.wv, self.conv_v, x_kv, pv, positions)
        q, pq = self.heads(self.wq, self.conv_q, x_q, pq, positions)
        return (k, v, q, *self.gate_features(self.gates(x_kv))), (None if pk is None else (pk, pv, pq))

    def init_state(self, batch: int, heads: slice = ALL_HEADS) -> State:
        """The initial state of `batch` sequences for the memory's heads `heads` (default all)."""
        weights = [w[heads].unsqueeze(0).expand(batch, -1, -1, -1) for w in self.mem_w]
        return weights, [torch.zeros_like(w) for w in weights]

    def output(self, reads: torch.Tensor) -> torch.Tensor:
        """reads [B, H, T, E] -> [B, T, D]."""
        r = F.rms_norm(reads.transpose(1, 2), (self.head_dim,), eps=self.eps)  # [B, T, H, E]
        return self.wo((r * self.out_norm_weight.view(-1, self.head_dim)).flatten(2))

    def read(self, q: torch.Tensor, state: State) -> torch.Tensor:
        """M(q) = q + f(q) of queries q [B, H, T, E] with the memory frozen at `state` (no writes)."""
        return q + mlp_read(q, state)

    def scan(self, x_kv: torch.Tensor, x_q: torch.Tensor, state: State,
             chunk_size: int | None = None) -> tuple[torch.Tensor, State]:
        """Write k_t, v_t and read M_t(q_t) for every token of x_kv / x_q [B, T, D] (sequences that
        start here), chunk by chunk: ([B, H, T, E], state)."""
        return self.scan_features(self.project(x_kv, x_q)[0], state, chunk_size)

    def scan_packed(self, x: torch.Tensor, packing: Packing) -> torch.Tensor:
        """`scan` of the packed documents (titans/documents.py) of x [B, T', D], each from the
        initial state with its convolutions restarted: the reads of the packed rows [B, H, T', E]."""
        features, _ = self.project(x, x, positions=packing.positions)
        return self.scan_features(features, self.init_state(x.shape[0]), documents=(packing.valid, packing.resets))[0]

    def scan_features(self, features: Features, state: State, chunk_size: int | None = None,
                      mix: ReadMix | None = None, whole_chunks: bool = False,
                      documents: tuple[torch.Tensor, torch.Tensor] | None = None,
                      heads: slice = ALL_HEADS) -> tuple[torch.Tensor, State]:
        """`scan` from projected features (`project`): ([B, H, T, E], state). `mix`, when given,
        replaces each memory layer's pre-activation read (see ReadMix). `whole_chunks`: the state
        returned is the one after the last whole chunk (a trailing partial chunk is read, not written).
        `documents`: (valid, resets) [B, T], the features are packed rows (titans/documents.py;
        resets only at chunk boundaries): padding rows write nothing and a
        reset row starts its chunk from the initial state (reset_terms). `heads`: the memory's heads
        the features are of (default all)."""
        reads, state, _ = self.scan_with_starts(features, state, chunk_size, mix, whole_chunks, documents, heads)
        return reads, state

    def scan_segments(self, features: Features, start: State, length: int,
                      documents: tuple[torch.Tensor, torch.Tensor] | None = None, heads: slice = ALL_HEADS
                      ) -> tuple[torch.Tensor, list[torch.Tensor], State]:
        """Memory Caching's continuing segments of `length` tokens (a multiple of the chunk; the
        last segment may be shorter) in one scan from `start`: the reads [B, H, T, E], every
        segment's end weights per memory layer [B, H, n, i, o] and the state after the last.
        `documents`, `heads`: as scan_features'."""
        size = min(self.chunk_size, length)  # the chunks a segment of its own would have
        reads, state, starts = self.scan_with_starts(features, start, size, documents=documents, heads=heads)
        every = length // size
        ends = [torch.cat((w[:, :, every::every], end.unsqueeze(2)), dim=2) for w, end in zip(starts[0], state[0])]
        return reads, ends, state

    def scan_with_starts(self, features: Features, state: State, chunk_size: int | None = None,
                         mix: ReadMix | None = None, whole_chunks: bool = False,
                         documents: tuple[torch.Tensor, torch.Tensor] | None = None,
                         heads: slice = ALL_HEADS) -> tuple[torch.Tensor, State, State]:
        """scan_features, and the state every chunk started from (per layer [B, H, N, i, o])."""
        k, q = features[0], features[2]
        batch, n_heads, total = k.shape[:3]
        if not total:
            return q, state, tuple([t.unsqueeze(2)[:, :, :0] for t in ts] for ts in state)
        whole = chunk_size or self.chunk_size
        size = min(whole, total)  # one chunk of T < C tokens is the same math unpadded
        count = -(-total // size)
        n = len(self.mem_w)
        init = [w[heads].to(k.dtype).expand(batch, -1, -1, -1).reshape(batch * n_heads, *w.shape[1:])
                for w in self.mem_w]
        if documents is not None:
            features = pad_features(features, documents[0])
            state = reset_state(self.init_state(batch, heads), state, documents[1][:, 0])
        loop, reads = chunk_terms(features, init[0], size, n > 1, documents)
        weights = [w.to(k.dtype).reshape(batch * n_heads, *w.shape[2:]) for w in state[0]]  # [B*H, i, o]
        surprise = [s.to(k.dtype).reshape(batch * n_heads, *s.shape[2:]) for s in state[1]]
        fused = not torch.is_autocast_enabled(k.device.type)  # else the state keeps its dtype
        last = count - 1 if whole_chunks and total % whole else count  # chunks that write
        out = WriteLoop.apply(n, last, fused, documents is not None, *init, *weights, *surprise, *loop)
        starts, deltas, acts = out[:2 * n], out[2 * n:3 * n], out[3 * n:4 * n - 1]  # [B*H, N, ., .]
        ends = out[4 * n - 1:] if last == count else [t[:, last] for t in starts]
        out = read_chunks(init, starts, deltas, acts, reads, mix, batch, total)  # [B*H, T, E]
        unflat = [t.view(batch, n_heads, *t.shape[1:]) for t in ends]
        stacked = [t.view(batch, n_heads, *t.shape[1:]) for t in starts]
        return q + out.view(batch, n_heads, total, -1), (unflat[:n], unflat[n:]), (stacked[:n], stacked[n:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.scan(x, x, self.init_state(x.shape[0]))[0])


def add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fused: bool) -> torch.Tensor:
    """acc + a @ b ([B*H, ., .]); one baddbmm when `fused`, else in acc's dtype (under autocast)."""
    return torch.baddbmm(acc, a, b) if fused else acc + torch.bmm(a, b)


def write_chunk(init: list[torch.Tensor], weights: list[torch.Tensor], surprise: list[torch.Tensor],
                terms: tuple[torch.Tensor, ...], one: torch.Tensor, fused: bool,
                write: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], State | None]:
    """One chunk's writes from its starting state (weights, surprise per layer [B*H, i, o]) and its
    terms (chunk_terms): per layer delta' = (theta / nu) delta [B*H, C, o], the hidden layers'
    inputs a_l [B*H, C, i] (l >= 1), what WriteLoop's backward keeps (the hidden pre-activations
    z_l, the products delta'_{l+1} W_{l+1}^T [B*H, C, i], 2 (k + f(k) - v) [B*H, C, E] and nu
    [B*H, C, 1]) and, when `write`, the state after the chunk."""
    n = len(weights)
    k, kk, theta, kv2, k_last, k_scale, keep_end, decay_end, eta_end, *deep = terms
    acts, pre, h = [k], [], k  # forward of the chunk's starting state on the keys
    for layer, w in enumerate(weights):
        h = torch.bmm(h, w)
        if layer < n - 1:
            pre.append(h)
            h = F.silu(h)
            acts.append(h)
    nu = kk
    for a in acts[1:]:
        nu = nu + a.square().sum(-1, keepdim=True)
    error = torch.add(kv2, h, alpha=2.0)
    delta = error * (theta / nu)  # (theta / nu) d ||k + f(k) - v||^2 / d f(k)
    deltas, prods = [delta] * n, [delta] * (n - 1)
    for layer in range(n - 1, 0, -1):  # silu'(z) = s + silu(z) (1 - s), s = sigmoid(z)
        slope = torch.lerp(torch.sigmoid(pre[layer - 1]), one, acts[layer])
        prods[layer - 1] = torch.bmm(delta, weights[layer].transpose(1, 2))
        delta = prods[layer - 1] * slope
        deltas[layer - 1] = delta
    kept = pre + prods + [error, nu]
    if not write:
        return deltas, acts[1:], kept, None
    new_w, new_s = [], []
    for layer in range(n):
        if layer == 0:
            to_w, to_s = k_last, k_scale  # -(last * k)^T, -(E_C / E * k)^T [B*H, E, C]
        else:
            a_t = acts[layer].transpose(1, 2)
            to_w, to_s = a_t * deep[0], a_t * deep[1]
        kept_w = torch.addcmul(torch.lerp(init[layer], weights[layer], keep_end), decay_end, surprise[layer])
        new_w.append(add_mm(kept_w, to_w, deltas[layer], fused))
        new_s.append(add_mm(surprise[layer] * eta_end, to_s, deltas[layer], fused))
    return deltas, acts[1:], kept, (new_w, new_s)


class WriteLoop(torch.autograd.Function):
    """write_chunk over every chunk in turn as one autograd node: forward (n memory layers, the
    first `last` chunks writing) -> per layer the starting weights, then surprise, of every chunk
    [B*H, N, i, o], delta' [B*H, N, C, o], the hidden inputs a_l [B*H, N, C, i] and, when every
    chunk writes, the final weights and surprise [B*H, i, o], by write_loop_torch or the Triton
    kernels (write_kernel_handles; not over packed documents, `documents`: state_passing.kernel_choice);
    backward a reverse loop over the chunks carrying the gradient of the state (write_loop_backward)."""

    @staticmethod
    def forward(ctx, n: int, last: int, fused: bool, documents: bool,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        init, terms = list(tensors[:n]), tensors[3 * n:]
        weights, surprise = list(tensors[n:2 * n]), list(tensors[2 * n:3 * n])
        ctx.kernel = write_kernel_handles(n) and state_passing.kernel_choice(terms[0], documents=documents) == "triton"
        if ctx.kernel:
            from megatron_taper.models.kernels.memory_write_triton import write_loop_triton

            out, saved, ends = write_loop_triton(n, last, init, weights, surprise, terms)
        else:
            out, saved, ends = write_loop_torch(n, last, fused, init, weights, surprise, terms)
        ctx.n, ctx.last, ctx.fused, ctx.terms = n, last, fused, len(terms)
        ctx.device = terms[0].device.type
        ctx.dtype = torch.get_autocast_dtype(ctx.device)
        ctx.save_for_backward(*init, terms[0], *terms[2:3], *terms[4:], *out, *saved)  # all but ||k||^2, 2 (k - v)
        return (*out, *ends)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.fused:
            return None, None, None, None, *write_loop_backward(ctx, grads)
        with torch.autocast(ctx.device, dtype=ctx.dtype):
            return None, None, None, None, *write_loop_backward(ctx, grads)


def write_kernel_handles(n: int) -> bool:
    """Whether the Triton kernels (kernels/memory_write_triton.py) can run WriteLoop's chunk loops,
    forward and backward, for n memory layers: depths 1 and 2. Under autocast they compute in float32
    and store in the terms' dtype, the state included, which keeps autocast's rule (the state keeps
    its dtype)."""
    return n in (1, 2)


def write_loop_torch(n: int, last: int, fused: bool, init: list[torch.Tensor], weights: list[torch.Tensor],
                     surprise: list[torch.Tensor], terms: tuple[torch.Tensor, ...]
                     ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """WriteLoop.forward's loop in torch, write_chunk per chunk: (its outputs but the final state,
    what its backward keeps, the final weights and surprise when every chunk writes, else [])."""
    starts, deltas, acts, kept = [], [], [], []
    dtype = terms[0].dtype if fused else torch.get_autocast_dtype(terms[0].device.type)
    one = terms[0].new_ones((), dtype=dtype)  # silu'(z) = lerp(sigmoid(z), 1, silu(z))
    for c, chunk in enumerate(zip(*(t.unbind(1) for t in terms))):
        starts.append(weights + surprise)
        delta, act, keep, written = write_chunk(init, weights, surprise, chunk, one, fused, c < last)
        deltas.append(delta)
        acts.append(act)
        kept.append(keep)
        weights, surprise = written or (weights, surprise)
    out = [torch.stack(ts, dim=1) for rows in (starts, deltas, acts) for ts in zip(*rows)]
    saved = [torch.stack(ts, dim=1) for ts in zip(*kept)]
    return out, saved, weights + surprise if last == len(starts) else []


def write_loop_backward(ctx, grads: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """WriteLoop's gradients of (init, weights, surprise, terms) from those of its outputs: a reverse
    loop over the chunks carrying the gradient of the state (gw, gs per layer [B*H, i, o]; reverse_loop,
    or the Triton kernel when the forward ran one); what does not feed it is taken for every chunk at
    once before and after."""
    n, last, fused = ctx.n, ctx.last, ctx.fused
    saved = ctx.saved_tensors
    init, terms, rest = saved[:n], saved[n:n + ctx.terms - 2], saved[n + ctx.terms - 2:]
    ws, ss, ds, acts = rest[:n], rest[n:2 * n], rest[2 * n:3 * n], rest[3 * n:4 * n - 1]  # [B*H, N, ., .]
    pre, prods, error, nu = rest[4 * n - 1:5 * n - 2], rest[5 * n - 2:6 * n - 3], rest[-2], rest[-1]
    if ctx.kernel:
        from megatron_taper.models.kernels.memory_write_triton import write_loop_backward_triton

        rows, gw, gs, after = write_loop_backward_triton(n, last, terms, ws, ds, acts, pre, prods, error, nu, grads)
    else:
        rows, gw, gs, after = reverse_loop(n, last, fused, terms, ws, ds, acts, pre, prods, error, nu, grads)
    g_terms = [rows[0] @ ws[0].mT, rows[1], rows[2] / nu, rows[3] * 0.5]
    g_init, g_factors = write_grads(init, terms, ws, ss, ds, acts, after, last)
    return [*g_init, *gw, *gs, *g_terms, *g_factors]


def reverse_loop(n: int, last: int, fused: bool, terms: tuple[torch.Tensor, ...], ws: tuple[torch.Tensor, ...],
                 ds: tuple[torch.Tensor, ...], acts: tuple[torch.Tensor, ...], pre: tuple[torch.Tensor, ...],
                 prods: tuple[torch.Tensor, ...], error: torch.Tensor, nu: torch.Tensor,
                 grads: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], ...]:
    """write_loop_backward's reverse loop in torch -> (the gradients of z_1 = k W_1 (of f(k) at depth
    1), nu, theta / nu and f(k) per chunk [B*H, N, C, .]; of the starting weights and surprise per
    layer; of the state after each writing chunk per layer, weights then surprise [B*H, last, i, o])."""
    k, theta, k_last, k_scale, keep, decay, eta, *deep = terms
    count = k.shape[1]
    ratio = theta / nu
    sig = [torch.sigmoid(z) for z in pre]
    slope = [torch.lerp(s, s.new_ones(()), a) for s, a in zip(sig, acts)]
    curv = [p * (s - s * s) * (2 + z * (1 - 2 * s)) for p, s, z in zip(prods, sig, pre)]  # P silu''(z)
    ut, vt, dml, dms = [k_last.mT], [k_scale.mT], [None], [None]  # [B*H, N, C, i]
    if deep:
        ml, ms = deep[0].mT, deep[1].mT  # [B*H, N, C, 1]
        ut, vt = ut + [a * ml for a in acts], vt + [a * ms for a in acts]
        dml, dms = dml + [d * ml for d in ds[1:]], dms + [d * ms for d in ds[1:]]
    c_ws, c_ds, c_acts, c_ut, c_vt, c_dml, c_dms, c_slope, c_curv, c_wt, c_at = (
        [None if t is None else t.unbind(1) for t in ts]
        for ts in (ws, ds, acts, ut, vt, dml, dms, slope, curv, [None] + [w.mT for w in ws[1:]],
                   [k.mT] + [a.mT for a in acts]))
    g_ws, g_ss, g_ds, g_as = ([g.unbind(1) for g in grads[a:b]] for a, b in
                              ((0, n), (n, 2 * n), (2 * n, 3 * n), (3 * n, 4 * n - 1)))
    c_keep, c_decay, c_eta, c_r2, c_negrn, c_error = (t.unbind(1) for t in
                                                      (keep, decay, eta, 2 * ratio, -ratio / nu, error))
    gw, gs = (list(grads[4 * n - 1:5 * n - 1]), list(grads[5 * n - 1:])) if last == count else (None, None)
    after, g_z, g_top, g_r, g_nu = [], [], [], [], []
    for c in range(count - 1, -1, -1):  # per chunk [B*H, ., .]
        gd, ga = [g[c] for g in g_ds], [None] + [g[c] for g in g_as]
        if c < last:  # its write: W' = W_0 + B_C (W - W_0) + D_C S + U delta', S' = E_C S + V delta'
            after.append(gw + gs)
            for layer in range(n):
                gd[layer] = add_mm(add_mm(gd[layer], c_ut[layer][c], gw[layer], fused), c_vt[layer][c], gs[layer],
                                   fused)
                if layer:
                    ga[layer] = add_mm(add_mm(ga[layer], c_dml[layer][c], gw[layer].mT, fused), c_dms[layer][c],
                                       gs[layer].mT, fused)
            new_w = [torch.addcmul(g[c], c_keep[c], w) for g, w in zip(g_ws, gw)]
            new_s = [torch.addcmul(torch.addcmul(g[c], c_eta[c], s), c_decay[c], w) for g, w, s in zip(g_ss, gw, gs)]
        elif gw is None:
            new_w, new_s = [g[c] for g in g_ws], [g[c] for g in g_ss]
        else:
            new_w, new_s = [g[c] + w for g, w in zip(g_ws, gw)], [g[c] + s for g, s in zip(g_ss, gs)]
        for layer in range(n - 1):  # delta'_l = (delta'_{l+1} W_{l+1}^T) silu'(z_l)
            gp = gd[layer] * c_slope[layer][c]
            gd[layer + 1] = add_mm(gd[layer + 1], gp, c_ws[layer + 1][c], fused)
            new_w[layer + 1] = add_mm(new_w[layer + 1], gp.mT, c_ds[layer + 1][c], fused)
        gh = gd[n - 1] * c_r2[c]
        gr = (gd[n - 1] * c_error[c]).sum(-1, keepdim=True)
        gnu = gr * c_negrn[c]
        g_top.append(gh)
        g_r.append(gr)
        g_nu.append(gnu)
        for layer in range(n - 1, -1, -1):  # the forward of the memory MLP on the keys
            new_w[layer] = add_mm(new_w[layer], c_at[layer][c], gh, fused)
            if layer:
                grad = add_mm(ga[layer], gh, c_wt[layer][c], fused)
                grad = torch.addcmul(grad, c_acts[layer - 1][c], gnu, value=2)
                gh = torch.addcmul(grad * c_slope[layer - 1][c], gd[layer - 1], c_curv[layer - 1][c])
        g_z.append(gh)
        gw, gs = new_w, new_s
    rows = [torch.stack(ts[::-1], dim=1) for ts in (g_z, g_nu, g_r, g_top)]
    return rows, gw, gs, [torch.stack(ts[::-1], dim=1) for ts in zip(*after)]


def write_grads(init: tuple[torch.Tensor, ...], terms: tuple[torch.Tensor, ...], ws: tuple[torch.Tensor, ...],
                ss: tuple[torch.Tensor, ...], ds: tuple[torch.Tensor, ...], acts: tuple[torch.Tensor, ...],
                after: list[torch.Tensor], last: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of W_0 per layer and of the writes' factors -(last * k)^T, -(E_C / E * k)^T,
    B_C, D_C, E_C and when deeper -last, -E_C / E, from the gradients of the state after each
    writing chunk (`after`: per layer gw then gs [B*H, last, i, o])."""
    k, theta, *write = terms
    if not last:
        return [torch.zeros_like(t) for t in init], [torch.zeros_like(t) for t in write]
    n, count = len(init), k.shape[1]
    gw, gs = after[:n], after[n:]
    g_init = [(g * (1 - write[2][:, :last])).sum(1) for g in gw]
    ws, ss, ds, acts = ([t[:, :last] for t in ts] for ts in (ws, ss, ds, acts))

    def inner(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).sum((-1, -2), keepdim=True)

    found = [gw[0] @ ds[0].mT, gs[0] @ ds[0].mT, sum(inner(g, w - i[:, None]) for g, w, i in zip(gw, ws, init)),
             sum(inner(g, s) for g, s in zip(gw, ss)), sum(inner(g, s) for g, s in zip(gs, ss))]
    if len(write) > 5:  # d -last_j = sum_o delta'_jo (a gW)_jo, likewise -E_C / E_j with gS
        for grad in (gw, gs):
            found.append(sum(((a @ g) * d).sum(-1, keepdim=True).mT for a, g, d in zip(acts, grad[1:], ds[1:])))
    return g_init, [f if last == count else torch.cat((f, torch.zeros_like(t[:, last:])), dim=1)
                    for f, t in zip(found, write)]


def read_chunks(init: list[torch.Tensor], starts: list[torch.Tensor], deltas: list[torch.Tensor],
                acts: list[torch.Tensor], terms: tuple[torch.Tensor, ...], mix: ReadMix | None,
                batch: int, total: int) -> torch.Tensor:
    """f_t(q_t) [B*H, T, E] of every chunk at once (batched over chunks), from each chunk's
    starting weights and surprise (per layer [B*H, N, i, o], weights first), delta' [B*H, N, C, o]
    and hidden inputs [B*H, N, C, i] (WriteLoop) and the read terms (chunk_terms)."""
    first, left, q, *deep = terms  # [B*H, N, C, .]
    flat, count, size = first.shape[:3]
    n = len(init)
    r = None
    for layer in range(n):
        right = torch.cat((starts[layer], starts[n + layer], deltas[layer]), dim=2).flatten(0, 1)  # [B*H*N, 2i + C, o]
        if layer == 0:  # (1 - B) q W_0 + [B q, D q, -(P Q * q k^T)] [W; S; delta']
            read = torch.baddbmm(first.flatten(0, 1), left.flatten(0, 1), right)
            x = q.flatten(1, 2)
        else:
            fresh, kept, carried, pq = deep  # 1 - B, B, D [B*H, N, C, 1]; -P Q [B*H, N, C, C]
            x = F.silu(r).view(flat, count, size, -1)
            a_t = acts[layer - 1].transpose(-1, -2)  # [B*H, N, i, C]
            scores = pq * (x @ a_t)  # [B*H, N, C, C]
            acc = (x.flatten(1, 2) @ init[layer]).view(flat, count, size, -1) * fresh
            read = torch.baddbmm(acc.flatten(0, 1), torch.cat((x * kept, x * carried, scores), -1).flatten(0, 1), right)
            x = x.flatten(1, 2)
        read = read.view(flat, count * size, -1)  # [B*H, N*C, o]
        r = read if mix is None else call_mix(mix, batch, total, layer, x, read)
    return r[:, :total] if count * size > total else r


def call_mix(mix: ReadMix, batch: int, total: int, layer: int, r: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
    """`mix` over every token at once: r [B*H, N*C, i], read [B*H, N*C, o], of which the first T
    rows are tokens (the rest pad a trailing partial chunk) -> [B*H, N*C, o]."""
    rows = r.shape[1]
    r, read = (t[:, :total].unflatten(0, (batch, -1)) for t in (r, read))  # [B, H, T, .]
    out = mix(layer, r, read, positions=slice(0, total)).flatten(0, 1)
    return F.pad(out, (0, 0, 0, rows - total)) if rows > total else out


def pad_features(features: Features, valid: torch.Tensor) -> Features:
    """Features [B, H, T, .] whose rows where valid [B, T] is False are padding that changes nothing
    (chunk_terms' padding values: keys of ones, theta = 0, eta = keep = 1, zero values and queries)."""
    keep = valid[:, None]  # [B, 1, T]
    k, v, q, theta, log_eta, log_keep = features
    rows = [torch.where(keep[..., None], t, fill) for t, fill in ((k, 1.0), (v, 0.0), (q, 0.0))]
    return (*rows, *(torch.where(keep, t, 0.0) for t in (theta, log_eta, log_keep)))


def reset_state(initial: State, state: State, reset: torch.Tensor) -> State:
    """`state` with the batch rows where reset [B] is True replaced by `initial`'s."""
    pick = reset.view(-1, 1, 1, 1)
    return tuple([torch.where(pick, a.to(b.dtype), b) for a, b in zip(xs, ys)] for xs, ys in zip(initial, state))


def reset_terms(loop: list[torch.Tensor], carry: torch.Tensor) -> list[torch.Tensor]:
    """The write terms (chunk_terms) with the state a chunk hands on set to the initial one where
    carry [B*H, N] is 0 (the next chunk starts a document): its end factors B_C, D_C, E_C and update
    factors are zeroed, so W' = lerp(W_0, W, 0) + 0 S + 0 delta' = W_0 and S' = 0. The write loop
    (and its hand-written backward) is unchanged; the zeros reach its inputs' gradients by autograd."""
    k, kk, theta, kv2, k_last, k_scale, *factors = loop
    rows = carry[..., None, None]  # [B*H, N, 1, 1]
    return [k, kk, theta, kv2, k_last * rows, k_scale * rows, *(f * rows for f in factors)]


def chunk_terms(features: Features, init: torch.Tensor, size: int, deep: bool,
                documents: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[list[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]:
    """The state-independent terms of every chunk of C = `size` tokens (module doc; a trailing
    partial chunk padded). For the write loop, over the N chunks: k [B*H, N, C, E], ||k||^2 and
    theta [B*H, N, C, 1], 2 (k - v), the first layer's update factors -(last * k)^T and
    -(E_C / E * k)^T [B*H, N, E, C], B_C, D_C, E_C [B*H, N, 1, 1], and when the memory is deeper
    -last, -E_C / E [B*H, N, 1, C]. For the reads, over all chunks: (1 - B) (q W_0) [B*H, N, C, o],
    [B q, D q, -(P Q * q k^T)] [B*H, N, C, 2E + C], q [B*H, N, C, E], and when deeper 1 - B, B, D
    [B*H, N, C, 1] and -P Q [B*H, N, C, C]. `documents`: (valid, resets) [B, T] of packed rows
    (scan_features): padding rows are masked out of the end-of-chunk sums like a trailing partial
    chunk's, and a chunk before a reset hands on the initial state (reset_terms)."""
    k, v, q, theta, log_eta, log_keep = features
    batch, heads, total, dim = k.shape
    count = -(-total // size)
    pad, flat = count * size - total, batch * heads

    def rows(x: torch.Tensor, value: float = 0.0) -> torch.Tensor:  # [B, H, T, ...] -> [B*H, N*C, ...]
        x = x.reshape(flat, total, *x.shape[3:])
        return F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad), value=value) if pad else x

    k, v, q, theta = rows(k, 1.0), rows(v), rows(q), rows(theta)  # [B*H, N*C, E], theta [B*H, N*C]
    logs = torch.stack((rows(log_keep), rows(log_eta))).view(2, flat, count, size).cumsum(-1)  # [2, B*H, N, C]
    future = torch.ones(size, size, dtype=torch.bool, device=k.device).triu(1)
    decay, momentum = (logs[..., :, None] - logs[..., None, :]).masked_fill(future, -math.inf).exp()  # P, Q
    lb, le = logs  # [B*H, N, C]
    eta = le.exp()
    valid = None
    if documents is not None:  # per row: [B*H, N, C]
        valid = rows(documents[0][:, None].expand(-1, heads, -1).to(k.dtype)).view(flat, count, size)
        eta = eta * valid
    elif pad:  # the sums over j of P_Cj: real tokens only
        valid = (torch.arange(count * size, device=k.device) < total).to(k.dtype).view(count, size)
        eta = eta * valid
    both = torch.cat((momentum, eta[..., None]), dim=-1).flatten(0, 1)  # [B*H*N, C, C + 1]
    pq, ks = torch.bmm(decay.flatten(0, 1), both).view(flat, count, size, size + 1).split((size, 1), dim=-1)
    last = pq[..., -1:, :] if valid is None else (decay[..., -1:, :] * valid[..., None, :]) @ momentum  # [B*H, N, 1, C]
    scale = (le[..., -1:, None] - le[..., None, :]).exp()  # E_C / E_i [B*H, N, 1, C]
    kw = lb.exp()[..., None]  # B [B*H, N, C, 1]
    ends = torch.cat((kw[..., -1, :], ks[..., -1, :], le[..., -1:].exp()), dim=-1)  # B_C, D_C, E_C [B*H, N, 3]

    kc, vc, qc = (t.view(flat, count, size, dim) for t in (k, v, q))
    k_t = (kc * torch.stack((last, scale)).transpose(-1, -2)).neg().transpose(-1, -2)  # [2, B*H, N, E, C]
    loop = [kc, kc.square().sum(-1, keepdim=True), theta.view(flat, count, size, 1), 2 * (kc - vc), *k_t,
            *ends[..., None, None].unbind(-3)]
    if deep:
        loop += [-last, -scale]
    if documents is not None:
        carry = F.pad((~documents[1][:, size::size]).to(k.dtype), (0, 1), value=1.0)  # [B, N]: the next continues
        loop = reset_terms(loop, carry[:, None].expand(-1, heads, -1).reshape(flat, count))
    fresh = -torch.expm1(lb)[..., None]  # 1 - B [B*H, N, C, 1]
    first = fresh * (q @ init).view(flat, count, size, -1)  # (1 - B) q W_0 [B*H, N, C, o]
    left = torch.cat((kw * qc, ks * qc, -(pq * (qc @ kc.transpose(-1, -2)))), dim=-1)
    reads = (first, left, qc, *((fresh, kw, ks, -pq) if deep else ()))
    return loop, reads
