"""Pipeline parallelism (parallel.pp).

    schedule.py  stages (layers per stage: cost/partition.py) and torch.distributed.pipelining schedules
    profile.py   measured per-layer times for parallel.pp_balance=profile
"""
