"""The device table (megatron_taper/cost/devices.json): one table for MFU peaks and the planner."""
from __future__ import annotations

from megatron_taper.cost.devices import profiles, read_devices
from megatron_taper.cost.flops import PEAK_TFLOPS


def test_planner_profiles_carry_every_number_with_its_source():
    found = profiles()
    assert set(found) == {"cpu", "h100", "h200", "b200"}
    for name, p in found.items():
        assert set(p.sources) - {"concurrent_efficiency"} == {"flops", "memory", "links", "mfu", "collectives",
                                                              "op_overhead"}, name
        assert p.op_overhead_us > 0 and ("measured" in p.sources["op_overhead"]), name
        assert ("concurrent_efficiency" in p.sources) == (p.concurrent_efficiency != 1.0), name
        assert all(isinstance(s, str) and s for s in p.sources.values()), name
        assert 0 < p.mfu <= 1 and p.fp32_tflops > 0 and p.intra_node_gb_per_s > 0 and p.inter_node_gb_per_s > 0
        if name != "cpu":
            assert p.fp8_tflops > p.bf16_tflops and p.memory_gb > 0 and p.gpus_per_node == 8
            assert "https://" in p.sources["flops"] and "https://" in p.sources["links"]
    assert found["cpu"].bf16_tflops == 0 and "measured" in found["cpu"].sources["flops"]


def test_mfu_peaks_come_from_the_same_table():
    table = read_devices()
    assert all(set(e["sources"]) >= {"flops"} for e in table.values())
    assert PEAK_TFLOPS == {k: (e["bf16_tflops"], e["fp32_tflops"]) for k, e in table.items() if e["bf16_tflops"]}
    assert PEAK_TFLOPS["H100"] == (989.0, 67.0) and "cpu" not in PEAK_TFLOPS
