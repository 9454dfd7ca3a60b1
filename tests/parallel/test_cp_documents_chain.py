"""Hope-attention and the memory bridge under context parallelism with documents (doc_start): the
chain of their state (parallel/cp/state.py) resets at document starts and hands the open chunk or
segment of a document that spans the slices to the next rank. One 2-process launch (gloo,
contiguous split, fp32), the same for parallel.cp_attention allgather, ring and ulysses (their
attention differs, their chain does not), and the all-gather under full activation checkpointing
(each block's forward again in backward, its receives replaying what the forward got):
- window of 32 tokens, slices of 16; row 0 holds documents starting at 0, 5 (inside a chunk of
  every level and a segment), 16 (exactly at rank 1's first token) and 21; row 1 at 0, 11 (a
  document across the slices: rank 1 continues its open chunk of 5 rows for Hope's level 0 (C = 4:
  1 row), level 1 (C = 8: 5 rows), the bridge's open segment of 4 (1 row)) and 30; row 2 one
  document over the whole window (the chain hands on weights at a chunk boundary, no open rows).
- Hope: 2 online CMS levels (C = 4, 8) in both blocks; the bridge: 2 slots, segments of 4, the
  auxiliary loss on (training mode) and carry_state (its carried state after the window: the last
  document's, the same on both ranks).
Logits and every parameter's gradient (each rank's loss share x cp, gradients averaged over the cp
ranks, as DDP does) against one process with the same doc_start; the bridge's read projection is
made non-zero (it starts at zero) so that its reads reach the logits. fp32: the same sums in another
order (rank 1 scans the open chunk or segment again from the state it was handed; the ring merges
attention blocks by their log-sum-exp): logits within 1e-6, gradients within 2e-6 of the model's
largest and 1e-4 of each parameter's own largest (Hope's step sizes raw_step, scalars that sum every
token's terms; measured up to 1.5e-5; every other parameter under 1e-6; logits 9e-8).
The same launch also counts the bytes each rank sends and gathers and a block's saved mask against
the cost model, and trains both families 2 steps through the trainer's path (test docstrings).
"""

import pytest
import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.cost.attention_memory import document_mask_bytes
from megatron_taper.cost.cp import ALLGATHER, ALLTOALL, CHAIN, HALO, RING, cp_messages
from megatron_taper.cost.memory import MemorySetup
from megatron_taper.models import build_model
from megatron_taper.models.layers import rope_tables
from megatron_taper.parallel.block_options import apply_block_options
from megatron_taper.parallel.cp.split import SequenceSplit, apply_context_parallel
from tests.helpers.cp_harness import build as build_run
from tests.helpers.cp_harness import c10d_counter, compare, reference
from tests.helpers.cp_harness import train as train_steps
from tests.helpers.documents import forward_with_documents, grads_of
from tests.helpers.harness import run_distributed
from tests.helpers.runner import saved_elements
from tests.parallel.test_cp_hope_tree_bridge import BASE, BRIDGE, BRIDGE_TOL, HOPE, HOPE_TOL

pytestmark = pytest.mark.multiprocess

SEQ = 32
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        f"model.seq_len={SEQ}", "model.taper.multiple=16"]
FAMILIES = {"hope": ["model.arch=hope_attention", "model.hope.chunk_size=4", "model.hope.chunk_growth=2"],
            "bridge": ["model.arch=bridge", "model.bridge.slots=2", "model.bridge.segment=4",
                       "model.bridge.aux_weight=0.1", "model.bridge.carry_state=true"]}
MODES = ("allgather", "ring", "ulysses")
# (parallel.cp_attention, train.activation_checkpointing): under full checkpointing each block's
# forward runs again in backward, its receives replaying what the forward got (parallel/cp/state.py)
CASES = {**{mode: (mode, "none") for mode in MODES}, "allgather, recomputed": ("allgather", "full")}
# the training step (ParallelModel: doc_start from the end-of-document tokens, each rank its slice; DDP
# over the cp ranks; the bridge's carried state between steps), tests/helpers/cp_harness.py
TRAINED = {"hope": [*BASE, *HOPE, "data.document_mask=true"],
           "bridge": [*BASE, *BRIDGE, "model.bridge.carry_state=true", "model.bridge.aux_weight=0.5",
                      "data.document_mask=true"]}
LOGIT_TOL, GRAD_TOL, OWN_TOL = 1e-6, 2e-6, 1e-4


def build(overrides):
    model = build_model(load_config(None, TINY + overrides).model)
    model.init_weights(0)
    bridge = getattr(model, "bridge", None)
    if bridge is not None:  # the read's output projection starts at zero: give the reads an effect
        with torch.no_grad():
            bridge.read.wo.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return model


def window():
    tokens = torch.randint(0, 64, (3, SEQ), generator=torch.Generator().manual_seed(0))
    doc_start = torch.zeros(3, SEQ, dtype=torch.bool)
    doc_start[0, [5, 16, 21]] = True
    doc_start[1, [11, 30]] = True
    probe = torch.randn(3, SEQ, 64, generator=torch.Generator().manual_seed(1))
    return tokens, doc_start, probe


def carried(model):
    bridge = getattr(model, "bridge", None)
    return None if bridge is None else bridge.carry_out


def one_process(overrides):
    model = build(overrides)
    tokens, doc_start, probe = window()
    logits = forward_with_documents(model, tokens, doc_start)
    return logits.detach(), grads_of(model, (logits * probe).sum()), carried(model)


def _worker():
    rank = dist.get_rank()
    mine = slice(SEQ // 2 * rank, SEQ // 2 * (rank + 1))
    tokens, doc_start, probe = window()
    out = {}
    for name, overrides in FAMILIES.items():
        for case, (mode, checkpointing) in CASES.items():
            model = build(overrides)
            apply_context_parallel(model, SequenceSplit(cp=2, rank=rank, group=dist.group.WORLD, attention=mode,
                                                        balanced=False))
            apply_block_options(model, checkpointing, 1, compile_blocks=False)
            with c10d_counter() as sent:
                logits = forward_with_documents(model, tokens[:, mine], doc_start[:, mine])
                # as under DDP: each rank's share of the loss x cp, gradients averaged over the cp ranks
                # (the auxiliary loss is each rank's share of the whole sequence's mean)
                grads = grads_of(model, (logits * probe[:, mine]).sum() * 2)
            for g in grads.values():
                dist.all_reduce(g, op=dist.ReduceOp.AVG)
            state = carried(model)
            if state is not None:  # what take_state hands every cp rank: the last rank's
                from megatron_taper.models.bridge.cp import from_last_rank
                state = from_last_rank(state, model.bridge.context)
            out[name, case] = (logits.detach(), grads, state, dict(sent.bytes))
    # the all-gather's attention keeps SDPA's mask of its queries over the whole sequence, per block
    model = build([])
    apply_context_parallel(model, SequenceSplit(cp=2, rank=rank, group=dist.group.WORLD, balanced=False))
    x = torch.randn(3, SEQ // 2, 32, requires_grad=True)
    cos, sin = rope_tables(SEQ, model.cfg.head_dim, model.cfg.rope_theta, x.device)
    cos, sin = cos[mine], sin[mine]
    block = model.layers["0"]
    out["saved"] = [saved_elements(model, lambda d=d: block(x, cos, sin, doc_start=d))
                    for d in (doc_start[:, mine], None)]
    for name, overrides in TRAINED.items():
        out["trained", name] = train_steps(build_run([*overrides, "parallel.cp=2"]), True, steps=2)
    return out


@pytest.fixture(scope="module")
def ranks():
    """The one 2-process launch both tests read."""
    return run_distributed(_worker, 2, timeout=300)


def test_cp2_hope_and_bridge_documents_match_one_process_in_every_cp_mode(ranks):
    for name, overrides in FAMILIES.items():
        logits, grads, state = one_process(overrides)
        scale = max(g.abs().max().item() for g in grads.values())
        for mode in CASES:
            got = torch.cat([r[name, mode][0] for r in ranks], dim=1)
            logit_diff = (got - logits).abs().max().item()
            errors = {n: (ranks[0][name, mode][1][n] - g).abs().max().item() for n, g in grads.items()}
            own, worst = max((errors[n] / g.abs().max().item(), n) for n, g in grads.items())
            print(f"{name} {mode}: logits {logit_diff:.1e}, gradients {max(errors.values()) / scale:.1e} of the "
                  f"largest, {own:.1e} of its own largest ({worst})")
            assert logit_diff < LOGIT_TOL and max(errors.values()) < GRAD_TOL * scale, (name, mode, logit_diff, errors)
            assert own < OWN_TOL, (name, mode, worst, own)
            if state is not None:  # the carried state: the last document's, on both ranks
                assert all((r[name, mode][2] - state).abs().max().item() < LOGIT_TOL for r in ranks)


def test_cp2_document_bytes_equal_the_cost_model(ranks):
    """Per rank, the c10d calls of one forward and backward (benchmarks/context_parallel.py's
    counter) equal cost/cp.py cp_messages with documents exactly (whole tensors): the chain's state
    and tails at cp = 2 (rank 0 sends them, rank 1 their gradient back), the ring's 3 cp - 2 blocks,
    Ulysses' two all-to-alls forward and backward, every all-gather's buffer (K and V, reduce-scattered
    in backward, and doc_start, which is not); and a Transformer block's saved tensors under the
    all-gather grow with documents by the memory model's mask, [b, 1, S / cp, S] fp32, less the causal
    mask [S / cp, S] the block keeps without them (which the model leaves out)."""
    for name, overrides in FAMILIES.items():
        cfg = load_config(None, TINY + overrides).model
        for mode in MODES:
            messages = [m for block in cp_messages(cfg, 3, SEQ, 2, attention=mode, documents=True) for m in block]
            sends = sum(m.bytes for m in messages if m.kind in (CHAIN, HALO)) + 4 * sum(
                m.bytes for m in messages if m.kind == RING)
            gathered = sum(m.bytes for m in messages if m.kind == ALLGATHER)
            scattered = sum(m.bytes for m in messages if m.kind == ALLGATHER and m.what != "doc_start")
            for r in ranks:
                measured = r[name, mode][3]
                assert measured.get("p2p_send", 0) == sends, (name, mode, measured, sends)
                assert measured.get("all_gather", 0) == gathered, (name, mode, measured, gathered)
                assert measured.get("reduce_scatter", 0) == scattered, (name, mode, measured, scattered)
                assert measured.get("all_to_all", 0) == 2 * sum(m.bytes for m in messages if m.kind == ALLTOALL)
    cfg = load_config(None, TINY).model
    mask = document_mask_bytes(cfg, [64, 64], MemorySetup(micro_batch=3, cp=2, documents=True))[0]
    assert mask == 4 * 3 * SEQ // 2 * SEQ
    for r in ranks:
        with_documents, without = r["saved"]
        assert 4 * (with_documents - without) == mask - 4 * SEQ // 2 * SEQ


def test_cp2_training_steps_with_documents_match_one_process(ranks):
    """2 AdamW steps of 2 micro-batches through the trainer's path (tests/helpers/cp_harness.py; S = 64,
    slices of 32: documents end at 20, 28 and 48 of even rows, so the one from 29 to 48 spans the
    slices with 3 rows of its open chunk or segment, and at 24 of odd rows), against one process
    with the tolerances of tests/parallel/test_cp_hope_tree_bridge.py (the same fp32 sums in another
    order; the bridge's carried state after each step equal on both ranks within 1e-5)."""
    for name, overrides in TRAINED.items():
        ref = reference(overrides, steps=2)
        compare(ranks[0]["trained", name], ref, f"cp=2 documents {name}", BRIDGE_TOL if name == "bridge" else HOPE_TOL)
        for r in ranks:
            for mine, want in zip(r["trained", name]["carried"], ref["carried"], strict=True):
                for a, b in zip(mine["states"], want["states"], strict=True):
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
