"""Parallelism applied to single-device models from outside, in a fixed order:
pipeline split -> tensor parallel -> block options -> ZeRO (or, after materialisation, DDP).

The mesh and the whole chain:
    context.py           ParallelContext: the (pp, dp, cp, tp) mesh (HSDP's 2-D dp), groups, device, precision
    model.py             ParallelModel: what the Trainer and checkpoints see of a parallelised model
    parallelize.py       parallelize(): the chain below, in order
    meta_init.py         materialise a model built on the meta device, rank by rank
Pipeline:
    pipeline.py          stages (layers per stage: cost/partition.py) + torch.distributed.pipelining schedules
    profile.py           measured per-layer times for parallel.pp_balance=profile
Tensor and context parallelism:
    tensor.py            TP autograd ops and column/row/vocab-parallel layers (uneven shards)
    tp_plan.py           TPBuilder: applies a family's TP plan (its FamilySpec) to a model
    loss.py              next-token cross entropy: plain, vocab-parallel, or over chunks of tokens
    context_parallel.py  the cp split of each sequence and the attention families' K/V exchange
    cp_state.py          what a slice needs from the slices before it (the state-passing families)
Per block and data parallel:
    block_options.py     activation checkpointing and torch.compile per block
    float8.py            float8 linears through torchao (train.float8)
    zero.py              ZeRO-3 over dp: fsdp2 (and HSDP)
    zero_deepspeed.py    ZeRO over dp: DeepSpeed
    data_parallel.py     dp without ZeRO: torch DDP (bucketed, overlapped all-reduces)
Launching:
    spawn.py             run a function on N local processes in one process group (benchmarks, tests)
"""
