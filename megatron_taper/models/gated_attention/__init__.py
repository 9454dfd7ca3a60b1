"""The Gated Attention family (`model.arch=gated_attention`, Qiu et al. 2025): a sigmoid gate on
each attention head's output, otherwise the tapered Transformer.

model.py     the gated attention, its block and model, and its KV-cache decoder
cost.py      its block's cost terms (torch-free)
parallel.py  its block's tensor-parallel plan

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import GATED_ATTENTION
from megatron_taper.models.gated_attention.cost import gated_attention_layer_cost
from megatron_taper.models.gated_attention.parallel import tp_plan_gated_attention_block
from megatron_taper.models.spec import FamilySpec, lazy

MODEL = "megatron_taper.models.gated_attention.model"

SPECS = (FamilySpec(card=GATED_ATTENTION, build=lazy(MODEL, "GatedTransformer"),
                    layer_cost=gated_attention_layer_cost, tp_block_plan=tp_plan_gated_attention_block,
                    context_parallel=True, document_mask=True, document_mask_cp=True,
                    document_mask_ulysses=True, decoder=lazy(MODEL, "decoder")),)
