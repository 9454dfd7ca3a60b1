"""The device table (devices.json next to this file, one entry per device, each number with its
source): dense peak FLOP/s for MFU (cost/flops.py) and, for the devices the layout planner knows
(`profile`: cpu, h100, h200, b200), fp8 peak, memory, link bandwidths and the assumed MFU."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from megatron_taper.validation import did_you_mean

DEVICES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "devices.json")


def read_devices(path: str = DEVICES_FILE) -> dict[str, dict]:
    """Every entry of the table, keyed by the name fragment it is matched by."""
    with open(path) as f:
        return json.load(f)["devices"]


@dataclass(frozen=True)
class DeviceProfile:
    """What the planner assumes of one device (units: TFLOP/s, GB = 1e9 bytes, GB/s per direction)."""

    name: str  # the entry's key in devices.json
    profile: str
    bf16_tflops: float
    fp32_tflops: float
    fp8_tflops: float
    memory_gb: float  # 0: the host's RAM (cpu)
    memory_tb_per_s: float
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    gpus_per_node: int  # 0: every rank on one node
    mfu: float
    sources: dict
    cores: int = 0  # CPU cores the run's ranks share, all hosts (cpu profile, from the machine); 0: a device per rank
    all_gather_efficiency: float = 1.0  # all-gather's bus bandwidth / all-reduce's on the same link
    reduce_scatter_efficiency: float = 1.0  # reduce-scatter's bus bandwidth / all-reduce's on the same link
    collective_latency_us: float = 0.0  # what one collective call adds to a step beyond its bytes
    concurrent_efficiency: float = 1.0  # a CPU core's matmul rate while every core computes / alone
    op_overhead_us: float = 0.0  # host time to issue one eager operator (cost/op_count.py); 0: not modelled
    # a CPU host's total rate with more one-thread ranks than cores over one per core (time-slicing)
    oversubscribed_efficiency: float = 1.0
    # activation_checkpointing=op: host time per forward operator of a checkpointed block (torch's
    # selective-checkpoint policy called on it in the forward and again in the recompute); 0: not modelled
    op_checkpoint_overhead_us: float = 0.0

    def rank_share(self, ranks: int) -> float:
        """The fraction of one device a computing rank gets when `ranks` run: 1 on accelerators (a
        device each); on a CPU host (1 thread per rank) a core at `concurrent_efficiency` of its
        rate alone once more than one rank runs. Ranks beyond the host's `cores` take turns: the
        step-time model bounds the step by the host's total work (`host_cores`), not by this share."""
        if self.cores <= 0:
            return 1.0
        return self.concurrent_efficiency if ranks > 1 else 1.0

    def matmul_flops(self, bf16: bool, float8: bool = False) -> float:
        """FLOP/s the planner assumes a step's matmuls reach: mfu x the peak of their dtype."""
        peak = self.fp8_tflops if float8 else self.bf16_tflops if bf16 else self.fp32_tflops
        return self.mfu * peak * 1e12


def profiles(path: str = DEVICES_FILE, measured: str = "") -> dict[str, DeviceProfile]:
    """The planner's devices by profile name (cpu, h100, ...). `measured`: a file of measured
    numbers, {"devices": {profile: {field: number, ..., "sources": {key: text}}}} (what
    benchmarks/cpu_profile.py --write makes), whose fields replace the profile's and whose sources
    replace theirs; each number it gives must come with a source under its `sources` key
    (MEASURED_SOURCE), so a plan says where every number came from."""
    fields = DeviceProfile.__dataclass_fields__
    found = {e["profile"]: DeviceProfile(name=k, **{f: e[f] for f in fields if f != "name" and f in e})
             for k, e in read_devices(path).items() if "profile" in e}
    if measured:
        for name, entry in read_measured(measured, found).items():
            base = found[name]
            numbers = {k: type(getattr(base, k))(v) for k, v in entry.items() if k != "sources"}
            found[name] = dataclasses.replace(base, **numbers, sources={**base.sources, **entry["sources"]})
    return found


MEASURED_SOURCE = {  # a measured file's number -> the `sources` key that must say where it came from
    "bf16_tflops": "flops", "fp32_tflops": "flops", "fp8_tflops": "flops", "memory_gb": "memory",
    "memory_tb_per_s": "memory", "intra_node_gb_per_s": "links", "inter_node_gb_per_s": "links",
    "gpus_per_node": "links", "mfu": "mfu", "all_gather_efficiency": "collectives",
    "reduce_scatter_efficiency": "collectives", "collective_latency_us": "collectives",
    "concurrent_efficiency": "concurrent_efficiency", "op_overhead_us": "op_overhead",
    "oversubscribed_efficiency": "oversubscribed_efficiency", "op_checkpoint_overhead_us": "op_checkpoint_overhead"}


def read_measured(path: str, known: dict[str, DeviceProfile]) -> dict[str, dict]:
    """The entries of a measured-profile file (profiles' `measured`), checked: one ValueError
    naming the file and the entry for an unreadable file, an unknown profile or field, a number
    that is not a positive number, or a number without its source."""
    try:
        with open(path) as f:
            devices = json.load(f)["devices"]
        if not isinstance(devices, dict):
            raise TypeError("'devices' is not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"measured device profile {path}: not a readable {{\"devices\": {{...}}}} JSON file "
                         f"({type(e).__name__}: {e})") from None
    for name, entry in devices.items():
        where = f"measured device profile {path}: devices.{name}"
        if name not in known:
            raise ValueError(f"{where}: no such profile (known: {', '.join(sorted(known))}){did_you_mean(name, known)}")
        if not isinstance(entry, dict) or not isinstance(entry.get("sources", {}), dict):
            raise ValueError(f"{where}: not an object of numbers with a 'sources' object")
        for key, value in entry.items():
            if key == "sources":
                continue
            if key not in MEASURED_SOURCE:
                raise ValueError(f"{where}.{key}: not a measurable field (one of: {', '.join(MEASURED_SOURCE)})"
                                 f"{did_you_mean(key, MEASURED_SOURCE)}")
            integral = DeviceProfile.__dataclass_fields__[key].type == "int"
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0
                    or (integral and value != int(value))):
                raise ValueError(f"{where}.{key}={value!r}: not a positive {'integer' if integral else 'number'}")
            if not str(entry.get("sources", {}).get(MEASURED_SOURCE[key], "")).strip():
                raise ValueError(f"{where}.{key}: no sources.{MEASURED_SOURCE[key]} saying where it was measured")
    return devices
