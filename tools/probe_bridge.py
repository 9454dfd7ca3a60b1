"""Linear probe of narrative position from the memory bridge's state (model.arch=bridge).

    python tools/probe_bridge.py --checkpoint RUN_DIR_OR_CHECKPOINT --documents DOCS.jsonl [--json]

Documents (jsonl, field `text`; e.g. the held-out chapters benchmarks/bridge_ablation.py writes)
are tokenized with the checkpoint's tokenizer and cut into consecutive windows of model.seq_len
tokens (a shorter tail is dropped). A window's label is the third of its document (beginning,
middle, end, by token position) that holds the window's middle token. Features of a window:
- state:  the bridge state after the window's last segment (S_n), mean over its slots [D]; with
  model.bridge.carry_state the state runs along the document: each window starts from the state
  its document's previous window ended with (the first window from the initial state), as in
  training;
- hidden: the mean over the window of the hidden states entering the bridge (after the lower
  L//2 blocks) [D], for every model, with or without a bridge: what attention's own
  representations hold at the same depth.
A multinomial logistic regression (standardised features, L2 penalty, full-batch L-BFGS) is
fitted on the windows of half the documents and scored on the windows of the other half
(documents alternate, so no document is on both sides); its L2 weight is chosen from L2_GRID by
2-fold cross-validation over the training documents. Chance is the most frequent label's share
of the test windows.

Also here, shared with the benchmark: `kjv_chapters`, the chapters of the King James text as
documents (heading "Book N" and verse numbers removed, so that position cannot be read from
the numbers).
"""
from __future__ import annotations

import argparse
import gzip
import json
import re
import sys

import torch
import torch.nn.functional as F

from megatron_taper.inference.load import load_model, load_tokenizer, open_checkpoint

CHAPTER_HEADING = re.compile(r"^(\S.*) (\d+)$")
VERSE = re.compile(r"^\s+\d+ (.*)$")
LABELS = ("beginning", "middle", "end")
L2_GRID = (1e-3, 1e-2, 1e-1, 1.0)


def kjv_chapters(path: str) -> list[tuple[str, str]]:
    """(name, text) of every chapter of a KJV text in the layout of ../shared/data/kjv.txt.gz
    ("Book N" heading lines, verses "  V text" with continuation lines); one verse per line."""
    opener = gzip.open if path.endswith(".gz") else open
    chapters: list[tuple[str, list[str]]] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.rstrip("\n")
            heading, verse = CHAPTER_HEADING.match(line), VERSE.match(line)
            if heading and not line.startswith(" "):
                chapters.append((line, []))
            elif verse and chapters:
                chapters[-1][1].append(verse.group(1).strip())
            elif line.strip() and chapters and chapters[-1][1]:
                chapters[-1][1][-1] += " " + line.strip()
    return [(name, "\n".join(verses)) for name, verses in chapters if verses]


def read_documents(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def position_windows(docs: list[list[int]], seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Windows [N, seq_len], their labels [N] (third of the document holding the middle token)
    and document indices [N]."""
    windows, labels, owners = [], [], []
    for index, tokens in enumerate(docs):
        for start in range(0, len(tokens) - seq_len + 1, seq_len):
            windows.append(tokens[start:start + seq_len])
            labels.append(min(2, 3 * (start + seq_len // 2) // len(tokens)))
            owners.append(index)
    return torch.tensor(windows), torch.tensor(labels), torch.tensor(owners)


@torch.no_grad()
def window_features(model, windows: torch.Tensor, owners: torch.Tensor, batch: int = 32) -> dict[str, torch.Tensor]:
    """'hidden' (mean hidden state entering the bridge) for every model, 'state' (mean over
    slots of the final bridge state) when the model has a bridge: [N, D] each. `owners`: each
    window's document (a document's windows consecutive, in order), for a carried state."""
    model.eval()
    out: dict[str, list[torch.Tensor]] = {"hidden": [], "state": []}
    bridge = model.bridge
    carry = bridge is not None and bridge.carry_state
    state = None
    for first in range(0, len(windows), batch):
        h = model.lower_half(windows[first:first + batch])
        out["hidden"].append(h.mean(1))
        if bridge is None:
            continue
        if not carry:
            out["state"].append(bridge.states(h, last=True)[:, -1].mean(1))
            continue
        for i in range(len(h)):  # one window after the other: the state runs along its document
            g = first + i
            bridge.carry_in = (state, torch.tensor([g > 0 and bool(owners[g] == owners[g - 1])]))
            state = bridge.states(h[i:i + 1], last=True)[:, -1]
            bridge.carry_in = None
            out["state"].append(state.mean(1))
    return {k: torch.cat(v).float() for k, v in out.items() if v}


def fit_logistic(x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                 l2: float = 1e-2, iters: int = 200) -> float:
    """Test accuracy of a multinomial logistic regression on standardised features."""
    mean, std = x_train.mean(0), x_train.std(0).clamp_min(1e-6)
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    classes = len(LABELS)
    weight = torch.zeros(x_train.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimizer = torch.optim.LBFGS([weight, bias], max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(x_train @ weight + bias, y_train) + l2 * weight.square().sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float(((x_test @ weight + bias).argmax(1) == y_test).float().mean())


def choose_l2(x: torch.Tensor, y: torch.Tensor, owners: torch.Tensor) -> float:
    """The L2 weight of L2_GRID with the best 2-fold cross-validated accuracy, folds by document."""
    fold = (owners // 2) % 2

    def score(l2: float) -> float:
        return sum(fit_logistic(x[fold != k], y[fold != k], x[fold == k], y[fold == k], l2) for k in (0, 1))

    return max(L2_GRID, key=score)


def probe(model, docs: list[list[int]], seq_len: int) -> dict:
    """Probe accuracies on the windows of `docs` (token lists), split by document."""
    windows, labels, owners = position_windows(docs, seq_len)
    train, test = owners % 2 == 0, owners % 2 == 1
    result = {"documents": len(docs), "train_windows": int(train.sum()), "test_windows": int(test.sum()),
              "chance": float(torch.bincount(labels[test], minlength=3).max() / test.sum()),
              "label_counts": torch.bincount(labels, minlength=3).tolist()}
    for name, x in window_features(model, windows, owners).items():
        l2 = choose_l2(x[train], labels[train], owners[train])
        result[f"{name}_accuracy"] = fit_logistic(x[train], labels[train], x[test], labels[test], l2)
        result[f"{name}_l2"] = l2
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a run folder (its newest checkpoint) or a checkpoint")
    parser.add_argument("--documents", required=True, help="jsonl of held-out documents (field: text)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        ref = open_checkpoint(args.checkpoint)
        model = load_model(ref)
        if ref.config.model.arch != "bridge":
            raise ValueError(f"--checkpoint: model.arch={ref.config.model.arch!r}, not 'bridge'")
        tokenizer = load_tokenizer(ref.config, ref.path)
    except ValueError as e:  # ConfigError and CheckpointError included
        print(f"probe_bridge: error: {e}", file=sys.stderr)
        return 2
    docs = [tokenizer.encode(text) for text in read_documents(args.documents)]
    result = probe(model, docs, ref.config.model.seq_len)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>16}: {value:.3f}" if isinstance(value, float) else f"{key:>16}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
