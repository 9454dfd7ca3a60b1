"""What context parallelism sends per block and micro-batch, by kind, for every family.

`cp_messages(model_cfg, micro_batch, seq_len, cp)` lists, per block, the messages one micro-batch
makes the cp ranks exchange, each a `CPMessage(kind, bytes, what)`:

    chain      point-to-point rank r -> r + 1 of the state rank r's slice ends with
               (parallel/cp/state.py receive_state / send_state); rank r + 1 waits for it, so the
               hops run one after another across the cp ranks (serial). `bytes`: the largest hop
               (the one into the last rank where the message grows with the rank), one direction;
               backward sends its gradient back, as many bytes.
    halo       point-to-point rank r -> r + 1 of the last rows of rank r's input (previous_rows, or
               a chain message's rows that do not depend on the scan); every rank sends at once.
               `bytes`: per hop, one direction; backward sends their gradient back.
    allgather  a collective over the cp group (attention's K and V, a prefix's summaries, the
               tree's roots): `bytes` is the gathered buffer (every rank's part; a rank receives
               (cp - 1) / cp of it); backward reduce-scatters as many.
    ring       parallel.cp_attention=ring: K and V of one slice passed around the ring, cp - 1
               times forward; `bytes` per pass ([2, b, K, S / cp, E]); backward passes the same
               blocks again and their gradients (3 cp - 2 sends per rank and block in all).
    alltoall   parallel.cp_attention=ulysses (parallel/cp/ulysses.py): q, k, v to head-sharded and the
               output back, two all-to-alls forward; `bytes`: the two buffers of one rank
               ([b, S / cp, H + 2 K', E] and [b, S / cp, H, E], K' = lcm(K, cp)), of which
               (cp - 1) / cp leave it;
               backward the same two on the gradients. Titans MAG / MAL and Memory Caching send
               their memory's inputs and reads instead ("features": titans/cost.py ulysses_bytes).

`what` names the tensors ("kv" for attention's K and V, which cost/memory.py counts as kv
elements per token; "qkvo" for Ulysses' q, k, v and output; "doc_start" for the all-gather of the
document starts, which has no backward; "state", "rows", "summary", "roots" otherwise). Every
family's own counting
function gives the bytes (the ones its runtime code is checked against): the family's FamilySpec
`cp_messages`; a family without one is an attention family (the Transformer's K/V all-gather).
`attention` is parallel.cp_attention (allgather | ring | ulysses). Sizes are those of the whole
model (tp = 1); `act_bytes` is the activations' dtype (2 under bf16 autocast); recurrent states
travel in fp32 (their parameters' dtype) whatever it is.

`documents` (data.document_mask): a block with attention over the whole sequence (K and V gathered
or passed around the ring) or with Ulysses' all-to-alls (attention's, or a per-head memory's) also
all-gathers the ranks' doc_start slices, [b, S] uint8 (`document_messages`; forward only: the
starts take no gradient), and a family adds what its chain hands on for a document that spans the
slices (FamilySpec.cp_document_messages: Hope's and the bridge's open chunk or segment rows, Titans
MAG / MAL's whole open chunk and the ends of the sender's last document).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, NamedTuple

from megatron_taper.models import family
from megatron_taper.taper import layer_widths

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig

CHAIN, HALO, ALLGATHER, RING, ALLTOALL = "chain", "halo", "allgather", "ring", "alltoall"


class CPMessage(NamedTuple):
    kind: str  # chain | halo | allgather | ring | alltoall (module doc)
    bytes: float  # per block and micro-batch, one direction (module doc)
    # kv (attention's K and V) | qkvo (Ulysses' q, k, v, out) | features (a memory's, Ulysses) | doc_start
    # | state | rows | summary | roots
    what: str = "state"


def attention_messages(cfg: ModelConfig, micro_batch: int, cp: int, act_bytes: int = 4,
                       attention: str = "allgather") -> tuple[CPMessage, ...]:
    """One attention layer over the whole sequence (parallel/cp/split.py): the all-gather
    of K and V, [b, S, K, E] each, under the ring one slice's K and V per pass, under Ulysses the
    two all-to-alls of one rank's q, k, v and output (ulysses_bytes)."""
    if attention == "ulysses":
        return (CPMessage(ALLTOALL, ulysses_bytes(cfg, micro_batch, cp, act_bytes), "qkvo"),)
    kv = 2 * micro_batch * cfg.seq_len * cfg.kv_heads * cfg.head_dim * act_bytes
    return (CPMessage(RING, kv / cp, "kv"),) if attention == "ring" else (CPMessage(ALLGATHER, kv, "kv"),)


def ulysses_bytes(cfg: ModelConfig, micro_batch: int, cp: int, act_bytes: int = 4) -> float:
    """The buffers of one attention layer's two forward all-to-alls on one rank (parallel/cp/ulysses.py):
    q, k, v [b, S / cp, H + 2 K', E] and the output [b, S / cp, H, E]; K' = lcm(K, cp), the kv heads
    repeated until they divide by cp."""
    kv = math.lcm(cfg.kv_heads, cp)
    return micro_batch * cfg.seq_len / cp * (2 * cfg.n_heads + 2 * kv) * cfg.head_dim * act_bytes


def cp_messages(model_cfg: ModelConfig, micro_batch: int, seq_len: int, cp: int, act_bytes: int = 4,
                attention: str = "allgather", documents: bool = False) -> list[tuple[CPMessage, ...]]:
    """Per block of `model_cfg` at `seq_len` tokens split over `cp` ranks, micro-batches of
    `micro_batch` sequences: its messages (module doc); nothing at cp = 1. `attention`:
    parallel.cp_attention; `documents`: data.document_mask."""
    cfg = model_cfg if seq_len == model_cfg.seq_len else dataclasses.replace(model_cfg, seq_len=seq_len)
    return block_messages(cfg, layer_widths(cfg), micro_batch, cp, act_bytes, attention, documents)


def block_messages(cfg: ModelConfig, widths: list[int], micro_batch: int, cp: int, act_bytes: int = 4,
                   attention: str = "allgather", documents: bool = False) -> list[tuple[CPMessage, ...]]:
    """cp_messages of `cfg` at its seq_len, for blocks of MLP widths `widths` (the caller's)."""
    if cp == 1:
        return [() for _ in widths]
    spec = family(cfg.arch)
    if spec.cp_messages is None:
        blocks = [attention_messages(cfg, micro_batch, cp, act_bytes, attention) for _ in widths]
    else:
        blocks = [spec.cp_messages(cfg, layer, width, micro_batch, cp, act_bytes, attention)
                  for layer, width in enumerate(widths)]
    if not documents:
        return blocks
    return [block + document_messages(cfg, layer, width, micro_batch, cp, act_bytes, attention, block)
            for (layer, width), block in zip(enumerate(widths), blocks)]


def whole_attention(messages: tuple[CPMessage, ...]) -> bool:
    """Whether a block with these messages attends over the whole sequence (K and V gathered or
    passed around the ring, or Ulysses' q, k, v and output)."""
    return any(m.what in ("kv", "qkvo") for m in messages)


def document_messages(cfg: ModelConfig, layer: int, width: int, micro_batch: int, cp: int, act_bytes: int,
                      attention: str, messages: tuple[CPMessage, ...]) -> tuple[CPMessage, ...]:
    """What data.document_mask adds to a block's `messages` (module doc): the all-gather of doc_start
    ([b, S] uint8, SequenceSplit.sequence_starts) where the block attends over the whole sequence or
    runs Ulysses' all-to-alls (a per-head memory scans the whole sequence's documents), and the
    family's own (FamilySpec.cp_document_messages)."""
    spec = family(cfg.arch)
    whole = whole_attention(messages) or any(m.kind == ALLTOALL for m in messages)
    starts = (CPMessage(ALLGATHER, micro_batch * cfg.seq_len, "doc_start"),) if whole else ()
    extra = () if spec.cp_document_messages is None else spec.cp_document_messages(
        cfg, layer, width, micro_batch, cp, act_bytes, attention)
    return starts + extra


def received_bytes(messages: tuple[CPMessage, ...]) -> float:
    """Bytes the receiving rank keeps for backward from a block's messages besides attention's K
    and V (which memory.py counts as kv elements), the gathered doc_start (freed once attention's
    mask is built; memory.py counts the mask) and Ulysses' head-sharded q, k, v and output (as
    large as the rank's own, which memory.py counts already): what a chain or halo hands it (the scan's
    starting state and the rows its first outputs read; parallel/cp/state.py also keeps them for
    a recompute) and the gathered buffers of other all-gathers; its backward holds their gradient,
    as many bytes, before sending it back."""
    return sum(m.bytes for m in messages if m.what not in ("kv", "doc_start") and m.kind not in (RING, ALLTOALL))
