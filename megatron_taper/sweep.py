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
    baseline: {model.taper.start: 1.5}       # optional: also report each row minus this label's
                                             # run of the same seed and other labels
    data:                                    # optional: raw text the sweep tokenizes itself
      corpus: [path/to/text.txt.gz]          # files/folders/globs, .gz, jsonl (--corpus overrides)
      text_mode: paragraph                   # documents of a text file: file | line | paragraph
      val_fraction: 0.05                     # documents held out (by a keyed hash) for eval_loss

With `data`, the sweep trains a sentencepiece tokenizer (vocabulary = the recipe's
model.vocab_size) on the corpus and writes MDS shards with a held-out split into OUT/data once;
every run trains on OUT/data (data.path). OUT/data records its inputs, and a sweep with other
inputs refuses to reuse it.

`axes` may also be a list of such mappings with the same axis names: several grids whose runs are
run and tabulated together (e.g. 4 architectures x 3 tapers, plus more tapers for one
architecture); a run named twice is run once.

Run r of the grid writes to OUT/runs/<axis=label,...,seed=S>/ (a normal run folder; run locally,
its console output goes to OUT/logs/<axis=label,...,seed=S>.log). A run is
finished when its metrics.jsonl holds `metric` at step train.steps (training.metrics.read_metrics: a
torn last line is skipped with a warning); finished runs are skipped, unfinished ones resume from
their newest checkpoint (run.resume=auto), so a sweep can be restarted at any time. Every run's
config is loaded and checked before the first one starts.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import yaml

from megatron_taper.config import load_config
from megatron_taper.data.corpus import TEXT_MODES
from megatron_taper.training.metrics import perplexity, read_metrics
from megatron_taper.validation import ConfigError, check_choice

RESERVED = ("recipe",)
SWEEP_DATA_FILE = "sweep_data.json"
SWEEP_PARTIAL_FILE = ".sweep_data.partial"  # in OUT/data while a sweep writes it
DATA_KEYS = ("corpus", "text_mode", "val_fraction")


@dataclass(frozen=True)
class SweepData:
    corpus: tuple[str, ...]
    text_mode: str
    val_fraction: float
    vocab_size: int
    folder: str  # OUT/data: MDS train/ and val/ + tokenizer.model

    def record(self) -> dict:
        return {"corpus": [os.path.abspath(c) for c in self.corpus], "text_mode": self.text_mode,
                "val_fraction": self.val_fraction, "vocab_size": self.vocab_size}


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

    @property
    def log_file(self) -> str:
        """OUT/logs/<name>.log: a local run's console output (the run folder holds only what the trainer writes)."""
        return os.path.join(os.path.dirname(os.path.dirname(self.run_dir)), "logs", f"{self.name}.log")


@dataclass
class Sweep:
    path: str
    recipe: str
    overrides: list[str]
    grids: list[dict[str, dict[str, dict[str, Any]]]]  # per grid: axis -> label -> overrides (+ recipe)
    seeds: list[int]
    metric: str = "eval_loss"
    data: SweepData | None = None
    baseline: dict[str, str] = field(default_factory=dict)  # axis -> label
    runs: list[SweepRun] = field(default_factory=list)

    @property
    def axes(self) -> list[str]:
        return list(self.grids[0]) if self.grids else []


def load_sweep(path: str, out_dir: str, corpus: list[str] | None = None) -> Sweep:
    """Read and check a sweep file; every run's config is loaded (and so validated) here.
    `corpus` replaces the sweep file's data.corpus (and enables `data` when the file has none)."""
    try:
        with open(path) as f:
            spec = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"sweep file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"sweep file {path}: invalid YAML: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep file {path}: the top level must be a mapping")
    unknown = sorted(set(spec) - {"recipe", "overrides", "axes", "seeds", "metric", "data", "baseline"})
    if unknown:
        raise ConfigError(f"sweep file {path}: unknown key {unknown[0]!r} "
                          "(recipe, overrides, axes, seeds, metric, data, baseline)")
    folder = os.path.dirname(os.path.abspath(path))
    if "recipe" not in spec:
        raise ConfigError(f"sweep file {path}: 'recipe' (the base recipe) is required")
    overrides = spec.get("overrides") or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"sweep file {path}: overrides must be a list of key=value strings")
    seeds = spec.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"sweep file {path}: seeds must be a non-empty list of integers >= 0")
    sweep = Sweep(path, _resolve(folder, spec["recipe"]), overrides, _grids(path, spec.get("axes") or {}),
                  seeds, str(spec.get("metric", "eval_loss")))
    sweep.baseline = _baseline(path, spec.get("baseline"), sweep.grids)
    sweep.data = _data(path, folder, spec.get("data"), corpus, sweep, out_dir)
    if sweep.data is not None:
        sweep.overrides.append(f"data.path={sweep.data.folder}")
    sweep.runs = _expand(sweep, folder, out_dir)
    return sweep


def _baseline(path: str, raw: Any, grids: list[dict]) -> dict[str, str]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) != 1:
        raise ConfigError(f"sweep file {path}: baseline must be one axis: label, e.g. {{taper: uniform}}")
    axis, label = next(iter(raw.items()))
    label = _label(label)
    if axis not in grids[0]:
        raise ConfigError(f"sweep file {path}: baseline axis {axis!r} is not an axis ({', '.join(grids[0])})")
    if not any(label in grid[axis] for grid in grids):
        raise ConfigError(f"sweep file {path}: baseline label {label!r} is not a label of axis {axis!r}")
    return {axis: label}


def _data(path: str, folder: str, raw: Any, corpus: list[str] | None, sweep: Sweep, out_dir: str) -> SweepData | None:
    if raw is None and not corpus:
        return None
    raw = {} if raw is None else raw
    where = f"sweep file {path}: data"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping ({', '.join(DATA_KEYS)})")
    unknown = sorted(set(raw) - set(DATA_KEYS))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]} is not a key ({', '.join(DATA_KEYS)})")
    if corpus:
        paths = [os.path.abspath(c) for c in corpus]
    else:
        listed = raw.get("corpus")
        listed = [listed] if isinstance(listed, str) else listed
        if not listed or not all(isinstance(c, str) and c for c in listed):
            raise ConfigError(f"{where}.corpus: give the raw text (a path or a list), or pass --corpus")
        paths = [_resolve(folder, c) for c in listed]
    text_mode = raw.get("text_mode", "paragraph")
    check_choice(f"{where}.text_mode", text_mode, TEXT_MODES)
    val_fraction = raw.get("val_fraction", 0.05)
    if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 0.5:
        raise ConfigError(f"{where}.val_fraction {val_fraction!r} must be in (0, 0.5): "
                          "eval_loss needs a held-out split")
    vocab = load_config(sweep.recipe, list(sweep.overrides)).model.vocab_size
    return SweepData(tuple(paths), text_mode, float(val_fraction), vocab, os.path.join(out_dir, "data"))


def prepare_data(data: SweepData, log=print) -> None:
    """Tokenizer + MDS shards of the corpus in data.folder, unless they are there already for the
    same inputs. A folder made from other inputs is refused, not overwritten."""
    from megatron_taper.data import is_complete
    from megatron_taper.data.corpus import SkipLog, read_documents
    from megatron_taper.data.preprocess import preprocess
    from megatron_taper.data.tokenizer import train_tokenizer

    stamp = os.path.join(data.folder, SWEEP_DATA_FILE)
    if is_complete(data.folder) and os.path.exists(stamp):
        with open(stamp) as f:
            made_from = json.load(f)
        if made_from != data.record():
            raise ConfigError(f"{data.folder} holds data made from {made_from}, not {data.record()}: "
                              "remove it or use another --out")
        return
    for c in data.corpus:
        if not os.path.exists(c) and not any(ch in c for ch in "*?["):
            raise ConfigError(f"sweep data: corpus {c} does not exist")
    partial = os.path.join(data.folder, SWEEP_PARTIAL_FILE)
    if os.path.isdir(data.folder) and os.listdir(data.folder) and not os.path.exists(partial):
        raise ConfigError(f"{data.folder} exists and was not written by a sweep (no {SWEEP_DATA_FILE} or "
                          f"{SWEEP_PARTIAL_FILE}): the sweep's data step would replace it; remove it or use "
                          f"another --out")
    os.makedirs(data.folder, exist_ok=True)
    with open(partial, "w"):  # marks the folder as this sweep's until its stamp is written
        pass
    parent = os.path.dirname(os.path.abspath(data.folder))
    os.makedirs(parent, exist_ok=True)
    prefix = os.path.join(parent, "tokenizer.partial", "spm")
    log(f"[sweep] training a {data.vocab_size}-piece tokenizer on {', '.join(data.corpus)}")
    documents = read_documents(list(data.corpus), SkipLog(strict=False), text_mode=data.text_mode)
    train_tokenizer((d.text for d in documents), prefix, data.vocab_size)
    log(f"[sweep] tokenizing into {data.folder}")
    documents = read_documents(list(data.corpus), SkipLog(strict=False), text_mode=data.text_mode)
    stats = preprocess(documents, prefix + ".model", data.folder, skips=SkipLog(strict=False),
                       val_fraction=data.val_fraction, overwrite=True, progress=False, inputs=list(data.corpus))
    with open(stamp + ".tmp", "w") as f:
        json.dump(data.record(), f, indent=1)
    os.replace(stamp + ".tmp", stamp)
    shutil.rmtree(os.path.dirname(prefix), ignore_errors=True)
    log(f"[sweep] data: {stats['documents']} documents, {stats['tokens']} tokens, splits {stats['splits']}")


def _resolve(folder: str, recipe: str) -> str:
    return recipe if os.path.isabs(recipe) or os.path.exists(recipe) else os.path.join(folder, recipe)


def _grids(path: str, raw: Any) -> list[dict[str, dict[str, dict[str, Any]]]]:
    if not isinstance(raw, list):
        return [_axes(f"sweep file {path}: axes", raw)]
    if not raw:
        raise ConfigError(f"sweep file {path}: axes must not be an empty list")
    grids = [_axes(f"sweep file {path}: axes[{i}]", grid) for i, grid in enumerate(raw)]
    for i, grid in enumerate(grids[1:], 1):
        if list(grid) != list(grids[0]):
            raise ConfigError(f"sweep file {path}: axes[{i}] has axes {list(grid)}, axes[0] has {list(grids[0])}: "
                              "every grid names the same axes in the same order")
    return grids


def _axes(where_axes: str, raw: Any) -> dict[str, dict[str, dict[str, Any]]]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where_axes} must be a mapping of axis name -> values")
    axes = {}
    for name, values in raw.items():
        where = f"{where_axes}.{name}"
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
    runs: dict[str, SweepRun] = {}
    for grid in sweep.grids:
        for run in _expand_grid(sweep, grid, folder, out_dir):
            if run.name in runs and runs[run.name] != run:
                raise ConfigError(f"sweep file {sweep.path}: run {run.name} appears in two grids with different "
                                  "settings: give the labels distinct names")
            runs.setdefault(run.name, run)
    return list(runs.values())


def _expand_grid(sweep: Sweep, grid: dict, folder: str, out_dir: str) -> list[SweepRun]:
    runs = []
    choices = [[(axis, label) for label in labels] for axis, labels in grid.items()]
    for combo in product(*choices):
        recipe, overrides = sweep.recipe, list(sweep.overrides)
        for axis, label in combo:
            for key, value in grid[axis][label].items():
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
    for record in read_metrics(path):
        if record.get("step") == steps and metric in record:
            last = record
    return last


def collect(sweep: Sweep) -> dict:
    """Per run its final metric; per configuration (all axes but the seed) mean, std over seeds;
    with a baseline, the difference to the baseline run of the same seed and other labels
    (paired by seed: both runs saw the same data order), mean and std over seeds."""
    runs, groups, values = [], {}, {}
    for run in sweep.runs:
        record = final_record(run, sweep.metric)
        value = None if record is None else float(record[sweep.metric])
        runs.append({"name": run.name, **dict(run.labels), "seed": run.seed, sweep.metric: value})
        groups.setdefault(run.labels, []).append(run.seed)
        values[run.labels, run.seed] = value
    table = []
    for labels, seeds in groups.items():
        done = [values[labels, s] for s in seeds if values[labels, s] is not None]
        row = {**dict(labels), "seeds_done": len(done), "seeds": len(seeds)}
        if done:
            row.update(_spread(done))
            if sweep.metric.endswith("loss"):
                row["ppl"] = perplexity(row["mean"])
        if sweep.baseline:
            axis, label = next(iter(sweep.baseline.items()))
            base = tuple((a, label if a == axis else lab) for a, lab in labels)
            deltas = [values[labels, s] - values[base, s] for s in seeds
                      if values[labels, s] is not None and values.get((base, s)) is not None]
            if deltas and base != labels:
                row["delta"] = _spread(deltas)
        table.append(row)
    return {"sweep": sweep.path, "metric": sweep.metric, "axes": sweep.axes, "baseline": sweep.baseline,
            "runs": runs, "table": table}


def _baseline_name(baseline: dict[str, str]) -> str:
    return ", ".join(f"{axis}={label}" for axis, label in baseline.items())


def _spread(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
            "min": min(xs), "max": max(xs), "n": len(xs)}


def markdown_table(result: dict) -> str:
    axes, metric = result["axes"], result["metric"]
    cols = [*axes, f"{metric} mean", "std (seeds)", "min", "max", "ppl", "seeds"]
    baseline = result.get("baseline")
    if baseline:
        cols.append(f"vs {_baseline_name(baseline)} (paired by seed: mean +- std)")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in result["table"]:
        cells = [str(row[a]) for a in axes]
        if "mean" in row:
            cells += [f"{row['mean']:.4f}", f"{row['std']:.4f}", f"{row['min']:.4f}", f"{row['max']:.4f}",
                      f"{row['ppl']:.2f}" if "ppl" in row else "", f"{row['seeds_done']}/{row['seeds']}"]
        else:
            cells += ["", "", "", "", "", f"0/{row['seeds']}"]
        if baseline:
            delta = row.get("delta")
            cells.append(f"{delta['mean']:+.4f} +- {delta['std']:.4f}" if delta else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: str) -> None:
    """PNG: the metric (mean, error bars = std over seeds) against the last axis, one line per
    combination of the other axes; with a baseline, a second panel with the paired differences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = result["axes"]
    x_axis, group_axes = (axes[-1], axes[:-1]) if axes else ("seed", [])
    x_labels = list(dict.fromkeys(row.get(x_axis, "") for row in result["table"]))
    panels = [("", f"final {result['metric']} (mean +- std over seeds)")]
    if result.get("baseline"):
        panels.append(("delta", f"minus {_baseline_name(result['baseline'])}, same seed (mean +- std)"))
    width = max(5.0, 1.2 * len(x_labels) + 3)
    fig, subplots = plt.subplots(1, len(panels), figsize=(width * len(panels), 4), squeeze=False)
    for ax, (key, ylabel) in zip(subplots[0], panels):
        lines: dict[tuple, list] = {}
        for row in result["table"]:
            stats = row.get(key) if key else row
            if stats and "mean" in stats:
                lines.setdefault(tuple(row[a] for a in group_axes), []).append((row, stats))
        for n, (group, rows) in enumerate(lines.items()):
            xs = [x_labels.index(r.get(x_axis, "")) + (n - (len(lines) - 1) / 2) * 0.06 for r, _ in rows]
            ax.errorbar(xs, [st["mean"] for _, st in rows], yerr=[st["std"] for _, st in rows], marker="o",
                        capsize=4, label=", ".join(group) or result["metric"])
        if key:
            ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(x_labels)), x_labels)
        ax.set_xlabel(x_axis)
        ax.set_ylabel(ylabel)
        if len(lines) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
