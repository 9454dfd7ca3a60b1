"""Balanced-tree single-layer LM: our reading of the seed "A Single-Layer Model Can Do Language
Modeling" (an abstract only; no public paper or code matched it, so the details below are ours).

One recursive cell composes two node states into their parent. Over the sequence's leaves (the
normalised token embeddings, no positional encoding) it builds a balanced binary tree, and every
prefix [0, t] is read from that tree in O(log n) sequential depth and O(n) cell calls:

    up-sweep    level k holds the node of every aligned dyadic block [j 2^k, (j+1) 2^k):
                node_k[j] = cell(node_{k-1}[2j], node_{k-1}[2j+1]); one batched cell call per
                level, floor(log2 n) levels (a trailing block that is not complete has no node,
                so lengths that are not powers of two work)
    prefixes    the prefix of length m = t+1 is the left fold of the dyadic blocks of m's binary
                expansion (a Fenwick decomposition), largest first:
                m = 2^a + 2^b + ... (a > b > ...):  P(m) = cell(cell(B_1, B_2), B_3) ...
    down-sweep  hence P(m) = cell(P(m - 2^k), node_k[(m - 2^k) / 2^k]) where 2^k is m's lowest
                set bit (P(2^k) = node_k[0]); P(m - 2^k) has a larger lowest bit, so walking
                k from the top level down computes, per level, every m with lowest bit 2^k in
                one batched cell call; levels with work: those with 3 * 2^k <= n

The cell (`TreeCell`), for children l, r in R^D and C = model.tree.cell_width:
    h = GELU(W_in [l; r] + b_in)                         W_in: C x 2D
    [g_l, g_r, g_i, p] = W_out h + b_out                 W_out: 4D x C, four D-wide chunks
    parent = RMSNorm(sigmoid(g_l) * l + sigmoid(g_r) * r + sigmoid(g_i) * p)

The block (`TreeLayer`, the model's only layer, `layers["0"]`): leaves = RMSNorm(embedding);
s_t = P(t + 1); out_t = s_t + SwiGLU(RMSNorm(s_t)) with the MLP width of model.mlp_width; then
the final norm and the LM head predict token t+1 from out_t. With one layer the taper's schedule
has a single width, model.mlp_width itself (the taper is trivially uniform). `tree_prefixes`
counts the cell calls and their sequential levels; `tree_depth(n)` gives the latter.

Parallelism: tensor parallelism splits the cell's hidden width C like an MLP (W_in column-
parallel, W_out row-parallel: one all-reduce of [pairs, 4D] per cell level) and the SwiGLU as in
the Transformer; pipeline parallelism (one layer: nothing to split) and sequence parallelism (the
tree spans the whole sequence) are refused.

Context parallelism (contiguous split): with a slice of s = S / cp tokens, s a power of two
(check_tree_layout), cp rank r's slice [r s, (r+1) s) is one aligned block of the tree, whose
nodes it computes alone (up_sweep); every node above the slices is a node of the same tree over
the slices' roots. The roots ([B, D] each) are all-gathered (gather_states; backward
reduce-scatter), rank r runs the tree over roots 0 .. r (P(s), .., P((r+1) s)) and its down-sweep
from start = P(r s) (prefixes_after): no chain, every rank works at once. Extra cell
applications per rank: those of the tree over r + 1 roots and one level of log2(s) + 1 pairs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.cost.block import Cost, Split, norm_act, swiglu_cost
from megatron_taper.cost.cp import ALLGATHER, CPMessage
from megatron_taper.models.cards import TREE
from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.spec import FamilySpec
from megatron_taper.models.transformer import Transformer
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig
    from megatron_taper.parallel.tp_plan import TPBuilder


def cell_width(cfg: ModelConfig) -> int:
    return cfg.tree.cell_width or 2 * cfg.d_model


class TreeCell(nn.Module):
    """parent = RMSNorm(sigmoid(g_l) l + sigmoid(g_r) r + sigmoid(g_i) p); see the module doc."""

    def __init__(self, d_model: int, width: int, eps: float):
        super().__init__()
        self.w_in = nn.Linear(2 * d_model, width)
        self.w_out = nn.Linear(width, 4 * d_model)
        self.norm = RMSNorm(d_model, eps)

    def forward(self, pair: torch.Tensor) -> torch.Tensor:
        """pair: [..., 2D], the children [l; r] -> parent [..., D]."""
        left, right = pair.chunk(2, dim=-1)
        gate_l, gate_r, gate_i, proposal = self.w_out(F.gelu(self.w_in(pair))).chunk(4, dim=-1)
        mixed = torch.sigmoid(gate_l) * left + torch.sigmoid(gate_r) * right + torch.sigmoid(gate_i) * proposal
        return self.norm(mixed)


@dataclass
class SweepCount:
    """What one `tree_prefixes` call did: sequential cell levels and cell applications (pairs)."""

    up_levels: int = 0
    down_levels: int = 0
    cell_pairs: int = 0  # parents computed, per sequence

    @property
    def levels(self) -> int:
        return self.up_levels + self.down_levels


def tree_depth(seq_len: int) -> SweepCount:
    """Levels and cell applications of `tree_prefixes` for a sequence of `seq_len` tokens."""
    up = seq_len.bit_length() - 1  # floor(log2 n)
    down = sum(1 for k in range(up + 1) if 3 << k <= seq_len)
    up_pairs = sum(seq_len >> k for k in range(1, up + 1))  # complete blocks of size >= 2
    down_pairs = seq_len - (up + 1)  # every prefix length except the powers of two
    return SweepCount(up, down, up_pairs + down_pairs)


def tree_prefixes(compose: Callable[[torch.Tensor], torch.Tensor], leaves: torch.Tensor,
                  count: SweepCount | None = None) -> torch.Tensor:
    """leaves [B, S, D] -> prefix states [B, S, D]: position t holds the fold of leaves 0..t.
    `compose` maps [..., 2D] (children [l; r]) to [..., D]; `count`, if given, is filled."""
    count = count if count is not None else SweepCount()
    return down_sweep(compose, up_sweep(compose, leaves, count), count)


def up_sweep(compose: Callable[[torch.Tensor], torch.Tensor], leaves: torch.Tensor,
             count: SweepCount) -> list[torch.Tensor]:
    """nodes[k] [B, S >> k, D]: the node of every complete aligned block [j 2^k, (j+1) 2^k)."""
    nodes = [leaves]
    while nodes[-1].shape[1] >= 2:
        below = nodes[-1]
        pairs = below.shape[1] // 2
        nodes.append(compose(below[:, :2 * pairs].unflatten(1, (pairs, 2)).flatten(2)))
        count.up_levels += 1
        count.cell_pairs += pairs
    return nodes


def down_sweep(compose: Callable[[torch.Tensor], torch.Tensor], nodes: list[torch.Tensor], count: SweepCount,
               start: torch.Tensor | None = None) -> torch.Tensor:
    """The prefix states [B, S, D] from up_sweep's nodes. `start` [B, D]: the state of a prefix
    before the leaves; position t then holds the left fold of `start` and the dyadic blocks of
    t + 1 (a later slice's prefixes under context parallelism, tree_slice_prefixes)."""
    leaves = nodes[0]
    seq, device = leaves.shape[1], leaves.device
    # prefixes whose length is a power of two are the first node of their level
    top = len(nodes) - 1
    powers = torch.tensor([(1 << k) - 1 for k in range(top + 1)], device=device)
    firsts = torch.cat([n[:, :1] for n in nodes], dim=1)  # [B, top + 1, D]
    if start is not None:  # one more cell level: start folded with each power-of-two block
        firsts = compose(torch.cat([start[:, None].expand_as(firsts), firsts], dim=-1))
        count.down_levels += 1
        count.cell_pairs += top + 1
    prefixes = torch.zeros_like(leaves).index_copy(1, powers, firsts)
    for k in range(top, -1, -1):  # down-sweep: lengths m = 2^k (2j + 1), j >= 1
        block = 1 << k
        if 3 * block > seq:
            continue
        starts = torch.arange(2 * block, seq - block + 1, 2 * block, device=device)  # m - 2^k
        pair = torch.cat([prefixes.index_select(1, starts - 1), nodes[k].index_select(1, starts >> k)], dim=-1)
        prefixes = prefixes.index_copy(1, starts + block - 1, compose(pair))
        count.down_levels += 1
        count.cell_pairs += starts.numel()
    return prefixes


def tree_slice_prefixes(compose: Callable[[torch.Tensor], torch.Tensor], leaves: torch.Tensor, split,
                        count: SweepCount) -> torch.Tensor:
    """This cp rank's prefix states [B, s, D] of the whole sequence's tree, for its contiguous slice
    leaves [B, s, D] (s = S / cp a power of two, so the slice is one aligned block of the tree:
    module doc). The slices' roots are all-gathered ([cp, B, D], backward: reduce-scatter)."""
    from megatron_taper.parallel.cp_state import gather_states, tie  # the model file stays single-device

    nodes = up_sweep(compose, leaves, count)
    roots = gather_states(split, nodes[-1][:, 0])  # [cp, B, D]: the root of every slice
    return tie(prefixes_after(compose, nodes, roots[:split.rank + 1].transpose(0, 1), count), roots)


def prefixes_after(compose: Callable[[torch.Tensor], torch.Tensor], nodes: list[torch.Tensor],
                   roots: torch.Tensor, count: SweepCount) -> torch.Tensor:
    """The prefix states [B, s, D] of slice r from its up_sweep nodes and roots [B, r + 1, D], the
    roots of slices 0 .. r: the tree over the roots gives P(r s), the prefix before the slice, where
    its down-sweep starts, and P((r + 1) s), its last prefix (a node of the tree over roots, not
    P(r s) folded with the slice's root)."""
    rank = roots.shape[1] - 1
    if rank == 0:
        return down_sweep(compose, nodes, count)
    before = tree_prefixes(compose, roots, count)  # [B, r + 1, D]: P(s), P(2 s), .., P((r + 1) s)
    prefixes = down_sweep(compose, nodes, count, start=before[:, rank - 1])
    return torch.cat([prefixes[:, :-1], before[:, rank:]], dim=1)


class TreeLayer(nn.Module):
    """leaves = norm(embeddings) -> prefix states s -> s + SwiGLU(norm(s)) (the model's only layer)."""

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__()
        self.leaf_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.cell = TreeCell(cfg.d_model, cell_width(cfg), cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, mlp_width)
        self.context = None  # a contiguous context-parallel split (module doc), or None

    def forward(self, x: torch.Tensor, count: SweepCount | None = None) -> torch.Tensor:
        if self.context is not None and self.context.cp > 1:
            states = tree_slice_prefixes(self.cell, self.leaf_norm(x), self.context, count or SweepCount())
        else:
            states = tree_prefixes(self.cell, self.leaf_norm(x), count)  # [B, S, D]
        return states + self.mlp(self.mlp_norm(states))


def check_tree_model(cfg: ModelConfig) -> None:
    if cfg.n_layers != 1:
        raise ConfigError(f"model.n_layers={cfg.n_layers}: model.arch='tree' is a single-layer model; set "
                          f"model.n_layers=1")


class TreeLM(Transformer):
    """Embedding -> one TreeLayer -> norm -> head; the Transformer's embedding, head, weight
    initialisation and block layout (`layers["0"]`), without its positional tables."""

    block_class = TreeLayer

    def __init__(self, cfg: ModelConfig):
        check_tree_model(cfg)
        super().__init__(cfg)

    def run_blocks(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h)
        return h


def tree_layer_cost(cfg: ModelConfig, width: int, causal: bool = True) -> Cost:
    """The cell's matmuls per token (tree_depth(seq_len).cell_pairs / seq_len applications, about
    two) and the SwiGLU MLP. Activations per cell application, as autograd keeps them: the pair
    2D, W_in's output C and GELU's C, W_out's output 4D (gates and proposal), the three sigmoids
    3D and the norm's 2D + 1; plus the leaves' norm. Measured against autograd's saved tensors:
    within 3% at power-of-two lengths, 6% otherwise (copies of strided slices)."""
    d, c = cfg.d_model, cell_width(cfg)
    applications = tree_depth(cfg.seq_len).cell_pairs / cfg.seq_len
    cell_params = 2 * d * c + c + 4 * d * c + 4 * d + d
    cell_flops = 2.0 * (2 * d * c + 4 * d * c) * applications
    per_application = Split(whole=11 * d + 1, width=2 * c)
    act = norm_act(d) + per_application.scaled(applications)
    tp_params = Split(whole=4 * d + 2 * d, width=6 * d * c + c)
    # backward's moment: the prefix states' gradient, and the widest level's (S/2 applications)
    # gradients of its output and pair (3D) and of its hidden width before and after GELU (2C)
    backward = Split(seq=d, whole=1.5 * d, width=c)
    cell = Cost(cell_params + d, cell_flops, tp_params=tp_params, act=act, backward=(backward,))
    return cell + swiglu_cost(cfg, width)


def cp_gather_bytes(cfg: ModelConfig, cp: int, micro_batch: int, dtype_bytes: int = 4) -> int:
    """The all-gathered roots of one micro-batch under context parallelism: [cp, B, D] (the
    full buffer; a rank receives (cp - 1) / cp of it forward, and the reduce-scatter backward
    moves as much); no point-to-point traffic and no chain."""
    return cp * micro_batch * cfg.d_model * dtype_bytes if cp > 1 else 0


def tree_cp_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int = 4,
                     ring: bool = False) -> tuple[CPMessage, ...]:
    """FamilySpec.cp_messages: each tree layer all-gathers the slices' roots (cp_gather_bytes)."""
    return (CPMessage(ALLGATHER, cp_gather_bytes(cfg, cp, micro_batch, act_bytes), "roots"),)


def tp_plan_tree_layer(block: TreeLayer, prefix: str, cfg: ModelConfig, tp: TPBuilder) -> None:
    """Norms replicated; the cell's hidden width C split in units of model.taper.multiple (W_in
    column-, W_out row-parallel: one all-reduce per cell level); the SwiGLU as the Transformer's."""
    tp.replicated(block.leaf_norm, f"{prefix}.leaf_norm")
    tp.replicated(block.cell.norm, f"{prefix}.cell.norm")
    tp.replicated(block.mlp_norm, f"{prefix}.mlp_norm")
    rows, cols = tp.width_specs(block.cell.w_in.weight.shape[0], cfg.taper.multiple, f"{prefix}.cell")
    # f on W_in's input only: the children also enter the gated sum, whose gradient is whole on every rank
    tp.column(block.cell, "w_in", f"{prefix}.cell", rows, input_mode="copy")
    tp.row(block.cell, "w_out", f"{prefix}.cell", cols)
    tp.swiglu(block.mlp, f"{prefix}.mlp", cfg.taper.multiple)


def check_tree_layout(m: ModelConfig, p: ParallelConfig) -> None:
    check_tree_model(m)
    if p.pp > 1:
        raise ConfigError(f"parallel.pp={p.pp}: model.arch='tree' has a single layer, nothing to split over "
                          f"pipeline stages; use parallel.pp=1")
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError("parallel.sequence_parallel is not supported for model.arch='tree' (the tree spans the "
                          "whole sequence); set it to false")
    local = m.seq_len // p.cp
    if p.cp > 1 and local & (local - 1):
        raise ConfigError(f"parallel.cp={p.cp}: model.arch='tree' needs each rank's slice model.seq_len / "
                          f"parallel.cp = {m.seq_len}/{p.cp} = {local} tokens to be a power of two (a whole block of "
                          f"the balanced tree, whose root the later slices read); choose model.seq_len = "
                          f"parallel.cp x a power of two")
    units = cell_width(m) // m.taper.multiple
    if p.tp > units:
        raise ConfigError(f"parallel.tp={p.tp}: the tree cell's width {cell_width(m)} (model.tree.cell_width) is "
                          f"{units} unit(s) of model.taper.multiple={m.taper.multiple}, fewer than parallel.tp")


SPECS = (FamilySpec(card=TREE, build=TreeLM, layer_cost=tree_layer_cost, tp_block_plan=tp_plan_tree_layer,
                    check_layout=check_tree_layout, context_parallel=True, cp_balanced=False,
                    cp_messages=tree_cp_messages),)
