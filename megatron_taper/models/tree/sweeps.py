"""The balanced tree's sweeps over a sequence (tree/model.py's module doc): the up-sweep's
nodes of every aligned dyadic block and the down-sweep's prefix states, for any `compose` cell.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_taper.models.tree.cost import SweepCount


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
    t + 1 (a later slice's prefixes under context parallelism, tree/cp.py)."""
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
