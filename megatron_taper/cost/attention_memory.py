"""What attention adds to a block's activations beyond one process's causal attention (the
memory model's terms, cost/memory.py module doc): context parallelism's K and V (all-gather, ring,
Ulysses) and the document mask kept for backward. Torch-free."""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

from megatron_taper.cost.block import Cost, Split
from megatron_taper.cost.cp import CPMessage, block_messages, whole_attention

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig
    from megatron_taper.cost.memory import MemorySetup

CP_RING_TILE = 512  # query rows per piece of ring attention (parallel/cp/split.py)
FLEX_BLOCK = 128  # FlexAttention's sparse block of tokens (its default; models/local_attention.py)


def context_parallel_cost(cost: Cost, cfg: ModelConfig, setup: MemorySetup,
                          messages: Sequence[CPMessage] = ()) -> Cost:
    """A block's cost per local token under context parallelism (module doc), for a block whose
    `messages` (cost/cp.py) include attention's K and V: all-gathered, its K and V (and their
    gradients in backward) are those of the whole sequence, cp times the rank's tokens; under
    activation_checkpointing=op the kept K and V projections stay the rank's own (`op_act`).
    Ring: the moment of a piece of its backward. Ulysses (messages of q, k, v and the output): its
    own tokens' elements, k and v K' / K times where a tp rank's K kv heads are repeated to
    K' = lcm(K, cp). A block without them (Titans' local attention, the memories, the tree) keeps
    its own tokens' elements; what it is handed instead counts as `received` bytes (piece_memory)."""
    cp = setup.cp
    if cp > 1 and setup.cp_attention == "ulysses" and any(m.what == "qkvo" for m in messages):
        local = max(cfg.kv_heads // setup.tp, 1)  # kv heads of a tp rank (one, replicated, where tp > K)
        extra = math.lcm(local, cp) // local - 1

        def repeated(split: Split) -> Split:
            return split + Split(kv=split.kv * extra)

        return dataclasses.replace(cost, act=repeated(cost.act), backward=tuple(repeated(b) for b in cost.backward))
    if cp == 1 or not any(m.what == "kv" for m in messages):
        return cost
    if setup.cp_attention == "ring":
        rows = min(CP_RING_TILE, cfg.seq_len // (2 * cp))
        piece = Split(heads=cfg.n_heads * (2 * rows + 4 * cfg.head_dim))  # 4 x [t, C] per 2C tokens; 4 x [s, E]
        return dataclasses.replace(cost, backward=(*cost.backward, piece))

    def more(split: Split) -> Split:
        return split + Split(kv=split.kv * (cp - 1))

    return dataclasses.replace(cost, act=more(cost.act), backward=tuple(more(b) for b in cost.backward))


def document_mask_bytes(cfg: ModelConfig, widths: Sequence[int], setup: MemorySetup) -> list[float]:
    """Per block, the bytes per micro-batch of the document mask its attention keeps for backward
    (module doc, Documents): 0 without data.document_mask, for blocks that do not attend over the
    whole sequence (as cost/cp.py tells them apart at cp = 2) and under the ring."""
    if not setup.documents or (setup.cp > 1 and setup.cp_attention == "ring"):
        return [0.0 for _ in widths]
    attends = [whole_attention(m) for m in block_messages(cfg, list(widths), 1, max(setup.cp, 2),
                                                          attention=setup.cp_attention)]
    b, seq, ulysses = setup.micro_batch, cfg.seq_len, setup.cp > 1 and setup.cp_attention == "ulysses"
    if setup.flex and cfg.position_encoding == "rope" and (setup.cp == 1 or ulysses):
        n = -(-seq // FLEX_BLOCK)
        size = 4.0 * (4 * b * n + 4 * b * n * n + b * seq)  # int32 block counts and indices; the ids
    else:  # SDPA's additive mask in the compute dtype; ALiBi's: per head of the rank
        rows = seq // setup.cp if setup.cp > 1 and not ulysses else seq
        heads = math.ceil(cfg.n_heads / setup.tp) // (setup.cp if ulysses else 1) \
            if cfg.position_encoding == "alibi" else 1
        size = float(setup.compute_bytes * b * heads * rows * seq)
    return [size if attend else 0.0 for attend in attends]
