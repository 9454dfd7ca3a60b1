"""The training loop and what it is built from (the floors of tests/config/test_layering.py).

build.py     build_run: config -> parallel context -> model -> optimizer, preflight once
trainer.py   the Trainer: steps, evaluation, checkpoints, fault handling, logging
stop.py      stops by signal (SIGUSR1, SIGTERM, Ctrl-C), agreed by all ranks at every step boundary
health.py    the non-finite counters on the device and the console line naming skipped steps
run_folder.py  which run.dir a run may use, and what a resume may change (train.steps, global_batch)
carried.py   state carried across windows (the bridge's memory along each document)
held_out.py  the held-out evaluation loop
metrics.py   metrics.jsonl, tensorboard and wandb writers, MFU and ETA
optim.py     the optimizer and the learning-rate schedule
run_lock.py  one job per run folder: the main rank's lock on RUN/.lock
"""
