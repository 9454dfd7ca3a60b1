"""Weighted mixtures of MDS datasets (`data.mix`): one global sample stream drawn from several sources.

Schedule. Global sample g goes to one source and to an index within that source's own sample
stream (megatron_taper.data.streaming: its deterministic block-shuffled order, a new epoch of that
source whenever it runs out). The choice is a balanced binary tree over the sources in `data.mix`
order: a node whose two halves weigh p and 1 - p sends the m-th sample that reaches it to the
left half exactly when L(m + 1) > L(m), with L(m) = floor(m * p + 1/2) the left half's share of
the node's first m samples (p an exact fraction of the configured weights, all arithmetic on
integers). So among the first n global samples source i gets c_i(n) samples with
|c_i(n) - w_i * n| <= depth / 2 at every prefix n (depth = ceil(log2 K) for K sources; two
sources: within half a sample), the samples of each source are spread evenly through the stream
(no runs of one source), and `locate(g)` and `counts(n)` cost O(depth) integer operations with
nothing stored: the position is the global sample count alone, as for one source.

Ranks and resume. As for one source: micro-batch call c of data-parallel rank r returns global
samples [c*G + r*mb, c*G + (r+1)*mb) with G = dp_size * micro_batch, and the state is the number of
global samples consumed. A checkpoint at a step boundary therefore resumes at any dp size (or
micro-batch) that divides the position, with no sample repeated or skipped, and each source's
identity (documents, tokens, seed, seq_len) plus the names and weights are checked on resume.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import torch

from megatron_taper.data.streaming import StreamingSource, check_position

MIX_STATE_VERSION = 1


class MixSchedule:
    """Global sample index -> (source, index within the source), for positive weights (any scale)."""

    def __init__(self, weights: list[float]) -> None:
        if not weights or any(not w > 0 for w in weights):
            raise ValueError(f"mixture weights must be positive, got {weights}")
        exact = [Fraction(w) for w in weights]
        total = sum(exact)
        self.weights = [float(w / total) for w in exact]
        # node (lo, hi) with hi - lo > 1 -> (numerator, denominator) of the left half's share
        self._split: dict[tuple[int, int], tuple[int, int]] = {}
        stack = [(0, len(weights))]
        while stack:
            lo, hi = stack.pop()
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            share = sum(exact[lo:mid]) / sum(exact[lo:hi])
            self._split[(lo, hi)] = (share.numerator, share.denominator)
            stack += [(lo, mid), (mid, hi)]
        self.depth = (len(weights) - 1).bit_length()  # ceil(log2 K)

    def __len__(self) -> int:
        return len(self.weights)

    @staticmethod
    def _left(m: int, num: int, den: int) -> int:
        """floor(m * num / den + 1/2): the left half's share of a node's first m samples."""
        return (2 * m * num + den) // (2 * den)

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index in that source's stream) of global sample g."""
        assert g >= 0
        lo, hi, m = 0, len(self.weights), g
        while hi - lo > 1:
            num, den = self._split[(lo, hi)]
            mid = (lo + hi) // 2
            before = self._left(m, num, den)
            if self._left(m + 1, num, den) > before:
                hi, m = mid, before
            else:
                lo, m = mid, m - before
        return lo, m

    def counts(self, n: int) -> list[int]:
        """Samples of each source among global samples [0, n)."""
        out = [0] * len(self.weights)
        stack = [(0, len(self.weights), n)]
        while stack:
            lo, hi, m = stack.pop()
            if hi - lo == 1:
                out[lo] = m
                continue
            num, den = self._split[(lo, hi)]
            left = self._left(m, num, den)
            mid = (lo + hi) // 2
            stack += [(lo, mid, left), (mid, hi, m - left)]
        return out


class MixtureSource:
    """Endless micro-batches [micro_batch, seq_len + 1] (int64, CPU) of one data-parallel rank, drawn
    from several StreamingSources by a MixSchedule (module docstring)."""

    def __init__(self, sources: list[StreamingSource], names: list[str], weights: list[float], micro_batch: int,
                 dp_rank: int, dp_size: int) -> None:
        assert len(sources) == len(names) == len(weights) and len(set(names)) == len(names)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.sources, self.names, self.configured_weights = sources, list(names), [float(w) for w in weights]
        self.schedule = MixSchedule(self.configured_weights)
        self.micro_batch, self.dp_rank, self.dp_size = micro_batch, dp_rank, dp_size
        self.samples_consumed = 0

    @property
    def weights(self) -> dict[str, float]:
        """The normalised weights by source name."""
        return dict(zip(self.names, self.schedule.weights))

    @property
    def group_size(self) -> int:
        """Global samples consumed by one micro-batch call on every rank (dp_size * micro_batch)."""
        return self.dp_size * self.micro_batch

    def locate(self, g: int) -> tuple[str, int]:
        """(source name, index in that source's stream) of global sample g."""
        source, index = self.schedule.locate(g)
        return self.names[source], index

    def sample(self, g: int) -> np.ndarray:
        """Global sample g of the mixture: int64 [seq_len + 1]."""
        source, index = self.schedule.locate(g)
        return self.sources[source].sample(index)

    def next_batch(self) -> torch.Tensor:
        first = self.samples_consumed + self.dp_rank * self.micro_batch
        batch = np.stack([self.sample(first + i) for i in range(self.micro_batch)])
        self.samples_consumed += self.group_size
        return torch.from_numpy(batch)

    def realised(self, n: int | None = None) -> dict[str, float]:
        """Share of each source among the first n global samples (default: all consumed so far)."""
        n = self.samples_consumed if n is None else n
        return {name: c / max(n, 1) for name, c in zip(self.names, self.schedule.counts(n))}

    def metrics(self) -> dict[str, float]:
        """`mix/<name>`: each source's share of the global samples consumed so far (for metrics.jsonl)."""
        return {f"mix/{name}": share for name, share in self.realised().items()}

    def state_dict(self) -> dict[str, Any]:
        return {"mix_version": MIX_STATE_VERSION, "samples_consumed": self.samples_consumed,
                "names": list(self.names), "weights": list(self.configured_weights),
                "sources": [s.identity() for s in self.sources]}

    def load_state_dict(self, state: dict) -> None:
        if "mix_version" not in state:
            raise ValueError("cannot resume the data stream: the checkpoint was written by a run on one data.path "
                             "and this run reads data.mix; resume with the same data settings")
        if state["mix_version"] != MIX_STATE_VERSION:
            raise ValueError(f"data mixture state version {state['mix_version']!r} is not {MIX_STATE_VERSION}")
        if state.get("names") != self.names or state.get("weights") != self.configured_weights:
            raise ValueError(f"cannot resume the data stream: data.mix changed (names {state.get('names')} and "
                             f"weights {state.get('weights')} in the checkpoint, now {self.names} and "
                             f"{self.configured_weights})")
        for i, (source, identity) in enumerate(zip(self.sources, state["sources"])):
            source.check_identity(identity, where=f"data.mix[{i}].path")
        self.samples_consumed = check_position(int(state["samples_consumed"]), self.group_size)
