"""ParallelModel: what the Trainer and checkpoints see of a model after parallelism is applied.

The (possibly sharded) module, how its parameters map to logical (unsharded) tensors for
checkpoints, how gradients are reduced and clipped, and the loss function matching how the logits
are laid out. Engines that own more of the step (DeepSpeed, pipelining) subclass it and override
the hooks declared here: build_optimizer, optimizer_step, forward_backward, evaluate,
save_native / load_native.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megatron_taper.checkpoint.files import CheckpointReader, Piece
from megatron_taper.models.documents import document_starts
from megatron_taper.models.layers import cross_entropy
from megatron_taper.models.moe import set_aux_scale
from megatron_taper.parallel.context import ParallelContext
from megatron_taper.parallel.cp.split import SequenceSplit, cp_mean, split_batch
from megatron_taper.parallel.dp.ddp import wrap_ddp
from megatron_taper.parallel.tp.layers import ShardSpec
from megatron_taper.training.optim import build_optimizer

if TYPE_CHECKING:
    from megatron_taper.config import TrainConfig
    from megatron_taper.training.carried import CarriedRows


@dataclass
class ParallelModel:
    module: nn.Module
    ctx: ParallelContext
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
    # name -> function turning this rank's local tensor into the logical one, and back
    to_full: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    to_local: dict[str, Callable[[torch.Tensor], torch.Tensor]] = field(default_factory=dict)
    # name -> number of tp ranks holding an identical copy (gradient-norm weight 1 / replicas);
    # names not listed are replicated over the whole tp group
    replicas: dict[str, int] = field(default_factory=dict)
    # run in reduce_gradients before the dp average: tp-level sums of partial gradients
    # (parameters looked up by name at call time, so later wrappers may replace them)
    tp_grad_syncs: list[Callable[[nn.Module], None]] = field(default_factory=list)
    # set by ZeRO (parallel/dp/fsdp2.py): parameters, gradients and optimizer state are DTensors
    # sharded over the dp group; `dp_shard` turns a tp-local tensor into this rank's dp shard
    dp_sharded: bool = False
    dp_shard: Callable[[torch.Tensor], torch.Tensor] | None = None
    # name -> tp layout of a tensor-parallel parameter (where its slice lies in the logical tensor)
    tp_specs: dict[str, ShardSpec] = field(default_factory=dict)
    # name -> layout over the ep ranks of an expert-parallel parameter (parallel/ep.py): rank r holds
    # rows starts[ep_rank] ..; not averaged by DDP nor in the dp shards of fsdp2 (under fsdp2 with
    # ep < dp a DTensor sharded over the dp / ep copies of those rows)
    ep_specs: dict[str, ShardSpec] = field(default_factory=dict)
    # zero=none with dp > 1: `module` behind torch DDP (attach_data_parallel), used for training
    # forwards; `module` itself stays the unwrapped one (names, checkpoints, evaluation)
    dp_module: nn.Module | None = None
    ddp_attached: bool = False  # attach_data_parallel ran (the module, or each pipeline chunk, behind DDP)
    # CUDA: pinned host buffers an async save stages its device-to-host copies into, by key
    # (reused from save to save; the previous save's writer has finished before the next copy)
    pinned: dict[str, torch.Tensor] = field(default_factory=dict)
    # parallel.cp > 1: each sequence split over the cp group (parallel/cp/split.py); the
    # batches stay whole sequences and are sliced here, and loss_fn gives this rank's share
    split: SequenceSplit | None = None
    # data.document_mask: the id that ends every document in the data (its stats.json's eos_id);
    # each batch's doc_start is derived from it and passed to the model (`batch_inputs`); None = off
    document_end: int | None = None
    # train.cuda_graphs: the blocks replay CUDA graphs; each step and evaluation batch starts a new
    # generation of them (torch.compiler.cudagraph_mark_step_begin)
    cuda_graphs: bool = False

    def full_tensor(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """The logical tensor of parameter `name` (or of a state tensor shaped like it). For a
        tensor-parallel shard this is a collective: every rank of the tp group must call it; for
        a ZeRO shard also every rank of the dp group."""
        if isinstance(local, DTensor):
            local = local.full_tensor()
        fn = self.to_full.get(name)
        return local if fn is None else fn(local)

    def local_tensor(self, name: str, full: torch.Tensor) -> torch.Tensor:
        fn = self.to_local.get(name)
        local = full if fn is None else fn(full)
        # an expert's to_local shards it over its copies itself where fsdp2 does (dp/fsdp2.py)
        return local if self.dp_shard is None or name in self.ep_specs else self.dp_shard(local)

    def attach_data_parallel(self, bucket_mb: float) -> None:
        """Average gradients over dp with bucketed all-reduces overlapping backward (torch DDP,
        dp/ddp.py); called once the parameters are materialised."""
        assert not self.dp_sharded and self.dp_module is None
        self.dp_module = wrap_ddp(self.module, self.ctx, bucket_mb, ignore=list(self.ep_specs))
        self.ddp_attached = True

    # -- optimizer (engines that own their optimizer, e.g. DeepSpeed, override these) -------------

    def build_optimizer(self, train: TrainConfig) -> torch.optim.Optimizer:
        return build_optimizer(self.module, train, self.ctx.device)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, max_norm: float,
                       loss_finite: bool | torch.Tensor = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce and clip gradients, then step unless the loss or the gradient norm is
        non-finite; gradients are cleared either way. Returns (global grad norm, stepped), both
        0-dim tensors on the device: with a fused AdamW the skip happens on the device (its
        `found_inf`, as torch's GradScaler uses it), so nothing waits for the host."""
        self.reduce_gradients()
        norm = self.clip_gradients(max_norm)
        finite = torch.isfinite(norm) & torch.as_tensor(loss_finite, device=norm.device)
        if all(group.get("fused") for group in optimizer.param_groups):
            optimizer.found_inf = (~finite).float()  # 1.0: the fused kernel leaves params, state and step
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
        elif bool(finite):  # (a host sync: only optimizers without a fused kernel)
            optimizer.step()
        # behind DDP the gradients stay views into its buckets, zeroed in place: set to None, the
        # next backward would allocate fresh ones beside the buckets (a second fp32 copy per rank)
        optimizer.zero_grad(set_to_none=self.dp_module is None)
        return norm, finite

    # -- checkpoints (checkpoint.py) ---------------------------------------------------------------

    def save_native(self, folder: str) -> str | None:
        """Write an engine's own checkpoint files under `folder` (a collective); the subfolder
        (relative to `folder`) that holds them all, or None when it wrote none (the default: the
        logical files are the whole checkpoint)."""
        return None

    def load_native(self, folder: str, meta: dict, verify: Callable[[str], None]) -> bool:
        """Restore from the engine's own files if they fit this layout, first passing each file
        this rank will read (its name in meta["files"]) to `verify`; False: use the logical ones."""
        return False

    @property
    def gathers_on_every_dp_rank(self) -> bool:
        """Whether logical_state is a collective over the dp group (ZeRO shards) or is called by
        dp rank 0 alone (replicas)."""
        return self.dp_sharded or bool(self.ep_specs)

    def logical_state(self, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """(parameters, optimizer state) as logical CPU tensors keyed by parameter name."""
        model_state, optim_state = {}, {}
        for name, param in self.module.named_parameters():
            model_state[name] = self.full_tensor(name, param.detach()).cpu()
            state = optimizer.state.get(param, {})
            optim_state[name] = {k: (self.full_tensor(name, v) if v.dim() else v).detach().cpu()
                                 for k, v in state.items()}
        return model_state, optim_state

    def load_logical_state(self, optimizer: torch.optim.Optimizer, model_state: dict, optim_state: dict,
                           missing: Callable[[str], Exception]) -> None:
        """Inverse of logical_state: this rank's slices of the logical tensors into the model."""
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                if name not in model_state:
                    raise missing(name)
                param.copy_(self.local_tensor(name, model_state[name]).to(param.dtype))
        by_name = dict(self.module.named_parameters())
        for name, state in optim_state.items():
            if name in by_name:
                p = by_name[name]
                optimizer.state[p] = {k: (self.local_tensor(name, v) if v.dim() else v).to(p.device)
                                      for k, v in state.items()}

    # -- sharded checkpoints (checkpoint.py): each rank writes and reads only its own pieces -------

    def piece_box(self, name: str, local: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
        """(full shape, offsets) of this rank's `local` piece of parameter `name` (or of a state
        tensor shaped like it) in the logical tensor, and whether this rank owns it (writes it:
        one rank per box; tp and dp replicas and empty ZeRO shards do not)."""
        ctx = self.ctx
        owner = self.dp_sharded or (ctx.dp_rank == 0 and ctx.cp_rank == 0)
        expert = self.ep_specs.get(name)
        if isinstance(local, DTensor):  # FSDP2: Shard(0) of the tp-local tensor, torch.chunk sizes
            full, data = list(local.shape), local.to_local()
            offsets = [0] * len(full)
            owner = owner and ctx.dp_replicate_rank == 0  # HSDP: the first replica writes
            if full:  # over dp_shard, or an expert's rows over their dp / ep copies (parallel/ep.py)
                rank, shards = (ctx.ep_replicate_rank, ctx.dp // ctx.ep) if expert else (ctx.dp_shard_rank,
                                                                                          ctx.dp_shard)
                offsets[0] = rank * -(-full[0] // shards)
                owner = owner and data.numel() > 0
        else:
            full, offsets = list(local.shape), [0] * local.dim()
            if expert is not None:  # the first of the dp / ep copies of its rows writes
                owner = ctx.cp_rank == 0 and ctx.ep_replicate_rank == 0
        if expert is not None:  # each ep rank its own experts' rows
            full[0], offsets[0] = expert.full, offsets[0] + expert.starts[ctx.ep_rank]
        spec = self.tp_specs.get(name)
        if spec is not None:
            start = spec.starts[self.ctx.tp_rank]
            full[spec.dim], offsets[spec.dim] = spec.full, offsets[spec.dim] + start
            owner = owner and spec.starts.index(start) == self.ctx.tp_rank  # kv heads shared by tp ranks
        elif self.ctx.tp > 1:
            owner = owner and self.ctx.tp_rank == 0
        return tuple(full), tuple(offsets), owner

    def checkpoint_pieces(self, optimizer: torch.optim.Optimizer, copy: bool = True) -> list[Piece]:
        """The pieces of parameters and AdamW state this rank writes, on the CPU (no
        communication); `copy=False` shares the memory of CPU tensors (a synchronous save). For an
        async save from a GPU the copies go into pinned buffers (`pinned`, kept for the next save:
        one host copy of the rank's state), non-blocking, with one synchronisation at the end."""
        self._reshard()
        pieces = []
        staged = False
        for name, param in self.module.named_parameters():
            full, offsets, owner = self.piece_box(name, param)
            if not owner:
                continue
            tensors = {f"model/{name}": param}
            tensors.update({f"optim/{name}/{k}": v for k, v in optimizer.state.get(param, {}).items()})
            for key, t in tensors.items():
                data = local_part(t.detach())
                if data.device.type == "cuda" and copy:  # an async save
                    buffer = self.pinned.get(key)
                    if buffer is None or buffer.shape != data.shape or buffer.dtype != data.dtype:
                        buffer = self.pinned[key] = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
                    data, staged = buffer.copy_(data, non_blocking=True), True
                else:
                    data = data.to("cpu", copy=copy)
                if data.dim():
                    pieces.append(Piece(key, full, offsets, data))
                elif not any(offsets):  # a scalar (AdamW's step): written by the first box's owner
                    pieces.append(Piece(key, (), (), data))
        if staged:
            torch.cuda.synchronize()
        return pieces

    def load_pieces(self, optimizer: torch.optim.Optimizer, reader: CheckpointReader) -> None:
        """Fill parameters and AdamW state from a sharded checkpoint, reading only this rank's
        boxes, in place where the tensors exist (so the peak is the resident model plus about one
        record, not a second copy of the state)."""
        self._reshard()
        with torch.no_grad():
            for name, param in self.module.named_parameters():
                full, offsets, _ = self.piece_box(name, param)
                local = local_part(param.data)
                _read_local(reader, f"model/{name}", offsets, local)
                state = optimizer.state.get(param, {})
                for key in reader.keys(f"optim/{name}/"):
                    k = key.rsplit("/", 1)[1]
                    if reader.index[key]["shape"] == []:
                        state[k] = reader.read(key, (), ()).to(param.device)
                        continue
                    old = state.get(k)
                    if old is not None and tuple(local_part(old).shape) == tuple(local.shape):
                        _read_local(reader, key, offsets, local_part(old))
                        continue
                    value = reader.read(key, offsets, tuple(local.shape)).to(param.device)
                    if isinstance(param, DTensor):
                        value = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                   shape=param.shape, stride=param.stride())
                    state[k] = value
                if state:
                    optimizer.state[param] = state

    def _reshard(self) -> None:
        """FSDP2 leaves modules with reshard_after_forward=False gathered after a forward without
        backward (evaluation): shard them again, so that parameters are this rank's DTensor shards."""
        if self.dp_sharded:
            from torch.distributed.fsdp import FSDPModule

            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def forward_backward(self, micro_batches: list[torch.Tensor], autocast: Callable,
                         carry: CarriedRows | None = None, seq_len: int | None = None) -> torch.Tensor:
        """Forward and backward over one rank's micro-batches ([b, S + 1] tokens each) of one step.

        Returns the mean loss over the micro-batches (detached, float32 scalar on the device);
        gradients are accumulated as for that mean. Pipeline-parallel models override this.
        `carry` (a model that carries a state across steps): carry.before(i) runs before micro-batch
        i's forward, carry.after(i) after its backward (activation checkpointing recomputes the
        forward inside backward with the same state). `seq_len`: the step's window length
        (train.seq_len_warmup_steps; `batch_inputs`), None = S.
        """
        total = torch.zeros((), device=self.ctx.device)
        runner = self.dp_module or self.module
        set_aux_scale(self.module, 1.0 / len(micro_batches))  # MoE routing losses: weighted as the loss
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        for i, tokens in enumerate(micro_batches):
            if carry is not None:
                carry.before(i)
            tokens = tokens.to(self.ctx.device, non_blocking=True)
            # DDP reduces in the last micro-batch's backward only (gradients accumulate before)
            last = i == len(micro_batches) - 1
            with contextlib.nullcontext() if last or self.dp_module is None else self.dp_module.no_sync():
                inputs, targets, documents = self.batch_inputs(tokens, seq_len)
                with autocast():
                    loss = self.loss_fn(runner(inputs, **documents), targets)
                (loss / len(micro_batches)).backward()
            if carry is not None:
                carry.after(i)
            total += loss.detach().float()
        return cp_mean(total / len(micro_batches), self.split)

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, autocast: Callable) -> torch.Tensor:
        """Mean loss of one micro-batch without gradients (float32 scalar, same on every rank)."""
        tokens = tokens.to(self.ctx.device, non_blocking=True)
        inputs, targets, documents = self.batch_inputs(tokens)
        if self.cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            return cp_mean(self.loss_fn(self.module(inputs, **documents), targets).float(), self.split)

    def batch_inputs(self, tokens: torch.Tensor, seq_len: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """(inputs, targets, the model's keyword inputs) of tokens [b, S + 1] on the device: this
        rank's slices under cp; with `document_end` set, {"doc_start": [b, S] (or its slice)} marking
        the positions right after each end-of-document token of the inputs
        (models/documents.py document_starts), else {} (the model is called as without documents).
        `seq_len` < S (a sequence-length warmup; preflight refuses it with cp): each row cut into
        S / seq_len windows of its own, [b, S] -> [b x S / seq_len, seq_len] (`cut_windows`), the
        target of every input still the token after it, doc_start found in the cut windows: exactly
        the inputs of windows of seq_len + 1 tokens read one after another."""
        inputs, targets = split_batch(self.split, tokens)
        if seq_len is not None and seq_len != tokens.shape[1] - 1:  # (under cp the inputs are this rank's slice)
            assert self.split is None, "preflight refuses a sequence-length warmup with parallel.cp > 1"
            inputs, targets = cut_windows(inputs, seq_len), cut_windows(targets, seq_len)
        if self.document_end is None:
            return inputs, targets, {}
        if self.split is None:
            return inputs, targets, {"doc_start": document_starts(inputs, self.document_end)}
        return inputs, targets, {"doc_start": self.split.split(document_starts(tokens[:, :-1], self.document_end))}

    def reduce_gradients(self) -> None:
        """Complete partial tp gradients. The dp average happened in backward: DDP's bucketed
        all-reduces, or ZeRO's reduce-scatters (both commute with the tp sums)."""
        assert self.ctx.dp * self.ctx.cp == 1 or self.dp_sharded or self.ddp_attached, \
            "attach_data_parallel first"
        for sync in self.tp_grad_syncs:
            sync(self.module)

    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Global L2 gradient norm over all parameters of the model (all ranks), clipped to max_norm.

        Every logical value counts once: a tp shard with weight 1, a tensor held by k tp ranks with
        1/k (summed over the tp group), disjoint pipeline stages summed over the pp group, each dp
        rank's own experts (expert parallelism, ep_specs) summed over the ep group (and over their
        dp / ep copies where fsdp2 shards them; replicated over tp, weight 1/tp).
        """
        grads, by_replicas, experts = [], {}, []
        for name, p in self.module.named_parameters():
            if p.grad is not None:
                grad = local_part(p.grad)  # a ZeRO shard: its part of the norm, summed over dp below
                grads.append(grad)
                if name in self.ep_specs:
                    experts.append(grad)
                else:
                    by_replicas.setdefault(self.replicas.get(name, self.ctx.tp), []).append(grad)
        device = grads[0].device if grads else self.ctx.device
        sq = torch.zeros((), device=device, dtype=torch.float32)
        for k, gs in by_replicas.items():
            sq += torch.nn.utils.get_total_norm(gs, foreach=True).float().square() / k
        if self.dp_sharded and self.ctx.dp_shard > 1:  # HSDP: replicas hold the same shard, counted once
            dist.all_reduce(sq, group=self.ctx.dp_shard_group)
        if self.ep_specs:  # each ep rank's own experts (the same on every tp rank)
            expert_sq = torch.nn.utils.get_total_norm(experts, foreach=True).float().square() / self.ctx.tp \
                if experts else torch.zeros((), device=device, dtype=torch.float32)
            sharded = any(isinstance(self.module.get_parameter(name), DTensor) for name in self.ep_specs)
            dist.all_reduce(expert_sq, group=self.ctx.dp_group if sharded else self.ctx.ep_group)
            sq += expert_sq
        if self.ctx.tp > 1:
            dist.all_reduce(sq, group=self.ctx.tp_group)
        if self.ctx.pp > 1:
            dist.all_reduce(sq, group=self.ctx.pp_group)
        norm = sq.sqrt()
        if grads and max_norm > 0 and math.isfinite(max_norm):
            # (torch.nn.utils.clip_grads_with_norm_ takes parameters, not gradients: scale here)
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm


def _read_local(reader: CheckpointReader, key: str, offsets: tuple[int, ...], local: torch.Tensor) -> None:
    """The box of `key` at `offsets` into `local`: in place on the CPU, else through a CPU copy."""
    if local.device.type == "cpu" and local.is_contiguous():
        reader.read_into(key, offsets, local)
    else:
        local.copy_(reader.read(key, offsets, tuple(local.shape)))


def cut_windows(t: torch.Tensor, length: int) -> torch.Tensor:
    """[b, S] -> [b x S / length, length]: each row's consecutive pieces of `length` tokens, in order."""
    b, s = t.shape
    assert s % length == 0, f"window length {length} does not divide {s} (preflight checks it)"
    return t.reshape(b * (s // length), length)


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ZeRO (DTensor) tensor; a plain tensor unchanged."""
    return t.to_local() if isinstance(t, DTensor) else t
