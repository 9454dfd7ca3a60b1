"""The recurrent families reset at document starts (doc_start, issue 43): a packed window of 2-3
documents, one starting inside a memory chunk (and a MAC segment), against each document run alone
from the same weights; doc_start=None and an all-False doc_start give today's results bitwise.

Float32. The packed and the alone runs do the same math in another order (the packed memory scans
a document's last chunk padded to C rows, the window attention runs blockwise over the window) so
they differ by rounding only: logits within 1e-4 and every parameter's gradient within 1e-4 of the
largest gradient (measured: see each test's comment).
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.models.bridge.model import take_state
from megatron_taper.models.local_attention import blockwise_window_attention, flex_window_attention
from megatron_taper.models.titans.documents import document_ids
from tests.helpers.documents import documents_of, forward_with_documents, none_is_today, packed_against_alone

SEQ = 24
TINY = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        f"model.seq_len={SEQ}", "model.taper.multiple=16"]
TOL = 1e-4


def build(*overrides: str):
    model = build_model(load_config(None, TINY + list(overrides)).model)
    model.init_weights(0)
    return model


def windows() -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [2, SEQ] and doc_start: row 0 holds documents of 5, 9 and 10 tokens (starts at 5 and 14,
    inside chunks of 4 and 6 and segments of 8), row 1 of 11 and 13."""
    tokens = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    doc_start = torch.zeros(2, SEQ, dtype=torch.bool)
    doc_start[0, [0, 5, 14]] = True
    doc_start[1, 11] = True
    return tokens, doc_start


def check_family(model) -> tuple[float, float]:
    tokens, doc_start = windows()
    assert none_is_today(model, tokens)
    today = model(tokens)
    assert torch.equal(forward_with_documents(model, tokens, torch.zeros_like(doc_start)), today)
    with torch.no_grad():  # the documents matter: reading across them gives other logits
        assert (forward_with_documents(model, tokens, doc_start) - today).abs().max() > 1e-3
    logits, grads, scale = packed_against_alone(model, tokens, doc_start)
    assert logits < TOL and grads < TOL * scale, (logits, grads, scale)
    return logits, grads / scale


TITANS = ["model.arch=titans", "model.titans.chunk_size=4", "model.titans.window=8", "model.titans.conv_kernel=4",
          "model.titans.persistent_tokens=2"]


# measured (2 layers): logits <= 8e-6, gradients <= 2.2e-5 of the largest (mac; mag, mal <= 3e-7)
@pytest.mark.parametrize("variant,depth", [("mag", 2), ("mal", 1), ("mac", 2)])
def test_titans_resets_at_document_starts(variant, depth):
    check_family(build(*TITANS, f"model.titans.variant={variant}", f"model.titans.memory_depth={depth}"))


MEMORY_CACHING = ["model.memory_caching.segment=8", "model.memory_caching.linear_chunk=4", "model.titans.chunk_size=4",
                  "model.memory_caching.linear_conv_kernel=4", "model.titans.conv_kernel=4"]


# every scan path: linear (one chunked scan with resets; `none` aligned to chunks), deep continuing
# segments in one scan (residual), one by one (soup), independent segments folded into the batch (ssc)
# measured: logits <= 1.2e-7, gradients <= 2.4e-7 of the largest
@pytest.mark.parametrize("arch,variant,mode", [
    ("linear_memory", "grm", "checkpoint"), ("linear_memory", "none", "checkpoint"),
    ("deep_memory", "residual", "checkpoint"), ("deep_memory", "soup", "checkpoint"),
    ("deep_memory", "ssc", "independent")])
def test_memory_caching_resets_at_document_starts(arch, variant, mode):
    check_family(build(*MEMORY_CACHING, f"model.arch={arch}", f"model.memory_caching.variant={variant}",
                       f"model.memory_caching.write_mode={mode}", "model.memory_caching.top_k=1"))


HOPE = ["model.arch=hope_attention", "model.hope.levels=2", "model.hope.chunk_size=3", "model.hope.chunk_growth=2",
        "model.hope.online_lr=2.0"]


# measured: logits <= 9e-8, gradients <= 1.2e-7 of the largest
@pytest.mark.parametrize("online", ["true", "false"])
def test_hope_attention_resets_at_document_starts(online):
    check_family(build(*HOPE, f"model.hope.online={online}"))


BRIDGE = ["model.arch=bridge", "model.n_layers=2", "model.bridge.segment=4", "model.bridge.slots=3"]


# measured: logits <= 6e-8, gradients <= 1.4e-7 of the largest
def test_bridge_resets_at_document_starts():
    """Also with carry_state: the state a packed window hands on is its last document's alone
    (measured 2e-9)."""
    model = build(*BRIDGE, "model.bridge.carry_state=true")
    with torch.no_grad():  # the read's output projection starts at zero: make the bridge matter
        model.bridge.read.wo.weight.normal_(0, 0.2)
    check_family(model)
    tokens, doc_start = windows()
    with torch.no_grad():
        forward_with_documents(model, tokens, doc_start)
        packed = take_state(model)
        for b, docs in enumerate(documents_of(doc_start)):
            start, end = docs[-1]
            model(tokens[b:b + 1, start:end])
            torch.testing.assert_close(packed[b], take_state(model)[0], rtol=0, atol=1e-6)


# measured: logits <= 9e-8, gradients <= 1e-7 of the largest
def test_tree_resets_at_document_starts():
    check_family(build("model.arch=tree", "model.tree.cell_width=48"))


def dense_document_window(q, k, v, prefix: int, window: int, ids: torch.Tensor) -> torch.Tensor:
    """The sliding window within documents from its definition: query i sees key row j < P, and
    key row P + j when i - W < j <= i and ids[b, i] == ids[b, j]; one [B, 1, S, P + S] mask."""
    seq = q.shape[2]
    i = torch.arange(seq)[:, None]
    j = torch.arange(prefix + seq)[None, :] - prefix
    band = (j < 0) | ((i - j >= 0) & (i - j < window))
    same = ids[:, :, None] == ids[:, None, :].expand(-1, seq, -1)  # [B, S, S]
    mask = band & torch.cat((torch.ones(q.shape[0], seq, prefix, dtype=torch.bool), same), dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


# fp32, the same sums as the dense reference in another order: 1e-5 (test_titans_kernels' tolerance)
@pytest.mark.parametrize("seq,prefix,window", [(24, 2, 8), (37, 0, 10), (20, 3, 64)])
def test_window_kernels_stay_inside_documents(seq, prefix, window):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, seq, 16, generator=g)
    k, v = (torch.randn(2, 2, prefix + seq, 16, generator=g) for _ in range(2))
    doc_start = torch.rand(2, seq, generator=g) < 0.2
    ids = document_ids(doc_start)
    ref = dense_document_window(q, k, v, prefix, window, ids)
    torch.testing.assert_close(blockwise_window_attention(q, k, v, prefix, window, ids), ref, rtol=0, atol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()"
        flex = flex_window_attention(q, k, v, prefix, window, compiled=False, doc_ids=ids)
    torch.testing.assert_close(flex, ref, rtol=0, atol=1e-5)
