"""All-to-all (Ulysses) context parallelism for the recurrent families with per-head state, with and
without packed documents, against one process (models/memory_caching/cp.py ulysses_reads,
models/titans/cp.py): each cp rank scans the whole sequence for its share of the heads, no chain.

Training (tests/helpers/cp_harness.py: fp32, gloo, 3 AdamW steps of 2 micro-batches of 2
sequences, each layout built from the same seed): the linear and the deep Memory Caching memories
(test_cp_memory_caching.py's model: 4 heads of 16, seq_len 64 in segments of 16, chunks of 8, 4
convolution taps; each cp rank scans the 64 tokens for 2 heads) and Titans MAG / MAL with documents
(test_cp_titans.py's model: 2 heads, chunks of 16 rows behind 4 persistent tokens, window 8).
With data.document_mask the harness's rows start documents at tokens 21, 29 and 49 (even rows) and
25 (odd rows): inside a segment (16) and a chunk (8; Titans' 16 behind 4 persistent rows), and the
document from 29 crosses the slice boundary at 32, so each rank needs the other's starts (the
all-gathered doc_start) and its heads' scan packs the whole sequence's documents. Tolerances: those
of the families' cp tests (test_cp_memory_caching.py TOL, test_cp_titans.py TOLERANCES), for the
same reason: the forward is the one-process computation for each head, and the gradients of the
projections sum over the cp ranks' heads and tokens in another order; AdamW then carries those
roundings into the later steps. Measured at most: losses 4.8e-7, gradients 1.4e-5 (the deep
memory's soup; the others <= 4.6e-6), gradient norms 1.1e-7, final parameters 1.1e-5 (in float64,
outside this test, the memories' logits agree to the bit and the gradients to 5e-14 after one
forward + backward).

Bytes: one forward + backward of one micro-batch after training, the c10d all-to-alls counted by a
dispatch mode (each call's buffer): equal to twice (forward and backward) the cost model's
all-to-all bytes (cost/cp.py cp_messages; memory_caching/cost.py, titans/cost.py ulysses_bytes),
exactly (whole tensors).

4 processes, once: the deep memory (grm) with documents at cp=2 x fsdp2 dp=2 (the memory's per-head
parameters sliced by each cp rank from the gathered FSDP2 shards; measured: gradients 1.6e-5, final
parameters 8.4e-6).

Preflight (no processes): under Ulysses the Memory Caching slices need not hold whole segments
(the prefix's and the chain's rule), documents are kept, and heads that do not divide by cp are
refused with the keys (parallel.cp, model.n_heads, parallel.tp).
"""
import re
from contextlib import nullcontext

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.cp import ALLGATHER, ALLTOALL, HALO, cp_messages
from megatron_taper.cost.preflight import preflight
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import batch, build, c10d_counter, compare, merge_stages, reference, stage_worker, train
from tests.helpers.harness import run_distributed
from tests.parallel.test_cp_memory_caching import MODEL as MEMORY_CACHING
from tests.parallel.test_cp_memory_caching import TOL as MEMORY_CACHING_TOL
from tests.parallel.test_cp_titans import MODEL as TITANS
from tests.parallel.test_cp_titans import TOLERANCES as TITANS_TOL

ULYSSES = ["parallel.cp=2", "parallel.cp_attention=ulysses"]
DOCUMENTS = ["data.document_mask=true"]


def _memory_caching(arch, variant, *more):
    return MEMORY_CACHING + [f"model.arch={arch}", f"model.memory_caching.variant={variant}", *more]


CASES = {
    "linear_memory grm": (_memory_caching("linear_memory", "grm"), MEMORY_CACHING_TOL),
    "linear_memory ssc independent, documents": (
        _memory_caching("linear_memory", "ssc", "model.memory_caching.write_mode=independent", *DOCUMENTS),
        MEMORY_CACHING_TOL),
    "deep_memory soup": (_memory_caching("deep_memory", "soup"), MEMORY_CACHING_TOL),
    "deep_memory residual, documents": (_memory_caching("deep_memory", "residual", *DOCUMENTS), MEMORY_CACHING_TOL),
    "titans mag, documents": (TITANS + ["model.titans.variant=mag", *DOCUMENTS], TITANS_TOL),
    "titans mal, documents": (TITANS + ["model.titans.variant=mal", *DOCUMENTS], TITANS_TOL),
}


def _train_and_count(layouts):
    """Each layout: rank 0's training records, and this rank's c10d bytes by kind (all-to-all,
    all-gather, point-to-point) in one more forward + backward of one micro-batch."""
    out = []
    for overrides in layouts:
        run = build(overrides)
        rec = train(run, run.ctx.rank == 0)
        with c10d_counter() as counter:
            run.model.forward_backward([batch(run.cfg)[:2]], nullcontext)
        out.append((rec, dict(counter.bytes)))
    return out


@pytest.mark.multiprocess
def test_ulysses_cp2_matches_one_process_with_and_without_documents():
    """One 2-process launch: every case at cp=2 under Ulysses against one process, and its bytes."""
    results = run_distributed(_train_and_count, 2, [o + ULYSSES for o, _ in CASES.values()], timeout=600)
    for case, (label, (overrides, tol)) in enumerate(CASES.items()):
        compare(results[0][case][0], reference(overrides), f"ulysses cp=2 {label}", tol)
        cfg = load_config(None, overrides)
        messages = [m for block in cp_messages(cfg.model, 2, cfg.model.seq_len, 2, attention="ulysses",
                                               documents=cfg.data.document_mask) for m in block]
        # the all-to-alls forward and backward; with documents every block all-gathers doc_start
        # (forward only); Titans' window takes its halo from rank 0, rank 1 sends its gradient back
        halo = sum(m.bytes for m in messages if m.kind == HALO)
        assert (halo > 0) == ("titans" in label), label
        want = {"all_to_all": 2 * sum(m.bytes for m in messages if m.kind == ALLTOALL),
                "all_gather": sum(m.bytes for m in messages if m.kind == ALLGATHER), "p2p_send": halo}
        assert want["all_gather"] > 0 or not cfg.data.document_mask, label
        for rank in results:
            got = rank[case][1]
            assert {kind: got.get(kind, 0) for kind in want} == want, (label, got, want)
            # and the gradients' all-reduce over the cp ranks (DDP's), nothing else
            assert {kind for kind, size in got.items() if size} <= {*want, "all_reduce"}, got


@pytest.mark.multiprocess
def test_ulysses_deep_memory_documents_with_fsdp2():
    """4 processes: the deep memory with documents at cp=2 x fsdp2 dp=2 (FSDP2 shards over dp x cp)."""
    overrides = _memory_caching("deep_memory", "grm", *DOCUMENTS)
    got = merge_stages(run_distributed(stage_worker, 4, [overrides + ULYSSES + ["parallel.zero=fsdp2"]],
                                       timeout=300))[0]
    compare(got, reference(overrides), "ulysses cp=2 x fsdp2 dp=2 deep_memory grm, documents", MEMORY_CACHING_TOL)


def test_preflight_under_ulysses():
    """Memory Caching with slices of 24 tokens (segment 16) and documents passes under Ulysses and is
    refused by the prefix's rule without it; 4 heads over tp=4 do not split over cp=2."""
    slices = _memory_caching("linear_memory", "grm", "model.seq_len=48", *DOCUMENTS)
    preflight(load_config(None, slices + ULYSSES), 2)
    with pytest.raises(ConfigError, match=re.escape("model.memory_caching.segment=16 does not divide")):
        preflight(load_config(None, _memory_caching("linear_memory", "grm", "model.seq_len=48", "parallel.cp=2")), 2)
    with pytest.raises(ConfigError, match=re.escape("model.n_heads=4 / parallel.tp=4 = 1 heads per tp rank must "
                                                    "divide by parallel.cp=2")):
        four = _memory_caching("deep_memory", "soup", "parallel.tp=4", "model.taper.multiple=8")
        preflight(load_config(None, four + ULYSSES), 8)
