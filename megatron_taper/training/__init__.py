"""The training loop and what it is built from (the floors of tests/config/test_layering.py).

build.py     build_run: config -> parallel context -> model -> optimizer, preflight once
trainer.py   the Trainer: `fit` is the loop, over the named parts below (and fault/recovery.py)
state.py     TrainState: step, tokens seen, batches drawn: the loop's own part of a checkpoint
checkpointing.py  when to save, async save completion, resume / init_from, the save lines
step_log.py  the step and eval records (MFU, ETA, peak memory, stragglers) and console lines
stop.py      stops by signal (SIGUSR1, SIGTERM, Ctrl-C), agreed by all ranks at every step boundary
             (the same vote completes a background save)
run_folder.py  which run.dir a run may use (and its lock), and what a resume may change
carried.py   state carried across windows (the bridge's memory along each document)
experts.py   a mixture of experts' routing biases after each step and its load records
held_out.py  the held-out evaluation loop
metrics.py   metrics.jsonl, tensorboard and wandb writers
optim.py     the optimizer and the learning-rate schedule
run_lock.py  one job per run folder: the main rank's lock on RUN/.lock
"""
