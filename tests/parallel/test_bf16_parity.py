"""bf16 (train.precision=bf16: CPU autocast) at every layout against the one-process bf16 run.

One precision policy (docs/precision.md): fp32 parameters, gradients and AdamW state, bf16
matmuls, everything else (embedding, norms, residual stream, loss) in fp32, fp32 reductions.
Every layout then computes the same ops in the same dtypes, and differs from one process only by
the order of fp32 reductions (dp averages, tp's split matmuls, pipelined micro-batches), as in fp32.

Tolerance. In fp32 those orders move a loss by ~1e-6 (tests/parallel/test_step_engines.py). bf16
keeps 8 significant bits: unit roundoff u = 2^-8. Where a layout rounds an activation once more
than one process does (tp: each rank's partial matmul output is rounded to bf16 before the tp
all-reduce, as in Megatron; one process rounds the whole sum once), that element moves by up to
u/2 relative. Logits here are below ~1 in magnitude, so a cross-entropy term moves by at most
~u/2 from one such rounding and the mean over 128 tokens a step averages the random signs down.
tp also rounds gradients more: a column-parallel region's input gradient is summed over its
matmuls and then over the ranks in bf16 (the backward all-reduce moves bf16, docs/precision.md),
where one process sums it in fp32; that moves a gradient element by up to ~u relative, which
reaches the loss only through the updates of later steps, and AdamW's update m / sqrt(v) changes
by about the same relative amount, a small fraction of lr per weight. Context parallelism (cp=2)
computes attention by another kernel than one process's fused causal SDPA (SDPA under an explicit
mask; the ring's own fp32 pieces), whose bf16 outputs round differently. Over 4 steps we allow
BF16_ATOL = u/8 = 2^-11 ~ 4.9e-4 per step's loss. Measured (this file, -s): tp=2 and tp2 x dp2
2.2e-4 (3.2e-4 when the backward all-reduce moved fp32: the roundings' signs partly cancel),
cp=2 2.3e-4, cp=2 ring 1.7e-4, DeepSpeed 7e-5, fsdp2 2e-5, DDP and pp=2 0. bf16 really ran: each
layout's distance to the one-process fp32 run is above FP32_GAP = 1e-4, five times the fp32
parity tolerance (2e-5) that every layout meets in fp32 (measured: 2.7e-4 to 4.3e-4).

Tiny model: 2 layers, d_model 64, seq 32, 4 steps; one process group per layout group (2 ranks:
tp=2, pp=2, fsdp2 dp=2, DDP dp=2, cp=2 (all-gather, ring), DeepSpeed dp=2 run one after the other;
4 ranks: tp2 x dp2).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.harness import run_distributed
from tests.helpers.runner import REPO

pytestmark = pytest.mark.multiprocess

BF16_ATOL = 2.0**-11
FP32_GAP = 1e-4
STEPS = 4
MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=160",
         "model.vocab_size=256", "model.seq_len=32", "model.taper.multiple=16", "train.device=cpu"]
TRAIN = [f"train.steps={STEPS}", "train.global_batch=4", "train.micro_batch=1", "train.lr=3e-3",
         "train.warmup_steps=1", "train.grad_clip=1.0", "train.log_interval=1", "train.eval_interval=0",
         "run.tensorboard=false", "checkpoint.interval=0", "checkpoint.keep=1"]
LAYOUTS_2 = {"tp=2": ["parallel.tp=2"], "pp=2": ["parallel.pp=2"], "fsdp2 dp=2": ["parallel.zero=fsdp2"],
             "ddp dp=2": [], "cp=2": ["parallel.cp=2"], "cp=2 ring": ["parallel.cp=2", "parallel.cp_attention=ring"],
             "deepspeed dp=2": ["parallel.zero=deepspeed"]}


def _losses(overrides: list[str]) -> list[float]:
    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    cfg = load_config(None, MODEL + TRAIN + overrides)
    Trainer(cfg).fit()
    with open(os.path.join(cfg.run.dir, "metrics.jsonl")) as f:
        return [r["loss"] for r in map(json.loads, f) if "loss" in r]


def _layouts(root: str, data: str, layouts: dict[str, list[str]]) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    out = {}
    for name, extra in layouts.items():  # DeepSpeed last: it keeps process-wide state
        out[name] = _losses([f"data.path={data}", f"run.dir={root}/{name.replace(' ', '_')}",
                             "train.precision=bf16", *extra])
    return out


def _distributed(nproc: int, root, data: str, layouts: dict[str, list[str]]) -> dict[str, list[float]]:
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or str(REPO / ".cache" / "torch_extensions")  # DeepSpeed's ops
    return run_distributed(_layouts, nproc, str(root), data, layouts, timeout=300,
                           env={"TORCH_EXTENSIONS_DIR": ext})[0]


@pytest.fixture(scope="module")
def references(byte_tokens, tmp_path_factory) -> dict[str, list[float]]:
    root = tmp_path_factory.mktemp("bf16_ref")
    return {precision: _losses([f"data.path={byte_tokens}", f"run.dir={root}/{precision}",
                                f"train.precision={precision}"]) for precision in ("bf16", "fp32")}


def _check(name: str, got: list[float], refs: dict[str, list[float]]) -> None:
    bf16 = max(abs(a - b) for a, b in zip(got, refs["bf16"]))
    fp32 = max(abs(a - b) for a, b in zip(got, refs["fp32"]))
    print(f"{name}: max |loss - one-process bf16| = {bf16:.2e}, max |loss - one-process fp32| = {fp32:.2e} "
          f"(tolerance {BF16_ATOL:.2e}, fp32 gap > {FP32_GAP:.0e})")
    assert len(got) == STEPS
    assert bf16 < BF16_ATOL, (name, got, refs["bf16"])
    assert fp32 > FP32_GAP, (name, "bf16 did not change the losses", got, refs["fp32"])


def test_bf16_layouts_match_one_process(references, byte_tokens, tmp_path):
    assert max(abs(a - b) for a, b in zip(references["bf16"], references["fp32"])) > FP32_GAP
    results = _distributed(2, tmp_path, byte_tokens, LAYOUTS_2)
    for name, got in results.items():
        _check(name, got, references)


def test_bf16_tp2_dp2_matches_one_process(references, byte_tokens, tmp_path):
    results = _distributed(4, tmp_path, byte_tokens, {"tp2 x dp2 fsdp2": ["parallel.tp=2", "parallel.zero=fsdp2"]})
    _check("tp2 x dp2 fsdp2", results["tp2 x dp2 fsdp2"], references)


# -- per-parameter dtypes: the same recipe at fsdp2 dp=1 and dp=2 -----------------------------

# ops that only move, view or cast a tensor: a parameter's name follows them to the op that computes
_PASS = {"t", "view", "_unsafe_view", "_to_copy", "transpose", "expand", "detach", "alias", "clone",
         "reshape", "as_strided", "permute", "contiguous", "unsqueeze", "slice", "select"}


def _dtypes(overrides: list[str]) -> dict:
    """Storage dtype of every parameter (this rank's shard), and the dtype in which each one enters
    the ops of one forward + backward under the run's autocast (its compute dtype)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from megatron_taper.config import load_config
    from megatron_taper.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = load_config(None, MODEL + TRAIN + overrides)
    trainer = Trainer(cfg)
    module = trainer.pm.module
    names: dict[int, str] = {}
    keep: list[torch.Tensor] = []
    compute: dict[str, set[str]] = {}

    def see(mod_name):
        def hook(mod, args):
            for pname, p in mod._parameters.items():
                if p is not None:
                    names[id(p)] = f"{mod_name}.{pname}".lstrip(".")
                    keep.append(p)
        return hook

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            tracked = [(names[id(a)], a) for a in args if isinstance(a, torch.Tensor) and id(a) in names]
            if tracked and func.overloadpacket.__name__ in _PASS and isinstance(out, torch.Tensor):
                names[id(out)] = tracked[0][0]
                keep.append(out)
            else:
                for name, a in tracked:
                    compute.setdefault(name, set()).add(str(a.dtype))
            return out

    hooks = [m.register_forward_pre_hook(see(n)) for n, m in module.named_modules()]
    batch = [trainer.train_source.next_batch()]
    with Record():
        trainer.pm.forward_backward(batch, trainer.autocast)
    for h in hooks:
        h.remove()
    storage = {}
    for n, p in module.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        storage[n] = (str(local.dtype), str(local.grad.dtype if local.grad is not None else p.grad.dtype))
    return {"storage": storage, "compute": {k: sorted(v) for k, v in compute.items()}}


def test_fsdp2_dtypes_same_at_dp1_and_dp2(byte_tokens, tmp_path):
    args = [f"data.path={byte_tokens}", "train.precision=bf16", "parallel.zero=fsdp2"]
    dp1 = _dtypes([*args, f"run.dir={tmp_path}/dp1"])
    dp2 = run_distributed(_dtypes, 2, [*args, f"run.dir={tmp_path}/dp2"], timeout=120)[0]
    assert dp1 == dp2
    assert set(dp1["storage"].values()) == {("torch.float32", "torch.float32")}
    compute = dp1["compute"]
    assert compute["layers.0.attn_norm.weight"] == ["torch.float32"]  # norms in fp32
    assert compute["tok_embeddings.weight"] == ["torch.float32"]  # the embedding (and residual) in fp32
    assert compute["layers.1.mlp.w1.weight"] == ["torch.bfloat16"]  # matmuls in bf16
