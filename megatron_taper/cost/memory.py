"""Predicted peak memory of one rank during a training step, per pipeline stage, in bytes.

For a stage (its layers; the embedding on the first, final norm + head + loss on the last) on
one rank of the (pp, dp, cp, tp) layout, with n micro-batches in flight (1F1B: min(pp - s, m) on
stage s; GPipe: m; without pipelining 1):

    peak = static + (n - 1) * K + top + buffers

static   per tp-local parameter P of the stage: parameters, gradients, AdamW state
         (one precision policy, docs/precision.md: all fp32. zero=none, also DDP: 4 + 4 + 8
         bytes; fsdp2 with dp x cp > 1: 16 / s, s = dp_shard under HSDP (parallel.dp_replicate x
         parallel.dp_shard: the replicas hold the same shard), else dp x cp; deepspeed: (4 param + 4
         grad + 4 fp32 master + 8 AdamW) / dp, less what is offloaded), plus weights held
         unsharded: fsdp2 under
         pipelining keeps the stage's parameters gathered and their gradients unsharded through
         the step (each chunk sharded on its own under the interleaved and zero-bubble schedules:
         a rank's static bytes are the sum over its chunks, PipelinePlan.rank_static_bytes)
         (matmul weights in the compute dtype, embedding in fp32; gradients accumulated
         in fp32 under pipelining; the sharded gradient, made at the step's end as the unsharded
         one is freed, is not counted besides it: 12 / s + 4 + param bytes); fsdp2 without
         pipelining keeps the root's (embedding, final norm, head) weights gathered, and the
         head's unsharded gradient from its backward to the end of the backward (in the blocks'
         moments; it is reduce-scattered then, measured: docs/memory_model.md); bf16 autocast (every
         layout but fsdp2 at dp x cp > 1, which gathers matmul weights in bf16) keeps a bf16 copy of
         every weight it casts (2 bytes per P), except the block linears train.float8 converts
         (the rule of cost/float8.py, train.float8_min_dim: e.g. not wk / wv of 1024 features in
         Llama-3 8B's shape, which stay bf16 linears with their copy; counted from block_linears,
         the Transformer's): torchao's Float8Linear saves the fp32 weight and casts it to float8
         per matmul; its casts are transient, and its step adds nothing else measured on the CPU:
         docs/memory_model.md).
K        bytes one micro-batch keeps for backward: sum over the stage's blocks of their saved
         activations (cost/block.py: per token x tokens per micro-batch, plus any kept once
         per micro-batch), or of their input [b, S, d] alone for the blocks that recompute
         (train.activation_checkpointing: full = all, selective = global index a multiple of
         train.ac_every), plus the head's; op: every block's input and the outputs of its
         matmuls and attention kernels (cost/block.py `op_act`; a family that does not count
         them is booked as keeping everything). Under pipelining the last stage also keeps its
         output, the logits [b, S, V / tp] in the compute dtype, per micro-batch in flight
         (torch.distributed.pipelining's fwd_cache, to the end of the micro-batch's backward;
         with the chunked loss they are the loss's own saved logits, counted once).
top      the largest moment of the backward of the micro-batch being processed: at the head,
         K + its loss buffers (train.loss_chunk: the logits' gradient in the compute dtype and
         one chunk's fp32 softmax, two under bf16, instead of [tokens, V] fp32 buffers; fsdp2
         without pipelining: + the last FSDP unit's gathered weights, which stay gathered from its
         forward to its backward, parallel/dp/fsdp2.py); where gradients accumulate (pipelining,
         gradient accumulation) at least K + the logits' gradient + the head's new fp32 weight
         gradient [V / tp, d] before it is added to the accumulated one (the larger moment with
         the chunked loss unless loss_chunk is large against d_model); at
         block l, the kept bytes of the stage's blocks before l plus
         all of l's activations (recomputed or kept) and its largest backward moment (gradient
         buffers); fsdp2 without pipelining adds the gathered parameters and unsharded gradients
         of the block's FSDP unit (`fsdp_units`: consecutive blocks grouped) and of the unit
         before it (prefetched).
first backward: the gradients a step makes (made_grad_bytes_per_param: set to None between
         steps except behind DDP; FSDP2 frees its unsharded ones at the reduce-scatter) are not
         there in its first backward, beside the warm-up's n micro-batches: the activations term
         is max((n - 1) K + top - those gradients, the next backward's: (n - 1) K + top if a
         forward comes between (m > n), (n - 2) K + top if not; none if m = 1; at least 0), under fsdp2
         with pipelining and one chunk per rank at least those gradients once more: FSDP's
         reduce-scatter after the last backward copies them while they are held (measured).
retained (the split backward of ZB-V, cost/partition.py split_backward_activations) what
         stage_backward_input leaves until the weight pass: the gradients of the weight ops'
         outputs (`op_act` elements, all of `act` where unknown); the head's logits' gradient
         less the unchunked loss's saved tensor (freed with the detached loss's graph).
buffers  torch.distributed.pipelining's p2p buffers, [b, S, d] each: a non-first stage keeps
         a receive buffer per micro-batch of the step (those of the n in flight are the inputs
         counted in K), a non-last stage a gradient receive buffer per micro-batch and the
         outputs of the n in flight; deepspeed: its fp32 gradient reduce bucket
         (parallel.deepspeed.reduce_bucket_size elements) and the fp32 parameters it holds
         gathered (the piece running + prefetch_bucket_size elements, at most the model).

Layouts: an activation element (cost/block.py `Split`) counts on a rank as its largest tp
share (shards are uneven in whole units: heads, MLP width units, vocabulary rows); `seq`
elements (residual stream, norms) are whole on every tp rank, split by tp under sequence
parallelism. Bytes: `seq` and `vocab` (the unchunked loss) in fp32, the rest (the chunked loss's
`logits` too) in the compute dtype (bf16 under autocast, else fp32); a recomputed block's input
in fp32.

Context parallelism (parallel.cp, parallel/cp/split.py): a rank holds micro_batch x
seq_len / cp tokens, so every per-token activation divides by cp; but each attention layer keeps
the K and V of the whole sequence it all-gathered ([b, K, S, E] each, in the compute dtype) instead
of its own slice, and its backward holds their gradients at that size before the reduce-scatter:
the elements split with the kv heads (`kv`) of a block count cp times per local token (for the
families whose attention spans the sequence, `kv` is exactly K and V). Each family says what a
block exchanges (cost/cp.py cp_messages, from the family's own byte counts): blocks without an
all-gathered K and V (Titans' windows, the memories, the tree) keep their own tokens' kv; what a
block is handed instead (a chain's state, a halo's rows, a prefix's or the tree's gathered
summaries: the largest rank's) is kept per micro-batch, also by a block that recomputes, and its
backward holds the gradient of it besides (`received`; at tp = 1 sizes). The causal mask of the gathered keys ([S / cp,
S], which SDPA saves in the compute dtype; ALiBi: [H, S / cp, S]) is not modelled without documents
(with them: Documents below), nor what SDPA keeps under an explicit mask where it has no fused
kernel for one (docs/architectures.md). parallel.cp_attention=ring keeps only the rank's
own K and V; its backward's largest moment adds, per attention layer, the fp32 tensors of one
piece ([b, H, t, S / (2 cp)] x 4 with t = min(CP_RING_TILE, S / (2 cp)): scores, probabilities,
their gradient and a temporary) and the block's K, V repeated to the query heads with their
gradients ([b, H, S / cp, E] x 4), counted in the compute dtype like the other activations.
parallel.cp_attention=ulysses (parallel/cp/ulysses.py) keeps the head-sharded q, k, v and output of
the whole sequence, [b, S, H / cp, E], as many elements as the rank's own: the block's cost per
local token is the one-process one (its all-to-alls are not `received` bytes either), except that
k and v count K' / K times where the kv heads are repeated to K' = lcm(K, cp).

Mixture of experts (model.moe, cost/block.py moe_cost) and expert parallelism (parallel.ep,
parallel/ep.py): a rank holds N / ep of each MoE layer's routed experts (their parameters, gradients
and AdamW state; under fsdp2 sharded further over the dp_shard / ep ranks holding the same experts,
MemorySetup.expert_state_bytes_per_param), the router, routing bias and shared expert whole. The
rows its experts compute (cost/block.py's `experts` elements: per assignment the gathered input and
the SwiGLU's 4 W, and their gradients in backward) are, at ep > 1, the rows all ranks send it:
the busiest rank's are ep_imbalance (parallel.ep_imbalance) x its own tokens' assignments, which
the activation terms book; at ep = 1 exactly its own. At ep > 1 with DDP the experts' gradients are
outside DDP's buckets, so the step's first backward makes them (`grads`).

Documents (data.document_mask, `documents`; `document_mask_bytes`): a block that attends over the
whole sequence keeps, per micro-batch, the mask its attention saves for backward: SDPA converts the
boolean document mask to an additive one in the query's dtype and saves it, [b, 1, S, S] in one
process and under Ulysses (a rank's heads see the whole sequence), [b, 1, S / cp, S] under the
all-gather (measured, torch 2.13 CPU: the fused kernel takes the mask; ALiBi: per head); with
FlexAttention (`flex`: CUDA, RoPE, one process or Ulysses) the block mask instead, 8 int32 tensors
of [b, n] and [b, n, n] blocks (n = S / FLEX_BLOCK) and the document ids [b, S] int32; the ring
builds its pieces' masks again in backward (it keeps the ids [b, S], uncounted like other [b, S]
tensors). A recomputed block keeps none of it.

Not modelled: the optimizer step's temporaries (after the activations are freed), collective
buffers besides DeepSpeed's (DDP buckets are the gradients themselves), allocator caching and fragmentation, the
CUDA context and kernels' workspaces, token ids and other [b, S] tensors, the embedding's dense
gradient while it is accumulated. docs/memory_model.md compares the model with measured peaks.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from megatron_taper.cost.attention_memory import context_parallel_cost, document_mask_bytes
from megatron_taper.cost.block import Cost, Split, prefix_sums
from megatron_taper.cost.cp import block_messages, received_bytes
from megatron_taper.cost.float8 import converted_params
from megatron_taper.cost.flops import ModelCosts, head_cost, model_costs
from megatron_taper.cost.stage_memory import to_memory_model

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig, ParallelConfig, TrainConfig

ADAMW_BYTES = 8.0  # exp_avg + exp_avg_sq in fp32, per parameter
GIB = 2**30


@dataclass(frozen=True)
class MemorySetup:
    """Everything besides the model's shapes that one rank's memory depends on."""

    tp: int = 1
    sequence_parallel: bool = False
    dp: int = 1
    cp: int = 1  # context parallelism: each sequence split over cp ranks (module doc)
    # parallel.cp_attention: allgather (K/V of the whole sequence kept) | ring | ulysses (neither)
    cp_attention: str = "allgather"
    zero: str = "none"  # none | fsdp2 | deepspeed (parallel.zero)
    dp_shard: int = 0  # fsdp2: ranks the state is sharded over (dp x cp; HSDP: parallel.dp_shard); 0 = dp
    pipelined: bool = False  # pp > 1
    bf16: bool = False  # autocast to bf16 (train.precision on the device)
    float8: bool = False  # train.float8: the rule's block linears are torchao Float8Linear (parallel/float8.py)
    float8_min_dim: int = 4096  # train.float8_min_dim and train.float8_recipe: which linears the rule converts
    float8_recipe: str = "tensorwise"
    activation_checkpointing: str = "none"  # none | full | selective | op
    ac_every: int = 2
    loss_chunk: int = 0  # tokens per chunk of the cross entropy (train.loss_chunk); 0 = unchunked
    micro_batch: int = 1  # sequences per forward (per pipeline micro-batch when pipelined)
    microbatches: int = 1  # pipeline micro-batches per step on one rank
    bytes_per_param: float | None = None  # replaces the engine's params + grads + optimizer bytes
    optimizer: bool = True  # AdamW state allocated (False: forward+backward alone, as benchmarks measure)
    offload_optimizer: bool = False  # deepspeed: masters and AdamW state off the device
    offload_param: bool = False  # deepspeed: parameter partitions off the device
    reduce_bucket: float = 0.0  # deepspeed: elements of its fp32 gradient reduce bucket
    prefetch_bucket: float = 0.0  # deepspeed: elements of parameters it gathers ahead
    ep: int = 1  # expert parallelism: each MoE layer's routed experts spread over ep ranks of dp (module doc)
    # at ep > 1: the rows the busiest ep rank's experts compute over the mean (parallel.ep_imbalance)
    ep_imbalance: float = 1.0
    documents: bool = False  # data.document_mask: attention keeps a document mask (module doc)
    flex: bool = False  # attention under documents runs FlexAttention (CUDA, RoPE) rather than SDPA

    @classmethod
    def from_config(cls, parallel: ParallelConfig, train: TrainConfig, dp: int, bf16: bool,
                    micro_batch: int | None = None, microbatches: int = 1,
                    bytes_per_param: float | None = None, documents: bool = False,
                    flex: bool = False) -> "MemorySetup":
        """The setup of a run from its config sections, its dp size and precision; `micro_batch`
        (default train.micro_batch) is the pipeline micro-batch when pipelined; `documents`:
        data.document_mask, `flex`: FlexAttention available (CUDA)."""
        ds = parallel.deepspeed
        return cls(tp=parallel.tp, sequence_parallel=parallel.sequence_parallel and parallel.tp > 1, dp=dp,
                   cp=parallel.cp, cp_attention=parallel.cp_attention,
                   zero=parallel.zero,
                   dp_shard=parallel.dp_split(dp)[1] * parallel.cp if parallel.zero == "fsdp2" else 0,
                   pipelined=parallel.pp > 1, bf16=bf16, float8=train.float8,
                   float8_min_dim=train.float8_min_dim, float8_recipe=train.float8_recipe,
                   activation_checkpointing=train.activation_checkpointing, ac_every=train.ac_every,
                   loss_chunk=train.loss_chunk,
                   micro_batch=micro_batch or train.micro_batch, microbatches=microbatches,
                   bytes_per_param=bytes_per_param, offload_optimizer=ds.offload_optimizer != "none",
                   offload_param=ds.offload_param != "none",
                   reduce_bucket=ds.reduce_bucket_size if parallel.zero == "deepspeed" else 0.0,
                   prefetch_bucket=ds.prefetch_bucket_size if parallel.zero == "deepspeed" else 0.0,
                   ep=parallel.ep, ep_imbalance=parallel.ep_imbalance, documents=documents, flex=flex)

    @property
    def compute_bytes(self) -> int:
        return 2 if self.bf16 else 4

    @property
    def fsdp(self) -> bool:
        """fsdp2 shards (over dp x cp; with dp x cp = 1 the model is left as is)."""
        return self.zero == "fsdp2" and self.dp * self.cp > 1

    def state_bytes_per_param(self) -> float:
        """Parameters + gradients + optimizer state per tp-local parameter on one rank (fp32 at
        every layout and precision: docs/precision.md)."""
        if self.bytes_per_param is not None:
            return self.bytes_per_param
        adamw = ADAMW_BYTES if self.optimizer else 0.0
        if self.zero == "deepspeed":  # fp32 partitions, fp32 gradients, DeepSpeed's fp32 master copy
            on_device = (0 if self.offload_param else 4.0) + 4.0
            on_device += 0 if self.offload_optimizer else 4.0 + adamw
            return on_device / self.dp
        shards = (self.dp_shard or self.dp) if self.fsdp else 1
        if self.fsdp and self.pipelined:  # the sharded gradient appears only as the unsharded one is freed
            return (4.0 + adamw) / shards
        return (8.0 + adamw) / shards

    def unsharded_bytes_per_param(self, matmul: bool = True) -> float:
        """fsdp2: a gathered parameter and its unsharded gradient. Matmul-only layers (`matmul`)
        are gathered in the compute dtype, the rest (embedding, norms) in fp32; under pipelining
        the unsharded gradient accumulates over the micro-batches in fp32 (reduce_dtype)."""
        if not self.fsdp:
            return 0.0
        param = self.compute_bytes if matmul else 4.0
        return param + (4.0 if self.pipelined else param)

    def made_grad_bytes_per_param(self) -> float:
        """The gradients (of the bytes above) a step's first backward makes (module doc): fsdp2
        pipelined the unsharded fp32 one, else the sharded 4 / s; zero=none without DDP 4; DDP
        (bucket views), DeepSpeed (not measured), bytes_per_param, no optimizer step: 0."""
        if self.bytes_per_param is not None or not self.optimizer or self.zero == "deepspeed":
            return 0.0
        if self.fsdp:
            return 4.0 if self.pipelined else 4.0 / (self.dp_shard or self.dp)
        return 4.0 if self.dp * self.cp == 1 else 0.0

    @property
    def expert_rows(self) -> float:
        """Rows the busiest rank's experts compute per assignment of its own tokens: the imbalance
        at ep > 1; at ep = 1 a rank computes exactly its own tokens' assignments."""
        return self.ep_imbalance if self.ep > 1 else 1.0

    def expert_state_bytes_per_param(self) -> float:
        """state_bytes_per_param of a routed expert's parameter (one of the rank's N / ep experts):
        the same at zero=none (each rank holds its experts' whole state); under fsdp2 the experts
        shard over the dp_shard / ep ranks that hold the same experts (torchtitan's layout, as
        parallel/dp/fsdp2.py builds it; whole at ep = dp)."""
        state = self.state_bytes_per_param()
        return state * self.ep if self.fsdp and self.ep > 1 else state

    def cast_bytes_per_param(self) -> float:
        """bf16 autocast's copies of fp32 weights, kept for backward (fsdp2 at dp > 1 gathers the
        matmul weights in bf16 instead: nothing to cast)."""
        return 2.0 if self.bf16 and not self.fsdp else 0.0


@dataclass(frozen=True)
class PieceMemory:
    """One block, the embedding or the head, on one rank: bytes for the whole stage's step
    (`static`), kept by one micro-batch for backward (`kept`), and the largest moment of its
    backward (`peak`: its own activations, recomputed or kept, plus gradient buffers), and what
    a split backward's input pass leaves besides `kept` until its weight pass (`retained`, module
    doc)."""

    params: float  # tp-local parameters
    static: float
    kept: float
    peak: float
    retained: float = 0.0
    grads: float = 0.0  # of `static`: gradients made by the step's first backward (made_grad_bytes_per_param)


@dataclass(frozen=True)
class ModelMemory:
    """Every piece of a model under one setup; `io` = bytes of one [b, S, d] stage boundary."""

    layers: list[PieceMemory]
    embedding: PieceMemory
    head: PieceMemory
    io: float
    setup: MemorySetup

    def stage(self, layers: Sequence[int], index: int = 0, n_stages: int = 1, in_flight: int = 1) -> "StageMemory":
        """The predicted peak of pipeline stage `index` of `n_stages` holding the consecutive
        `layers` with `in_flight` micro-batches (the whole model: the defaults)."""
        lo, hi = layers[0], layers[-1] + 1
        assert list(layers) == list(range(lo, hi)) and 0 <= index < n_stages, (layers, index, n_stages)
        model = to_memory_model(self, [in_flight] * n_stages, [math.inf] * n_stages)
        static_pre, kept_pre = prefix_sums(model.static), prefix_sums(model.act)
        static, act, fixed = model.stage_parts(index, n_stages, lo, hi, static_pre, kept_pre)
        kept = kept_pre[hi] - kept_pre[lo] + (self.head.kept if index == n_stages - 1 else 0.0)
        return StageMemory(static=static, activations=act, buffers=fixed, kept=kept, in_flight=in_flight,
                           retained=self.retained(lo, hi, index == n_stages - 1))

    def retained(self, lo: int, hi: int, last: bool) -> float:
        """PieceMemory.retained of a stage holding layers lo..hi-1 (and the head if `last`)."""
        return sum(p.retained for p in self.layers[lo:hi]) + (self.head.retained if last else 0.0)


@dataclass(frozen=True)
class StageMemory:
    static: float  # parameters, gradients, optimizer state, unsharded / cast weights
    activations: float  # (n - 1) * K + top
    buffers: float  # pipeline p2p buffers
    kept: float  # K: one micro-batch's
    in_flight: int
    retained: float = 0.0  # after a split backward's input pass, besides K (PieceMemory.retained)

    @property
    def total(self) -> float:
        return self.static + self.activations + self.buffers


FSDP_UNIT_PER_RANK = 1_000_000  # elements of a unit's all-gather per dp_shard rank (Megatron's 1M x dp)
FSDP_UNIT_CAP = 40_000_000  # elements: the gathered unit's memory bound (Megatron's 40M bucket)


def fsdp_units(block_params: Sequence[float], dp_shard: int) -> list[list[int]]:
    """fsdp2's FSDP units over a stage's blocks (indices into `block_params`, the tp-local
    parameters of each block, in forward order): consecutive blocks grouped until a unit holds
    min(FSDP_UNIT_PER_RANK x dp_shard, FSDP_UNIT_CAP) elements (each rank's share of the unit's
    all-gather and reduce-scatter at least 1M elements, so they run at bandwidth rather than
    latency, while what is gathered at once stays bounded); a block at least that large is a unit
    alone; the last unit takes the blocks left over. parallel/dp/fsdp2.py applies it."""
    target = min(FSDP_UNIT_PER_RANK * dp_shard, FSDP_UNIT_CAP)
    units: list[list[int]] = [[]]
    size = 0.0
    for i, params in enumerate(block_params):
        if size >= target:
            units.append([])
            size = 0.0
        units[-1].append(i)
        size += params
    return units if block_params else []


def checkpointed_blocks(names: list[str], mode: str, every: int) -> list[str]:
    """The rule of train.activation_checkpointing (applied by parallel/block_options.py): those of the
    block `names` (global indices) whose activations are recomputed under `mode`."""
    if mode in ("full", "op"):
        return list(names)
    if mode == "selective":
        return [name for name in names if int(name) % every == 0]
    return []


def largest_share(units: int, tp: int) -> float:
    """The largest tp shard of a dimension of `units` whole units, as a fraction of it."""
    return math.ceil(units / tp) / units if units else 0.0


def _shares(cfg: ModelConfig, tp: int, width: int, ep: int = 1) -> Split:
    """Per layout class, the largest rank's fraction of its parameters (rank 0 holds the most of
    every class; each ep rank N / ep experts)."""
    return Split(whole=1.0, seq=1.0, heads=largest_share(cfg.n_heads, tp), kv=largest_share(cfg.kv_heads, tp),
                 width=largest_share(width // cfg.taper.multiple, tp), vocab=largest_share(cfg.vocab_size, tp),
                 experts=1.0 / ep)


def local_params(cost: Cost, shares: Split) -> float:
    """Parameters of `cost` on the largest tp rank (and its ep share of the routed experts)."""
    p = cost.params_split
    return (p.whole + p.heads * shares.heads + p.kv * shares.kv + p.width * shares.width
            + p.vocab * shares.vocab + p.experts * shares.experts)


def act_bytes_per_token(act: Split, shares: Split, setup: MemorySetup) -> float:
    """Bytes per token of activation elements on the largest tp rank (layouts and dtypes above)."""
    seq = act.seq / (setup.tp if setup.sequence_parallel else 1)
    compute = act.whole + act.heads * shares.heads + act.kv * shares.kv + act.width * shares.width
    compute += act.experts * setup.expert_rows
    if setup.bf16 and setup.tp == 1:
        compute += act.input_copies
    return (4.0 * seq + setup.compute_bytes * compute + 4.0 * act.vocab * shares.vocab
            + setup.compute_bytes * act.logits * shares.vocab)


def _activations(cost: Cost) -> Split:
    """A piece's saved elements; the earlier `act_bytes` form counts as whole, 2 bytes each."""
    return cost.act + Split(whole=cost.act_bytes / 2.0)


# the MemorySetup fields that piece_activations reads (with the model): model_memory's `cache` key
ACTIVATION_FIELDS = ("tp", "sequence_parallel", "cp", "cp_attention", "bf16", "activation_checkpointing", "ac_every",
                     "micro_batch", "ep", "ep_imbalance", "documents", "flex")


def piece_memory(cost: Cost, shares: Split, setup: MemorySetup, tokens: int, recompute: bool, d_model: int,
                 block: bool, matmul: bool = True, received: float = 0.0, mask: float = 0.0,
                 float8_params: float = 0.0) -> PieceMemory:
    """Bytes of one piece (see PieceMemory); `tokens` per micro-batch on this rank; `matmul`: its
    parameters are matmul weights (not an embedding); `float8_params`: its parameters in linears
    train.float8 converts, whose fp32 weights torchao's matmul saves uncast (no bf16 copy; measured).
    Its activations: piece_activations."""
    return _piece(local_params(cost, shares), cost.params_split.experts * shares.experts, float8_params, setup,
                  block, matmul, piece_activations(cost, shares, setup, tokens, recompute, d_model, received, mask))


def _piece(params: float, experts: float, float8_params: float, setup: MemorySetup, block: bool, matmul: bool,
           activations: tuple[float, float, float]) -> PieceMemory:
    """The PieceMemory of `params` tp-local parameters, `experts` of them routed experts (N / ep of
    each MoE layer's), `float8_params` of them in converted linears, and (kept, peak, retained)
    `activations` (piece_activations)."""
    cast = setup.cast_bytes_per_param()
    static = params * (setup.state_bytes_per_param() + cast) - float8_params * cast
    static += experts * (setup.expert_state_bytes_per_param() - setup.state_bytes_per_param())
    if setup.pipelined:
        static += params * setup.unsharded_bytes_per_param(matmul)
    elif not block and setup.fsdp:  # the root's weights stay gathered; its gradient: _root_gradient
        static += params * (setup.compute_bytes if matmul else 4.0)
    made = params * setup.made_grad_bytes_per_param()
    if setup.ep > 1 and setup.zero == "none" and setup.dp > 1:  # outside DDP's buckets: made by the backward
        made += 4.0 * experts
    return PieceMemory(params, static, *activations, made)


def piece_activations(cost: Cost, shares: Split, setup: MemorySetup, tokens: int, recompute: bool, d_model: int,
                      received: float = 0.0, mask: float = 0.0) -> tuple[float, float, float]:
    """(kept, peak, retained) of a piece (PieceMemory), from the setup's ACTIVATION_FIELDS alone.
    A recomputed piece keeps its input, and under activation_checkpointing=op also its `op_act`
    (all of `act` where that is unknown). `received`: bytes per micro-batch the block was handed
    under context parallelism besides K and V (cost/cp.py received_bytes), kept also when it
    recomputes (parallel/cp/state.py keeps what a forward received for the recompute), and their
    gradient in its backward. `mask`: bytes per micro-batch of the document mask attention keeps
    (document_mask_bytes; not kept when recomputed)."""
    act = _activations(cost)
    full = act_bytes_per_token(act, shares, setup) * tokens
    full += act_bytes_per_token(cost.per_batch, shares, setup)
    full += received + mask
    moments = [act_bytes_per_token(m, shares, setup) * tokens for m in cost.backward]
    peak = full + max(moments, default=0.0) + received
    if not recompute:
        kept = full
    elif setup.activation_checkpointing != "op":
        kept = boundary_bytes(d_model, tokens, setup) + received
    elif cost.op_kept is None:
        kept = full
    else:
        kept = (boundary_bytes(d_model, tokens, setup) + act_bytes_per_token(cost.op_kept, shares, setup) * tokens
                + received)
    op = cost.op_kept
    retained = act_bytes_per_token(act if op is None else op, shares, setup) * tokens
    return kept, peak, retained


def boundary_bytes(d_model: int, tokens: int, setup: MemorySetup) -> float:
    """A block's input / a stage's output [b, S, d] (fp32 residual stream) on one rank."""
    return 4.0 * d_model * tokens / (setup.tp if setup.sequence_parallel else 1)


def model_memory(cfg: ModelConfig, setup: MemorySetup, costs: ModelCosts | None = None,
                 cache: dict | None = None) -> ModelMemory:
    """Bytes of every piece of the model `cfg` under `setup` (module doc); `costs`: its
    model_costs, when the caller has them already; `cache`: a dict kept across calls for this
    model, in which the blocks' piece_activations are kept by the setup's ACTIVATION_FIELDS, their
    parameters by tp and ep and those in float8-converted linears by the float8 rule (a layout
    search meets each many times under other engines and dp sizes)."""
    costs = costs or model_costs(cfg)
    tokens = setup.micro_batch * cfg.seq_len // setup.cp
    key = tuple(getattr(setup, name) for name in ACTIVATION_FIELDS)
    cache = {} if cache is None else cache
    if key not in cache:
        recomputed = set(checkpointed_blocks([str(i) for i in range(cfg.n_layers)], setup.activation_checkpointing,
                                             setup.ac_every))
        messages = block_messages(cfg, costs.widths, setup.micro_batch, setup.cp, setup.compute_bytes,
                                  setup.cp_attention, setup.documents)
        masks = document_mask_bytes(cfg, costs.widths, setup)
        cache[key] = [piece_activations(context_parallel_cost(cost, cfg, setup, sent),
                                        _shares(cfg, setup.tp, width, setup.ep), setup, tokens, str(i) in recomputed,
                                        cfg.d_model, received_bytes(sent), mask)
                      for i, (cost, width, sent, mask) in enumerate(zip(costs.layers, costs.widths, messages, masks))]
    if ("params", setup.tp, setup.ep) not in cache:  # context_parallel_cost changes activations only
        shares = [_shares(cfg, setup.tp, width, setup.ep) for width in costs.widths]
        cache["params", setup.tp, setup.ep] = [(local_params(cost, share), cost.params_split.experts * share.experts)
                                               for cost, share in zip(costs.layers, shares)]
    rule = ("float8", setup.float8_min_dim, setup.float8_recipe) if setup.float8 else ("float8",)
    if rule not in cache:  # per block: its parameters in the linears the float8 rule converts (none without)
        cache[rule] = [converted_params(cfg, width, *rule[1:]) if setup.float8 else 0.0 for width in costs.widths]
    layers = [_piece(params, experts, f8, setup, True, True, act)
              for (params, experts), f8, act in zip(cache["params", setup.tp, setup.ep], cache[rule], cache[key])]
    if setup.fsdp and not setup.pipelined:
        layers = _gathered_units(layers, setup)
    shares = _shares(cfg, setup.tp, cfg.taper.multiple)
    head = head_cost(cfg, vocab_parallel=setup.tp > 1, chunked=setup.loss_chunk > 0, bf16=setup.bf16)
    head_piece = piece_memory(head, shares, setup, tokens, False, cfg.d_model, block=False,
                              matmul=not cfg.tie_embeddings)
    last = fsdp_units([p.params for p in layers], setup.dp_shard or setup.dp)[-1] if layers else []
    gathered = sum(layers[i].params for i in last) * setup.compute_bytes if setup.fsdp and not setup.pipelined else 0.0
    head_peak = max(head_piece.peak + loss_chunk_bytes(cfg, setup, tokens), head_weight_grad_moment(cfg, shares, setup,
                                                                                                  head_piece, tokens))
    # the split backward's input pass keeps the logits' gradient and frees the loss's graph
    # (torch detaches the loss), with it the unchunked loss's saved tensor
    retained = (act_bytes_per_token(Split(logits=cfg.vocab_size), shares, setup) * tokens
                - loss_saved_bytes(cfg, shares, setup, tokens))
    head_piece = dataclasses.replace(head_piece, peak=head_peak + gathered, retained=retained)
    head_piece = _with_stage_output(head_piece, cfg, shares, setup, tokens)
    layers = _root_gradient(layers, head_piece, setup, matmul=not cfg.tie_embeddings)
    embedding = piece_memory(costs.embedding, shares, setup, tokens, False, cfg.d_model, block=False, matmul=False)
    return ModelMemory(layers, embedding, head_piece, boundary_bytes(cfg.d_model, tokens, setup), setup)



def _root_gradient(layers: list[PieceMemory], head: PieceMemory, setup: MemorySetup, matmul: bool
                   ) -> list[PieceMemory]:
    """fsdp2 without pipelining: the root's unsharded gradients are reduce-scattered only at the
    end of the backward, so the head's, made in its backward, is there through every block's
    backward (the embedding's is made last, when the activations are gone: not counted)."""
    if not setup.fsdp or setup.pipelined:
        return layers
    grad = head.params * (setup.unsharded_bytes_per_param(matmul) - (setup.compute_bytes if matmul else 4.0))
    return [dataclasses.replace(p, peak=p.peak + grad) for p in layers]


def _gathered_units(layers: list[PieceMemory], setup: MemorySetup) -> list[PieceMemory]:
    """fsdp2 without pipelining: while block l runs backward its whole FSDP unit (fsdp_units) and
    the unit before it (prefetched) are gathered, parameters and unsharded gradients."""
    per_param = setup.unsharded_bytes_per_param()
    units = fsdp_units([p.params for p in layers], setup.dp_shard or setup.dp)
    out = list(layers)
    for k, unit in enumerate(units):
        gathered = sum(layers[i].params for i in unit) + sum(layers[i].params for i in units[k - 1] if k)
        for i in unit:
            out[i] = dataclasses.replace(layers[i], peak=layers[i].peak + gathered * per_param)
    return out



def head_weight_grad_moment(cfg: ModelConfig, shares: Split, setup: MemorySetup, head: PieceMemory, tokens: int
                            ) -> float:
    """The head's backward at its output projection, where gradients accumulate over micro-batches
    (pipelining or gradient accumulation; else 0): what the head keeps less the unchunked loss's
    saved fp32 [V] per token (freed once the loss's backward has run), the logits' gradient
    [b, S, V / tp] (compute dtype) and the new fp32 weight gradient [V / tp, d] before it is added
    to the existing one (docs/memory_model.md). It outgrows the loss's own moment where d_model is
    large against loss_chunk (chunked) or against the micro-batch's tokens (unchunked)."""
    if not setup.pipelined and setup.microbatches <= 1:
        return 0.0
    weight = 4.0 * cfg.vocab_size * largest_share(cfg.vocab_size, setup.tp) * cfg.d_model
    logits_grad = act_bytes_per_token(Split(logits=cfg.vocab_size), shares, setup) * tokens
    return head.kept - loss_saved_bytes(cfg, shares, setup, tokens) + logits_grad + weight


def loss_saved_bytes(cfg: ModelConfig, shares: Split, setup: MemorySetup, tokens: int) -> float:
    """The unchunked loss's saved fp32 [b, S, V / tp] (F.cross_entropy's log-softmax, the
    vocab-parallel loss's softmax of the rank's slice); 0 under train.loss_chunk (its saved
    tensors are the logits, which the pipeline keeps too)."""
    return 0.0 if setup.loss_chunk > 0 else act_bytes_per_token(Split(vocab=cfg.vocab_size), shares, setup) * tokens


def _with_stage_output(head: PieceMemory, cfg: ModelConfig, shares: Split, setup: MemorySetup, tokens: int
                       ) -> PieceMemory:
    """The head under pipelining: torch.distributed.pipelining keeps the last stage's output, the
    logits [b, S, V / tp] in the compute dtype, from its forward to the end of its backward (the
    stage's fwd_cache), once per micro-batch in flight. The unchunked loss does not keep them
    itself (F.cross_entropy saves the log-softmax), so they are one more [V] per token; the
    chunked one saves those very logits, already counted."""
    if not setup.pipelined or setup.loss_chunk > 0:
        return head
    logits = act_bytes_per_token(Split(logits=cfg.vocab_size), shares, setup) * tokens
    return dataclasses.replace(head, kept=head.kept + logits, peak=head.peak + logits)


def loss_chunk_bytes(cfg: ModelConfig, setup: MemorySetup, tokens: int) -> float:
    """The chunked loss's fp32 temporaries in its backward (parallel/loss.py): the softmax of one
    chunk [c, V_r], and under bf16 the chunk's fp32 copy it is computed from; 0 unchunked."""
    if setup.loss_chunk <= 0:
        return 0.0
    rows = min(setup.loss_chunk, tokens) * cfg.vocab_size * largest_share(cfg.vocab_size, setup.tp)
    return 4.0 * rows * (2 if setup.bf16 else 1)
