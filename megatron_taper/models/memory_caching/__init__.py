"""The Memory Caching families (Behrouz et al.): recurrent memories that cache their state at the
end of every segment. Two families, one code: `model.arch=linear_memory` (over a gated linear
attention) and `deep_memory` (over Titans' neural memory, models/titans/neural_memory.py).

model.py          the caching mixer, its blocks and both models
linear_memory.py  the linear base: gated linear attention in chunked, loop-free form
cost.py           both families' cost terms and context-parallel message sizes (torch-free)
parallel.py       their tensor-parallel plan and layout checks
cp.py             their context-parallel handover: a prefix for the linear memory, a chain for the deep one;
                  or (parallel.cp_attention=ulysses) each rank's share of the heads over the whole sequence

This module holds the families' SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import DEEP_MEMORY, LINEAR_MEMORY
from megatron_taper.models.memory_caching.cost import cp_messages, deep_memory_layer_cost, linear_memory_layer_cost
from megatron_taper.models.memory_caching.parallel import check_memory_caching_layout, tp_plan_memory_caching_block
from megatron_taper.models.spec import FamilySpec, lazy

MODEL = "megatron_taper.models.memory_caching.model"

SPECS = (FamilySpec(card=LINEAR_MEMORY, build=lazy(MODEL, "LinearMemoryLM"), layer_cost=linear_memory_layer_cost,
                    tp_block_plan=tp_plan_memory_caching_block, check_layout=check_memory_caching_layout,
                    context_parallel=True, document_mask=True, cp_balanced=False, cp_messages=cp_messages,
                    document_mask_ulysses=True),
         FamilySpec(card=DEEP_MEMORY, build=lazy(MODEL, "DeepMemoryLM"), layer_cost=deep_memory_layer_cost,
                    tp_block_plan=tp_plan_memory_caching_block, check_layout=check_memory_caching_layout,
                    context_parallel=True, document_mask=True, cp_balanced=False, cp_messages=cp_messages,
                    document_mask_ulysses=True))
