"""Parallelism applied to single-device models from outside, in a fixed order:
pipeline split -> tensor parallel -> block options -> ZeRO (or, after materialisation, DDP).

The mesh and the whole chain:
    context.py        ParallelContext: the (pp, dp, cp, tp) mesh (HSDP's 2-D dp), groups, device, precision
    model.py          ParallelModel: what the Trainer and checkpoints see of a parallelised model
    parallelize.py    parallelize(): the chain below, in order
    meta_init.py      materialise a model built on the meta device, rank by rank
One package per dimension:
    pp/               pipeline stages and schedules (schedule.py), measured layer times (profile.py)
    tp/               TP ops and layers (layers.py), a family's TP plan applied (plan.py)
    cp/               the sequence split and attention's K/V exchange (split.py), state passing (state.py)
    dp/               ZeRO-3 with fsdp2 (fsdp2.py) or DeepSpeed (zero_deepspeed.py), plain DDP (ddp.py)
    ep.py             expert parallelism (parallel.ep): MoE experts split over ep ranks of the dp group
                      (copied over dp / ep groups), tokens exchanged by all-to-all
Per block, the loss, launching:
    block_options.py  activation checkpointing and torch.compile per block
    float8.py         float8 linears through torchao (train.float8)
    loss.py           next-token cross entropy: plain, vocab-parallel, or over chunks of tokens
    spawn.py          run a function on N local processes in one process group (benchmarks, tests)
"""
