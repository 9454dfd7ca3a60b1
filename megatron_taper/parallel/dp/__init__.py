"""Data parallelism over the dp ranks: ZeRO-3 (parallel.zero) or plain replicas.

    fsdp2.py           zero=fsdp2: torch FSDP2 over dp (and HSDP's 2-D dp mesh)
    zero_deepspeed.py  zero=deepspeed: DeepSpeed ZeRO stage 3 behind the ParallelModel interface
    ddp.py             zero=none, dp > 1: torch DDP (bucketed, overlapped all-reduces)
"""
