"""Command-line conventions shared by the trainer and the tools that take config overrides.

Overrides come in three spellings, mixed freely with a command's own options:

    train.steps=100          (Megatron-LM / Hydra style)
    --train.steps=100        (torchtitan style)
    --train.steps 100        (the value as the next argument; a boolean key alone means true:
                              --train.compile)

`--print-config` prints the resolved config (defaults <- recipe <- overrides) as YAML and exits;
`--list-keys` prints every key with its type and default and exits.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any

import yaml

from megatron_taper.config import SWITCH_KEYS, Config, ConfigError, load_config

OVERRIDES_HELP = ("config overrides, as key=value, --key=value or --key value "
                  "(e.g. train.steps=100 --train.lr=3e-4 --run.dir runs/a); see --list-keys")
_BOOL_WORDS = ("true", "false", "yes", "no", "1", "0")


def add_config_arguments(parser: argparse.ArgumentParser, recipe_help: str = "YAML recipe (configs/*.yaml)") -> None:
    """--config, --print-config and --list-keys (the overrides: OVERRIDES_HELP, for the epilog)."""
    parser.add_argument("--config", help=recipe_help)
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (defaults <- recipe <- overrides) as YAML and exit")
    parser.add_argument("--list-keys", action="store_true",
                        help="print every config key with its type and default and exit")


def parse_with_overrides(parser: argparse.ArgumentParser,
                         argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The parser's own options and the config overrides (as key=value), in their order."""
    args, rest = parser.parse_known_args(argv)
    try:
        return args, normalise_overrides(rest)
    except ConfigError as e:
        parser.error(str(e))
        raise  # parser.error exits; keeps type checkers content


def normalise_overrides(tokens: list[str]) -> list[str]:
    """key=value, --key=value and --key value (or a bare --bool_key) as key=value strings."""
    types = key_types()
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("--"):
            if "=" not in token or token.startswith("-"):
                raise ConfigError(f"unrecognised argument {token!r} (overrides are key=value, --key=value or "
                                  f"--key value)")
            out.append(token)
            continue
        body = token[2:]
        if "=" in body:
            out.append(body)
            continue
        key = body
        has_next = i < len(tokens) and not tokens[i].startswith("--")
        if types.get(key) is bool or key in SWITCH_KEYS:
            if has_next and (tokens[i].lower() in _BOOL_WORDS or key in SWITCH_KEYS and tokens[i].lower() == "auto"):
                out.append(f"{key}={tokens[i]}")
                i += 1
            else:
                out.append(f"{key}=true")
            continue
        if not has_next:
            if key not in types and "." not in key:
                raise ConfigError(f"unrecognised option {token!r}")
            raise ConfigError(f"{token} needs a value ({token}=VALUE or {token} VALUE)")
        out.append(f"{key}={tokens[i]}")  # an unknown key fails in apply_override, with a suggestion
        i += 1
    return out


def handle_info_flags(args: argparse.Namespace, overrides: list[str]) -> bool:
    """Print what --list-keys / --print-config ask for; True when the command should exit (0)."""
    if args.list_keys:
        sys.stdout.write(list_keys_text())
        return True
    if args.print_config:
        cfg = load_config(args.config, overrides)
        sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        return True
    return False


def config_keys(obj: Any = None, prefix: str = "") -> dict[str, tuple[type, Any]]:
    """Every dotted key of the config: its Python type (int, float, str, bool, list) and default."""
    obj = Config() if obj is None else obj
    hints = typing.get_type_hints(type(obj))
    out: dict[str, tuple[type, Any]] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(config_keys(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (hints[f.name], value)
    return out


def key_types() -> dict[str, type]:
    return {key: hint for key, (hint, _) in config_keys().items()}


def list_keys_text() -> str:
    """One line per key: name, type, default (as it would be written in YAML)."""
    keys = config_keys()
    width = max(len(k) for k in keys)
    lines = [f"{'key':<{width}}  {'type':<5}  default"]
    for key, (hint, value) in keys.items():
        default = yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()
        lines.append(f"{key:<{width}}  {hint.__name__:<5}  {default}")
    return "\n".join(lines) + "\n"

