"""Attention restricted to the documents of a packed window (data.document_mask; models/layers.py,
models/documents.py), one process.

Model: 2 layers, d=32, 4 query heads over 2 kv heads (GQA), tapered MLP, vocab 50, fp32. A batch of
two windows of 24 tokens packs 3 documents (starts at 7 and 16) and 2 documents (start at 11), so
boundaries fall mid-window and every document but one sits after position 0.

Tolerances (fp32): a masked key adds exactly 0 to the softmax, so the packed run computes each
document's attention over the same keys as the document alone; what differs is the kernel's
summation order over the (masked) row and RoPE's angles at shifted absolute positions (only
relative positions matter in exact arithmetic). Measured: logits within 6e-8 of each document
alone, gradients within 2e-7 of their largest entry; asserted 1e-5 absolute on logits (values of
order 1) and 1e-5 relative on gradients.
"""
import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.data.sources import document_end_id
from megatron_taper.models import build_model, cards, family
from megatron_taper.models.documents import document_block_mask, document_starts, flex_document_attention
from megatron_taper.models.layers import cross_entropy, document_ids, document_mask
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.model import ParallelModel
from megatron_taper.validation import ConfigError

MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=64",
         "model.taper.multiple=16", "model.vocab_size=50", "model.seq_len=24"]
SEQ, STARTS = 24, [[0, 7, 16], [0, 11]]  # each row's document starts
CASES = {"transformer rope": ["model.arch=transformer"],
         "transformer alibi": ["model.arch=transformer", "model.position=alibi"],
         "gated_attention elementwise": ["model.arch=gated_attention"],
         "gated_attention headwise": ["model.arch=gated_attention", "model.gated.gate=headwise"]}


def _model(overrides):
    model = build_model(load_config(None, MODEL + overrides).model)
    model.init_weights(3)
    return model


def _doc_start():
    doc_start = torch.zeros(len(STARTS), SEQ, dtype=torch.bool)
    for row, starts in enumerate(STARTS):
        doc_start[row, starts[1:]] = True
    return doc_start


def _documents():
    """(row, first, end) of every document of the batch."""
    return [(row, a, b) for row, starts in enumerate(STARTS) for a, b in zip(starts, starts[1:] + [SEQ])]


@pytest.mark.parametrize("overrides", CASES.values(), ids=CASES.keys())
def test_a_packed_window_equals_each_document_alone(overrides):
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (len(STARTS), SEQ))
    weights = torch.randn(len(STARTS), SEQ, 50)  # the loss: a fixed projection of every logit

    packed = _model(overrides)
    logits = packed(tokens, doc_start=_doc_start())
    (logits * weights).sum().backward()

    alone = _model(overrides)
    for row, a, b in _documents():
        out = alone(tokens[row:row + 1, a:b])[0]
        assert (out - logits[row, a:b]).abs().max() < 1e-5, (row, a, b)
        (out * weights[row, a:b]).sum().backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        err = (p.grad - q.grad).abs().max() / q.grad.abs().max()
        assert err < 1e-5, (name, err.item())
    # without documents the same window is attended across its boundaries
    assert (packed(tokens) - logits).abs().max() > 1e-3


def test_doc_start_marks_the_token_after_each_end_of_document():
    tokens = torch.tensor([[5, 2, 7, 2, 2, 9], [2, 4, 4, 4, 4, 2]])
    assert document_starts(tokens, 2).tolist() == [[False, False, True, False, True, True],
                                                   [False, True, False, False, False, False]]
    assert document_ids(document_starts(tokens, 2)).tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1]]


def test_flex_attention_block_mask_equals_the_dense_mask():
    """The CUDA path's kernel run eagerly on the CPU (flex_attention's unfused form): the block mask
    built from the document ids visits exactly the blocks that hold a visible pair of the dense
    mask, and (its full blocks skipping the mask_mod) gives SDPA's result under the dense mask;
    with 16-token blocks over 150 tokens, blocks are full, empty or cut by a boundary or the diagonal."""
    seq, block = 150, 16
    doc_start = torch.zeros(3, seq, dtype=torch.bool)
    doc_start[0, [5, 64, 65, 120]] = True
    doc_start[1, [48]] = True  # row 2: one document
    ids = document_ids(doc_start)
    mask = document_block_mask(ids, block)
    dense = document_mask(doc_start)
    n = -(-seq // block)
    padded = F.pad(dense[:, 0], (0, n * block - seq, 0, n * block - seq))  # [B, n x block, n x block]
    visited = padded.unflatten(1, (n, block)).unflatten(3, (n, block)).any(4).any(2)  # [B, q blocks, kv blocks]
    assert torch.equal(mask.to_dense()[:, 0].bool(), visited)
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 4, seq, 8), torch.randn(3, 2, seq, 8), torch.randn(3, 2, seq, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        got = flex_document_attention(q, k, v, ids, compiled=False, block=block)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    assert (got - want).abs().max() < 1e-5


def test_without_the_switch_the_model_gets_no_doc_start():
    """data.document_mask=false (ParallelModel.document_end None): the model is called exactly as
    before (no keyword), and the loss is bitwise the plain forward's; with it, doc_start reaches the
    model and changes the loss."""
    model = _model([])
    seen = []
    model.register_forward_pre_hook(lambda _m, _args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    pm = ParallelModel(model, ParallelContext(1, 0, 0, 1, 1, 1, torch.device("cpu")))
    torch.manual_seed(0)
    tokens = torch.randint(3, 50, (2, SEQ + 1))
    tokens[:, [6, 15]] = 2
    with torch.no_grad():
        plain = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    off = pm.evaluate(tokens, contextlib.nullcontext)
    assert seen[-1] == {} and torch.equal(off, plain)
    pm.document_end = 2
    on = pm.evaluate(tokens, contextlib.nullcontext)
    assert seen[-1]["doc_start"][:, [7, 16]].all() and seen[-1]["doc_start"].sum() == 4
    assert abs(on - off) > 1e-4


def test_bad_configs_are_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data.document_mask=true needs .*\.npy"):
        load_config(None, ["data.document_mask=true", "data.path=tokens.npy"])
    unsupported = [name for name in cards() if not family(name).document_mask]
    if unsupported:  # (a family without document support, while there is one)
        cfg = load_config(None, ["data.document_mask=true", f"model.arch={unsupported[0]}"])
        with pytest.raises(ConfigError, match=rf"data.document_mask=true: model.arch='{unsupported[0]}' .*transformer"):
            preflight(cfg, 1)
    # under cp: the families whose state passing keeps documents; under Ulysses' all-to-alls the
    # attention families, the per-head memories and those whose chain stays (Titans' window of 64
    # needs slices of at least 63 tokens: seq_len 128)
    for arch, attention in (("transformer", "ring"), ("titans", "allgather"), ("hope_attention", "allgather"),
                            ("bridge", "ring"), ("transformer", "ulysses"), ("gated_attention", "ulysses"),
                            ("hope_attention", "ulysses"), ("titans", "ulysses"), ("linear_memory", "ulysses"),
                            ("deep_memory", "ulysses")):
        cfg = load_config(None, ["data.document_mask=true", f"model.arch={arch}", "parallel.cp=2",
                                 f"parallel.cp_attention={attention}", "model.seq_len=128"])
        preflight(cfg, 2)
    # a family refused under ring / all-gather (tree, Memory Caching) is pointed at Ulysses where it
    # keeps documents there
    layouts = {"tree": ["model.n_layers=1"], "linear_memory": ["model.memory_caching.segment=16"],
               "deep_memory": ["model.memory_caching.segment=16"]}
    refused = [name for name in cards() if family(name).document_mask and not family(name).document_mask_cp]
    assert refused and set(refused) <= set(layouts), refused
    for arch in refused:
        cfg = load_config(None, ["data.document_mask=true", f"model.arch={arch}", "parallel.cp=2",
                                 "parallel.cp_attention=ring", "model.seq_len=128", *layouts[arch]])
        with pytest.raises(ConfigError, match=rf"data.document_mask=true with parallel.cp=2 .*'{arch}'") as refusal:
            preflight(cfg, 2)
        assert ("use parallel.cp_attention=ulysses" in str(refusal.value)) == family(arch).document_mask_ulysses, arch
    # a variant refused where its family keeps documents: Titans MAC's state along the cp chain (at
    # preflight, not when a rank first sees a document start)
    cfg = load_config(None, ["data.document_mask=true", "model.arch=titans", "model.titans.variant=mac",
                             "parallel.cp=2", "parallel.cp_attention=allgather", "model.seq_len=128"])
    with pytest.raises(ConfigError, match=r"parallel.cp=2 .*model.titans.variant='mac'"):
        preflight(cfg, 2)
    preflight(load_config(None, ["model.arch=titans", "model.titans.variant=mac", "parallel.cp=2",
                                 "parallel.cp_attention=allgather", "model.seq_len=128"]), 2)
    (tmp_path / "train").mkdir()
    (tmp_path / "stats.json").write_text('{"vocab_size": 512}')
    cfg = load_config(None, ["data.document_mask=true", f"data.path={tmp_path}"])
    with pytest.raises(ConfigError, match=r"data.path=.* records no end-of-document id"):
        document_end_id(cfg.data, cfg.model.vocab_size)
