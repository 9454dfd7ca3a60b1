"""Parallelism applied to single-device models from outside, in a fixed order:
pipeline split -> tensor parallel -> block options -> ZeRO (or, after materialisation, DDP).

    context.py      ParallelContext: the (pp, dp, tp) mesh, groups, device, precision
    model.py        ParallelModel: what the Trainer and checkpoints see of a parallelised model
    parallelize.py  parallelize(): the chain below, in order
    pipeline.py     stage construction + torch.distributed.pipelining schedules
    partition.py    cost-balanced stage split (pure)
    profile.py      measured per-layer times for parallel.pp_balance=profile
    tensor.py       TP autograd ops and column/row/vocab-parallel layers (uneven shards)
    tp_plan.py      TPBuilder: applies a family's TP plan (its FamilySpec) to a model
    block_options.py  activation checkpointing and torch.compile per block
    zero.py         ZeRO-3 over dp: fsdp2; zero_deepspeed.py: DeepSpeed
    data_parallel.py  dp without ZeRO: torch DDP (bucketed, overlapped all-reduces)
    meta_init.py    materialise a model built on the meta device, rank by rank
"""
