"""ParallelContext: the (pp, dp, cp, tp) DeviceMesh, its process groups and this rank's coordinates.

Built once at start and passed explicitly to whatever needs it; nothing here is global.
Rank layout (tp fastest, then cp, then dp, pp slowest, as in Megatron):
rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank.
The ranks of a cp group hold slices of the same sequences (parallel/cp/split.py); gradients
are averaged over the flattened dp x cp group (`grad_group`).

HSDP (parallel.zero=fsdp2 with parallel.dp_replicate > 1): the dp ranks of a (pp, cp, tp)
coordinate also form a 2-D mesh (dp_replicate, dp_shard), dp_shard the faster one:
dp_rank = dp_replicate_rank * dp_shard + dp_shard_rank, so with tp x dp_shard processes per node
the shard groups (all-gathers, reduce-scatters) stay inside a node and only the replicas'
gradient all-reduce crosses nodes. The flat dp rank and dp group are unchanged (data loading,
loss averages); `dp_mesh` is what FSDP2 shards over: the 1-D dp mesh, or under HSDP the 2-D
(dp_replicate, dp_shard) one (`mesh._unflatten` of the dp dimension: same ranks, new groups).
With cp > 1, ZeRO shards over the flattened dp x cp dimension (`dp_cp_mesh`, as Megatron-core and
torchtitan do: the ranks of a cp group hold the same parameters), so `dp_mesh` is that mesh,
`dp_shard` = dp x cp and `dp_shard_rank` = dp_rank x cp + cp_rank (cost/preflight.py refuses HSDP
with cp).

Expert parallelism (parallel.ep, parallel/ep.py) splits the dp ranks once more, as torchtitan
does: dp_rank = ep_replicate_rank * ep + ep_rank. The ep ranks of one ep_replicate coordinate
(consecutive dp ranks) exchange tokens and each holds N / ep of the experts; the dp / ep ranks of
one ep coordinate hold the same experts (`ep_mesh`: (ep_replicate, ep), built only when
1 < ep < dp; with ep = dp the ep group is the dp group).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import ParallelConfig


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
    dp_replicate: int = 1  # HSDP: replicas of the sharded state (dp = dp_replicate x dp_shard)
    dp_mesh: DeviceMesh | None = None  # what ZeRO shards over (module doc; dp x cp when cp > 1); None without a mesh
    cp: int = 1  # context-parallel ranks: each sequence is split over them
    dp_cp_mesh: DeviceMesh | None = None  # cp > 1: the dp and cp dims flattened (gradient averaging)
    ep: int = 1  # expert-parallel ranks: each MoE layer's experts split over them (a divisor of dp)
    ep_mesh: DeviceMesh | None = None  # 1 < ep < dp: the dp ranks as (ep_replicate, ep) (module doc)

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.dp * self.cp * self.tp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_shard(self) -> int:
        """Ranks the ZeRO state is sharded over (dp x cp, or dp / dp_replicate under HSDP)."""
        return self.dp // self.dp_replicate * self.cp

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % (self.dp // self.dp_replicate) * self.cp + self.cp_rank

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // (self.dp // self.dp_replicate)

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.ep

    @property
    def ep_replicate_rank(self) -> int:
        """Which of the dp / ep copies of this rank's experts it holds."""
        return self.dp_rank // self.ep

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks exchanging tokens, each holding N / ep of the experts (the dp group when ep = dp)."""
        return self.dp_group if self.ep_mesh is None else self.ep_mesh.get_group("ep")

    @property
    def ep_replicate_mesh(self) -> DeviceMesh | None:
        """The dp / ep ranks holding the same experts as this one (1 < ep < dp), else None."""
        return None if self.ep_mesh is None else self.ep_mesh["ep_replicate"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def group(self, dim: str) -> dist.ProcessGroup | None:
        """Process group of mesh dimension `dim` (pp | dp | cp | tp), None when there is no mesh."""
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

    @property
    def dp_shard_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other shards of this rank's ZeRO state (the dp group, or dp x cp,
        without HSDP)."""
        if self.dp_mesh is None:
            return self.dp_group
        return self.dp_mesh.get_group() if self.dp_mesh.ndim == 1 else self.dp_mesh.get_group("dp_shard")

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return self.group("cp")

    @property
    def grad_group(self) -> dist.ProcessGroup | None:
        """The ranks gradients are averaged over: dp, flattened with cp when cp > 1 (its ranks
        computed partial gradients of the same sequences)."""
        if self.dp_cp_mesh is None:
            return self.dp_group
        return self.dp_cp_mesh.get_group()

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()


def choose_device(requested: str = "auto") -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but no CUDA device is available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """The collective backend of a device: nccl on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def has_bf16(device: torch.device) -> bool:
    """Whether `device` has bf16 matrix units (TrainConfig.uses_bf16's device half): CUDA that supports it."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def world_size() -> int:
    """Processes of this run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def init_parallel(pcfg: ParallelConfig, device: str = "auto", timeout_s: float = 600.0,
                  chosen_layout: str = "") -> ParallelContext:
    """Join the process group started by torchrun (if any) and build the (pp, dp, cp, tp) mesh.
    Run cost/preflight.py's checks first: here the layout is taken as valid. `chosen_layout`
    (parallel.layout=auto: what this rank chose) must be the same on every rank, checked before the
    mesh is built (ranks building different meshes would wait in mismatched collectives)."""
    world = world_size()
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    assert world % (pcfg.tp * pcfg.pp * pcfg.cp) == 0, "preflight() checks the layout against the world size"
    dp = world // (pcfg.tp * pcfg.pp * pcfg.cp)
    dev = choose_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if world == 1 and not dist.is_initialized():
        return ParallelContext(1, 0, 0, 1, 1, 1, dev, None)
    if not dist.is_initialized():
        backend = process_group_backend(dev)
        timeout = datetime.timedelta(seconds=timeout_s)
        joined = {}
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # torchrun: the agents' store outlives an in-job restart with the previous attempt's
            # keys (the old ranks' addresses), so each attempt joins under its own prefix: the
            # number of times this rank has started (TORCHELASTIC_RESTART_COUNT differs between
            # nodes: a node restarted because another one failed does not count it)
            store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
            starts = store.add(f"megatron_taper.starts.rank{rank}", 1)
            joined = {"store": dist.PrefixStore(f"megatron_taper.attempt-{starts}", store), "rank": rank,
                      "world_size": world}
        dist.init_process_group(backend, timeout=timeout, device_id=dev if dev.type == "cuda" else None, **joined)
    if chosen_layout:
        _check_same_layout(chosen_layout, world)
    mesh = init_device_mesh(dev.type, (pcfg.pp, dp, pcfg.cp, pcfg.tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    replicate, shard = pcfg.dp_split(dp)
    # the flattened dp x cp group is created on every rank (a collective)
    dp_cp = mesh["dp", "cp"]._flatten("dp_cp") if pcfg.cp > 1 else None
    if dp_cp is not None:
        dp_mesh = dp_cp  # cost/preflight.py refuses HSDP with cp
    elif replicate == 1:
        dp_mesh = mesh["dp"]
    else:
        dp_mesh = mesh._unflatten("dp", (replicate, shard), ("dp_replicate", "dp_shard"))["dp_replicate", "dp_shard"]
    # cost/preflight.py: ep divides dp, without HSDP or cp (the dp dimension is unflattened once)
    ep_mesh = mesh._unflatten("dp", (dp // pcfg.ep, pcfg.ep), ("ep_replicate", "ep"))["ep_replicate", "ep"] \
        if 1 < pcfg.ep < dp else None
    return ParallelContext(world, rank, local_rank, pcfg.pp, dp, pcfg.tp, dev, mesh, replicate, dp_mesh,
                           cp=pcfg.cp, dp_cp_mesh=dp_cp, ep=pcfg.ep, ep_mesh=ep_mesh)


def _check_same_layout(chosen: str, world: int) -> None:
    """One ConfigError on every rank when the ranks chose different layouts (one all-gather of a
    short string per rank, once at start)."""
    seen: list = [None] * world
    dist.all_gather_object(seen, chosen)
    if len(set(seen)) > 1:
        ranks: dict[str, list[int]] = {}
        for r, layout in enumerate(seen):
            ranks.setdefault(layout, []).append(r)
        listing = "; ".join(f"{len(rs)} rank(s) from rank {rs[0]}: {layout}" for layout, rs in ranks.items())
        raise ConfigError(f"parallel.layout=auto chose different layouts on different ranks ({listing}): their "
                          f"nodes differ in device memory; set the layout by hand (the overrides above) or one "
                          f"parallel.layout_memory_gb for all")


def shutdown(ctx: ParallelContext, barrier: bool = True) -> None:
    """Leave the process group; `barrier=False` after an error, when peers may never arrive."""
    if ctx.mesh is not None and dist.is_initialized():
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
