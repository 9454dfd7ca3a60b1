"""Titans' cost terms (cost/block.py), torch-free: the block's parameters, FLOPs per real token
(counting exactly the matmuls of titans/model.py, 2 per multiply-add) and saved activations, and
its context-parallel messages.

Cost model (`titans_layer_cost`): FLOPs count every pair the attention kernels compute, masked or
not, the same with `causal` or without: the blockwise band (P + 2W keys per query, P + W in the
first block, padded rows included; `blockwise_pairs`) for MAG / MAL and L x (P + 2L) per MAC
segment. That is what runs on CPU and what torch's FLOP counter sees; FlexAttention on CUDA
computes the 128-wide kv blocks that meet the window or hold persistent tokens, about W + 128 to
W + 256 keys per query plus the persistent tokens' block: fewer than the band when W is large
(W = 512: ~0.8x), more when it is small (W = 64: ~3x).

Context parallelism (titans/cp.py's module doc): the bytes of each block's chain message
(`cp_state_bytes`, `cp_messages`) and the wavefront's step-time ratio (`wavefront_ratio`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from megatron_taper.cost.block import Cost, Split, attention_cost, norm_act, swiglu_cost
from megatron_taper.cost.cp import ALLTOALL, CHAIN, HALO, CPMessage

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


def memory_dims(head_dim: int, depth: int, expansion: int) -> list[int]:
    return [head_dim] + [expansion * head_dim] * (depth - 1) + [head_dim]


def blockwise_pairs(seq: int, prefix: int, window: int) -> int:
    """(query, key) pairs the blockwise kernel computes, padded rows and masked pairs included."""
    block = min(window, seq)
    blocks = math.ceil(seq / block)
    return block * (prefix + block) + (blocks - 1) * block * (prefix + 2 * block)


def memory_params(cfg: ModelConfig) -> int:
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    return (4 * d * h * e + 3 * d * h + 3 * h + h * sum(i * o for i, o in zip(dims[:-1], dims[1:])) + h * e
            + 3 * h * e * t.conv_kernel)


def scan_flops(cfg: ModelConfig, tokens: int) -> float:
    """Projections, chunked writes and reads of `tokens` tokens, output projection included. A
    trailing partial chunk is padded to C tokens (neural_memory.py) and, when there is one, every
    chunk computes the last row of P Q over its real tokens apart (2 C^2)."""
    d, h, e, t = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.titans
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    io = [i * o for i, o in zip(dims[:-1], dims[1:])]
    total = tokens * 2 * (4 * d * h * e + 3 * d * h + 3 * h * e * t.conv_kernel)  # wq, wk, wv, wo, gates, convs
    c = min(t.chunk_size, tokens)
    count = -(-tokens // c) if tokens else 0
    per_head = 2 * c * (sum(io) + sum(io[1:]))  # forward on keys, backward of deltas
    per_head += 2 * c**3 + 2 * c**2  # coefficients P Q, P E
    per_head += sum(2 * c * (3 * x) + 2 * c * c * (i + o) for x, i, o in zip(io, dims[:-1], dims[1:]))  # reads
    per_head += sum(2 * c * 2 * x for x in io)  # new weights and surprise
    per_head += 2 * c**2 if count * c > tokens else 0  # the last row of P Q over the real tokens
    return total + h * count * per_head


def row_attention_flops(cfg: ModelConfig, q_rows: int, kv_rows: int, pairs: float) -> float:
    """RowAttention: wq and wo on `q_rows` rows, wk and wv on `kv_rows` rows, scores and values
    of `pairs` (query, key) pairs per head."""
    d, h, k, e = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim
    return 4 * q_rows * d * h * e + 4 * kv_rows * d * k * e + 4 * h * e * pairs


def titans_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    d, h, k, e, t, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.titans, cfg.seq_len
    p = t.persistent_tokens
    attn_params = d * h * e + 2 * d * k * e + h * e * d
    params = attn_params + memory_params(cfg) + p * d + 2 * d + (d if t.variant == "mal" else 0)
    # attention: every pair its kernel computes, masked or not, whether `causal` or not (the
    # blockwise band for MAG / MAL, the [L, P + 2L] rows of each MAC segment)
    if t.variant in ("mag", "mal"):
        rows = p + s
        flops = row_attention_flops(cfg, s, rows, blockwise_pairs(s, p, t.window)) + scan_flops(cfg, rows)
        flops -= 2 * p * h * e * d  # the memory's output projection runs on the real tokens only
    else:
        flops = 0.0
        for start in range(0, s, t.window):
            seg = min(t.window, s - start)
            dims = memory_dims(e, t.memory_depth, t.memory_expansion)
            read = seg * (2 * d * h * e + 2 * h * e * t.conv_kernel + 2 * h * e * d  # queries, wo
                          + h * sum(2 * i * o for i, o in zip(dims[:-1], dims[1:])))
            flops += row_attention_flops(cfg, seg, p + 2 * seg, seg * (p + 2 * seg)) + read + scan_flops(cfg, seg)
    mlp = swiglu_cost(cfg, width)
    tp_params = Split(whole=params - attn_params - memory_params(cfg) - d, heads=memory_params(cfg) + 2 * d * h * e,
                      kv=2 * d * k * e) + mlp.params_split
    backward = attention_cost(cfg).backward + mlp.backward
    return Cost(params + width * 3 * d, flops / s + mlp.flops, tp_params=tp_params,
                act=titans_mixer_act(cfg) + mlp.act, backward=backward)


def scan_act_per_row(cfg: ModelConfig, rows: int, size: int | None = None) -> float:
    """Elements one head of the neural memory keeps for backward per row of one scan of `rows`
    rows in chunks of `size` (default model.titans.chunk_size; one chunk of all rows when fewer):
    the memory weights and surprise each chunk starts from and writes, the starting state, and per
    padded row its keys, queries, values, gates, step norms, per-layer activations and deltas and
    the chunk's [C, C] decay / momentum / coefficient products. Counted from torch's saved tensors
    (the constants 4.0 and 0.9 of the state terms, 9.2, 14.2, -46.6 and 5 * depth are fitted to what
    NeuralMemory.scan_features saves: the write loop's hand-written backward keeps per hidden unit
    its pre-activation, delta' W^T product and input)."""
    t, e = cfg.titans, cfg.head_dim
    dims = memory_dims(e, t.memory_depth, t.memory_expansion)
    state = sum(i * o for i, o in zip(dims[:-1], dims[1:]))
    size = min(size or t.chunk_size, rows)
    chunks = -(-rows // size)
    per_padded_row = 9.2 * sum(dims[1:-1]) + 14.2 * e - 46.6 + 5.0 * t.memory_depth * size
    return (4.0 * state * chunks + 0.9 * state + per_padded_row * chunks * size) / rows


def titans_mixer_act(cfg: ModelConfig) -> Split:
    """Elements per real token the mixer (norms, persistent prefix, memory, attention, gate) keeps
    for backward. The memory scan is counted as above; the rest (attention over the prefixed rows,
    the memory's read-out norm and gate) as c * d + k * H * (hidden memory widths), with (c, k)
    (17.2, 2.25) for MAG, (18.2, 2.25) for MAL and (31, 4.5) for MAC, matched to torch's saved
    tensors (tests/cost/test_memory_model.py checks the whole block within 10%)."""
    t, d, h, s = cfg.titans, cfg.d_model, cfg.n_heads, cfg.seq_len
    hidden = h * sum(memory_dims(cfg.head_dim, t.memory_depth, t.memory_expansion)[1:-1])
    if t.variant == "mac":
        rows, scan = s, h * scan_act_per_row(cfg, min(t.window, s))  # the memory writes y, segment by segment
        rest = 31 * d + 4.5 * hidden
    else:
        rows = s + t.persistent_tokens
        scan = h * scan_act_per_row(cfg, rows) * rows / s
        rest = (17.2 + (t.variant == "mal")) * d + 2.25 * hidden
    norm = norm_act(d)
    prefixed = d * rows / s  # [P, norm(x)] (the input of every projection)
    return norm + Split(whole=prefixed, heads=scan + rest - norm.total - prefixed)


def conv_rows(kernel: int) -> int:
    """Rows of a causal convolution's past: K - 1 (0 without a convolution)."""
    return max(kernel - 1, 0)


def tail_rows(persistent: int, chunk: int, kernel: int, window: int, rank: int, local: int) -> tuple[int, int]:
    """(memory-input rows, attention rows) cp rank `rank` receives in MAG / MAL (titans/cp.py's module doc)."""
    pending = (persistent + rank * local) % chunk if rank else 0
    return pending + conv_rows(kernel), min(window - 1, rank * local)


def cp_state_bytes(cfg: ModelConfig, rank: int, cp: int, batch: int, act_bytes: int = 4,
                   documents: bool = False) -> int:
    """Bytes cp rank `rank` receives per block in forward (its gradient goes back in backward)
    for micro-batches of `batch` sequences (titans/cp.py's module doc); 0 on rank 0. With
    `documents` (MAG / MAL) the memory tail is the open chunk's whole C - 1 rows (and the
    convolution's K - 1), and the ends of the sender's last document, [B, 2] fp32, come along."""
    t, h, e, d = cfg.titans, cfg.n_heads, cfg.head_dim, cfg.d_model
    if rank == 0:
        return 0
    dims = [e] + [t.memory_expansion * e] * (t.memory_depth - 1) + [e]
    state = 2 * batch * h * sum(i * o for i, o in zip(dims[:-1], dims[1:])) * 4
    local = cfg.seq_len // cp
    if t.variant == "mac":
        return state + 4 * act_bytes * batch * conv_rows(t.conv_kernel) * h * e
    mem, attn = tail_rows(t.persistent_tokens, t.chunk_size, t.conv_kernel, t.window, rank, local)
    if documents:
        return state + act_bytes * batch * d * (t.chunk_size - 1 + conv_rows(t.conv_kernel) + attn) + 4 * batch * 2
    return state + act_bytes * batch * d * (mem + attn)


def cp_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages: every block's chain message (cp_state_bytes), the largest hop's (the
    attention tail grows with the rank up to W - 1 rows); Titans' attention is local, nothing is
    all-gathered. Under Ulysses (parallel.cp_attention=ulysses, MAG / MAL: titans/cp.py) no chain:
    the all-to-alls of the memory's inputs and reads (ulysses_bytes) and the window's halo of W - 1
    rows [b, W - 1, D] (previous_rows)."""
    if attention == "ulysses":
        halo = (CPMessage(HALO, act_bytes * micro_batch * (cfg.titans.window - 1) * cfg.d_model, "rows"),)
        return (CPMessage(ALLTOALL, ulysses_bytes(cfg, micro_batch, cp, act_bytes), "features"),
                *(halo if cfg.titans.window > 1 else ()))
    return (CPMessage(CHAIN, max(cp_state_bytes(cfg, rank, cp, micro_batch, act_bytes) for rank in range(1, cp))),)


def cp_document_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                         attention: str = "allgather") -> tuple[CPMessage, ...]:
    """FamilySpec.cp_document_messages: under the chain (MAG / MAL; MAC refuses documents there), what
    the largest hop's message grows by with documents (cp_state_bytes); nothing under Ulysses."""
    if attention == "ulysses" or cfg.titans.variant == "mac":
        return ()
    hops = range(1, cp)
    more = max(cp_state_bytes(cfg, rank, cp, micro_batch, act_bytes, documents=True) for rank in hops) - \
        max(cp_state_bytes(cfg, rank, cp, micro_batch, act_bytes) for rank in hops)
    return (CPMessage(CHAIN, more, "rows"),) if more else ()


def ulysses_bytes(cfg: ModelConfig, micro_batch: int, cp: int, act_bytes: int = 4, gates: int = 3,
                  extra: int = 0) -> float:
    """One block's two forward all-to-all buffers on one rank under Ulysses (titans/cp.py
    head_channels): the memory's inputs before the convolution, q, k, v, the `gates` gate
    pre-activations and `extra` more projections of E per head [b, S / cp, H, (3 + extra) E + gates]
    (Titans: 3 gates; Memory Caching: memory_caching/cost.py), and the reads back [b, S / cp, H, E]."""
    return act_bytes * micro_batch * cfg.seq_len // cp * cfg.n_heads * ((4 + extra) * cfg.head_dim + gates)


def wavefront_ratio(n_layers: int, cp: int) -> float:
    """Step time at cp over the one-process step time, from the wavefront alone (titans/cp.py's module doc):
    (L + cp - 1) block-slices of S / cp tokens against L blocks of S tokens."""
    return (n_layers + cp - 1) / (n_layers * cp)
