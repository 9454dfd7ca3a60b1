"""The recurrent families under context parallelism with documents (doc_start), one 2-process
launch (gloo, contiguous split):
- Titans MAG and MAL (depth-2 memory, convolution of 4 taps, chunks of 4 rows behind P=2 persistent
  tokens, window 8) on a window of 32 tokens: row 0 holds documents starting at 0, 5, 16 (a start at
  rank 1's first token) and 21, row 1 at 0, 11 (a document across the slices: rank 1 continues its
  open chunk and its window) and 30. Logits and every parameter's gradient (summed over the cp ranks)
  against one process with the same doc_start. fp32: the same sums in another order (rank 1 scans
  the open chunk again from the state it was handed, the window over the halo): logits within
  1e-6, gradients within 3e-6 of the largest (measured 3e-8 and 1e-7 on logits, 2.3e-7 and 3.2e-7
  of the largest gradient, MAG and MAL; handing on no open chunk gives 7e-6 and 1.2e-3). The bytes
  each rank sends equal cost/cp.py cp_messages with documents exactly.
- deep Memory Caching, whose state passing does not reset yet: a document start inside a slice is
  refused with one ValueError naming data.document_mask and parallel.cp, and an all-False
  doc_start runs today's cp path bitwise.
"""
import pytest
import torch
import torch.distributed as dist

from megatron_taper.config import load_config
from megatron_taper.cost.cp import CHAIN, cp_messages
from megatron_taper.models import build_model
from megatron_taper.parallel.cp.split import SequenceSplit, apply_context_parallel
from tests.helpers.cp_harness import c10d_counter
from tests.helpers.documents import forward_with_documents, grads_of
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

SEQ = 32
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        f"model.seq_len={SEQ}", "model.taper.multiple=16", "model.titans.chunk_size=4", "model.titans.window=8",
        "model.titans.conv_kernel=4", "model.titans.persistent_tokens=2", "model.titans.memory_depth=2"]
TITANS = {"mag": ["model.arch=titans", "model.titans.variant=mag"],
          "mal": ["model.arch=titans", "model.titans.variant=mal"]}
REFUSED = ["model.arch=deep_memory", "model.memory_caching.segment=8"]
LOGIT_TOL, GRAD_TOL = 1e-6, 3e-6


def build(overrides):
    model = build_model(load_config(None, TINY + overrides).model)
    model.init_weights(0)
    return model


def window():
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    doc_start = torch.zeros(2, SEQ, dtype=torch.bool)
    doc_start[0, [0, 5, 16, 21]] = True
    doc_start[1, [11, 30]] = True
    probe = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    return tokens, doc_start, probe


def one_process(overrides):
    model = build(overrides)
    tokens, doc_start, probe = window()
    logits = forward_with_documents(model, tokens, doc_start)
    return logits.detach(), grads_of(model, (logits * probe).sum())


def _worker():
    rank = dist.get_rank()
    split = SequenceSplit(cp=2, rank=rank, group=dist.group.WORLD, balanced=False)
    mine = slice(SEQ // 2 * rank, SEQ // 2 * (rank + 1))
    tokens, doc_start, probe = window()
    out = {}
    for name, overrides in TITANS.items():
        model = build(overrides)
        apply_context_parallel(model, split)
        with c10d_counter() as counter:
            logits = forward_with_documents(model, tokens[:, mine], doc_start[:, mine])
            grads = grads_of(model, (logits * probe[:, mine]).sum())
        for g in grads.values():
            dist.all_reduce(g)
        out[name] = (logits.detach(), grads, dict(counter.bytes))
    model = build(REFUSED)
    apply_context_parallel(model, split)
    with torch.no_grad():
        today = model(tokens[:, mine])
        same = torch.equal(forward_with_documents(model, tokens[:, mine], torch.zeros_like(doc_start[:, mine])), today)
        try:
            forward_with_documents(model, tokens[:, mine], doc_start[:, mine])  # starts inside both slices
            message = None
        except ValueError as error:
            message = str(error)
    out["refused"] = (same, message)
    return out


def test_cp2_titans_documents_match_one_process_and_memory_caching_refuses():
    ranks = run_distributed(_worker, 2, timeout=300)
    for name, overrides in TITANS.items():
        logits, grads = one_process(overrides)
        got = torch.cat([r[name][0] for r in ranks], dim=1)
        scale = max(g.abs().max().item() for g in grads.values())
        logit_diff = (got - logits).abs().max().item()
        grad_diff = max((ranks[0][name][1][n] - g).abs().max().item() for n, g in grads.items())
        assert logit_diff < LOGIT_TOL and grad_diff < GRAD_TOL * scale, (name, logit_diff, grad_diff, scale)
        # the chain's messages with documents (state, whole open chunk, window tail, ends) equal the
        # cost model's exactly: rank 0 sends them, rank 1 their gradient back; nothing is gathered
        cfg = load_config(None, TINY + overrides).model
        messages = [m for block in cp_messages(cfg, 2, SEQ, 2, documents=True) for m in block]
        assert {m.kind for m in messages} == {CHAIN}, messages
        want = {"p2p_send": sum(m.bytes for m in messages)}
        assert [r[name][2] for r in ranks] == [want, want], (name, want)
    for r in ranks:
        same, message = r["refused"]
        assert same
        assert message is not None and "data.document_mask" in message and "parallel.cp" in message, message
