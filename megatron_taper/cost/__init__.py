"""The planning tier: the cost model, the pipeline partition, the start-up layout rules and the
layout search, all without torch at module level (`import megatron_taper.cost.plan` loads none).

block.py         per-piece costs (FLOPs, parameters, activations) and the shared counting helpers
flops.py         per-layer and whole-model costs from each family's spec, MFU and device peaks
memory.py        per-rank, per-stage peak memory of a training step (docs/memory_model.md)
attention_memory.py  what cp's K / V and the document mask add to a block's activations
stage_memory.py  per-stage memory of a pipeline split: communication buffers, DeepSpeed's buckets
cp.py            per block, what each family sends under context parallelism (chain / halo / all-gather)
devices.py       the device table (devices.json) and measured profiles laid over it
float8.py        where float8 pays (the rule on a linear's dimensions) and the measured speed ratios
                 (speedups.json: float8 per linear, eager and compiled arithmetic rates)
op_count.py      the eager operators a training step dispatches (counted on the CPU, torch imported lazily)
step_time.py     the predicted time of one training step of one layout (docs/planning.md)
partition.py     layers per pipeline stage by cost (exact min-max contiguous split), in-flight micro-batches
preflight.py     the rules across config sections and the world size, checked before any process starts
plan.py          the layout search: every layout of SEARCH_SPACE, its peak memory and step time, best first
auto_layout.py   parallel.layout=auto: the device planned for and the fastest layout that fits it
"""
