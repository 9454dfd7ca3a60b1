"""ParallelContext: the (pp, dp, tp) DeviceMesh, its process groups and this rank's coordinates.

Built once at start and passed explicitly to whatever needs it; nothing here is global.
Rank layout (tp fastest, pp slowest, as in Megatron): rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_taper.config import ConfigError, ModelConfig, ParallelConfig


@dataclass
class ParallelContext:
    world_size: int
    rank: int
    local_rank: int
    pp: int
    dp: int
    tp: int
    device: torch.device
    mesh: DeviceMesh | None = None  # None in a single process without a process group

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.tp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """Process group of mesh dimension `dim` (pp | dp | tp), None when there is no mesh."""
        return None if self.mesh is None else self.mesh.get_group(dim)

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        return self.group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        return self.group("pp")

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()


def choose_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def check_degrees(world_size: int, pcfg: ParallelConfig, mcfg: ModelConfig | None = None) -> int:
    """Validate (pp, tp) against the world and the model before any collective; returns dp."""
    if world_size % (pcfg.tp * pcfg.pp):
        raise ConfigError(
            f"parallel.tp={pcfg.tp} x parallel.pp={pcfg.pp} = {pcfg.tp * pcfg.pp} does not divide "
            f"the world size {world_size}"
        )
    if mcfg is not None:
        if mcfg.n_heads % pcfg.tp:
            raise ConfigError(f"parallel.tp={pcfg.tp} must divide model.n_heads={mcfg.n_heads}")
        if pcfg.pp > mcfg.n_layers:
            raise ConfigError(f"parallel.pp={pcfg.pp} is larger than model.n_layers={mcfg.n_layers}")
        from megatron_taper.parallel.tp_plan import check_tp  # kv heads, widths, vocab vs tp

        check_tp(mcfg, pcfg)
    return world_size // (pcfg.tp * pcfg.pp)


def init_parallel(pcfg: ParallelConfig, mcfg: ModelConfig | None = None, device: str = "auto",
                  timeout_s: float = 600.0) -> ParallelContext:
    """Join the process group started by torchrun (if any) and build the (pp, dp, tp) mesh."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dp = check_degrees(world_size, pcfg, mcfg)
    dev = choose_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world_size == 1 and not dist.is_initialized():
        return ParallelContext(1, 0, 0, 1, 1, 1, dev, None)
    if not dist.is_initialized():
        backend = "nccl" if dev.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    mesh = init_device_mesh(dev.type, (pcfg.pp, dp, pcfg.tp), mesh_dim_names=("pp", "dp", "tp"))
    return ParallelContext(world_size, rank, local_rank, pcfg.pp, dp, pcfg.tp, dev, mesh)


def shutdown(ctx: ParallelContext, barrier: bool = True) -> None:
    """Leave the process group; `barrier=False` after an error, when peers may never arrive."""
    if ctx.mesh is not None and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
