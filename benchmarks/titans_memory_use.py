"""Does Titans' neural memory matter after a short training run at the recipe's real sequence length?
A narrow model of the titans_125m_taper recipe's shape (its seq_len, window, persistent tokens, memory
depth / expansion / chunk / max_lr / gates; d_model, heads, layers and MLP width cut, a byte
vocabulary) trains on the bytes of the Python standard library's sources on the CPU, then its
held-out loss is measured with the memory and with every memory layer's output (what `memory.wo`
returns) replaced by zeros (MAG: the gate is then sigmoid(0) = 1/2 everywhere). Prints JSON.

    python benchmarks/titans_memory_use.py [--steps 120] [--batch 4] [--d-model 128] [--heads 2]
        [--layers 2] [--lr 3e-3] [--eval-batches 8] [--recipe titans_125m_taper] [key=value ...]

Held-out files: every 20th file of the sorted corpus; windows of seq_len + 1 bytes at random
offsets (fixed seed). Loss is reported over all positions and over positions >= the attention
window (where only the memory reaches past the window).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from small_training import train_small  # benchmarks/small_training.py, beside this script

from megatron_taper.config import load_config
from megatron_taper.data.corpus import EMBEDDED_MAX_BYTES, embedded_files
from megatron_taper.models import build_model

HERE = os.path.dirname(os.path.abspath(__file__))


def corpus(max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) byte tensors: every 20th sorted file is held out."""
    files = sorted(embedded_files(max_bytes))
    parts = ([], [])
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            parts[i % 20 == 0].append(f.read())
    return tuple(torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in parts)


def windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen)
    return torch.stack([data[s:s + seq + 1] for s in starts.tolist()])


def losses(model, batches: list[torch.Tensor], window: int) -> dict:
    total, far = [], []
    with torch.no_grad():
        for b in batches:
            nll = F.cross_entropy(model(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten(), reduction="none")
            nll = nll.view(b.shape[0], -1)
            total.append(nll.mean().item())
            far.append(nll[:, window:].mean().item())
    return {"loss": round(sum(total) / len(total), 4), f"loss_from_{window}": round(sum(far) / len(far), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="titans_125m_taper")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-batches", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-bytes", type=int, default=EMBEDDED_MAX_BYTES)
    parser.add_argument("overrides", nargs="*", help="key=value applied to the model config")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(os.path.join(HERE, "..", "configs", f"{args.recipe}.yaml"), [
        f"model.d_model={args.d_model}", f"model.n_heads={args.heads}", "model.n_kv_heads=0",
        f"model.n_layers={args.layers}", "model.vocab_size=256", f"model.mlp_width={2 * args.d_model}",
        "model.taper.schedule=uniform", "model.taper.start=1.0", "model.taper.multiple=8", *args.overrides]).model
    train, held = corpus(args.max_bytes)
    torch.manual_seed(args.seed)
    model = build_model(cfg)
    model.init_weights(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    def next_loss(step: int) -> torch.Tensor:
        b = windows(train, args.batch, cfg.seq_len, gen)
        return F.cross_entropy(model(b[:, :-1]).float().flatten(0, 1), b[:, 1:].flatten())

    start = time.perf_counter()
    trace = train_small(model, args.lr, args.steps, args.warmup, next_loss, log_every=10)
    eval_gen = torch.Generator().manual_seed(10_000 + args.seed)
    batches = [windows(held, args.batch, cfg.seq_len, eval_gen) for _ in range(args.eval_batches)]
    model.eval()
    with_memory = losses(model, batches, cfg.titans.window)
    hooks = [m.register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
             for name, m in model.named_modules() if name.endswith("memory.wo")]
    zeroed = losses(model, batches, cfg.titans.window)
    for h in hooks:
        h.remove()
    print(json.dumps({"recipe": args.recipe, "seq_len": cfg.seq_len, "d_model": cfg.d_model, "layers": cfg.n_layers,
                      "steps": args.steps, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                      "memory": {"chunk_size": cfg.titans.chunk_size, "max_lr": cfg.titans.max_lr,
                                 "forget_init": cfg.titans.forget_init, "window": cfg.titans.window},
                      "overrides": args.overrides, "final_train_loss": round(sum(trace[-10:]) / len(trace[-10:]), 4),
                      "held_out_with_memory": with_memory, "held_out_memory_zeroed": zeroed,
                      "train_s": round(time.perf_counter() - start, 1)}, indent=1))


if __name__ == "__main__":
    main()
