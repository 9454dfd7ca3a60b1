"""The tree LM under context parallelism.

Context parallelism (contiguous split): with a slice of s = S / cp tokens, s a power of two
(check_tree_layout), cp rank r's slice [r s, (r+1) s) is one aligned block of the tree, whose
nodes it computes alone (up_sweep); every node above the slices is a node of the same tree over
the slices' roots. The roots ([B, D] each) are all-gathered (gather_states; backward
reduce-scatter), rank r runs the tree over roots 0 .. r (P(s), .., P((r+1) s)) and its down-sweep
from start = P(r s) (prefixes_after): no chain, every rank works at once. Extra cell
applications per rank: those of the tree over r + 1 roots and one level of log2(s) + 1 pairs.
The roots' bytes: tree/cost.py cp_gather_bytes.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron_taper.models.tree.cost import SweepCount
from megatron_taper.models.tree.sweeps import down_sweep, tree_prefixes, up_sweep


def tree_slice_prefixes(compose: Callable[[torch.Tensor], torch.Tensor], leaves: torch.Tensor, split,
                        count: SweepCount) -> torch.Tensor:
    """This cp rank's prefix states [B, s, D] of the whole sequence's tree, for its contiguous slice
    leaves [B, s, D] (s = S / cp a power of two, so the slice is one aligned block of the tree:
    this module's doc). The slices' roots are all-gathered ([cp, B, D], backward: reduce-scatter)."""
    from megatron_taper.parallel.cp.state import gather_states, tie  # the model file stays single-device

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
