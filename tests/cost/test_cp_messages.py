"""cost/cp.py cp_messages against the bytes the cp runtime sent, as the cp benchmarks recorded them.

docs/results/{context_parallel,cp_families,titans_cp,cp_memory_caching}.json hold, per cp rank, the c10d calls
of one micro-batch's forward_backward counted by benchmarks/context_parallel.py's dispatch counter
(the full buffer of every all-gather and reduce-scatter, the tensor of every point-to-point send):
measured numbers, compared here exactly (the messages are whole tensors: no tolerance). At cp = 2
each rank sends per block one hop of every chain and halo (rank 0 forward, rank 1 the gradient
back); the ring sends 3 cp - 2 blocks per layer (cp - 1 forward, cp - 1 again and cp gradient
blocks backward, benchmarks/context_parallel.py); Ulysses' two all-to-alls run forward and again
on the gradients backward (the counter records each call's buffer). Hope's chain: the measured bytes in
docs/architectures.md (540,672 bytes from cp rank 0 per micro-batch, benchmarks/context_parallel.py
at its shape with model.arch=hope_attention).
"""
from __future__ import annotations

import json
import os

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.cp import ALLGATHER, ALLTOALL, CHAIN, HALO, RING, cp_messages
from megatron_taper.cost.memory import MemorySetup, model_memory
from tests.helpers.runner import REPO

CP_SHAPE = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=176",
            "model.taper.schedule=uniform", "model.taper.multiple=16", "model.vocab_size=256", "train.micro_batch=1"]


def _results(name: str) -> dict:
    with open(os.path.join(REPO, "docs", "results", name)) as f:
        return json.load(f)


def _rows():
    """(case, overrides, cp, cp_attention, the rank's measured c10d calls) of every cp > 1 row."""
    for r in _results("context_parallel.json")["results"]:
        if r["cp"] > 1:
            yield f"transformer_{r['cp_attention']}_cp{r['cp']}_{r['seq_len']}", [f"model.seq_len={r['seq_len']}"], \
                r["cp"], r["cp_attention"], r["comm_measured"]
    for r in _results("cp_families.json")["results"]:  # gated, Hope, bridge, Titans at S = 2048
        if r["cp"] > 1:
            yield f"{r['arch']}_{r['cp_attention']}_cp{r['cp']}_{r['seq_len']}", [*r["overrides"],
                                                                                   f"model.seq_len={r['seq_len']}"], \
                r["cp"], r["cp_attention"], r["comm_measured"]
    for r in _results("titans_cp.json")["results"]:
        if r["cp"] > 1:
            overrides = ["model.arch=titans", f"model.titans.variant={r['variant']}", f"model.seq_len={r['seq_len']}"]
            yield f"titans_{r['variant']}_{r['seq_len']}", overrides, r["cp"], "", r["comm_measured"]
    data = _results("cp_memory_caching.json")
    for r in data["results"]:
        if r["cp"] > 1:
            for rank in r["ranks"]:
                yield (f"{r['arch']}_{r['variant']}_{r['seq_len']}_{rank['cp_attention']}_rank{rank['rank']}",
                       [f"model.arch={r['arch']}", f"model.memory_caching.variant={r['variant']}",
                        f"model.seq_len={r['seq_len']}", *data["config"]], r["cp"], rank["cp_attention"],
                       rank["comm_measured"])


ROWS = {case: rest for case, *rest in _rows()}


@pytest.mark.parametrize("case", ROWS)
def test_message_bytes_equal_what_the_runtime_sent(case):
    overrides, cp, attention, measured = ROWS[case]
    cfg = load_config(None, CP_SHAPE + overrides).model
    ring = attention == "ring"
    messages = [m for block in cp_messages(cfg, 1, cfg.seq_len, cp, attention=attention or "allgather") for m in block]
    assert cp == 2 or ring or not any(m.kind in (CHAIN, HALO) for m in messages)  # one hop per block at cp = 2
    sends = sum(m.bytes for m in messages if m.kind in (CHAIN, HALO)) + (3 * cp - 2) * sum(
        m.bytes for m in messages if m.kind == RING)
    gathered = sum(m.bytes for m in messages if m.kind == ALLGATHER)
    assert sends == measured.get("p2p_send", {}).get("bytes", 0)
    assert gathered == measured.get("all_gather", {}).get("bytes", 0)
    assert gathered == measured.get("reduce_scatter", {}).get("bytes", 0)
    assert 2 * sum(m.bytes for m in messages if m.kind == ALLTOALL) == measured.get("all_to_all", {}).get("bytes", 0)


def test_hope_chain_bytes_equal_the_measured_sends():
    cfg = load_config(None, CP_SHAPE + ["model.arch=hope_attention", "model.seq_len=1024"]).model
    blocks = cp_messages(cfg, 1, 1024, 2)
    assert sum(m.bytes for block in blocks for m in block if m.kind == CHAIN) == 540_672
    assert all(sum(m.kind == ALLGATHER for m in block) == 1 for block in blocks)  # attention's K and V


def test_memory_model_charges_each_family_its_own_cp_term():
    """Titans' attention is a window: at cp = 2 a rank keeps its own K and V and the chain's state
    it received (and, in backward, its gradient), not the Transformer's all-gathered K and V."""
    cfg = load_config(None, CP_SHAPE + ["model.arch=titans", "model.seq_len=1024"]).model
    one, two = (model_memory(cfg, MemorySetup(cp=cp, activation_checkpointing="full")) for cp in (1, 2))
    state = max(m.bytes for block in cp_messages(cfg, 1, 1024, 2) for m in block)
    # full checkpointing: each block keeps its input (half the tokens) and what it received
    assert two.layers[0].kept == pytest.approx(one.layers[0].kept / 2 + state)
    transformer = load_config(None, CP_SHAPE + ["model.seq_len=1024"]).model
    t1, t2 = (model_memory(transformer, MemorySetup(cp=cp)) for cp in (1, 2))
    assert t2.layers[0].kept > t1.layers[0].kept / 2  # the gathered K and V of the whole sequence
