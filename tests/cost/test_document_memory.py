"""What data.document_mask adds to the memory model (cost/attention_memory.py document_mask_bytes), against the
tensors autograd saves and the block mask FlexAttention is handed.

- One process on the CPU: a Transformer block's forward with documents saves, beside what it saves
  without them (causal SDPA keeps no mask), SDPA's additive mask [b, 1, S, S] in the query's dtype
  (the boolean document mask converted; measured, torch 2.13): the model's kept bytes of the block
  grow by exactly that (fp32: elements x 4 bytes), and not at all where the block recomputes.
- FlexAttention (CUDA with RoPE): the block mask's tensors as models/documents.py builds them (here
  on the CPU, where the block mask is built the same way; flex_attention's backward needs CUDA) and
  the document ids its mask_mod reads: the model's bytes are their sizes, exactly.
The cp > 1 terms (the all-gather's [b, 1, S / cp, S] mask, the messages) are measured in the
2-process launch of tests/parallel/test_cp_documents_chain.py.
"""
import dataclasses

import torch

from megatron_taper.config import load_config
from megatron_taper.cost.attention_memory import document_mask_bytes
from megatron_taper.cost.memory import MemorySetup, model_memory
from megatron_taper.models import build_model
from megatron_taper.models.documents import document_block_mask
from megatron_taper.models.layers import document_ids, rope_tables
from tests.helpers.runner import saved_elements

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        "model.seq_len=64", "model.taper.multiple=16"]


def _saved(model, x, cos, sin, doc_start):
    block = model.layers["0"]
    return saved_elements(model, lambda: block(x, cos, sin) if doc_start is None else
                          block(x, cos, sin, doc_start=doc_start))


def test_one_process_block_keeps_sdpa_mask_as_the_model_says():
    cfg = load_config(None, TINY).model
    model = build_model(cfg)
    model.init_weights(0)
    batch = 3
    x = torch.randn(batch, cfg.seq_len, cfg.d_model, requires_grad=True)
    cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, x.device)
    doc_start = torch.zeros(batch, cfg.seq_len, dtype=torch.bool)
    doc_start[:, [9, 40]] = True
    added = 4 * (_saved(model, x, cos, sin, doc_start) - _saved(model, x, cos, sin, None))  # fp32 bytes
    setup = MemorySetup(micro_batch=batch, optimizer=False)
    plain, masked = (model_memory(cfg, dataclasses.replace(setup, documents=on)) for on in (False, True))
    assert added == 4 * batch * cfg.seq_len ** 2
    assert masked.layers[0].kept - plain.layers[0].kept == added
    recomputed = dataclasses.replace(setup, activation_checkpointing="full")
    assert model_memory(cfg, dataclasses.replace(recomputed, documents=True)).layers[0].kept == \
        model_memory(cfg, recomputed).layers[0].kept


def test_flex_block_mask_bytes_are_its_tensors():
    cfg = load_config(None, TINY + ["model.seq_len=300"]).model
    batch = 2
    doc_start = torch.zeros(batch, cfg.seq_len, dtype=torch.bool)
    doc_start[0, [100, 250]] = True
    doc_start[1, 129] = True
    ids = document_ids(doc_start)
    mask = document_block_mask(ids)
    tensors = [t for t in mask.as_tuple(flatten=True) if isinstance(t, torch.Tensor)] + [ids]
    real = sum(t.numel() * t.element_size() for t in tensors)
    setup = MemorySetup(micro_batch=batch, documents=True, flex=True)
    assert document_mask_bytes(cfg, [64, 64], setup) == [real, real]
