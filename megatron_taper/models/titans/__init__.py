"""The Titans family (`model.arch=titans`, Behrouz et al. 2024): attention plus a neural long-term
memory, as a gate (MAG), a layer (MAL) or context (MAC).

model.py          the blocks and the model (single-device code)
neural_memory.py  the neural memory: its chunked parallel form and hand-written backward (also the
                  deep Memory Caching family's base)
convolution.py    the causal depthwise convolution on the memories' q, k, v
cost.py           its cost terms and context-parallel message sizes (torch-free)
parallel.py       its tensor-parallel plan and layout checks (torch-free at module level)
cp.py             its context-parallel forward: the memory's state passed along the cp chain, or
                  (parallel.cp_attention=ulysses) each rank's share of the heads scanned whole (its
                  all-to-all helpers also serve Memory Caching)
documents.py      packed documents (data.document_mask): each moved to a chunk or segment boundary
                  with its own positions (also used by Memory Caching, Hope-attention, the bridge, the tree)

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import TITANS
from megatron_taper.models.spec import FamilySpec, lazy
from megatron_taper.models.titans.cost import cp_document_messages, cp_messages, titans_layer_cost
from megatron_taper.models.titans.parallel import check_titans_documents, check_titans_layout, tp_plan_titans_block

SPECS = (FamilySpec(card=TITANS, build=lazy("megatron_taper.models.titans.model", "Titans"),
                    layer_cost=titans_layer_cost, tp_block_plan=tp_plan_titans_block,
                    check_layout=check_titans_layout, context_parallel=True, cp_balanced=False,
                    cp_messages=cp_messages, cp_document_messages=cp_document_messages,
                    document_mask=True, document_mask_cp=True,
                    document_mask_ulysses=True, check_documents=check_titans_documents),)
