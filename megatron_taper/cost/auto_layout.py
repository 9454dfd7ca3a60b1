"""parallel.layout=auto at start-up: the device a job plans for (this machine's, or a profile of
cost/devices.json named from elsewhere, e.g. a login node) and the fastest layout of the planner
(cost/plan.py search) that fits its memory per rank. Torch is imported only to ask CUDA for the
local device."""
from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from megatron_taper.cost.devices import DeviceProfile, profiles
from megatron_taper.cost.memory import GIB
from megatron_taper.cost.plan import no_fit_message, overrides, search, with_values
from megatron_taper.validation import ConfigError

if TYPE_CHECKING:
    from megatron_taper.config import Config


def local_device(train_device: str, world: int, local_ranks: int | None = None,
                 measured: str = "") -> tuple[DeviceProfile, float, str]:
    """This machine's device profile, memory per rank in GiB and where they came from: a CUDA
    device's total memory and its profile (by name; the h100 one's links and MFU with the
    device's own peak FLOP/s for other GPUs), else the CPU profile and the RAM / local ranks
    (`local_ranks`, default LOCAL_WORLD_SIZE, else `world`); the CPU profile's cores are every
    node's (world / local ranks nodes, alike), which the step-time model's host bound divides by.
    `measured`: a measured-profile file over the table's numbers (cost/devices.py profiles)."""
    import torch

    from megatron_taper.cost.flops import lookup_peak_tflops

    known = profiles(measured=measured)
    if train_device != "cpu" and torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        name = torch.cuda.get_device_name(index)
        memory = torch.cuda.get_device_properties(index).total_memory / GIB
        match = sorted((p for p in known.values() if p.name in name), key=lambda p: -len(p.name))
        if match:
            return match[0], memory, f"{name}: {memory:.1f} GiB ({match[0].profile} profile)"
        base = known["h100"]
        bf16 = lookup_peak_tflops(name, True) or base.bf16_tflops
        fp32 = lookup_peak_tflops(name, False) or base.fp32_tflops
        device = dataclasses.replace(base, name=name, profile="cuda", bf16_tflops=bf16, fp32_tflops=fp32,
                                     fp8_tflops=0.0, memory_gb=memory * GIB / 1e9)
        return device, memory, f"{name}: {memory:.1f} GiB (not in cost/devices.json: the h100 profile's links)"
    ranks = local_ranks or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ram = host_memory_gib()
    nodes = max(1, world // ranks)  # every node alike: its cores shared by its local ranks
    cpu = dataclasses.replace(known["cpu"], cores=(os.cpu_count() or 1) * nodes)
    return cpu, ram / ranks, (f"CPU: {ram:.1f} GiB of RAM / {ranks} local process(es), "
                              f"{cpu.cores // nodes} cores x {nodes} node(s)")


def host_memory_gib() -> float:
    """This machine's RAM in GiB."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def profile_device(name: str, world: int, local_ranks: int | None = None, measured: str = ""
                   ) -> tuple[DeviceProfile, float, str]:
    """The device profile `name` of cost/devices.json (what a job will get, planned from elsewhere:
    a login node), its memory per rank in GiB and a line naming it; `local_ranks` per node (default:
    the profile's GPUs per node). The cpu profile: this machine's RAM and cores per node."""
    known = profiles(measured=measured)
    if name not in known:
        raise ConfigError(f"--device {name}: not a device profile of cost/devices.json ({', '.join(sorted(known))})")
    device = known[name]
    ranks = local_ranks or device.gpus_per_node or world
    if device.memory_gb <= 0:
        cpu, memory, found = local_device("cpu", world, ranks, measured)
        return cpu, memory, f"--device {name}: {found}"
    device = dataclasses.replace(device, gpus_per_node=ranks)
    memory = device.memory_gb * 1e9 / GIB
    return device, memory, (f"--device {name}: {device.name}, {memory:.1f} GiB, {ranks} per node (cost/devices.json; "
                            f"not this machine's devices)")


def choose_layout(cfg: Config, world: int, local_ranks: int | None = None, device_profile: str = ""
                  ) -> tuple[Config, str]:
    """parallel.layout=auto: `cfg` with the fastest predicted layout that fits the device memory
    per rank (parallel.layout_memory_gb when > 0) at `world` processes (`local_ranks` per node) and
    a line saying why and for which device; nothing fits: ConfigError naming the nearest layout.
    The device: this machine's (local_device), or the profile `device_profile` (profile_device)."""
    try:
        if device_profile:
            device, memory, found = profile_device(device_profile, world, local_ranks, cfg.parallel.layout_profile)
        else:
            device, memory, found = local_device(cfg.train.device, world, local_ranks, cfg.parallel.layout_profile)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"parallel.layout_profile: {e}") from None
    if cfg.parallel.layout_profile:
        found += f"; measured numbers from {cfg.parallel.layout_profile}"
    if cfg.parallel.layout_memory_gb > 0:
        memory = cfg.parallel.layout_memory_gb
        found = f"parallel.layout_memory_gb={memory:g} on {device.name} ({device.profile} profile)"
    result = search(cfg, world, memory, device)
    if not result.layouts:
        raise ConfigError(f"parallel.layout=auto: {no_fit_message(result, memory)}")
    best = result.layouts[0]
    chosen = with_values(cfg, best.values)
    why = (f"layout auto: {best.describe()} ({' '.join(overrides(best.values))}): the fastest predicted of "
           f"{len(result.layouts)} layouts that fit {memory:.3g} GiB per rank (planned for {found}; {result.legal} "
           f"legal of {result.candidates}): step {best.step.total:.3g} s, peak {best.peak / GIB:.3g} GiB")
    if len(result.layouts) > 1:
        second = result.layouts[1]
        why += f"; next {second.describe()} at {second.step.total:.3g} s"
    return chosen, why
