"""The Transformer family (`model.arch=transformer`): a Llama-style decoder with tapered MLP widths.

model.py     the blocks and the model (RoPE or ALiBi), and its KV-cache decoder
cost.py      its block's cost terms (torch-free)
parallel.py  its block's tensor-parallel plan

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import TRANSFORMER
from megatron_taper.models.hf_llama import LLAMA
from megatron_taper.models.spec import FamilySpec, lazy
from megatron_taper.models.transformer.cost import transformer_layer_cost
from megatron_taper.models.transformer.parallel import tp_plan_transformer_block

MODEL = "megatron_taper.models.transformer.model"

SPECS = (FamilySpec(card=TRANSFORMER, build=lazy(MODEL, "Transformer"), layer_cost=transformer_layer_cost,
                    tp_block_plan=tp_plan_transformer_block, context_parallel=True, decoder=lazy(MODEL, "decoder"),
                    hf=LLAMA, document_mask=True, document_mask_cp=True, document_mask_ulysses=True),)
