"""Document-masked attention (data.document_mask) under context, pipeline, tensor and ZeRO
parallelism against one process with the same documents.

The model, batches and steps are test_context_parallel.py's (tests/helpers/cp_harness.py: 2
layers, d=64, GQA, seq_len 64, AdamW steps of 2 micro-batches of 2 rows), with end-of-document
tokens at positions 20, 28 and 48 of even rows and 24 of odd ones: at cp=2 (chunks of 16; rank 0
holds positions 0-15 and 48-63) documents cross both ranks' chunks, so each rank's mask needs the
document ids counted over the whole sequence (the doc_start all-gather of parallel/cp/split.py).
Under Ulysses (parallel/cp/ulysses.py) each rank attends over the whole sequence for 2 of the 4
heads, in the sequence's order after the all-to-all: documents start inside both ranks' slices (at
49 on rank 0, at 21, 25 and 29 on rank 1) and cross the slice boundaries (0-20: positions 0-15 on
rank 0, 16-20 on rank 1; 29-48: 29-47 on rank 1, 48 on rank 0), and the mask must be built from
the ids in that order.
The one-process reference derives doc_start from the same tokens. Tolerances and why they hold:
test_context_parallel.py's (the same fp32 sums in another order; a masked key adds exactly 0).
"""
import pytest

from tests.helpers.cp_harness import compare, merge_stages, reference, stage_worker
from tests.helpers.harness import run_distributed
from tests.parallel.test_context_parallel import MODEL

pytestmark = pytest.mark.multiprocess

DOCUMENTS = ["data.document_mask=true"]
STEPS = 2


def test_document_mask_at_cp2_pp2_tp2_and_fsdp2_matches_one_process():
    """2 processes, one launch, 2 steps: cp=2 with the all-gather (RoPE), with the ring (Gated
    Attention) and with Ulysses (the Transformer with ALiBi: the bias set to -inf outside the
    document; Gated Attention with RoPE: the boolean mask), pp=2 under 1F1B (doc_start cut into
    micro-batches and handed to both stages), tp=2 with sequence parallelism (attention gathers
    the sequence; the mask is the whole window's) and dp=2 with fsdp2 (each rank its own rows and
    their doc_start). DDP and DeepSpeed hand doc_start to the model as the same keyword
    (ParallelModel.batch_inputs) and are not run here."""
    layouts = {"cp=2 allgather rope": ["parallel.cp=2"],
               "cp=2 ring gated_attention": ["parallel.cp=2", "parallel.cp_attention=ring",
                                             "model.arch=gated_attention"],
               "cp=2 ulysses alibi": ["parallel.cp=2", "parallel.cp_attention=ulysses", "model.position=alibi"],
               "cp=2 ulysses gated_attention": ["parallel.cp=2", "parallel.cp_attention=ulysses",
                                                "model.arch=gated_attention"],
               "pp=2 1f1b": ["parallel.pp=2"],
               "tp=2 sequence parallel": ["parallel.tp=2", "parallel.sequence_parallel=true"],
               "dp=2 fsdp2": ["parallel.zero=fsdp2"]}
    got = merge_stages(run_distributed(stage_worker, 2, [MODEL + DOCUMENTS + o for o in layouts.values()], STEPS,
                                       timeout=240))
    for (label, overrides), rec in zip(layouts.items(), got):
        ref = reference(MODEL + DOCUMENTS + [o for o in overrides if o.startswith("model.")], STEPS)
        compare(rec, ref, f"documents {label}")
    # the documents change the training (so the layouts above did mask)
    assert abs(reference(MODEL, STEPS)["loss"][-1] - reference(MODEL + DOCUMENTS, STEPS)["loss"][-1]) > 1e-3
