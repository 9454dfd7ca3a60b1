"""Text generation from a single-device model: sampling, with the family's decoding state.

Decoding state: a family whose FamilySpec has a `decoder` hook (models/spec.py) is decoded
incrementally: each new token costs one position. Today the Transformer, Gated Attention and
Hope-attention use models/decoding.py's KV cache (with RoPE; model.position=alibi takes the
fallback), and Hope-attention's online CMS levels also keep their incremental state (the fast
weights of the chunk being read and that chunk's inputs so far; the update at a chunk's end is
the training code's own, so decoding reads exactly the weights a full forward reads).

Fallback (a family without a decoder, e.g. Titans, whose memory's chunked state is not kept
between calls yet): the full prefix is run through `model(tokens)` for every new token, which
gives the same tokens at O(length^2) cost.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, then top-k (0 = off)
and top-p (nucleus, 1 = off), drawn with a torch.Generator seeded by `seed`. Generation stops
after max_new_tokens or at a stop id (the tokenizer's EOS).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from megatron_taper.models import family
from megatron_taper.models.spec import Decoder


@dataclass
class SamplingOptions:
    max_new_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set whose probability reaches p; 1 = all
    seed: int = 0
    stop_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError(f"--max-new-tokens={self.max_new_tokens} must be >= 0")
        if self.temperature < 0:
            raise ValueError(f"--temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"--top-k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p={self.top_p} must be in (0, 1]")


@dataclass
class Generation:
    tokens: list[int]  # the new tokens only
    cached: bool  # whether the family's decoding state was used
    prefill_s: float  # the prompt's forward
    decode_s: float  # everything after it
    stopped_at_eos: bool = False

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of decoding (the first token comes from the prefill)."""
        return max(len(self.tokens) - 1, 0) / self.decode_s if self.decode_s > 0 else 0.0


def make_decoder(model: nn.Module, batch: int, max_len: int) -> Decoder | None:
    """The family's decoding state for `model` (FamilySpec.decoder), or None where it has none."""
    hook = family(model.cfg.arch).decoder
    return hook(model, batch, max_len) if hook is not None else None


def next_token(logits: torch.Tensor, opts: SamplingOptions, generator: torch.Generator) -> torch.Tensor:
    """One token id per row of `logits` [B, V] (greedy, or sampled as the options say): [B]."""
    if opts.temperature == 0:
        return logits.argmax(dim=-1)
    scores = logits.float() / opts.temperature
    if 0 < opts.top_k < scores.shape[-1]:
        kth = torch.topk(scores, opts.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if opts.top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= opts.top_p  # the mass before a token already reaches p
        ordered = ordered.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(logits.device)


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], opts: SamplingOptions, use_cache: bool | None = None
             ) -> Generation:
    """New tokens after `prompt` (one sequence). `use_cache` None: the family's decoding state
    where it has one; True: require it; False: recompute the prefix for every token."""
    opts.validate()
    if not prompt:
        raise ValueError("the prompt must have at least one token")
    decoder = make_decoder(model, 1, len(prompt) + opts.max_new_tokens) if use_cache is not False else None
    if use_cache and decoder is None:
        raise ValueError(f"model.arch={model.cfg.arch!r} (model.position={model.cfg.position_encoding}) has no "
                         f"incremental decoding state (FamilySpec.decoder)")
    cached = decoder is not None
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(opts.seed)
    step = _cached_steps(decoder, prompt, device) if cached else _full_steps(model, prompt, device)
    out, stopped = [], False
    started = time.perf_counter()
    logits = next(step)  # the prompt's forward: logits of the last position [1, V]
    prefill = time.perf_counter() - started
    while len(out) < opts.max_new_tokens:
        token = int(next_token(logits, opts, generator)[0])
        out.append(token)
        if token in opts.stop_ids:
            stopped = True
            break
        if len(out) < opts.max_new_tokens:
            logits = step.send(token)
    return Generation(out, cached, prefill, time.perf_counter() - started - prefill, stopped)


def _cached_steps(decoder: Decoder, prompt: list[int], device: torch.device):
    """Generator: yields the last logits [1, V] of the prompt, then of each token sent to it."""
    logits = decoder(torch.tensor([prompt], device=device))
    while True:
        token = yield logits[:, -1]
        logits = decoder(torch.tensor([[token]], device=device))


def _full_steps(model: nn.Module, prompt: list[int], device: torch.device):
    """As _cached_steps, recomputing the whole sequence for every token."""
    ids = list(prompt)
    while True:
        logits = model(torch.tensor([ids], device=device))
        token = yield logits[:, -1]
        ids.append(token)
