"""The tree LM family (`model.arch=tree`, docs/tree_lm.md): one recursive cell composing a balanced
binary tree over the sequence, every prefix read in O(log n) sequential depth.

model.py     the cell, the layer and the model
sweeps.py    the tree's up- and down-sweeps for any cell
cost.py      its cost terms, the sweeps' counts and the context-parallel all-gather's size (torch-free)
parallel.py  its tensor-parallel plan and model and layout checks
cp.py        its context-parallel prefixes: the slices' roots all-gathered, no chain

This module holds the family's SPECS only; the model code is imported when a model is built.
"""
from megatron_taper.models.cards import TREE
from megatron_taper.models.spec import FamilySpec, lazy
from megatron_taper.models.tree.cost import tree_cp_messages, tree_layer_cost
from megatron_taper.models.tree.parallel import check_tree_layout, tp_plan_tree_layer

SPECS = (FamilySpec(card=TREE, build=lazy("megatron_taper.models.tree.model", "TreeLM"), layer_cost=tree_layer_cost,
                    tp_block_plan=tp_plan_tree_layer, check_layout=check_tree_layout, context_parallel=True,
                    cp_balanced=False, cp_messages=tree_cp_messages, document_mask=True),)
