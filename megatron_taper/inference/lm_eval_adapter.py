"""EleutherAI lm-evaluation-harness adapter: score and sample a megatron_taper checkpoint.

    python -m megatron_taper.inference.lm_eval_adapter --model megatron_taper --model_args checkpoint=runs/X \\
        --batch_size 8 --tasks hellaswag,arc_easy [lm_eval options]

runs lm_eval's own command line with this model registered as `megatron_taper` (batch size and
device through lm_eval's --batch_size / --device); from Python,
`lm_eval.simple_evaluate(model=lm_eval_model_class()(checkpoint=...), tasks=[...])`. lm_eval
itself is an optional extra (`.[lmeval]`, docs/interop.md), not installed by launch/install.sh:
its dependency tree (datasets, pandas, pyarrow, scipy, scikit-learn, nltk, ...) is large.
Checked with lm_eval 0.4.13 (simple_evaluate and the command line, offline, on local tasks).

`MegatronTaperLM` implements the interface of lm_eval's `LM` (requests are objects with `.args`):
- loglikelihood((context, continuation)) -> (sum of log p(continuation tokens), whether greedy
  decoding would produce them). Trailing whitespace of the context moves to the continuation;
  the continuation's tokens are those of encode(context + continuation) after encode(context)
  when that is a prefix of it, else encode(continuation). Every context starts with the prefix
  token (as every document of the training stream follows the previous one's EOS), so an empty
  context is the prefix token alone and loglikelihood(c, x) = rolling(c + x) - rolling(c).
- loglikelihood_rolling((text,)) -> log p(text | prefix token), every token scored exactly once in
  windows of at most `max_length` inputs, each window with as much preceding context as fits.
- generate_until((context, {"until": [...], "max_gen_toks": N, "temperature": T, "do_sample": b}))
  -> the continuation cut before the first stop string (megatron_taper.inference.generation, KV cache for
  transformer / gated_attention; greedy unless do_sample with temperature > 0).
Prefix token: the tokenizer's EOS (documents end with EOS in training data), "\\n" for byte models.
Scoring runs the single-device model in fp32 (or `dtype`), `batch_size` sequences at a time,
right-padded (padding after a sequence does not change a causal model's earlier logits).
"""
from __future__ import annotations

import sys
import warnings
from typing import Any, Sequence

import torch

from megatron_taper.inference.generation import SamplingOptions, generate
from megatron_taper.inference.load import load_model, load_tokenizer, open_checkpoint

MODEL_NAME = "megatron_taper"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NEWLINE_BYTE = 10


class MegatronTaperLM:
    """lm_eval's LM interface over one checkpoint (see the module doc)."""

    def __init__(self, checkpoint: str, batch_size: int | str = 8, device: str | None = None,
                 max_length: int | None = None, dtype: str = "float32", tokenizer: str = "", **unused: Any):
        super().__init__()  # lm_eval's LM.__init__ when mixed in (lm_eval_model_class)
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
        self._rank, self._world_size = 0, 1
        ref = open_checkpoint(checkpoint, flag="checkpoint=")
        self.config = ref.config
        self.tokenizer = load_tokenizer(ref.config, ref.path, tokenizer, flag="tokenizer=")
        self._device = _usable_device(device)
        self.model = load_model(ref, self._device, DTYPES[dtype])
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or ref.config.model.seq_len)
        eos = self.tokenizer.eos_id
        self.prefix_token = eos if eos is not None and eos >= 0 else NEWLINE_BYTE
        self.stop_ids = () if eos is None or eos < 0 else (eos,)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "path", "bytes")

    # -- lm_eval's three request types ---------------------------------------------------------

    def loglikelihood(self, requests: Sequence, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self.encode_pair(*req.args) for req in requests]
        windows = []
        for context, continuation in pairs:
            tokens = (context + continuation)[-(self.max_length + 1):]
            windows.append((tokens, min(len(continuation), len(tokens) - 1)))
        return [(float(lp.sum()), bool(greedy)) for lp, greedy in self.score(windows)]

    def loglikelihood_rolling(self, requests: Sequence, disable_tqdm: bool = False) -> list[float]:
        out = []
        for req in requests:
            windows = self.rolling_windows(self.tokenizer.encode(req.args[0]))
            out.append(sum(float(lp.sum()) for lp, _ in self.score(windows)))
        return out

    def generate_until(self, requests: Sequence, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            prompt = (self.tokenizer.encode(context) or [self.prefix_token])[-max(1, self.max_length - max_new):]
            opts = SamplingOptions(max_new, temperature, int(kwargs.get("top_k", 0) or 0),
                                   float(kwargs.get("top_p", 1.0) or 1.0), int(kwargs.get("seed", 0) or 0),
                                   self.stop_ids)
            text = self.tokenizer.decode(generate(self.model, prompt, opts).tokens)
            cuts = [text.index(s) for s in until if s and s in text]
            out.append(text[:min(cuts)] if cuts else text)
        return out

    # -- tokens --------------------------------------------------------------------------------

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) as the module doc says."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_token], self.tokenizer.encode(continuation)
        whole = self.tokenizer.encode(context + continuation)
        head = self.tokenizer.encode(context)
        if whole[:len(head)] == head and len(whole) > len(head):
            return [self.prefix_token] + head, whole[len(head):]
        return [self.prefix_token] + head, self.tokenizer.encode(continuation)

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], int]]:
        """(window tokens, how many of its last tokens are scored) covering `tokens` after the
        prefix token: each token scored once, each window at most max_length inputs."""
        seq = [self.prefix_token] + list(tokens)
        windows, scored = [], 1  # seq[1:] are the targets; seq[:scored] are done
        while scored < len(seq):
            end = min(len(seq), scored + self.max_length)
            begin = max(0, end - 1 - self.max_length)
            windows.append((seq[begin:end], end - scored))
            scored = end
        return windows

    @torch.no_grad()
    def score(self, windows: list[tuple[list[int], int]]) -> list[tuple[torch.Tensor, bool]]:
        """Per window (tokens, n): log p of its last n tokens given the earlier ones [n] (float64),
        and whether each of them is the argmax; in input order, batch_size windows per forward."""
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][0]))
        out: list[Any] = [None] * len(windows)
        for at in range(0, len(order), self.batch_size):
            group = order[at:at + self.batch_size]
            width = max(len(windows[i][0]) - 1 for i in group)
            inputs = torch.zeros(len(group), width, dtype=torch.long)
            for row, i in enumerate(group):
                tokens = windows[i][0][:-1]
                inputs[row, :len(tokens)] = torch.tensor(tokens)
            logprobs = torch.log_softmax(self.model(inputs.to(self._device)).double(), dim=-1).cpu()  # [b, S, V]
            for row, i in enumerate(group):
                tokens, n = windows[i]
                if n == 0:  # an empty continuation: probability 1
                    out[i] = (torch.zeros(0, dtype=torch.float64), True)
                    continue
                positions = torch.arange(len(tokens) - 1 - n, len(tokens) - 1)
                targets = torch.tensor(tokens[-n:])
                picked = logprobs[row, positions].gather(-1, targets[:, None]).squeeze(-1)
                greedy = bool((logprobs[row, positions].argmax(-1) == targets).all())
                out[i] = (picked, greedy)
        return out


def _usable_device(requested: str | None) -> torch.device:
    """`requested`, except that CUDA without a CUDA device (lm_eval's default device is "cuda")
    becomes the CPU with a warning."""
    if requested and requested.startswith("cuda") and not torch.cuda.is_available():
        warnings.warn(f"device={requested!r} but CUDA is not available: running on the CPU", stacklevel=3)
        return torch.device("cpu")
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def lm_eval_model_class() -> type:
    """MegatronTaperLM as a subclass of lm_eval's LM, registered as `megatron_taper` (needs lm_eval)."""
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import get_model, register_model
    except ImportError as e:
        raise ImportError(f"lm-evaluation-harness is not installed ({e}); pip install -e .[lmeval]") from None
    try:
        return get_model(MODEL_NAME)
    except (KeyError, ValueError):
        pass
    cls = type("MegatronTaperEvalLM", (MegatronTaperLM, LM), {"__module__": __name__})
    register_model(MODEL_NAME)(cls)
    return cls


def main(argv: list[str] | None = None) -> int:
    """lm_eval's command line with `--model megatron_taper` available (exit 2 without lm_eval)."""
    try:
        lm_eval_model_class()
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
