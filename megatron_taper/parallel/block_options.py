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

train.compile
    torch.compile (inductor) of each block's forward, after checkpointing (the recompute is then
    part of the compiled region); module hooks (FSDP2's gathers) stay outside it. Blocks of
    different MLP width share one code object: dynamo compiles the first width statically, and
    on the second marks the changed sizes dynamic, so a tapered stack compiles twice rather than
    once per width (measured: 2 graphs for 8 blocks of 6 widths). Collectives inside a block
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

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from megatron_taper.cost.memory import checkpointed_blocks


def apply_block_options(model: nn.Module, activation_checkpointing: str, ac_every: int, compile_blocks: bool,
                        cuda_graphs: bool = False) -> None:
    """In place on `model.layers`: recompute (see module doc), then compile, as CUDA graphs when
    `cuda_graphs`. Each block records what it got in `block.options` (a tuple of "recompute",
    "compile", "cuda_graphs")."""
    layers = model.layers
    for block in layers.values():
        block.options = ()
    recompute = _op_recomputed if activation_checkpointing == "op" else _recomputed
    for name in checkpointed_blocks(list(layers.keys()), activation_checkpointing, ac_every):
        block = layers[name]
        block.forward = functools.partial(recompute, block.forward)
        block.options += ("recompute",)
    if compile_blocks:
        mode = "reduce-overhead" if cuda_graphs else None
        for block in layers.values():
            block.forward = functools.partial(_compiled, torch.compile(block.forward, mode=mode))
            block.options += ("compile", "cuda_graphs") if cuda_graphs else ("compile",)


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


def _compiled(compiled_forward, *args, **kwargs) -> torch.Tensor:
    # dynamo keeps parameter (and module attribute) shapes static by default, which would compile
    # once per MLP width and fall back to eager past its recompile limit; letting them become
    # dynamic keeps a tapered stack at two compilations. Read while tracing, inside this call.
    with torch._dynamo.config.patch(force_parameter_static_shapes=False,
                                    force_nn_module_property_static_shapes=False):
        return compiled_forward(*args, **kwargs)
