"""Predicted time of one training step of one layout (pure arithmetic; docs/planning.md).

Per pipeline rank r, for one micro-batch of b x S tokens on one tp rank:

    compute_r   (3 x forward FLOPs + forward FLOPs of the recomputed blocks) / tp / rate; under
                train.float8 the blocks' linear layers faster by their measured float8 / bf16 ratio
                (RankWork.float8_speedup: cost/float8.py's rule and table, 1 for the linears the rule
                leaves out), everything else (attention scores, embedding, head) at the rate; rate =
                the device's bf16 peak (fp32 without bf16) x its assumed MFU (cost/devices.json) x
                the measured math_rate of an eager or a compiled step on a GPU (cost/speedups.json;
                1 on the CPU; not for the attention kernels' FLOPs, fused either way), x its
                concurrent_efficiency on a CPU host where more than one rank computes;
                plus, under activation_checkpointing=op, its recomputed elementwise outputs written
                again and their inputs read (2 x the activation bytes op drops) at the memory
                bandwidth; at least its operators x the device's op_overhead_us (cost/op_count.py;
                under compile its blocks' as the kernels their compiled graphs launch)
                where the device runs kernels beside the host issuing them (GPUs: the host runs
                ahead), their sum on a CPU (the same cores do both); under op, in series, the
                forward operators of its blocks x op_checkpoint_overhead_us (torch's selective-
                checkpoint policy, a Python call per operator in the forward and the recompute;
                eager only: compile applies it while tracing)
    tp_r        Megatron's 4 collectives per block ([b, S, d] in the compute dtype: 2 in forward,
                2 in backward; all-reduces, or all-gather + reduce-scatter under sequence
                parallelism, which move the same bytes), 2 more per recomputed block, and those of
                the vocab-parallel ends (the embedding's all-reduce, the head's in backward, the
                loss's two of [b, S] statistics, all counted as [b, S, d]), ring algorithm, not
                overlapped with compute
    pp_r        the boundary activation forward and its gradient backward ([b, S, d] fp32, / tp
                under sequence parallelism), not overlapped
    T_r         compute_r + tp_r + pp_r; T = max over ranks (the balanced partition's slowest rank)

    step        m x T + bubble + dp (exposed) + optimizer; on a CPU host with fewer cores than
                ranks at least every rank's busy time (m x T_r + dp + optimizer, without the
                collectives' per-call latency) summed over the cores at the host's
                oversubscribed_efficiency (the ranks take turns, which costs the switches; a rank
                idle in the bubble or waiting out a collective's latency gives its core up)
    bubble      (pp - 1) x T' for gpipe and 1f1b, where T' is the other ranks' mean T_r (the
                warm-up and drain pass through them while the slowest rank waits; T' = T when
                the partition balances the ranks exactly), / v interleaved, / 3 for the
                zero-bubble ones
                (ZB-H1 with equal forward, input-backward and weight-backward times, Qi et al.
                2023, arXiv 2401.10241), / (3 v) interleaved zero-bubble; the V schedules (zbv,
                dualpipev) as interleaved zero-bubble with v = 2
    dp          ring collectives over the dp group of the rank's tp-local parameters P:
                zero=none (DDP): all-reduce of fp32 gradients once per step, overlapped with the
                last micro-batch's backward (exposed: what exceeds it); fsdp2 without pipelining:
                per micro-batch an all-gather of the weights (compute dtype) in forward and again
                in backward and a reduce-scatter of fp32 gradients, overlapped with that micro-
                batch's compute (prefetch); fsdp2 under pipelining: one all-gather and one
                reduce-scatter per step, not overlapped; HSDP (dp_replicate x dp_shard): those
                over the dp_shard group, plus an all-reduce of the fp32 gradient shard over the
                replicas each time; deepspeed ZeRO-3: per micro-batch fp32 gathers in forward
                and backward and the fp32 reduce-scatter, overlapped with that micro-batch's
                compute. Overlap only where the device overlaps (`overlap`: GPUs, where NCCL
                and DeepSpeed's overlap_comm run beside the kernels; not the CPU, where gloo's
                collectives take the same cores as compute: there all of it is exposed)
    optimizer   AdamW over the rank's shard of fp32 state at the device's memory bandwidth
                (32 bytes read or written per parameter)

Context parallelism (parallel.cp, parallel/cp/split.py): every rank holds b x S / cp
tokens of each micro-batch and does 1 / cp of its work (the load-balanced causal split; the
contiguous split of the state-passing families too), so the compute, tp and pp terms above are
those of S / cp tokens. Besides, per block and micro-batch, its messages (RankWork.cp_messages,
cost/cp.py cp_messages; for attention its K and V, [b, K, S, E] each in the compute dtype):
allgather = an all-gather in forward and a reduce-scatter of the gradients in backward (one more
all-gather in a recomputed block), not overlapped; ring = (cp - 1) blocks sent forward and (2 cp -
1) backward, point to point, overlapped with the compute where the device overlaps; alltoall
(Ulysses) = two all-to-alls forward (q, k, v out, the output back) and two backward, each moving
(cp - 1) / cp of its buffer as an all-gather does (its bandwidth and efficiency), not overlapped; halo = one hop
forward and its gradient back, all ranks at once; chain = (cp - 1) hops one after another each way,
and the wait it imposes: rank r starts a block when rank r - 1 has finished its slice of it, so the
ranks form a wavefront ((cp - 1) blocks' time per micro-batch), or wait block by block when every
block also meets all cp ranks (an all-gather, ring or all-to-all beside the chain: (cp - 1) x the whole block's
time, an upper bound: only the chained part waits). DDP's gradient all-reduce spans dp x cp.

Expert parallelism (parallel.ep, parallel/ep.py; RankWork's expert fields): a rank's routed
experts are N / ep of each MoE layer's (`params` counts those), and at ep > 1 they compute the rows
every rank of its ep group sends them: the busiest rank's expert GEMMs take ep_imbalance (the
expert load max / mean assumed, parallel.ep_imbalance) x its own tokens' share. Per MoE block and
micro-batch the all-to-alls (dispatch and combine forward, their gradients backward; a recomputed
block repeats the forward two) move cost/block.py moe_all_to_all_bytes, priced at the busiest rank's
load (ep_imbalance x the balanced bytes: the exchange ends when that rank has its rows) at the
all-gather's bandwidth and efficiency over the ep group's span (ep consecutive dp ranks, tp x cp
apart), plus the latency of each call (per block 3 forward: the counts and two row exchanges, 2
backward, 3 per recompute), not overlapped (the experts wait for their rows). The experts'
gradients reduce over the dp / ep ranks that hold the same experts (none at ep = dp), the other
parameters' over dp; the optimizer steps the rank's own experts.

Links: a group whose ranks lie within one node (its span in the (pp, dp, tp) rank order, tp
fastest, then cp, at most gpus_per_node) uses the intra-node bandwidth, else the inter-node one (the
GPU's own NIC). Bandwidths are per direction; ring all-reduce moves 2 (n - 1) / n of the
bytes per rank, all-gather and reduce-scatter (n - 1) / n, at the link's bandwidth x the device's
`all_gather_efficiency` / `reduce_scatter_efficiency` (1 on GPUs, where NCCL runs all three at one
bus bandwidth; measured for gloo on the CPU, whose all-gather and reduce-scatter are slower than its
all-reduce). Every collective call (and point-to-point message) also costs the device's
`collective_latency_us` (the CPU's is measured between ranks that compute between collectives, the
way a step's collectives run; 0 on the GPU profiles: not measured, not modelled). Calls counted: tp
one per collective above; pp 2 per micro-batch; cp one per message, ring step or hop; DDP one per
gradient bucket (`ddp_bucket_elements`, the rule parallel/dp/ddp.py buckets with); fsdp2 and
DeepSpeed one per ZeRO unit (each block and the root) and collective (gathers, reduce-scatter and
the replicas' all-reduce).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from megatron_taper.cost.devices import DeviceProfile

ADAMW_TRAFFIC_BYTES = 32.0  # param, grad, exp_avg, exp_avg_sq read + param, moments written (fp32)
DDP_MIN_BUCKETS = 4  # a module's gradients in at least this many buckets, so reduction overlaps backward
DDP_MIN_BUCKET_ELEMENTS = 2**18  # 1 MiB of fp32: below it a collective's latency dominates


def ddp_bucket_elements(configured_mb: float, trainable: float, dp: int) -> float:
    """Elements per DDP gradient bucket (fp32): `configured_mb` MiB when > 0 (parallel.ddp_bucket_mb),
    else Megatron-LM's rule, max(40M, 1M x dp) elements (larger buckets as dp grows, so that each
    all-reduce's per-rank share stays large enough to run at bandwidth), capped at 1 / DDP_MIN_BUCKETS
    of the `trainable` elements (at least DDP_MIN_BUCKET_ELEMENTS) so that a small model or pipeline
    chunk still overlaps reduction with backward."""
    if configured_mb > 0:
        return configured_mb * 2**20 / 4
    return min(max(40_000_000, 1_000_000 * dp), max(trainable // DDP_MIN_BUCKETS, DDP_MIN_BUCKET_ELEMENTS))


@dataclass(frozen=True)
class RankWork:
    """What one pipeline rank does per token of a micro-batch (whole-layer counts, before tp)."""

    flops: float  # forward FLOPs per token of its layers, embedding and head
    linear_flops: float  # of which in the blocks' linear layers (float8 candidates)
    recompute_flops: float  # forward FLOPs per token recomputed in backward
    blocks: int  # blocks on the rank
    recomputed_blocks: int  # of which recompute their forward (full / selective)
    params: float  # tp-local parameters on the rank (its dp collectives' payload)
    vocab_collectives: int = 0  # tp collectives of its vocab-parallel ends per micro-batch (embedding 1, head + loss 3)
    # context parallelism: per block, its messages per micro-batch as (kind, bytes) pairs (cost/cp.py
    # cp_messages: chain, halo, allgather, ring, alltoall; attention's K and V (Ulysses: q, k, v and
    # output) for the attention families)
    cp_messages: tuple = ()
    # of flops, its blocks' FLOPs outside their linear layers: attention scores and values (SDPA: fused, as
    # fast eager as compiled, so math_rate leaves them), a memory family's memory arithmetic
    attention_flops: float = 0.0
    float8_speedup: float = 1.0  # under float8: float8 / bf16 speed of its linear_flops (cost/float8.py)
    # host calls per micro-batch: eager operators, or a compiled block's launches (cost/op_count.py; recomputed
    # forwards included)
    ops: float = 0.0
    # activation_checkpointing=op: bytes per micro-batch (tp-local) of the elementwise outputs its
    # backward makes again (none's kept activations less op's, cost/memory.py)
    op_recompute_bytes: float = 0.0
    op_checkpointed_ops: float = 0.0  # forward operators of its op-checkpointed blocks per micro-batch
    # mixture of experts (module doc): of flops (and linear_flops), the routed experts' forward FLOPs per token
    expert_flops: float = 0.0
    expert_params: float = 0.0  # of params, its routed experts' (its ep share), reduced over dp / ep
    moe_blocks: int = 0  # of blocks, the MoE ones
    moe_recomputed: int = 0  # of those, the ones that recompute their forward (its exchanges too)
    all_to_all_bytes: float = 0.0  # per token of a micro-batch and MoE block: moe_all_to_all_bytes at the layout's ep


@dataclass(frozen=True)
class StepLayout:
    tp: int
    pp: int
    dp: int
    virtual: int
    schedule: str
    zero: str
    sequence_parallel: bool
    micro_batch: int
    microbatches: int  # per step on one dp rank (pipeline micro-batches, or accumulation at pp = 1)
    bf16: bool
    float8: bool
    overlap: bool  # the device runs collectives beside compute (GPUs: copy engines / NCCL; not gloo on the CPU)
    dp_shard: int = 0  # fsdp2: ranks the state is sharded over (HSDP: dp = dp_replicate x dp_shard); 0 = dp
    compute_share: float = 1.0  # of one device's rate a computing rank gets (DeviceProfile.rank_share)
    host_cores: int = 0  # a CPU host's cores its tp x pp x dp x cp ranks share; 0: a device per rank
    cp: int = 1  # context parallelism: each sequence split over cp ranks
    cp_attention: str = "allgather"  # parallel.cp_attention (allgather | ring | ulysses)
    ddp_bucket_mb: float = 0.0  # parallel.ddp_bucket_mb (0: ddp_bucket_elements' rule)
    math_rate: float = 1.0  # the arithmetic's rate over the device's assumed one (cost/float8.py math_rate)
    ep: int = 1  # expert parallelism: each MoE layer's experts over ep ranks of dp
    ep_imbalance: float = 1.0  # at ep > 1, the busiest ep rank's expert rows over the mean (parallel.ep_imbalance)

    @property
    def expert_load(self) -> float:
        """The busiest rank's expert rows over its own tokens' assignments (1 at ep = 1)."""
        return self.ep_imbalance if self.ep > 1 else 1.0


@dataclass(frozen=True)
class StepTime:
    total: float
    compute: float  # m x the slowest rank's compute
    bubble: float
    tp: float
    pp: float
    dp: float  # exposed
    optimizer: float
    cp: float = 0.0  # exposed
    ep: float = 0.0  # the MoE all-to-alls (not overlapped)
    parts: dict = field(default_factory=dict)


def bandwidth(span: int, device: DeviceProfile) -> float:
    """Bytes/s per direction of a group spanning `span` consecutive ranks."""
    inside = device.gpus_per_node == 0 or span <= device.gpus_per_node
    return 1e9 * (device.intra_node_gb_per_s if inside else device.inter_node_gb_per_s)


def ring_seconds(nbytes: float, n: int, bytes_per_s: float, all_reduce: bool) -> float:
    """One ring collective over n ranks of a tensor of `nbytes`: all-reduce or all-gather / reduce-scatter."""
    if n <= 1:
        return 0.0
    return (2.0 if all_reduce else 1.0) * (n - 1) / n * nbytes / bytes_per_s


def collective_seconds(kind: str, nbytes: float, n: int, span: int, device: DeviceProfile) -> float:
    """One `kind` collective (all_reduce, all_gather, reduce_scatter) over n ranks spanning `span`
    consecutive ranks, of a tensor of `nbytes` (the whole, gathered or scattered): the device's
    latency per call plus the ring's bytes at the link's bandwidth x the kind's efficiency."""
    if n <= 1:
        return 0.0
    efficiency = {"all_reduce": 1.0, "all_gather": device.all_gather_efficiency,
                  "reduce_scatter": device.reduce_scatter_efficiency}[kind]
    bw = bandwidth(span, device) * efficiency
    return device.collective_latency_us * 1e-6 + ring_seconds(nbytes, n, bw, kind == "all_reduce")


def bubble_fraction(pp: int, virtual: int, schedule: str) -> float:
    """The pipeline bubble in units of one micro-batch's time on the slowest rank (module doc)."""
    if pp == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return pp - 1.0
    if schedule == "interleaved_1f1b":
        return (pp - 1.0) / virtual
    return (pp - 1.0) / (3.0 * (2 if schedule in ("zbv", "dualpipev") else virtual))


def step_time(ranks: Sequence[RankWork], layout: StepLayout, d_model: int, seq_len: int,
              device: DeviceProfile) -> StepTime:
    """Seconds of one optimizer step of `layout` whose pipeline ranks do `ranks` (module doc)."""
    lo = layout
    tokens = lo.micro_batch * seq_len // lo.cp
    compute_bytes = 2 if lo.bf16 else 4
    fused_rate = device.matmul_flops(lo.bf16) * lo.compute_share
    rate = fused_rate * lo.math_rate
    pp_bw = bandwidth(lo.tp * lo.cp * lo.dp * lo.pp, device)
    hidden = tokens * d_model * compute_bytes
    per_collective = collective_seconds("all_reduce", hidden, lo.tp, lo.tp, device)
    boundary = 4.0 * tokens * d_model / (lo.tp if lo.sequence_parallel else 1)
    pp_s = 2.0 * (boundary / pp_bw + device.collective_latency_us * 1e-6) if lo.pp > 1 else 0.0

    compute, tp_s = [], []
    for r in ranks:
        share = (3 * tokens + r.recompute_flops * tokens / max(r.flops, 1e-30))  # of a forward FLOP per token
        # the busiest ep rank's experts compute expert_load x its own tokens' rows
        linear = (r.linear_flops + r.expert_flops * (lo.expert_load - 1.0)) * share
        attention = r.attention_flops * share
        other = (3 * r.flops + r.recompute_flops) * tokens - r.linear_flops * share - attention
        # op-level recompute: memory-bound elementwise work, each output written again and its
        # inputs (as many bytes) read
        elementwise = 2.0 * r.op_recompute_bytes / (device.memory_tb_per_s * 1e12)
        math = ((linear / (r.float8_speedup if lo.float8 else 1.0) + other) / rate + attention / fused_rate) / lo.tp \
            + elementwise
        issue = r.ops * device.op_overhead_us * 1e-6
        policy = r.op_checkpointed_ops * device.op_checkpoint_overhead_us * 1e-6  # measured in series on an H200
        compute.append((max(math, issue) if lo.overlap else math + issue) + policy)
        tp_s.append(per_collective * (4 * r.blocks + 2 * r.recomputed_blocks + r.vocab_collectives))
    cp_s = [_cp_seconds(r, lo, compute[k], device) for k, r in enumerate(ranks)]
    ep_s = [_ep_seconds(r, lo, tokens, device) for r in ranks]
    per_rank = [compute[k] + tp_s[k] + cp_s[k] + ep_s[k] + pp_s for k in range(len(ranks))]
    i = max(range(len(ranks)), key=per_rank.__getitem__)
    slowest = per_rank[i]
    # the fill and drain pass through the other stages: their mean micro-batch time
    others = (sum(per_rank) - slowest) / (len(ranks) - 1) if len(ranks) > 1 else slowest
    params = ranks[i].params
    experts = ranks[i].expert_params
    dp_s = _dp_seconds(params, experts, ranks[i].blocks + 1, compute[i], lo, compute_bytes, device)
    m = lo.microbatches
    bubble = bubble_fraction(lo.pp, lo.virtual, lo.schedule) * others
    shard = (lo.dp_shard or lo.dp) if lo.zero == "fsdp2" else lo.dp if lo.zero == "deepspeed" else 1
    expert_shard = max(1, shard // lo.ep)  # fsdp2 x ep: the experts over the dp_shard / ep ranks holding them
    optimizer = ADAMW_TRAFFIC_BYTES * ((params - experts) / shard + experts / expert_shard) \
        / (device.memory_tb_per_s * 1e12)
    total = m * slowest + bubble + dp_s + optimizer
    world = lo.tp * lo.pp * lo.dp * lo.cp
    if 0 < lo.host_cores < world:  # the ranks take turns on the cores; idle ones (the bubble) give theirs up,
        # and so does one waiting out a collective's per-call latency: busy time is without it
        quiet = step_time(ranks, dataclasses.replace(lo, host_cores=0), d_model, seq_len,
                          dataclasses.replace(device, collective_latency_us=0.0))
        busy = sum(m * t + quiet.dp + optimizer for t in quiet.parts["rank_micro_batch_s"]) * (world // lo.pp)
        total = max(total, busy / (lo.host_cores * device.oversubscribed_efficiency))
    return StepTime(total=total, compute=m * compute[i], bubble=bubble, tp=m * tp_s[i], pp=m * pp_s, dp=dp_s,
                    optimizer=optimizer, cp=m * cp_s[i], ep=m * ep_s[i],
                    parts={"micro_batch_s": slowest, "rank_micro_batch_s": per_rank})


def _cp_seconds(r: RankWork, lo: StepLayout, compute: float, device: DeviceProfile) -> float:
    """Exposed context-parallel communication and waiting of one micro-batch on a rank doing `r`
    (its blocks' messages: `r.cp_messages`), whose compute takes `compute` s (module doc)."""
    if lo.cp <= 1:
        return 0.0
    span, latency = lo.tp * lo.cp, device.collective_latency_us * 1e-6
    hop = bandwidth(span, device)
    redo = r.recomputed_blocks / max(r.blocks, 1)  # recomputed blocks gather again
    exposed, ring, chained, serial = 0.0, 0.0, 0, False
    for messages in r.cp_messages:
        kinds = {kind for kind, _ in messages}
        for kind, nbytes in messages:
            if kind == "allgather":
                gather = collective_seconds("all_gather", nbytes, lo.cp, span, device)
                exposed += (1.0 + redo) * gather + collective_seconds("reduce_scatter", nbytes, lo.cp, span, device)
            elif kind == "ring":
                ring += (3 * lo.cp - 2 + redo * (lo.cp - 1)) * (nbytes / hop + latency)
            elif kind == "alltoall":  # two all-to-alls forward, two backward, two more in a recompute
                per_call = collective_seconds("all_gather", nbytes / 2, lo.cp, span, device)
                exposed += 2.0 * (2.0 + redo) * per_call
            elif kind == "halo":  # every rank sends at once; the gradient comes back
                exposed += 2.0 * (nbytes / hop + latency)
            elif kind == "chain":  # the hops run one after another, forward and back
                exposed += 2.0 * (lo.cp - 1) * (nbytes / hop + latency)
        if "chain" in kinds:
            chained += 1
            serial = serial or bool(kinds & {"allgather", "ring", "alltoall"})
    # a chain makes rank r wait for rank r - 1's slice: a wavefront over the blocks ((cp - 1) blocks'
    # time once), or, where every block also meets all cp ranks, once per block
    per_block = compute / max(r.blocks, 1)
    wait = (lo.cp - 1) * per_block * (chained if serial else min(chained, 1))
    return exposed + wait + (max(0.0, ring - compute) if lo.overlap else ring)


def _ep_seconds(r: RankWork, lo: StepLayout, tokens: int, device: DeviceProfile) -> float:
    """The MoE all-to-alls of one micro-batch of `tokens` on a rank doing `r` (module doc)."""
    if lo.ep <= 1 or not r.moe_blocks:
        return 0.0
    exchanges = r.moe_blocks + r.moe_recomputed / 2.0  # a recompute repeats the 2 forward row exchanges of 4
    nbytes = lo.expert_load * r.all_to_all_bytes * tokens * exchanges
    calls = 5 * r.moe_blocks + 3 * r.moe_recomputed
    bw = bandwidth(lo.tp * lo.cp * lo.ep, device) * device.all_gather_efficiency
    return nbytes / bw + calls * device.collective_latency_us * 1e-6


def _dp_seconds(params: float, experts: float, units: int, compute: float, lo: StepLayout, compute_bytes: int,
                device: DeviceProfile) -> float:
    """Exposed data-parallel communication of one step for a rank with `params` tp-local
    parameters, of which `experts` its routed experts' (reduced over the dp / ep ranks holding
    them), in `units` ZeRO units and `compute` seconds of compute per micro-batch (module doc)."""
    n, m = lo.dp, lo.microbatches
    if n * lo.cp <= 1:
        return 0.0
    span = lo.tp * lo.cp * n  # the dp ranks are tp x cp apart
    backward = compute * 2.0 / 3.0
    dense = params - experts
    if lo.zero == "none":  # DDP over dp x cp, one all-reduce per bucket; the experts' over dp x cp / ep

        def all_reduce(elements: float, ranks: int) -> float:
            if elements <= 0:
                return 0.0
            buckets = max(1.0, -(-elements // ddp_bucket_elements(lo.ddp_bucket_mb, elements, ranks)))
            return buckets * collective_seconds("all_reduce", 4.0 * elements / buckets, ranks, span, device)

        reduce = all_reduce(dense, n * lo.cp) + all_reduce(experts, n * lo.cp // lo.ep)
        return max(0.0, reduce - (backward if lo.overlap else 0.0))
    shard = lo.dp_shard or n if lo.zero == "fsdp2" else n

    def per_unit(kind: str, nbytes: float, ranks: int, group_span: int) -> float:
        return units * collective_seconds(kind, nbytes / units, ranks, group_span, device)

    def sharded(elements: float, shard: int) -> tuple[float, float, float]:
        """(all-gather, reduce-scatter, replicas' all-reduce) of `elements` sharded over `shard` ranks."""
        shard_span = lo.tp * lo.cp * shard
        # HSDP: the replicas all-reduce their reduce-scattered fp32 gradient shard
        replicas = per_unit("all_reduce", 4.0 * elements / shard, n // shard, span)
        scatter = per_unit("reduce_scatter", 4.0 * elements, shard, shard_span)
        gather = per_unit("all_gather", (compute_bytes if lo.zero == "fsdp2" else 4.0) * elements, shard, shard_span)
        return gather, scatter, replicas

    # fsdp2 x ep: the experts sharded over the dp_shard / ep ranks holding them (torchtitan's layout)
    parts = [sharded(dense, shard), *([sharded(experts, max(1, shard // lo.ep))] if experts else [])]
    gather, scatter, replicas = (sum(x) for x in zip(*parts))
    if lo.zero == "fsdp2" and lo.pp > 1:
        return gather + scatter + replicas
    per_micro = 2 * gather + scatter + replicas
    return m * (max(0.0, per_micro - compute) if lo.overlap else per_micro)
