"""The cost model: pure arithmetic, no torch at module level.

block.py   per-piece costs (FLOPs, parameters, activations) and the shared counting helpers
flops.py   per-layer and whole-model costs from each family's spec, MFU and device peaks
memory.py  per-rank, per-stage peak memory of a training step (docs/memory_model.md)
cp.py      per block, what each family sends under context parallelism (chain / halo / all-gather)
"""
