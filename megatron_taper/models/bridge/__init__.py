"""The memory bridge family (`model.arch=bridge`): a tapered Transformer with a GRU state of slots
between its lower and upper halves, written after each segment and read by the later ones
(docs/memory_bridge.md).

model.py     the bridge, its block and model, and the carried state's put / take
cost.py      the bridge's cost terms and its state's context-parallel messages (torch-free)
parallel.py  its tensor-parallel plan and layout checks
cp.py        its context-parallel chain of the state, and the carried state's broadcast

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.bridge.cost import bridge_block_cost, bridge_cp_document_messages, bridge_cp_messages
from megatron_taper.models.bridge.parallel import check_bridge_layout, tp_plan_bridge_block
from megatron_taper.models.cards import BRIDGE
from megatron_taper.models.spec import CarriedState, FamilySpec, lazy
from megatron_taper.models.transformer.cost import transformer_layer_cost

MODEL = "megatron_taper.models.bridge.model"

SPECS = (FamilySpec(card=BRIDGE, build=lazy(MODEL, "MemoryBridgeLM"), layer_cost=transformer_layer_cost,
                    block_extra_cost=bridge_block_cost, tp_block_plan=tp_plan_bridge_block,
                    check_layout=check_bridge_layout, context_parallel=True, document_mask=True, document_mask_cp=True,
                    document_mask_ulysses=True, cp_balanced=False,
                    cp_messages=bridge_cp_messages, cp_document_messages=bridge_cp_document_messages,
                    carried_state=CarriedState(enabled=lambda cfg: cfg.bridge.slots > 0 and cfg.bridge.carry_state,
                                               put=lazy(MODEL, "put_state"), take=lazy(MODEL, "take_state"))),)
