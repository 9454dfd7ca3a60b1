"""The recurrent families under context parallelism with documents (doc_start): the state passed
along the cp chain does not reset at document starts yet, so a window with a document start is
refused with one ValueError naming data.document_mask and parallel.cp, and an all-False doc_start
runs today's cp path bitwise. One 2-process launch (gloo, contiguous split) covers Titans MAG and
deep Memory Caching."""
import pytest
import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.parallel.cp.split import SequenceSplit, apply_context_parallel
from tests.helpers.documents import forward_with_documents
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        "model.seq_len=32", "model.taper.multiple=16", "model.titans.chunk_size=4", "model.titans.window=8"]
FAMILIES = {"titans": ["model.arch=titans", "model.titans.variant=mag"],
            "deep_memory": ["model.arch=deep_memory", "model.memory_caching.segment=8"]}


def _worker():
    rank = dist.get_rank()
    out = {}
    for name, overrides in FAMILIES.items():
        model = build_model(load_config(None, TINY + overrides).model)
        model.init_weights(0)
        apply_context_parallel(model, SequenceSplit(cp=2, rank=rank, group=dist.group.WORLD, balanced=False))
        tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))[:, 16 * rank:16 * (rank + 1)]
        with torch.no_grad():
            today = model(tokens)
            same = torch.equal(forward_with_documents(model, tokens, torch.zeros_like(tokens, dtype=torch.bool)), today)
            doc_start = torch.zeros_like(tokens, dtype=torch.bool)
            doc_start[:, 5] = True  # a start inside every rank's slice: every rank refuses before any message
            try:
                forward_with_documents(model, tokens, doc_start)
                message = None
            except ValueError as error:
                message = str(error)
        out[name] = (same, message)
    return out


def test_cp2_refuses_document_starts_and_runs_all_false_as_today():
    for per_rank in run_distributed(_worker, 2, timeout=180):
        for name, (same, message) in per_rank.items():
            assert same, name
            assert message is not None and "data.document_mask" in message and "parallel.cp" in message, (name, message)
