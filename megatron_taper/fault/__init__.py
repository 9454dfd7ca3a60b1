"""Surviving faults (README "Surviving faults").

watchdog.py   hang detection: a watchdog thread per rank with a timeout per section of the run
inject.py     the fault-injection hook for tests and drills (MEGATRON_TAPER_FAULT)
guard.py      FaultGuard: the one object the Trainer calls for the watchdog and injected faults
recovery.py   Recovery: the one object the Trainer asks about bad steps (health, spikes, rollback)
health.py     the non-finite counters (train.max_nonfinite) and the line naming skipped steps
rollback.py   the non-finite and spike policy: bad steps, rollback, the data windows it skips
straggler.py  straggler statistics across ranks at log intervals

recovery.py, health.py, rollback.py and straggler.py import torch; the others do not.
"""
