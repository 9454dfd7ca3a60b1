"""Sweeps: a grid of runs from one recipe, run in sequence or as a Slurm job array, collected
into a table and a plot (tools/sweep.py is the command line).

A sweep file (YAML):

    recipe: configs/tiny_taper.yaml          # base recipe (relative to the sweep file's folder)
    overrides: [train.steps=400]             # for every run
    axes:                                    # the grid is the product of the axes, in this order
      arch:                                  # label -> overrides (and optionally its own recipe)
        transformer: {model.arch: transformer}
        titans: {recipe: configs/tiny_titans.yaml}
      model.taper.start: [1.25, 1.5, 1.75]   # or: a config key -> its values (labels are the values)
    seeds: [0, 1, 2]                         # train.seed of each run
    metric: eval_loss                        # the final record's key that the table reports

Run r of the grid writes to OUT/runs/<axis=label,...,seed=S>/ (a normal run folder). A run is
finished when its metrics.jsonl holds `metric` at step train.steps; finished runs are skipped,
unfinished ones resume from their newest checkpoint (run.resume=auto), so a sweep can be
restarted at any time. Every run's config is loaded and checked before the first one starts.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import yaml

from megatron_taper.config import load_config
from megatron_taper.validation import ConfigError

RESERVED = ("recipe",)


@dataclass(frozen=True)
class SweepRun:
    name: str
    labels: tuple[tuple[str, str], ...]  # (axis, label) in axis order
    seed: int
    recipe: str
    overrides: tuple[str, ...]
    run_dir: str

    @property
    def args(self) -> list[str]:
        """Arguments of `python -m megatron_taper.train` for this run."""
        return ["--config", self.recipe, *self.overrides]


@dataclass
class Sweep:
    path: str
    recipe: str
    overrides: list[str]
    axes: dict[str, dict[str, dict[str, Any]]]  # axis -> label -> overrides (+ recipe)
    seeds: list[int]
    metric: str = "eval_loss"
    runs: list[SweepRun] = field(default_factory=list)


def load_sweep(path: str, out_dir: str) -> Sweep:
    """Read and check a sweep file; every run's config is loaded (and so validated) here."""
    try:
        with open(path) as f:
            spec = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"sweep file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"sweep file {path}: invalid YAML: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep file {path}: the top level must be a mapping")
    unknown = sorted(set(spec) - {"recipe", "overrides", "axes", "seeds", "metric"})
    if unknown:
        raise ConfigError(f"sweep file {path}: unknown key {unknown[0]!r} (recipe, overrides, axes, seeds, metric)")
    folder = os.path.dirname(os.path.abspath(path))
    if "recipe" not in spec:
        raise ConfigError(f"sweep file {path}: 'recipe' (the base recipe) is required")
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"sweep file {path}: overrides must be a list of key=value strings")
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"sweep file {path}: seeds must be a non-empty list of integers >= 0")
    sweep = Sweep(path, _resolve(folder, spec["recipe"]), overrides, _axes(path, spec.get("axes") or {}),
                  seeds, str(spec.get("metric", "eval_loss")))
    sweep.runs = _expand(sweep, folder, out_dir)
    return sweep


def _resolve(folder: str, recipe: str) -> str:
    return recipe if os.path.isabs(recipe) or os.path.exists(recipe) else os.path.join(folder, recipe)


def _axes(path: str, raw: Any) -> dict[str, dict[str, dict[str, Any]]]:
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {path}: axes must be a mapping of axis name -> values")
    axes = {}
    for name, values in raw.items():
        where = f"sweep file {path}: axes.{name}"
        if isinstance(values, list):  # a config key and its values
            if not values or any(isinstance(v, (dict, list)) for v in values):
                raise ConfigError(f"{where}: a list axis holds the values of config key {name!r}")
            axes[name] = {_label(v): {name: v} for v in values}
        elif isinstance(values, dict) and values and all(isinstance(v, dict) for v in values.values()):
            axes[name] = {str(label): dict(over) for label, over in values.items()}
        else:
            raise ConfigError(f"{where}: give a list of values of a config key, or label -> {{key: value}}")
        for label in axes[name]:
            if not label or any(c in label for c in "/=,") or label.startswith("."):
                raise ConfigError(f"{where}: label {label!r} cannot name a folder (no '/', '=', ',')")
    return axes


def _label(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _expand(sweep: Sweep, folder: str, out_dir: str) -> list[SweepRun]:
    runs = []
    choices = [[(axis, label) for label in labels] for axis, labels in sweep.axes.items()]
    for combo in product(*choices):
        recipe, overrides = sweep.recipe, list(sweep.overrides)
        for axis, label in combo:
            for key, value in sweep.axes[axis][label].items():
                if key == "recipe":
                    recipe = _resolve(folder, str(value))
                else:
                    overrides.append(f"{key}={_yaml_value(value)}")
        for seed in sweep.seeds:
            name = ",".join([*(f"{a}={label}" for a, label in combo), f"seed={seed}"])
            run_dir = os.path.join(out_dir, "runs", name)
            args = (*overrides, f"train.seed={seed}", f"run.dir={run_dir}")
            try:
                load_config(recipe, list(args))
            except ConfigError as e:
                raise ConfigError(f"sweep file {sweep.path}, run {name}: {e}") from None
            runs.append(SweepRun(name, tuple(combo), seed, recipe, args, run_dir))
    return runs


def _yaml_value(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def final_record(run: SweepRun, metric: str) -> dict | None:
    """The record with `metric` at the run's last step, if the run finished."""
    steps = load_config(run.recipe, list(run.overrides)).train.steps
    path = os.path.join(run.run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    last = None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get("step") == steps and metric in record:
                last = record
    return last


def collect(sweep: Sweep) -> dict:
    """Per run its final metric; per configuration (all axes but the seed) mean, std over seeds."""
    runs, groups = [], {}
    for run in sweep.runs:
        record = final_record(run, sweep.metric)
        value = None if record is None else float(record[sweep.metric])
        runs.append({"name": run.name, **dict(run.labels), "seed": run.seed, sweep.metric: value})
        groups.setdefault(run.labels, []).append(value)
    table = []
    for labels, values in groups.items():
        done = [v for v in values if v is not None]
        row = {**dict(labels), "seeds_done": len(done), "seeds": len(values)}
        if done:
            row["mean"] = statistics.fmean(done)
            row["std"] = statistics.stdev(done) if len(done) > 1 else 0.0
            row["min"], row["max"] = min(done), max(done)
            if sweep.metric.endswith("loss"):
                row["ppl"] = math.exp(min(row["mean"], 50.0))
        table.append(row)
    return {"sweep": sweep.path, "metric": sweep.metric, "axes": list(sweep.axes), "runs": runs, "table": table}


def markdown_table(result: dict) -> str:
    axes, metric = result["axes"], result["metric"]
    cols = [*axes, f"{metric} mean", "std (seeds)", "min", "max", "ppl", "seeds"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in result["table"]:
        cells = [str(row[a]) for a in axes]
        if "mean" in row:
            cells += [f"{row['mean']:.4f}", f"{row['std']:.4f}", f"{row['min']:.4f}", f"{row['max']:.4f}",
                      f"{row['ppl']:.2f}" if "ppl" in row else "", f"{row['seeds_done']}/{row['seeds']}"]
        else:
            cells += ["", "", "", "", "", f"0/{row['seeds']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """PNG: the metric (mean, error bars = std over seeds) against the last axis, one line per
    combination of the other axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = result["axes"]
    x_axis, group_axes = (axes[-1], axes[:-1]) if axes else ("seed", [])
    x_labels = list(dict.fromkeys(row.get(x_axis, "") for row in result["table"]))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(x_labels) + 3), 4))
    lines: dict[tuple, list] = {}
    for row in result["table"]:
        if "mean" in row:
            lines.setdefault(tuple(row[a] for a in group_axes), []).append(row)
    for n, (group, rows) in enumerate(lines.items()):
        xs = [x_labels.index(r.get(x_axis, "")) + (n - (len(lines) - 1) / 2) * 0.06 for r in rows]
        ax.errorbar(xs, [r["mean"] for r in rows], yerr=[r["std"] for r in rows], marker="o", capsize=4,
                    label=", ".join(group) or result["metric"])
    ax.set_xticks(range(len(x_labels)), x_labels)
    ax.set_xlabel(x_axis)
    ax.set_ylabel(f"final {result['metric']} (mean +- std over seeds)")
    if len(lines) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
