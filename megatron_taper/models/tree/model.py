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

Documents (`doc_start` [B, S], True where a new document begins; context parallelism refused):
each document is a sequence of its own, with its own tree from its first token: the documents
are folded into the batch (titans/documents.py `fold_documents`: one row per document, as long
as the longest, padded at its end; a prefix never reads the padding after it).

The sweeps: tree/sweeps.py. Cost terms: tree/cost.py; tensor-parallel plan and layout checks:
tree/parallel.py; context parallelism: tree/cp.py.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from megatron_taper.models.layers import RMSNorm, SwiGLU
from megatron_taper.models.titans.documents import fold_documents, starts_inside
from megatron_taper.models.transformer.model import Transformer
from megatron_taper.models.tree.cost import SweepCount, cell_width
from megatron_taper.models.tree.cp import tree_slice_prefixes
from megatron_taper.models.tree.parallel import check_tree_model
from megatron_taper.models.tree.sweeps import tree_prefixes

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


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


class TreeLayer(nn.Module):
    """leaves = norm(embeddings) -> prefix states s -> s + SwiGLU(norm(s)) (the model's only layer)."""

    def __init__(self, cfg: ModelConfig, mlp_width: int):
        super().__init__()
        self.leaf_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.cell = TreeCell(cfg.d_model, cell_width(cfg), cfg.norm_eps)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, mlp_width)
        self.context = None  # a contiguous context-parallel split (tree/cp.py), or None

    def forward(self, x: torch.Tensor, count: SweepCount | None = None,
                doc_start: torch.Tensor | None = None) -> torch.Tensor:
        split = self.context if self.context is not None and self.context.cp > 1 else None
        doc_start = starts_inside(doc_start, split, "the tree LM")
        if doc_start is not None:
            fold = fold_documents(doc_start)
            states = fold.unrows(tree_prefixes(self.cell, fold.rows(self.leaf_norm(x)), count))
        elif split is not None:
            states = tree_slice_prefixes(self.cell, self.leaf_norm(x), self.context, count or SweepCount())
        else:
            states = tree_prefixes(self.cell, self.leaf_norm(x), count)  # [B, S, D]
        return states + self.mlp(self.mlp_norm(states))


class TreeLM(Transformer):
    """Embedding -> one TreeLayer -> norm -> head; the Transformer's embedding, head, weight
    initialisation and block layout (`layers["0"]`), without its positional tables."""

    block_class = TreeLayer

    def __init__(self, cfg: ModelConfig):
        check_tree_model(cfg)
        super().__init__(cfg)

    def run_blocks(self, h: torch.Tensor, doc_start: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.layers.values():
            h = block(h) if doc_start is None else block(h, doc_start=doc_start)
        return h
