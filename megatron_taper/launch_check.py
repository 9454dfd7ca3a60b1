"""The check that launch/torchrun.sh and launch/train.sbatch run before starting any process.

    python -m megatron_taper.launch_check --world-size N [--nodes N] [--device PROFILE] [--plan]
        [--print-run-dir] --config X [key=value | --key=value | --key value ...]

Loads the config with the trainer's own command-line forms (megatron_taper.cli), then runs
preflight (the layout at N processes), check_data (data.path, the tokenizer against
model.vocab_size), check_data_tokenizer (data.tokenizer is the one the data was written with) and
check_run_dir (run.dir and its checkpoints/ take new files): exit 0 when the run can start, 2 with
one `error: ...` line when it cannot. `--print-run-dir` prints the absolute run folder
(train.sbatch hands it to every node); `--plan` prints the resolved plan (layout, batch split,
model size, data, run folder). With parallel.layout=auto the layout is chosen first, as each worker
will (plan.choose_layout, from this machine's device memory at world-size / nodes processes per
node, or parallel.layout_memory_gb), and checked; `--plan` prints the choice, why, and the device
it was planned for. `--device PROFILE` (h100, h200, b200, cpu: cost/devices.json) plans for that
device instead of this machine's: a login node checking a GPU job (launch/train.sbatch --dry-run
--device h100). `--print-config` and `--list-keys` are left to the trainer: nothing is checked then.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings

from megatron_taper.cli import add_config_arguments, parse_with_overrides

WRITE_PROBE = ".write-check-"  # the prefix of _cannot_write's file (run_folder lets another rank's be)


def _cannot_write(folder: str) -> str:
    """Why no file can be created in `folder` ('' when one can): creates and removes one empty file."""
    try:
        fd, probe = tempfile.mkstemp(prefix=WRITE_PROBE, dir=folder)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    os.unlink(probe)
    return ""


def check_data_tokenizer(cfg) -> None:
    """data.tokenizer against the tokenizer each local MDS folder was written with (its stats.json);
    the workers check remote folders (and these again) when they build their data."""
    from megatron_taper.data import is_remote
    from megatron_taper.data.sources import check_tokenizer

    d = cfg.data
    paths = [(e["path"], f"data.mix[{i}].path") for i, e in enumerate(d.mix)] or [(d.path, "data.path")]
    for path, key in paths:
        if path and not is_remote(path) and not path.endswith(".npy"):
            check_tokenizer(os.path.join(path, "stats.json"), d.tokenizer, key, path)


def check_run_dir(run_dir: str) -> None:
    """run.dir, and its checkpoints/ when it exists, are folders this process can create files in;
    a run.dir that does not exist yet: its nearest existing parent, where it will be created."""
    from megatron_taper.validation import ConfigError

    path = os.path.abspath(run_dir)
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent != path:
        checks = [(parent, f"cannot be created in {parent}")]
    else:
        checks = [(path, "is not writable")]
        if os.path.lexists(os.path.join(path, "checkpoints")):
            checks.append((os.path.join(path, "checkpoints"), "has a checkpoints/ that is not writable"))
    for folder, what in checks:
        reason = "not a folder" if not os.path.isdir(folder) else _cannot_write(folder)
        if reason:
            raise ConfigError(f"run.dir={run_dir} {what} ({reason}): choose another run.dir or make it writable")


def plan_lines(cfg, layout, world: int, nodes: int) -> list[str]:
    from megatron_taper.cost.flops import model_costs

    m, p, t = cfg.model, cfg.parallel, cfg.train
    costs = model_costs(m)
    data = (f"data.mix of {len(cfg.data.mix)} sources" if cfg.data.mix else
            f"data.path={cfg.data.path or '(built-in corpus)'}")
    lines = [
        f"processes: {nodes} node(s) x {world // nodes} per node = {world}: pp {layout.pp} x dp {layout.dp} x "
        + (f"cp {layout.cp} x " if layout.cp > 1 else "") + f"tp {layout.tp}, zero {p.zero}"
        + ("" if p.dp_replicate == 1 else "; HSDP dp_replicate {} x dp_shard {}".format(*p.dp_split(layout.dp))),
        f"batch: global_batch {t.global_batch} = dp {layout.dp} x micro_batch {t.micro_batch} x "
        f"{layout.accumulation} accumulation" + (f"; {layout.pipeline_microbatches} pipeline micro-batches"
                                                 if layout.pp > 1 else ""),
        f"model: {m.arch}, {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, seq_len {m.seq_len}: "
        f"{costs.total_params / 1e6:,.2f}M parameters",
        f"train: {t.steps} steps" + (f", exit_after {t.exit_after}" if t.exit_after else "")
        + f", lr {t.lr:g}, device {t.device}; {data}",
        f"run dir: {os.path.abspath(cfg.run.dir)} (resume {cfg.run.resume})",
    ]
    group = p.tp * p.dp_split(layout.dp)[1]  # consecutive ranks of one HSDP shard group
    if p.dp_replicate > 1 and (world // nodes) % group:
        lines.append(f"note: an HSDP shard group is parallel.tp x parallel.dp_shard = {group} consecutive ranks, which "
                     f"do not fit the {world // nodes} per node: its all-gathers cross nodes")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron_taper.launch_check", description=__doc__.split("\n\n")[0],
                                     allow_abbrev=False)
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, required=True, help="processes of the run, all nodes together")
    parser.add_argument("--nodes", type=int, default=1, help="nodes (for --plan)")
    parser.add_argument("--device", default="", metavar="PROFILE",
                        help="parallel.layout=auto plans for this device profile of cost/devices.json "
                             "(default: this machine's devices)")
    parser.add_argument("--plan", action="store_true", help="print the resolved plan")
    parser.add_argument("--print-run-dir", action="store_true", help="print the absolute run folder")
    args, overrides = parse_with_overrides(parser, argv)
    if args.print_config or args.list_keys:
        return 0
    from megatron_taper.config import load_config
    from megatron_taper.console import report_error
    from megatron_taper.cost.preflight import preflight
    from megatron_taper.data.checks import check_data

    try:
        cfg = load_config(args.config, overrides)
        chosen = ""
        if cfg.parallel.layout == "auto":
            from megatron_taper.cost.auto_layout import choose_layout

            cfg, chosen = choose_layout(cfg, args.world_size, local_ranks=args.world_size // max(1, args.nodes),
                                        device_profile=args.device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layout = preflight(cfg, args.world_size)
            check_data(cfg)
            check_data_tokenizer(cfg)
            check_run_dir(cfg.run.dir)
    except ValueError as e:  # ConfigError included
        report_error(e, 0, None, expected=True)
        return 2
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if args.plan:
        print("\n".join(([chosen] if chosen else []) + plan_lines(cfg, layout, args.world_size, args.nodes)))
    if args.print_run_dir:
        print(os.path.abspath(cfg.run.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
