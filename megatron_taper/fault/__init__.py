"""Surviving faults (README "Surviving faults"): the hang watchdog (watchdog.py) and the
fault-injection hook for tests and drills (inject.py). Torch-free."""
