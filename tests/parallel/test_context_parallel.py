"""Context parallelism (parallel/cp/split.py) against one process.

Model: 2 layers, d=64, 4 query heads over 2 kv heads (GQA), tapered MLP, vocab 101, seq_len 64
(chunks of 16 at cp=2): the load-balanced split puts positions 0-15 and 48-63 on cp rank 0 and
16-47 on rank 1, so causal masks, RoPE angles and ALiBi distances all cross slice boundaries.
Each rank builds its layout from the same seed (the weights are layout-free) and runs 3 AdamW steps
of 2 micro-batches of 2 sequences with clipping that bites; the one-process run does the same.

Tolerances (fp32): the cp run computes the same sums in another order (attention's softmax over
keys gathered in rank order, the loss as a sum of per-rank shares), so each value differs by a few
float32 roundings (eps = 1.2e-7) of quantities of order 1 to 10: 2e-5 absolute on the losses
(measured 1e-6), 1e-5 relative to each parameter's largest gradient entry at every step (measured
5e-7 at the first, 2e-6 after two steps), 1e-4 relative on the gradient norms (measured 2e-7) and
2e-5 relative on the final parameters (measured 3e-6). AdamW runs with train.eps=1e-5: with the
default 1e-8 its first update lr x g / (|g| + eps) is a full +-lr step for every entry whose
gradient is as small as the rounding noise, which turns a 1e-7 difference into 7e-4 (measured).
"""
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_taper.config import load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.models.layers import alibi_slopes, causal_mask_at
from megatron_taper.parallel.cp.split import SequenceSplit
from megatron_taper.validation import ConfigError
from tests.helpers.cp_harness import Tolerances, compare, reference, worker
from tests.helpers.harness import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=96",
         "model.taper.multiple=16", "model.vocab_size=101", "model.seq_len=64", "train.seed=11",
         "train.global_batch=4", "train.micro_batch=2", "train.lr=3e-3", "train.warmup_steps=0",
         "train.grad_clip=0.5", "train.eps=1e-5"]

LOSS_ATOL = Tolerances().loss


def _config(overrides):
    return load_config(None, MODEL + list(overrides))


def _worker(layouts):
    """Each (overrides) layout in turn on these processes; rank 0's records."""
    return worker([MODEL + list(o) for o in layouts])


def _reference(overrides):
    return reference(MODEL + list(overrides))


_compare = compare


CP2_CASES = {"rope": ["model.position=rope"], "alibi": ["model.position=alibi"],
             "gated_attention": ["model.arch=gated_attention"],
             "ring rope": ["parallel.cp_attention=ring", "model.position=rope"],
             "ring alibi": ["parallel.cp_attention=ring", "model.position=alibi"],
             # the recomputed forward repeats the collectives inside backward, in the same order on every rank
             "full checkpointing": ["train.activation_checkpointing=full"],
             "ring, full checkpointing": ["parallel.cp_attention=ring", "train.activation_checkpointing=full"]}


def test_cp2_matches_one_process():
    """The Transformer with RoPE and with ALiBi, and Gated Attention, at cp=2 with either attention,
    also under activation checkpointing (one 2-process launch)."""
    got = run_distributed(_worker, 2, [["parallel.cp=2", *o] for o in CP2_CASES.values()], timeout=120)[0]
    for (label, overrides), rec in zip(CP2_CASES.items(), got):
        _compare(rec, _reference(overrides), f"cp=2 {label}")


def test_cp4_and_cp2_with_tp2_and_with_dp2():
    """4 processes: cp=2 x tp=2 (heads and vocabulary split, ALiBi slopes of the global heads);
    cp=2 x dp=2 (gradients averaged over the flattened dp x cp group, rank = (dp_rank x cp + cp_rank));
    cp=4 with the all-gather and with the ring (blocks and their gradients travel 3 and 4 hops)."""
    layouts = {"cp=2 x tp=2 alibi": ["parallel.cp=2", "parallel.tp=2", "model.position=alibi"],
               "cp=2 x dp=2": ["parallel.cp=2"],
               "cp=4": ["parallel.cp=4"],
               "cp=4 ring alibi": ["parallel.cp=4", "parallel.cp_attention=ring", "model.position=alibi"]}
    got = run_distributed(_worker, 4, list(layouts.values()), timeout=180)[0]
    for (label, overrides), rec in zip(layouts.items(), got):
        model = [o for o in overrides if o.startswith("model.")]
        _compare(rec, _reference(model), label)


def _attention_inputs(position):
    """q [B, H, S, E], k, v [B, K, S, E] (GQA), an output weighting w and the ALiBi slopes (or None)."""
    g = torch.Generator().manual_seed(3)
    q, w = (torch.randn(2, 4, 48, 8, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, 48, 8, generator=g) for _ in range(2))
    return q, k, v, w, (alibi_slopes(4, 0, 4, torch.device("cpu")) if position == "alibi" else None)


ATTENTION_CASES = [(ring, position) for ring in (False, True) for position in ("rope", "alibi")]


def _attention_worker():
    """Per case: this rank's attention output and q, k, v gradients of sum(out x w) at cp=2, ring
    tiles of 5 rows."""
    results = []
    for ring, position in ATTENTION_CASES:
        q, k, v, w, slopes = _attention_inputs(position)
        split = SequenceSplit(2, dist.get_rank(), dist.group.WORLD, attention="ring" if ring else "allgather", tile=5)
        mine = [split.split(t.transpose(1, 2)).transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
        out = split.attend(*mine, slopes)
        (out * split.split(w.transpose(1, 2)).transpose(1, 2)).sum().backward()
        results.append([out.detach()] + [t.grad for t in mine])
    return results


def test_attention_over_the_split_equals_whole_sequence_attention():
    """The cp attention kernels alone (all-gather and ring; RoPE-style causal mask and ALiBi), fp32,
    against SDPA over the whole sequence (48 tokens, chunks of 12, ring tiles of 5 rows: uneven
    tiles and every mask case): each rank's output and q, k, v gradients equal its slices of the
    whole-sequence ones within 2e-6 (fp32 sums of up to 48 terms of order 1 in another order)."""
    results = run_distributed(_attention_worker, 2, timeout=60)
    for case, (ring, position) in enumerate(ATTENTION_CASES):
        q, k, v, w, slopes = _attention_inputs(position)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        pos = torch.arange(48)
        out = F.scaled_dot_product_attention(*full, attn_mask=causal_mask_at(pos, pos, slopes), enable_gqa=True)
        (out * w).sum().backward()
        want = [out.detach()] + [t.grad for t in full]
        for rank, per_rank in enumerate(results):
            split = SequenceSplit(2, rank, None)
            for name, a, b in zip(("out", "dq", "dk", "dv"), per_rank[case], want):
                err = (a - split.split(b.transpose(1, 2)).transpose(1, 2)).abs().max().item()
                assert err < 2e-6, (ring, position, rank, name, err)


def test_split_covers_the_sequence_once():
    """Rank r holds chunks r and 2 cp - 1 - r: together every position once, each rank the same count."""
    for cp in (2, 4):
        seq = torch.arange(8 * cp).unsqueeze(0)  # [1, S]: the token at position i is i
        held = []
        for r in range(cp):
            split = SequenceSplit(cp, r, None)
            mine = split.split(seq)[0]
            assert torch.equal(mine, split.positions(mine.shape[0], mine.device))
            c, late = 4, 2 * cp - 1 - r
            assert mine.tolist() == list(range(r * c, (r + 1) * c)) + list(range(late * c, (late + 1) * c))
            held += mine.tolist()
        assert sorted(held) == list(range(8 * cp))


@pytest.mark.parametrize("overrides,world,message", [
    (["model.seq_len=62"], 2, "needs model.seq_len=62 divisible by 2 x parallel.cp = 4"),
    (["parallel.zero=fsdp2", "parallel.dp_replicate=2"], 4, "parallel.cp=2 with parallel.dp_replicate=2 (HSDP)"),
    (["model.arch=titans", "parallel.pp=2"], 4, "parallel.cp=2 with parallel.pp=2 is not supported for "
                                                "model.arch='titans' yet"),
    (["model.arch=tree", "train.compile=true"], 2, "parallel.cp=2 with train.compile=true is not supported for "
                                                   "model.arch='tree' yet"),
    (["parallel.tp=4", "parallel.sequence_parallel=true", "model.seq_len=68", "model.taper.multiple=8"], 8,
     "needs the slice of model.seq_len=68 / parallel.cp = 34 tokens divisible by parallel.tp=4"),
    ([], 3, "parallel.tp=1 x parallel.pp=1 x parallel.cp=2 = 2 does not divide the world size 3"),
])
def test_preflight_refuses_what_cp_does_not_support(overrides, world, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(_config(["parallel.cp=2", *overrides]), world)


def test_unknown_cp_key_suggests_parallel_cp():
    with pytest.raises(ConfigError, match=re.escape("did you mean 'parallel.cp'")):
        load_config(None, ["parallel.cp_size=2"])


# DeepSpeed JIT-builds a C++ op on first use, cached here (as tests/parallel/test_zero.py does)
DEEPSPEED_ENV = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR")
                 or str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions")}


def _train_main(args):
    """The Trainer's command line on this process (the harness joined the process group)."""
    from megatron_taper.train import main

    assert main(list(args)) == 0


def test_resume_at_another_cp_size(tmp_path):
    """Trained at cp=2 (2 processes) up to a checkpoint at step 2, resumed in one process; and
    trained in one process, resumed at cp=2 under parallel.zero=deepspeed (its ZeRO partitions
    over dp x cp = 2 ranks read from the logical checkpoint; DeepSpeed's data-parallel group is the
    dp x cp group): each loss sequence (and the held-out loss at the end) equals the uninterrupted
    one-process run within the tolerance above. The checkpoint is cp-free (only cp rank 0 writes
    the replicated parameters), and a cp group reads the samples of one dp rank."""
    import numpy as np

    from tests.helpers.runner import losses, read_metrics, stdlib_bytes, train_in_process

    tokens = tmp_path / "tokens.npy"
    np.save(tokens, np.frombuffer(stdlib_bytes(200_000), dtype=np.uint8).astype(np.int64) % 101)
    args = [*MODEL, f"data.path={tokens}", "train.steps=4", "train.log_interval=1", "train.eval_batches=2",
            "run.tensorboard=false", "train.device=cpu"]
    train_in_process([*args, f"run.dir={tmp_path / 'straight'}"])
    run_distributed(_train_main, 2, [*args, "parallel.cp=2", "train.exit_after=2", f"run.dir={tmp_path / 'down'}"],
                    timeout=120)
    assert len(losses(tmp_path / "down")) == 2
    out = train_in_process([*args, f"run.dir={tmp_path / 'down'}"])
    assert "resumed from" in out.stdout and "at step 2" in out.stdout
    train_in_process([*args, "train.exit_after=2", f"run.dir={tmp_path / 'up'}"])
    assert len(losses(tmp_path / "up")) == 2
    run_distributed(_train_main, 2, [*args, "parallel.cp=2", "parallel.zero=deepspeed", f"run.dir={tmp_path / 'up'}"],
                    timeout=300, env=DEEPSPEED_ENV)
    straight = losses(tmp_path / "straight")
    for resumed in ("down", "up"):
        split = losses(tmp_path / resumed)
        assert len(split) == len(straight) == 4
        assert max(abs(a - b) for a, b in zip(split, straight)) < LOSS_ATOL, (resumed, split, straight)
        evals = [[r["eval_loss"] for r in read_metrics(tmp_path / d) if "eval_loss" in r]
                 for d in ("straight", resumed)]
        assert len(evals[0]) == 1 and abs(evals[0][0] - evals[1][-1]) < LOSS_ATOL, (resumed, evals)


def test_memory_model_divides_activations_by_cp():
    """cost/memory.py at cp=2: each block's kept bytes are those of seq_len / 2 tokens plus the K
    and V of the tokens it does not hold (all-gather: [b, K, S/2, E] x 2 more, fp32), and the ring
    keeps no more than the half sequence does."""
    from megatron_taper.cost.memory import MemorySetup, model_memory

    def kept(overrides):
        cfg = _config(overrides)
        setup = MemorySetup.from_config(cfg.parallel, cfg.train, 1, False)
        return [p.kept for p in model_memory(cfg.model, setup).layers]

    half = kept(["model.seq_len=32"])
    kv_rest = 2 * 2 * 2 * 16 * 32 * 4  # micro_batch 2 x (K and V) x 2 kv heads x head_dim 16 x 32 tokens x fp32
    assert kept(["parallel.cp=2"]) == [h + kv_rest for h in half]
    assert kept(["parallel.cp=2", "parallel.cp_attention=ring"]) == half
