"""Recipe files and overrides: a YAML recipe read as one mapping with its `base:` chain resolved,
and a mapping or `key=value` overrides merged into a tree of section dataclasses (config.py's
load_config builds the typed config with both). Torch-free, like config.py; every error is a
ConfigError naming the file or the key (with the closest key for an unknown one)."""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
import warnings
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


# ---------------------------------------------------------------------------------------------
# A mapping or a key=value merged into a tree of section dataclasses (config.py's Config)


def merge_mapping(root: Any, data: dict[str, Any], source: str, removed: dict[str, str] | None = None) -> None:
    """`data` (a recipe's mapping) set into the dataclass tree `root`, each value coerced to its
    field's type; an unknown key is one ConfigError with the closest key of `root`; `removed`: keys
    that existed once (loaded with a warning saying why they are gone)."""
    _merge(root, root, data, "", source, removed or {})


def apply_key_value(root: Any, item: str) -> None:
    """One `key=value` (the value read as YAML) set into the dataclass tree `root`."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("-")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    target: Any = root
    for i, part in enumerate(parts[:-1]):
        target = _child(root, target, part, ".".join(parts[: i + 1]), suggest_for=key)
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"unknown key {key!r}{_suggest(root, key)}")
    _set(root, target, parts[-1], value, key, source="command line")


def dataclass_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the dataclass tree `obj`."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        keys += dataclass_keys(value, name + ".") if dataclasses.is_dataclass(value) else [name]
    return keys


def _merge(root: Any, obj: Any, data: dict[str, Any], prefix: str, source: str, removed: dict[str, str]) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: section {prefix.rstrip('.') or 'top level'} must be a mapping")
    for name, value in data.items():
        key = f"{prefix}{name}"
        if key in removed:
            warnings.warn(f"{source}: {key} is no longer a setting ({removed[key]}); ignored", stacklevel=2)
            continue
        current = _child(root, obj, str(name), key)
        if dataclasses.is_dataclass(current):
            _merge(root, current, value, key + ".", source, removed)
        else:
            _set(root, obj, str(name), value, key, source)


def _child(root: Any, obj: Any, name: str, key: str, suggest_for: str | None = None) -> Any:
    names = {f.name for f in dataclasses.fields(obj)}
    if name not in names:
        raise ConfigError(f"unknown key {key!r}{_suggest(root, suggest_for or key)}")
    return getattr(obj, name)


def _set(root: Any, obj: Any, name: str, value: Any, key: str, source: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ConfigError(f"unknown key {key!r}{_suggest(root, key)}")
    hint = typing.get_type_hints(type(obj))[name]
    if dataclasses.is_dataclass(hint):
        raise ConfigError(f"{source}: {key} is a section; set its keys ({key}.<name>=...)")
    setattr(obj, name, _coerce(value, hint, key))


def _coerce(value: Any, hint: Any, key: str) -> Any:
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ConfigError(f"{key} must be a boolean (true/false), got {value!r}")
    if isinstance(value, str) and hint in (int, float):
        try:  # YAML 1.1 reads "2e-4" (no dot) as a string
            value = float(value) if hint is float else int(value)
        except ValueError:
            pass
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if hint is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return "" if value is None else str(value)
    if hint is list:
        if value is None or value == "":
            return []
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list (YAML, or JSON on the command line), got {value!r}")
        return list(value)
    raise AssertionError(f"unsupported config type {hint} for {key}")


def _suggest(root: Any, key: str) -> str:
    keys = dataclass_keys(type(root)())  # the defaults' keys: a loaded tree holds the same sections
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not close:
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1]
    return f"; did you mean {close[0]!r}?" if close else ""
