"""Cost of the pieces blocks are made of: parameters, forward FLOPs and activation memory.

FLOPs are forward FLOPs per token (one multiply-add = 2 FLOPs); a training step costs about 3x
(backward = 2x forward). Attention scores and values cost 2 * 2 * H * E * C per token, where the
context C is (S + 1) / 2 on average under a causal mask (S when `causal=False`, which is what
`torch.utils.flop_counter` counts for SDPA). With data.document_mask each token attends only within
its document, so a window of documents of L_1..L_n tokens has sum L_i (L_i + 1) / 2 useful pairs,
not S (S + 1) / 2; that depends on the data, which the cost model does not read, so it counts the
causal upper bound (MFU and the planner's step times then overstate masked attention's work; the
CPU's SDPA path computes every S x S score anyway, FlexAttention on CUDA skips the blocks outside
the documents). Elementwise work (norms, RoPE, activations, softmax)
is not counted, as in the usual 6N accounting. Each family's `layer_cost` (its FamilySpec) is
built from these; flops.py adds embedding and head and sums over the model.

Memory (read by megatron_taper/cost/memory.py) is counted per piece and by how tensor parallelism lays
it out (`Split`): parameters in `tp_params`; activations in elements per token of one
micro-batch: `act` is what the piece's forward leaves for its backward (what autograd saves,
counted op by op from the code; tests/cost/test_memory_model.py compares it with torch's saved
tensors), `per_batch` what it saves once per micro-batch whatever its tokens, and `backward` the
moments of its backward, each the elements alive besides `act` then (gradient buffers), of which
memory.py takes the largest. Elements carry no dtype: `seq` (residual stream, norm internals) and
`vocab` (the loss) elements are fp32, the others (`logits` too) are in the compute dtype (bf16
under autocast), applied once in memory.py.

Saved tensors of the shared pieces, per token (the norm is torch 2.13's composite rms_norm, as
on the CPU: it keeps its input, the normalised input and 1 / rms; a fused kernel that keeps less
makes the count conservative):
    norm       input d, normalised d, rstd 1                 (seq)
    attention  normalised input d (one storage for wq/wk/wv)  (whole; one copy each: see input_copies)
               q after RoPE H*E, SDPA output H*E, logsumexp H  (heads; wo reads the output as is)
               k after RoPE, v: 2*K*E                         (kv)
    SwiGLU     normalised input d (whole); w1 out, silu(w1 out), w3 out, product: 4*W (width)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from megatron_taper.config import ModelConfig


@dataclass(frozen=True)
class Split:
    """A count (parameters, or activation elements per token) by its tensor-parallel layout."""

    whole: float = 0.0  # the same on every tp rank
    seq: float = 0.0  # activations: whole on every tp rank, split along the sequence under SP
    heads: float = 0.0  # split with the query heads
    kv: float = 0.0  # split with the key/value heads
    width: float = 0.0  # split with the MLP width, in units of model.taper.multiple
    vocab: float = 0.0  # split with the vocabulary
    # split over the ep ranks (model.moe's routed experts, parallel/ep.py): parameters 1 / ep on each
    # rank; activations (the rows an expert computes) the busiest rank's rows per token of its own
    experts: float = 0.0
    # activations: copies of a projection input shared by several projections, beyond the one
    # storage counted in `whole`: each projection keeps its own copy under bf16 autocast at
    # tp = 1 (each casts the fp32 norm output itself); at tp > 1 the input enters the tp region
    # cast once (parallel/tp/layers.py enter_tp_region), so the projections share it
    input_copies: float = 0.0
    # activations: split with the vocabulary like `vocab`, but in the compute dtype (the logits
    # a chunked loss keeps, and their gradient)
    logits: float = 0.0

    def __add__(self, other: "Split") -> "Split":
        return Split(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: float) -> "Split":
        return Split(*(getattr(self, f.name) * k for f in fields(self)))

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class Cost:
    params: int
    flops: float  # forward FLOPs per token
    # the earlier form, still accepted from families that give nothing else: activations kept for
    # backward per token at 2 bytes per element, layout unknown (memory.py: whole, compute dtype)
    act_bytes: float = 0.0
    tp_params: Split | None = None  # the parameters by layout; None = all whole on every tp rank
    act: Split = Split()  # elements per token kept for backward
    backward: tuple[Split, ...] = ()  # moments of the backward: elements per token besides `act`
    per_batch: Split = Split()  # elements kept for backward once per micro-batch, whatever its tokens
    # elements per token kept under train.activation_checkpointing=op besides the block's input:
    # the outputs of its matmuls and attention kernels; None = not counted (memory.py keeps `act`)
    op_act: Split | None = None

    def __add__(self, other: "Cost") -> "Cost":
        mine, theirs = self.op_kept, other.op_kept
        return Cost(self.params + other.params, self.flops + other.flops, self.act_bytes + other.act_bytes,
                    self.params_split + other.params_split, self.act + other.act, self.backward + other.backward,
                    self.per_batch + other.per_batch, None if mine is None or theirs is None else mine + theirs)

    @property
    def op_kept(self) -> Split | None:
        """`op_act`, or nothing for a piece that keeps no activations at all."""
        if self.op_act is not None or self.act.total or self.act_bytes or self.per_batch.total:
            return self.op_act
        return Split()

    @property
    def params_split(self) -> Split:
        return self.tp_params if self.tp_params is not None else Split(whole=self.params)

    def repeated(self, n: int) -> "Cost":
        """`n` copies of this piece one after another (their moments of backward stay one each)."""
        op = self.op_kept
        return Cost(self.params * n, self.flops * n, self.act_bytes * n, self.params_split.scaled(n),
                    self.act.scaled(n), self.backward, self.per_batch.scaled(n), None if op is None else op.scaled(n))


def norm_act(d: int) -> Split:
    """RMSNorm over d features: its input, the normalised input and 1 / rms."""
    return Split(seq=2 * d + 1)


def attention_cost(cfg: ModelConfig, causal: bool = True, extra_outputs: int = 0) -> Cost:
    """Pre-norm attention with wq/wk/wv/wo; `extra_outputs`: the width of one more projection of
    the normalised input, split by head like wq, whose output is kept for backward (e.g. an
    output gate)."""
    d, h, k, e, s = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.seq_len
    matmul = d * h * e + 2 * d * k * e + h * e * d + d * extra_outputs
    context = (s + 1) / 2 if causal else s
    flops = 2 * matmul + 4 * h * e * context
    params = Split(whole=d, heads=2 * d * h * e + d * extra_outputs, kv=2 * d * k * e)
    projections = 4 if extra_outputs else 3
    act = norm_act(d) + Split(whole=d, heads=2 * h * e + h + extra_outputs, kv=2 * k * e,
                              input_copies=(projections - 1) * d)
    # SDPA's backward: gradients of its output, q, k and v, and the residual's gradient
    backward = Split(seq=d, heads=2 * h * e, kv=2 * k * e)
    # op-level recompute keeps q, k, v and the extra projection's outputs (before RoPE), SDPA's
    # output and logsumexp, and wo's output
    op_act = Split(whole=d, heads=2 * h * e + h + extra_outputs, kv=2 * k * e)
    return Cost(matmul + d, flops, tp_params=params, act=act, backward=(backward,), op_act=op_act)


def swiglu_cost(cfg: ModelConfig, width: int) -> Cost:
    """Pre-norm SwiGLU MLP of hidden width `width`."""
    d = cfg.d_model
    matmul = 3 * d * width
    act = norm_act(d) + Split(whole=d, width=4 * width, input_copies=d)  # w1 and w3 read the input
    # the product's backward: gradients of silu(w1 out) and of w3 out while the one of the product
    # still exists (the product itself is freed by then), and the residual's gradient
    backward = Split(seq=d, width=2 * width)
    op_act = Split(whole=d, width=2 * width)  # op-level recompute keeps w1's, w3's and w2's outputs
    return Cost(matmul + d, 2 * matmul, tp_params=Split(whole=d, width=matmul), act=act, backward=(backward,),
                op_act=op_act)


def routed_experts(cfg: ModelConfig, width: int) -> tuple[int, float]:
    """(parameters of the N routed SwiGLU experts of width W of an MoE layer, the forward FLOPs per
    token of the k a token is sent to)."""
    moe = cfg.moe
    return 3 * cfg.d_model * width * moe.experts, 2.0 * 3 * cfg.d_model * width * moe.top_k


def moe_cost(cfg: ModelConfig, width: int) -> Cost:
    """What an MoE layer's MLP (models/moe.py) adds to its pre-norm (a family's block with MLP width 0
    holds the norm and its output, the layer's input): router [N, D] and routing bias [N], N experts
    of width W (all count as parameters; `experts`: split over the ep ranks), a shared expert of
    width Ws; FLOPs are the active ones, the router's and the k experts' each token is sent to, and
    the shared expert's.

    Saved per token (counted from the code; tests/cost/test_memory_model.py compares them with torch's
    saved tensors): fp32 (`seq`) the router's logits and probabilities [N], logsumexp 1, the gates
    [k] and their sum 1, and the int64 ids of the choices, the sorted order and the rows' tokens
    (3 k, as 6 k fp32-sized elements); in the compute dtype (`whole`) each assignment's gate k, the
    expert rows scaled by their gates and the combined product kept by index_add_, 2 k D, the shared
    expert's 4 Ws; the rows the experts compute (`experts`: per row the gathered input D and the
    SwiGLU's 4 W). At ep > 1 those rows are the ones a rank receives (the busiest rank's over its own,
    memory.py), and the k D of the expert outputs it sends back are freed there (the combine's input
    is the all-to-all's output, counted in `whole`), so the per-token count is the same formula at
    every ep. Left out: expert parallelism's int64 permutations of the received rows."""
    d, moe = cfg.d_model, cfg.moe
    n, k, shared = moe.experts, moe.top_k, moe.shared_width
    expert_params, expert_flops = routed_experts(cfg, width)
    params = n * d + n + expert_params + 3 * d * shared
    flops = 2 * d * n + expert_flops + 2 * 3 * d * shared
    act = Split(seq=2 * n + 2 + k + 6 * k, whole=k + 2 * k * d + 4 * shared, experts=k * (d + 4 * width))
    # the experts' backward: gradients of w1's and w3's outputs and of the rows' input; the shared expert's
    backward = Split(seq=d, whole=2 * shared, experts=k * (2 * width + d))
    # op-level recompute keeps the matmuls' outputs: the router's logits, w1's, w3's and w2's
    op_act = Split(seq=n, whole=2 * shared, experts=k * (2 * width + d))
    return Cost(params, flops, tp_params=Split(whole=params - expert_params, experts=expert_params), act=act,
                backward=(backward,), op_act=op_act)


def moe_all_to_all_bytes(cfg: ModelConfig, tokens: int, ep: int, act_bytes: int) -> float:
    """Bytes one rank sends to the other ranks through one MoE layer's all-to-alls (parallel/ep.py)
    for `tokens` of its tokens, forward and backward, when the routing is balanced: the tokens' k
    assignments each carry d_model activations out (dispatch) and back (combine), and the same
    gradients the other way in backward, the (ep - 1) / ep of them whose expert is elsewhere.
    The expert counts' exchange (N integers) is left out. The step-time model prices it at the
    busiest rank's load (cost/step_time.py); benchmarks/moe_ep.py measures it."""
    return 4.0 * tokens * cfg.moe.top_k * cfg.d_model * act_bytes * (ep - 1) / ep


def prefix_sums(values: Sequence[float]) -> list[float]:
    """[0, v0, v0 + v1, ...]: the sum of any contiguous run of `values` as a difference of two."""
    return [0.0, *itertools.accumulate(values)]
