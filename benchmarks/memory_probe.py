"""Probes of the neural memory at the long-context recipes' own lengths and memory settings, at
initialisation; prints JSON.

    python benchmarks/memory_probe.py [--recipes titans_760m_taper,...] [--heads 2] [--seed 0]
        [--probe-len 1600] [key=value ...]

scale   For each recipe (its seq_len, head_dim, chunk, max_lr, gates, Memory Caching settings; d_model
        cut to --d-model with n_heads = d_model / head_dim, 1 layer), a forward of random tokens;
        per memory layer the norm of the memory's output (the input of the residual / gate: what
        `memory.wo` returns) averaged over the batch at positions 0, 64, 256, 512, 1024, ..., the
        mean over the first 64 and the last 256 positions, their ratio, and the fraction of
        positions below 1% of position 0's norm.
write   The write-then-read probe on the recipe's NeuralMemory at init: random inputs of --probe-len
        tokens; at token 100 the key is kappa and the value nu (a random unit pair), at token
        --probe-len - 100 the query is kappa. recall = <d, nu - r0> / |nu - r0|^2 with d = r1 - r0,
        r1 the read at the query with the pair written and r0 with token 100's own key and value
        (1: the read became nu; 0: nothing of the write is left). Twice: the gates as the inputs set
        them, and with the write's theta at max_lr.

MQAR at 2K tokens (chunk 64 vs chunk 1) is benchmarks/recall.py with --lengths 2048.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.models import build_model

RECIPES = ("titans_125m_taper", "titans_760m_taper", "titans_1.3b_taper", "deep_memory_caching_760m_taper",
           "deep_memory_caching_1.3b_taper")
HERE = os.path.dirname(os.path.abspath(__file__))


def recipe_config(recipe: str, heads: int, overrides: list[str]):
    """The recipe's model section, d_model cut to `heads` heads of its head_dim, one layer, a small vocabulary."""
    path = os.path.join(HERE, "..", "configs", f"{recipe}.yaml")
    head_dim = load_config(path, []).model.head_dim
    cut = [f"model.d_model={heads * head_dim}", f"model.n_heads={heads}", "model.n_kv_heads=0",
           "model.n_layers=1", "model.vocab_size=256", "model.mlp_width=64",
           "model.taper.schedule=uniform", "model.taper.start=1.0", "model.taper.multiple=8"]
    return load_config(path, cut + overrides).model


def output_norms(cfg, seed: int, batch: int = 2) -> list[torch.Tensor]:
    """Per memory layer the norm of its output at every position, averaged over the batch: [seq]."""
    torch.manual_seed(seed)
    model = build_model(cfg)
    model.init_weights(seed)
    seen = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: seen.append(out.detach().norm(dim=-1).mean(0)))
             for name, m in model.named_modules() if name.endswith("memory.wo")]
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed)))
    for h in hooks:
        h.remove()
    return [n for n in seen if n.shape[0] == cfg.seq_len]


def scale_report(norms: torch.Tensor) -> dict:
    seq = norms.shape[0]
    marks = [p for p in (0, 64, 256, 512, 1024, 2047, 4095) if p < seq]
    first, last = norms[:64].mean().item(), norms[-256:].mean().item()
    return {"norm_at": {p: float(f"{norms[p].item():.3g}") for p in marks},
            "first64": float(f"{first:.3g}"), "last256": float(f"{last:.3g}"),
            "last_over_first": float(f"{last / first:.3g}"),
            "below_1pct_of_pos0": round((norms < 0.01 * norms[0]).float().mean().item(), 3)}


def write_then_read(cfg, seed: int, length: int, saturate: bool) -> float:
    torch.manual_seed(seed)
    model = build_model(cfg)
    model.init_weights(seed)
    memory = next(m for name, m in model.named_modules() if name.endswith("memory") and hasattr(m, "mem_w"))
    memory.double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, length, cfg.d_model, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        feats = [f.clone() for f in memory.project(x, x)[0]]
        k, v, q, theta = feats[0], feats[1], feats[2], feats[3]
        kappa, nu = (F.normalize(torch.randn(k.shape[1], k.shape[3], generator=gen, dtype=torch.float64), dim=-1)
                     for _ in range(2))
        w, r = 100, length - 100
        q[0, :, r] = kappa
        if saturate:
            theta[0, :, w] = memory.max_lr
        r0 = memory.scan_features(tuple(feats), memory.init_state(1))[0][0, :, r]
        k[0, :, w], v[0, :, w] = kappa, nu
        r1 = memory.scan_features(tuple(feats), memory.init_state(1))[0][0, :, r]
        ideal, d = nu - r0, r1 - r0
        return ((d * ideal).sum() / (ideal * ideal).sum()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--heads", type=int, default=2, help="d_model = heads x the recipe's head_dim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-len", type=int, default=1600)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="key=value applied to every recipe")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = {"heads": args.heads, "seed": args.seed, "overrides": args.overrides, "recipes": {}}
    for recipe in args.recipes.split(","):
        cfg = recipe_config(recipe, args.heads, args.overrides)
        t = cfg.titans
        entry = {"seq_len": cfg.seq_len, "head_dim": cfg.head_dim, "chunk_size": t.chunk_size, "max_lr": t.max_lr,
                 "forget_init": t.forget_init, "scale": [scale_report(n) for n in output_norms(cfg, args.seed)]}
        entry["write_then_read"] = {
            name: float(f"{write_then_read(cfg, args.seed, args.probe_len, saturate):.3g}")
            for name, saturate in (("gates_from_inputs", False), ("theta_at_max_lr", True))}
        out["recipes"][recipe] = entry
        print(json.dumps({recipe: entry}), flush=True, file=sys.stderr)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
