"""Tensor parallelism (parallel.tp), the process group always passed explicitly.

    layers.py  TP autograd ops and column/row/vocab-parallel layers (uneven shards)
    plan.py    TPBuilder: applies a family's TP plan (its FamilySpec) to a model
"""
