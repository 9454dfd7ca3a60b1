"""The error type of user input and the checks every config section's `validate(prefix)` uses.

A leaf module (no imports from the package, no torch), so that config sections defined outside
config.py (the model families' options in models/cards.py) validate the same way as config.py's.
"""
from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A user error in a recipe, an override or a parallel layout; the message names the key."""


def did_you_mean(value: str, allowed) -> str:
    """"; did you mean 'x'?" for the allowed value closest to `value`, or "" when none is close."""
    close = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(allowed)}{did_you_mean(value, allowed)}")


def check_range(key: str, value: float, low: float | None, high: float | None,
                open_low: bool = False, open_high: bool = False) -> None:
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and (value >= high if open_high else value > high)
    if below or above:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        interval = f"{'(' if open_low or low is None else '['}{lo}, {hi}{')' if open_high or high is None else ']'}"
        raise ConfigError(f"{key}={value} is outside the allowed range {interval}")


def inside_folder(name, plain: bool = False) -> bool:
    """Whether `name`, read from a file (an index, a checkpoint's meta.json), names a path inside
    the folder it is joined to: relative, no '', '.' or '..' component, no NUL; with `plain`, a
    bare file name (no folder at all)."""
    if not isinstance(name, str) or not name or "\0" in name or name.startswith(("/", "\\")):
        return False
    parts = name.replace("\\", "/").split("/")
    return not any(part in ("", ".", "..") for part in parts) and not (plain and len(parts) > 1)
