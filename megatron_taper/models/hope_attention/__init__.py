"""The Hope-attention family (`model.arch=hope_attention`, Nested Learning): attention followed by
a Continuum Memory System, MLP levels that also learn inside the sequence at their own frequencies.

model.py     the CMS levels, the block and model, and the decoder's online level state
fast_weights.py  a level's tp hooks, fast-weight shapes and SwiGLU activations (model.py and cp.py)
online.py    an online level as one scan over its chunks, with its hand-written backward
cost.py      its cost terms, the scan's FLOPs and the context-parallel message sizes (torch-free)
parallel.py  its tensor-parallel plan (the levels' collectives) and layout checks
cp.py        its context-parallel chain of the online levels' fast weights

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import HOPE_ATTENTION
from megatron_taper.models.hope_attention.cost import (
    hope_attention_layer_cost,
    hope_cp_document_messages,
    hope_cp_messages,
)
from megatron_taper.models.hope_attention.parallel import check_hope_layout, tp_plan_hope_attention_block
from megatron_taper.models.spec import FamilySpec, lazy

MODEL = "megatron_taper.models.hope_attention.model"

SPECS = (FamilySpec(card=HOPE_ATTENTION, build=lazy(MODEL, "HopeAttention"), layer_cost=hope_attention_layer_cost,
                    tp_block_plan=tp_plan_hope_attention_block, check_layout=check_hope_layout,
                    context_parallel=True, document_mask=True, document_mask_cp=True, document_mask_ulysses=True,
                    cp_balanced=False, cp_messages=hope_cp_messages, cp_document_messages=hope_cp_document_messages,
                    decoder=lazy(MODEL, "decoder")),)
