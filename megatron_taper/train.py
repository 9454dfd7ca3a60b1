"""Command line entry point of training (the Trainer is megatron_taper/training/trainer.py).

    torchrun --nproc-per-node N -m megatron_taper.train --config configs/X.yaml [key=value ...]
    python -m megatron_taper.train --config configs/X.yaml [key=value ...]
    megatron-taper-train --config configs/X.yaml [--key=value | --key value ...]

--print-config and --list-keys are answered without importing torch or any model code.
Exit codes: 0 done (or stopped by train.exit_after), 1 failed, 2 bad input, 3 stopped by
SIGUSR1/SIGTERM/Ctrl-C after a checkpoint (the slurm script requeues the job on 3), 4 a hang detected
by the watchdog (launch/torchrun.sh restarts the workers from the last checkpoint).
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap

from megatron_taper.cli import OVERRIDES_HELP, add_config_arguments, handle_info_flags, parse_with_overrides
from megatron_taper.console import DEBUG_ENV, report_error
from megatron_taper.validation import ConfigError

HELP_EPILOG = textwrap.fill(OVERRIDES_HELP + ".", 96) + f"""

Errors: the main rank prints one line; every rank writes its error with the full traceback to
RUN/logs/rank-N.log; {DEBUG_ENV}=1 also prints the traceback on the console.
Exit codes: 0 done (or stopped by train.exit_after), 1 failed, 2 bad input, 3 stopped by
SIGUSR1/SIGTERM/Ctrl-C after a checkpoint (run the same command again to resume), 4 a hang detected by
the watchdog (stacks in RUN/logs/stacks-rankN.txt; run the same command again to resume)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-taper-train", description=__doc__.split("\n\n")[0],
                                     epilog=HELP_EPILOG, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_arguments(parser)
    parser.usage = ("%(prog)s [-h] [--config CONFIG] [--print-config] [--list-keys] "
                    "[key=value | --key=value | --key value ...]")
    args, overrides = parse_with_overrides(parser, argv)
    if args.print_config or args.list_keys:
        try:
            handle_info_flags(args, overrides)
            return 0
        except ConfigError as e:
            report_error(e, int(os.environ.get("RANK", "0")), None, expected=True)
            return 2
    from megatron_taper.training.trainer import run

    return run(args.config, overrides)


if __name__ == "__main__":
    sys.exit(main())
