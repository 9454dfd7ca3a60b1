"""Recipe files: a YAML recipe read as one mapping, its `base:` chain resolved (config.py's
load_config builds the typed config from it). Torch-free, like config.py; every error is a
ConfigError naming the file."""
from __future__ import annotations

import os
from typing import Any

import yaml

from megatron_taper.validation import ConfigError


def read_recipe(path: str, chain: tuple[str, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """A YAML recipe as one mapping with its `base:` chain resolved, and the files read (this one first).

    `base: other.yaml` (relative to the folder of the file that names it, or absolute) is read first,
    then this file's sections are merged over it: mappings key by key, scalars and lists replaced.
    `chain` holds the files that (transitively) named this one as their base, outermost first.
    """
    real = os.path.realpath(path)
    reals = [os.path.realpath(p) for p in chain]
    if real in reals:
        cycle = " -> ".join([*chain[reals.index(real):], path])
        raise ConfigError(f"recipe base cycle: {cycle}")
    what = f"{path} (base of {chain[-1]})" if chain else path
    if not os.path.isfile(path):
        if chain:
            raise ConfigError(f"{chain[-1]}: base file not found: {path}")
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{what}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: the top level must be a mapping of sections")
    if "base" not in data:
        return data, [path]
    base = data.pop("base")
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"{path}: base must be the path of a YAML recipe, got {base!r}")
    base_data, files = read_recipe(os.path.join(os.path.dirname(path), base), (*chain, path))
    return merge_recipe(base_data, data), [path, *files]


def merge_recipe(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` on top of `base`: mappings on both sides merge key by key; any other value of `over` replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_recipe(merged[key], value)
        else:
            merged[key] = value
    return merged
