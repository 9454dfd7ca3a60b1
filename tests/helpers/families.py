"""The standard family test cases, read from the family registry (models/cards.py and whatever
MEGATRON_TAPER_FAMILIES registers): a family is tested by the standard tests as soon as it is
registered, with no test file naming it.

`family_cases()`: case id -> overrides: `model.arch=<name>` plus the card's test_cases entry
(the case id is the family name, or `<name>_<case>`). `refuses(case, layout)`: whether the
card says the family refuses that layout by design ("pp", ...).
"""
from __future__ import annotations

from megatron_taper.models import cards


def family_cases() -> dict[str, list[str]]:
    out = {}
    for card in cards().values():
        for case, overrides in card.test_cases.items():
            out[f"{card.name}_{case}" if case else card.name] = [f"model.arch={card.name}", *overrides]
    return out


def case_family(case: str) -> str:
    return family_cases()[case][0].removeprefix("model.arch=")


def refuses(case: str, layout: str) -> bool:
    return layout in cards()[case_family(case)].refuses


def one_case_per_family() -> dict[str, list[str]]:
    """The first case of every family."""
    out: dict[str, list[str]] = {}
    for case, overrides in family_cases().items():
        out.setdefault(overrides[0], [case, overrides])
    return {case: overrides for case, overrides in out.values()}
