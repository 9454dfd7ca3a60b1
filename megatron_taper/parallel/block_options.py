"""Per-block options of the training step: activation checkpointing and torch.compile.

Applied by parallelize() to this rank's blocks after tensor parallelism and before ZeRO (as
torchtitan orders them), on meta or real modules alike. Both act on `model.layers` (every family
keeps its blocks there) and leave parameter names unchanged: the block's `forward` is replaced on
the instance, so checkpoints, tp layouts and FSDP units see the same module tree.

train.activation_checkpointing
    none       every block keeps the tensors its backward needs.
    full       every block keeps only its input; its forward is re-run inside its backward
               (torch.utils.checkpoint, non-reentrant), including any tp collectives in it.
               Costs one extra forward of every block (about +1/3 of the step's FLOPs).
    selective  as full for the blocks whose global index is a multiple of train.ac_every
               (0, k, 2k, ...), the others keep everything: about 1/k of full's recompute for
               about 1/k of its saving. With a taper, block 0 (the widest MLP) is always among them.
    op         every block, op-level (torch's selective checkpoint policies): the outputs of its
               matmuls (aten mm / addmm / bmm / baddbmm) and attention kernels (SDPA) are saved,
               everything else (norms, RoPE, activations, elementwise products, casts and the tp
               collectives) is recomputed in backward. Costs the elementwise work of one forward
               and no matmul FLOPs.

train.compile (auto | true | false; auto = on where the device is CUDA: TrainConfig.compiles)
    torch.compile (inductor) of each block's forward, after checkpointing (the recompute is then
    part of the compiled region); module hooks (FSDP2's gathers) stay outside it. Static shapes
    only (dynamic=False): the blocks are grouped by their signature (block_signature: the class,
    its options, and the name, shape and dtype of every parameter and buffer), and each group gets
    its own torch.compile region (isolate_recompiles=True), so a tapered stack compiles one graph
    per distinct MLP width rather than falling back to dynamic shapes, and no group's compiles count
    against another's recompile limit. Blocks of one group share the graph (parameters are graph
    inputs). Each region may compile RECOMPILES_PER_SHAPE graphs: the training step's, and the
    evaluation's (grad mode off is a guard), plus one training graph per further window length of a
    sequence-length warmup (`lengths`: log2(model.seq_len / train.seq_len_warmup_start) more);
    past that it runs eager. Collectives inside a block
    (tp) are graph breaks: compiled regions lie between them.

train.cuda_graphs (with compile, CUDA only; preflight refuses it with ZeRO, pipelining or cp)
    each block compiled with mode="reduce-overhead": inductor records the compiled forward and
    backward as CUDA graphs (cudagraph trees, one recording per distinct shape) and replays them,
    so a block costs one graph launch instead of one host call per kernel. ParallelModel marks a
    new step before each training step and each evaluation batch; within a step, outputs of the
    previous micro-batch that are still alive (accumulated gradients) make inductor record a
    further graph rather than overwrite them. Never run on a GPU in this project's tests (CPU:
    inductor skips the graphs and runs the compiled code).
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatron_taper.cost.memory import checkpointed_blocks

RECOMPILES_PER_SHAPE = 2  # graphs one compile region may hold: training (grad on) and evaluation (grad off)


def apply_block_options(model: nn.Module, activation_checkpointing: str, ac_every: int, compile_blocks: bool,
                        cuda_graphs: bool = False, lengths: int = 1) -> int:
    """In place on `model.layers`: recompute (see module doc), then compile, as CUDA graphs when
    `cuda_graphs`. Each block records what it got in `block.options` (a tuple of "recompute",
    "compile", "cuda_graphs"). Returns the number of compile regions (distinct block signatures;
    one static graph each per grad mode and, in training, per window length: `lengths`), 0 without
    compile."""
    layers = model.layers
    for block in layers.values():
        block.options = ()
    recompute = _op_recomputed if activation_checkpointing == "op" else _recomputed
    for name in checkpointed_blocks(list(layers.keys()), activation_checkpointing, ac_every):
        block = layers[name]
        block.forward = functools.partial(recompute, block.forward)
        block.options += ("recompute",)
    if not compile_blocks:
        return 0
    mode = "reduce-overhead" if cuda_graphs else None
    regions: dict[tuple, Callable] = {}
    for block in layers.values():
        signature = block_signature(block)
        if signature not in regions:
            regions[signature] = torch.compile(_run, mode=mode, dynamic=False, isolate_recompiles=True,
                                               recompile_limit=RECOMPILES_PER_SHAPE + lengths - 1)
        block.forward = functools.partial(regions[signature], block.forward)
        block.options += ("compile", "cuda_graphs") if cuda_graphs else ("compile",)
    return len(regions)


def block_signature(block: nn.Module) -> tuple:
    """What a compiled block's graph depends on besides its inputs: its options so far (recompute),
    the class of each of its modules (float8 swaps some linears), and the name, shape and dtype of
    each parameter and buffer (local shards under tp; shapes are read on meta tensors too)."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (block.options, tuple(type(m) for m in block.modules()),
            tuple((name, tuple(t.shape), t.dtype) for name, t in tensors))


def _recomputed(forward, *args, **kwargs) -> torch.Tensor:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _saved_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default}
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"):
        op = getattr(aten, name, None)
        if op is not None:
            ops.add(op.default)
    return ops


def _save_matmuls(saved: set, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _op_recomputed(forward, *args, **kwargs) -> torch.Tensor:
    policy = functools.partial(_save_matmuls, _saved_ops())
    return checkpoint(forward, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, policy), **kwargs)


def _run(forward: Callable, *args, **kwargs) -> torch.Tensor:
    # the frame each compile region traces; `forward` (the block's bound forward, or its recompute
    # wrapper) is inlined, the block's parameters becoming inputs of the graph
    return forward(*args, **kwargs)
