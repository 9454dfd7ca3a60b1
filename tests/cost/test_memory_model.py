"""The per-stage memory model (megatron_taper/cost/memory.py) against measured peaks and saved tensors.

Measured: benchmarks/activation_memory.py runs forward+backward of one micro-batch
(MALLOC_MMAP_THRESHOLD_=65536, peak RSS from VmHWM after clearing it with /proc/self/clear_refs,
minus the resident bytes just before the step; gradients already resident, no optimizer step) on a
4-layer tapered Transformer, d_model 64, MLP widths 384..128, vocabulary 2048, 16 sequences of 256
tokens: activations of 60-210 MB, far above the allocator's noise. Cases: checkpointing none /
selective / full / op; tp=2 with sequence parallelism (two gloo processes); bf16 autocast; the last
pipeline stage (2 blocks + head) and the first (embedding + 2 blocks) with 2 micro-batches in
flight. Each case runs in children forked from one fresh interpreter that imported torch and the
project with that allocator setting (activation_memory.measure_forked; tp=2: two children joined
over gloo): a child starts from the heap a fresh worker has after its imports, and the imports are
paid once instead of once per process.

Margin: measured activation bytes within MARGIN = 5% of the prediction. Justification, measured on
this commit (Dec 2026, 2-core machine under load), measured / predicted, fresh interpreters per case
(activation_memory.measure; tp=2 under torchrun: four runs, the rest one) against forked children
(six runs; tp=2 three): none 1.0032 / 1.0031-1.0042, selective 1.0035 / 1.0031-1.0049, full 1.0048 /
1.0035-1.0062, op 1.0051 / 1.0041-1.0059, tp2 (both ranks) 1.0052-1.0079 / 1.0049-1.0089, bf16
1.0335 / 1.0330-1.0348, last stage 0.9961 / 0.9960-0.9971, first stage 1.0128 / 1.0102-1.0156: every
fresh reading lies inside the forked runs' range. The largest deviation is bf16, +3.3-3.5% with both
methods (it read -0.6% when the margin was set: the weights' bf16 copies, predicted, are small
allocations whose reuse of heap memory freed by the warm-up depends on the heap), then the first
stage, +1.0-1.6% that appears at the first forward and does not grow with the micro-batches in
flight. The rest is what the model leaves out on purpose (RoPE tables, token ids, a few small
temporaries), under 1%. 5% is over the largest deviation by 1.5 points and still catches a missed
[N, V] loss buffer (16% of the first case), the SwiGLU's backward buffers (6%) or a wrong
checkpointing rule (25% or more); a single missed d-wide tensor per block (2%) is left to the
saved-tensor tests below (1%).
Parameters + gradients are compared exactly.

Saved tensors: the elements each family's cost function says a block keeps for backward are
compared with the storages torch's autograd actually saves (saved_tensors_hooks), fp32: the
families counted op by op within 1% (the RoPE tables are not counted), online Hope levels within
2% (the factors their scan keeps, hope_attention/cost.py online_level_act) and Titans within 10% (counted
by constants fitted on saved tensors, see its file).
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import math
import os
import random

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.cost.block import Cost, Split
from megatron_taper.cost.flops import head_cost, model_costs
from megatron_taper.cost.memory import (
    MemorySetup,
    model_memory,
    piece_memory,
)
from megatron_taper.cost.partition import evaluate, partition
from megatron_taper.cost.stage_memory import MemoryModel, deepspeed_buffers, pipeline_buffers
from megatron_taper.models import build_model
from megatron_taper.models.layers import rope_tables
from tests.helpers.families import family_cases
from tests.helpers.runner import REPO, saved_elements

MARGIN = 0.05
SHAPE = ["model.n_layers=4", "model.d_model=64", "model.n_heads=2", "model.mlp_width=256", "model.taper.multiple=32",
         "model.vocab_size=2048", "model.seq_len=256", "train.micro_batch=16", "train.global_batch=16"]
TP_SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
CASES = {  # name -> (overrides, checkpointing, processes, stage, stage layers, in flight)
    "none": ([], "none", 1, "", 0, 1),
    "selective": ([], "selective", 1, "", 0, 1),
    "full": ([], "full", 1, "", 0, 1),
    "op": ([], "op", 1, "", 0, 1),
    "tp2_sp_selective": (TP_SP, "selective", 2, "", 0, 1),
    "bf16": (["train.precision=bf16"], "none", 1, "", 0, 1),
    "last_stage": ([], "none", 1, "last", 2, 1),
    "first_stage_selective_2_in_flight": ([], "selective", 1, "first", 2, 2),
}


def _bench():
    spec = importlib.util.spec_from_file_location("activation_memory", os.path.join(REPO, "benchmarks",
                                                                                  "activation_memory.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _measured(bench, names: list[str]) -> dict:
    """name -> rows: every case in children forked from one fresh interpreter (bench.measure_forked),
    one case after another."""
    kwargs = [dict(overrides=SHAPE + CASES[name][0], mode=CASES[name][1], nproc=CASES[name][2], stage=CASES[name][3],
                   stage_layers=CASES[name][4], in_flight=CASES[name][5]) for name in names]
    return dict(zip(names, bench.measure_forked(kwargs, timeout=600)))


@pytest.fixture(scope="module")
def measured() -> dict:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("peak RSS is measured through Linux's /proc/self/clear_refs")
    return _measured(_bench(), list(CASES))


def _config(name: str):
    overrides, mode, *_ = CASES[name]
    return load_config(None, SHAPE + overrides + [f"train.activation_checkpointing={mode}"])


def _predicted(name: str) -> tuple[float, float]:
    """(activation bytes, params + grads bytes) of the case, from the memory model alone."""
    cfg = _config(name)
    _, _, nproc, stage, layers, in_flight = CASES[name]
    p, t = cfg.parallel, cfg.train
    bf16 = t.precision == "bf16"
    if stage:
        setup = MemorySetup(micro_batch=t.micro_batch, pipelined=True, optimizer=False,
                            activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every)
        mm = model_memory(cfg.model, setup)
        last = stage == "last"
        ids = range(cfg.model.n_layers - layers, cfg.model.n_layers) if last else range(layers)
        sm = mm.stage(list(ids), index=int(last), n_stages=2, in_flight=in_flight)
        sent = 0.0 if last else (in_flight + 1) * mm.io  # outputs kept for backward, one gradient received
        return sm.activations + sent, sm.static
    setup = MemorySetup(tp=p.tp, sequence_parallel=p.sequence_parallel, dp=nproc // p.tp, bf16=bf16,
                        activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every,
                        micro_batch=t.micro_batch, optimizer=False)
    mm = model_memory(cfg.model, setup)
    sm = mm.stage(range(cfg.model.n_layers))
    casts = sum(x.params for x in [*mm.layers, mm.embedding, mm.head]) * setup.cast_bytes_per_param()
    return sm.activations + casts, sm.static - casts  # bf16 copies of the weights: made in the measured forward


@pytest.mark.slow  # over ~20 s alone
@pytest.mark.parametrize("name", list(CASES))
def test_prediction_within_margin_of_measured_peak(measured, name):
    act, static = _predicted(name)
    for row in measured[name]:
        ratio = row["measured_activation_bytes"] / act
        assert abs(ratio - 1) <= MARGIN, (name, row["rank"], row["measured_activation_bytes"], act, ratio)
        assert row["params_grads_bytes"] == pytest.approx(static, rel=1e-9), name


def test_checkpointing_and_tensor_parallelism_lower_the_measured_peak(measured):
    peak = {name: max(r["measured_activation_bytes"] for r in rows) for name, rows in measured.items()}
    assert peak["none"] > 1.3 * peak["selective"] > 1.3 * 1.3 * peak["full"] > 1e8
    assert peak["tp2_sp_selective"] < 0.75 * peak["selective"]


# ---------------------------------------------------------------------------------------------
# The cost functions against the tensors autograd saves


def _saved_elements(overrides: list[str], batch: int = 2) -> tuple[float, object]:
    """Elements per token of the storages one block's forward saves for backward (fp32)."""
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=128", "model.n_heads=4", "model.mlp_width=256",
                             "model.vocab_size=512", "model.seq_len=64", "model.taper.multiple=32"] + overrides).model
    model = build_model(cfg)
    model.init_weights(0)
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x.device)
    return saved_elements(model, lambda: model.layers["0"](x, cos, sin)) / (batch * cfg.seq_len), cfg


# Every registered family's standard cases (tests/helpers/families.py) within DEFAULT_TOLERANCE, and
# tighter where the family's cost function is counted op by op (measured at this shape: 0.5% or better);
# Titans is counted by constants fitted on saved tensors, online Hope levels by their scan's factors. Measured
# predicted / saved at this shape: transformer 0.994, alibi 0.918 (the [H, S, S] bias per block is not
# counted), titans 0.98-1.02, hope 0.997-0.998, bridge 0.994, linear_memory grm 1.046 and ssc 1.153
# (at 8 cached segments the selective-caching scores are over-counted), deep_memory 1.009. An MoE block
# (model.moe, cost/block.py moe_cost; layer 0 an MoE one) counted op by op within 1%: measured 0.997 (top-2
# of 4 experts through the grouped GEMM, Transformer and Gated Attention) and 0.996 (top-1 of 8 with a shared
# expert: top-1 saves no renormalised gates, counted anyway); the int64 ids it saves count as 2 fp32 elements
# each in the model, 1 here.
DEFAULT_TOLERANCE = 0.10
TOLERANCE = {"transformer": 0.01, "gated_attention_elementwise": 0.01, "gated_attention_headwise": 0.01,
             "hope_attention": 0.02, "hope_attention_offline": 0.01, "bridge": 0.01, "linear_memory_ssc": 0.20,
             "transformer_moe": 0.01, "transformer_moe_top1_shared": 0.01, "gated_attention_moe": 0.01}
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.moe.expert_width=128"]
SAVED_CASES = {**family_cases(), "transformer_gqa": ["model.n_kv_heads=2"], "transformer_moe": MOE,
               "transformer_moe_top1_shared": ["model.moe.experts=8", "model.moe.top_k=1", "model.moe.expert_width=128",
                                               "model.moe.shared_width=64"],
               "gated_attention_moe": ["model.arch=gated_attention", *MOE]}


@pytest.mark.parametrize("case", SAVED_CASES)
def test_cost_act_matches_saved_tensors(case):
    cfg = load_config(None, SAVED_CASES[case]).model
    block = build_model(cfg).layers["0"]
    if list(inspect.signature(block.forward).parameters)[1:3] != ["cos", "sin"]:
        pytest.skip(f"{case}: its blocks do not take (x, cos, sin); its own tests count its saved tensors")
    tolerance = TOLERANCE.get(case, 0.01 if case == "transformer_gqa" else DEFAULT_TOLERANCE)
    saved, cfg = _saved_elements(SAVED_CASES[case], batch=2)
    cost = model_costs(cfg).layers[0]
    predicted = cost.act.total - cost.act.input_copies + cost.per_batch.total / (2 * cfg.seq_len)
    assert predicted == pytest.approx(saved, rel=tolerance)


def _expert_parallel_saved(overrides: list[str]) -> tuple[float, float, float]:
    """On each of 2 gloo ranks, one MoE block's forward with its experts spread over both (ep = 2,
    parallel/ep.py's dispatch; each rank its own tokens): (saved elements per token, predicted per
    token with the rank's received rows over its own assignments as the imbalance, that ratio)."""
    import torch.distributed as dist
    from torch import nn

    from megatron_taper.cost.memory import MemorySetup, act_bytes_per_token
    from megatron_taper.models.moe import moe_modules
    from megatron_taper.parallel.ep import EXPERT_WEIGHTS, ExpertDispatch

    rank, batch = dist.get_rank(), 2
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=128", "model.n_heads=4", "model.mlp_width=256",
                             "model.vocab_size=512", "model.seq_len=64", "model.taper.multiple=32", *overrides]).model
    model = build_model(cfg)
    model.init_weights(0)
    _, moe = moe_modules(model.layers["0"])[0]
    local = moe.n_experts // 2
    moe.dispatch = ExpertDispatch(dist.group.WORLD, 2, moe.n_experts)
    for weight in EXPERT_WEIGHTS:  # this rank's experts, as parallel/ep.py apply_expert_parallel keeps them
        setattr(moe.experts, weight, nn.Parameter(getattr(moe.experts, weight)[rank * local:(rank + 1) * local]))
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True, generator=torch.Generator().manual_seed(rank))
    cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x.device)
    tokens = batch * cfg.seq_len
    saved = saved_elements(model, lambda: model.layers["0"](x, cos, sin)) / tokens
    load = moe.load_step.clone()  # this rank's assignments per expert
    dist.all_reduce(load)
    imbalance = float(load[rank * local:(rank + 1) * local].sum()) / (tokens * cfg.moe.top_k)
    act = model_costs(cfg).layers[0].act
    setup = MemorySetup(ep=2, ep_imbalance=imbalance)  # fp32: 4 bytes per element, no input copies
    return saved, act_bytes_per_token(act, Split(whole=1.0, seq=1.0, heads=1.0, kv=1.0, width=1.0), setup) / 4.0, \
        imbalance


def test_expert_parallel_moe_act_matches_saved_tensors():
    """At ep = 2 a rank keeps the rows it receives (its experts' inputs and SwiGLU activations) and the
    rows that come back, not the expert outputs it sent: the count with the rank's measured received /
    own rows as the imbalance, within 1% like one process (measured 0.996 on both ranks, which received
    255 and 257 rows for 256 assignments each: its int64 permutations of the received rows are left
    out). One spawn of 2 processes."""
    from tests.helpers.harness import run_distributed

    results = run_distributed(_expert_parallel_saved, 2, MOE, timeout=120)
    for saved, predicted, _ in results:
        assert predicted == pytest.approx(saved, rel=0.01)
    assert results[0][2] != results[1][2] and sum(r[2] for r in results) == pytest.approx(2.0)


@pytest.mark.parametrize("loss_chunk", [0, 24])
def test_head_act_matches_saved_tensors(loss_chunk):
    cfg = load_config(None, ["model.n_layers=1", "model.d_model=64", "model.n_heads=2", "model.vocab_size=1024"]).model
    model = build_model(cfg)
    model.init_weights(0)
    h = torch.randn(2, 32, 64, requires_grad=True)

    from megatron_taper.parallel.loss import loss_function

    loss_fn = loss_function(loss_chunk)
    saved = saved_elements(model, lambda: loss_fn(model.output(model.norm(h)), torch.randint(0, 1024, (2, 32))),
                           floating_only=True)
    assert head_cost(cfg, chunked=loss_chunk > 0).act.total == pytest.approx(saved / 64, rel=0.01)


@pytest.mark.parametrize("case", family_cases())
def test_tp_layout_of_parameters_adds_up(case):
    cfg = load_config(None, ["model.n_layers=3", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
                             "model.vocab_size=256", "model.taper.multiple=16", *family_cases()[case]]).model
    costs = model_costs(cfg)
    for cost in [*costs.layers, costs.embedding, costs.head]:
        assert cost.params_split.total == cost.params


# ---------------------------------------------------------------------------------------------
# Accounting rules


def test_state_bytes_per_engine():
    assert MemorySetup().state_bytes_per_param() == 16
    assert MemorySetup(optimizer=False).state_bytes_per_param() == 8
    assert MemorySetup(zero="fsdp2", dp=4).state_bytes_per_param() == 4
    assert MemorySetup(zero="fsdp2", dp=1).state_bytes_per_param() == 16  # nothing to shard
    assert MemorySetup(zero="fsdp2", dp=4, pipelined=True).state_bytes_per_param() == 3  # grads: unsharded only
    assert MemorySetup(zero="deepspeed", dp=2).state_bytes_per_param() == 10  # fp32 masters too
    assert MemorySetup(zero="deepspeed", dp=2, bf16=True).state_bytes_per_param() == 10  # fp32 under autocast
    assert MemorySetup(zero="deepspeed", dp=2, offload_optimizer=True).state_bytes_per_param() == 4
    assert MemorySetup(bytes_per_param=12).state_bytes_per_param() == 12
    assert MemorySetup(bf16=True).cast_bytes_per_param() == 2
    assert MemorySetup(bf16=True, zero="fsdp2", dp=2).cast_bytes_per_param() == 0
    assert MemorySetup(bf16=True, zero="fsdp2", dp=1).cast_bytes_per_param() == 2  # fsdp2 leaves dp=1 alone
    assert MemorySetup(bf16=True, zero="deepspeed", dp=2).cast_bytes_per_param() == 2  # autocast casts
    assert MemorySetup(bf16=True, zero="fsdp2", dp=2, pipelined=True).unsharded_bytes_per_param() == 6  # fp32 grads


def test_deepspeed_buffers_are_its_reduce_bucket_and_gathered_parameters():
    """Measured (docs/memory_model.md, benchmarks/layout_memory.py): DeepSpeed holds its fp32
    reduce bucket and, with the default 5e7-element prefetch, every parameter gathered at once."""
    cfg = load_config(None, SHAPE)
    big = model_memory(cfg.model, MemorySetup(zero="deepspeed", dp=2, reduce_bucket=1000, prefetch_bucket=1e9))
    params = [p.params for p in [*big.layers, big.embedding, big.head]]
    assert deepspeed_buffers(big) == 4 * (1000 + sum(params))  # the whole model gathered
    assert big.stage(range(cfg.model.n_layers)).buffers == deepspeed_buffers(big)
    small = model_memory(cfg.model, MemorySetup(zero="deepspeed", dp=2, prefetch_bucket=100))
    assert deepspeed_buffers(small) == 4 * (100 + max(params))  # the running piece + the prefetch
    assert deepspeed_buffers(model_memory(cfg.model, MemorySetup(zero="fsdp2", dp=2, prefetch_bucket=100))) == 0


def test_earlier_cost_form_still_counts():
    """A family giving only Cost(params, flops, act_bytes) (2 bytes per element, layout unknown)."""
    legacy = Cost(100, 1.0, 6.0)
    shares = Split(whole=1.0, seq=1.0, heads=0.5, kv=0.5, width=0.5, vocab=0.5)
    piece = piece_memory(legacy, shares, MemorySetup(tp=2), tokens=10, recompute=False, d_model=4, block=True)
    assert piece.params == 100 and piece.static == 100 * 16  # whole on every tp rank
    assert piece.kept == 3 * 4 * 10  # 3 elements per token, fp32
    assert (legacy + legacy).act_bytes == 12.0 and (legacy + legacy).params_split.whole == 200


def _model_cfg(**over):
    base = {"model.n_layers": 8, "model.d_model": 512, "model.n_heads": 8, "model.mlp_width": 1536,
            "model.vocab_size": 8000, "model.seq_len": 512, "model.taper.multiple": 64}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()]).model


def _whole(cfg, micro_batch: int = 4, **setup) -> float:
    mm = model_memory(cfg, MemorySetup(micro_batch=micro_batch, **setup))
    return mm.stage(range(cfg.n_layers)).total


def test_every_knob_moves_the_prediction_the_right_way():
    cfg = _model_cfg()
    none = _whole(cfg)
    assert _whole(cfg, activation_checkpointing="full") < _whole(cfg, activation_checkpointing="selective") < none
    assert _whole(cfg, tp=2) < none
    assert _whole(cfg, 1, tp=2, sequence_parallel=True) < _whole(cfg, 1, tp=2)
    # also with several sequences per micro-batch: the gathered input is contiguous and shared by
    # the projections (parallel/tp/layers.py enter_tp_region), as is the bf16 cast at tp > 1
    assert _whole(cfg, tp=2, sequence_parallel=True) < _whole(cfg, tp=2)
    assert _whole(cfg, tp=2, bf16=True) < _whole(cfg, bf16=True)
    assert _whole(cfg, bf16=True) < none
    assert _whole(cfg, zero="fsdp2", dp=8) < none
    # a rank holds the largest tp shard: 5 heads over tp=2 -> 3 heads; MLP width units rounded up
    odd = _model_cfg(**{"model.n_heads": 5, "model.d_model": 320})
    d, w = 320, model_costs(odd).widths[0]
    expected = 2 * d + 4 * d * d * 3 / 5 + 3 * d * math.ceil(w / 64 / 2) * 64
    assert model_memory(odd, MemorySetup(tp=2)).layers[0].params == pytest.approx(expected, rel=1e-12)


def test_in_flight_micro_batches_and_pipeline_buffers():
    cfg = _model_cfg()
    mm = model_memory(cfg, MemorySetup(micro_batch=4, pipelined=True, microbatches=8))
    one = mm.stage([0, 1, 2, 3], index=0, n_stages=2, in_flight=1)
    four = mm.stage([0, 1, 2, 3], index=0, n_stages=2, in_flight=4)
    assert four.activations - one.activations == pytest.approx(3 * one.kept)
    assert pipeline_buffers(10.0, [2, 1], 8) == [(8 + 2) * 10.0, (8 - 1) * 10.0]
    assert pipeline_buffers(10.0, [1], 8) == [0.0]


def _brute_force(costs, memory, n_stages):
    best = None
    s_pre = [0.0] + list(itertools.accumulate(memory.static))
    a_pre = [0.0] + list(itertools.accumulate(memory.act))
    for cuts in itertools.combinations(range(1, len(costs)), n_stages - 1):
        bounds = (0, *cuts, len(costs))
        if any(memory.stage_bytes(s, n_stages, bounds[s], bounds[s + 1], s_pre, a_pre) > memory.limits[s]
               for s in range(n_stages)):
            continue
        p = evaluate(bounds, costs)
        key = (p.bottleneck, sum(c * c for c in p.costs), bounds)
        best = key if best is None or key < best else best
    return best


def test_partition_with_backward_peaks_matches_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(2, 8)
        s = rng.randint(1, min(4, n))
        costs = [rng.randint(0, 9) for _ in range(n)]
        act = [rng.randint(0, 5) for _ in range(n)]
        memory = MemoryModel([rng.randint(0, 5) for _ in range(n)], act, [min(s - i, 3) for i in range(s)],
                             [rng.randint(10, 60)] * s, first_static=2, last_static=3, last_act=2,
                             peak=[a + rng.randint(0, 6) for a in act], last_peak=rng.randint(0, 8),
                             fixed=[rng.randint(0, 4) for _ in range(s)])
        ref = _brute_force(costs, memory, s)
        if ref is None:
            with pytest.raises(ValueError, match="parallel.pp_memory_gb"):
                partition(costs, s, memory=memory)
            continue
        assert partition(costs, s, memory=memory).bounds == ref[2]


def test_last_pipeline_stage_keeps_its_logits_per_micro_batch_in_flight():
    """torch.distributed.pipelining holds the last stage's output to the end of its backward: under
    pipelining the head keeps the logits [tokens, V] in the compute dtype besides what the
    unchunked loss saves; the chunked loss saves those very logits, so nothing more."""
    cfg = load_config(None, SHAPE).model
    tokens = 16 * cfg.seq_len
    for bf16 in (False, True):
        alone, piped = (model_memory(cfg, MemorySetup(micro_batch=16, bf16=bf16, pipelined=p)) for p in (False, True))
        logits = tokens * cfg.vocab_size * (2 if bf16 else 4)
        assert piped.head.kept - alone.head.kept == pytest.approx(logits)
        chunked = [model_memory(cfg, MemorySetup(micro_batch=16, bf16=bf16, pipelined=p, loss_chunk=64))
                   for p in (False, True)]
        assert chunked[1].head.kept == chunked[0].head.kept


def test_interleaved_ranks_book_the_head_chunk_at_one_micro_batch():
    """partition.interleaved_activations by hand: chunks keeping 10 and 50 (the head's) per
    micro-batch, backward moments 15 and 80, 3 micro-batches in flight."""
    from megatron_taper.cost.partition import interleaved_activations

    assert interleaved_activations([10, 50], [15, 80], 3, last=1) == max(2 * 10 + 80, 1 * 10 + 50 + 15)
    assert interleaved_activations([10, 50], [15, 80], 3, last=None) == 2 * 50 + 80


def test_tensor_meter_counts_each_live_storage_once():
    """benchmarks/activation_memory.py --meter tensors: a view adds nothing, a freed tensor leaves
    the count, and the peak is the largest sum of live storages after an op (bytes exact)."""
    meter = _bench().TensorMeter(torch.device("cpu"))
    meter.reset()
    a = torch.ones(1000, 250)  # 1e6 bytes
    view = a.view(-1)
    b = a * 2  # 2e6 live
    del a, view
    c = torch.cat((b, b))  # 1e6 + 2e6 live: the peak
    del b, c
    assert meter.peak() == 3_000_000 and meter.bytes == 0
