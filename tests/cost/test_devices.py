"""The device table (megatron_taper/cost/devices.json): one table for MFU peaks and the planner."""
from __future__ import annotations

import json

import pytest

from megatron_taper.cost.devices import profiles, read_devices
from megatron_taper.cost.flops import PEAK_TFLOPS


def test_planner_profiles_carry_every_number_with_its_source():
    found = profiles()
    assert set(found) == {"cpu", "h100", "h200", "b200"}
    for name, p in found.items():
        assert set(p.sources) - {"concurrent_efficiency"} == {"flops", "memory", "links", "mfu", "collectives",
                                                              "op_overhead", "op_checkpoint_overhead"}, name
        assert p.op_overhead_us > 0 and ("measured" in p.sources["op_overhead"]), name
        assert p.op_checkpoint_overhead_us > 0 and ("measured" in p.sources["op_checkpoint_overhead"]), name
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


def _measured(tmp_path, entry: dict, name: str = "m.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"devices": entry}))
    return str(path)


def test_a_measured_profile_replaces_the_numbers_it_gives_with_their_sources(tmp_path):
    stored = profiles()["cpu"]
    path = _measured(tmp_path, {"cpu": {"fp32_tflops": 0.2, "concurrent_efficiency": 0.9, "gpus_per_node": 4,
                                        "sources": {"flops": "a 2048^2 matmul here",
                                                    "concurrent_efficiency": "2 processes here",
                                                    "links": "one node of 4"}}})
    cpu = profiles(measured=path)["cpu"]
    assert (cpu.fp32_tflops, cpu.concurrent_efficiency, cpu.gpus_per_node) == (0.2, 0.9, 4)
    assert isinstance(cpu.gpus_per_node, int)
    assert cpu.sources["flops"] == "a 2048^2 matmul here" and cpu.sources["mfu"] == stored.sources["mfu"]
    assert (cpu.mfu, cpu.intra_node_gb_per_s) == (stored.mfu, stored.intra_node_gb_per_s)
    assert profiles(measured=path)["h100"] == profiles()["h100"]


@pytest.mark.parametrize("content, message", [
    ({"cpuu": {}}, "devices.cpuu: no such profile (known: b200, cpu, h100, h200); did you mean 'cpu'?"),
    ({"cpu": {"fp32_tflop": 1, "sources": {"flops": "x"}}}, "devices.cpu.fp32_tflop: not a measurable field"),
    ({"cpu": {"fp32_tflops": 1}}, "devices.cpu.fp32_tflops: no sources.flops saying where it was measured"),
    ({"cpu": {"mfu": 0, "sources": {"mfu": "x"}}}, "devices.cpu.mfu=0: not a positive number"),
    ({"cpu": {"mfu": "0.5", "sources": {"mfu": "x"}}}, "devices.cpu.mfu='0.5': not a positive number"),
    ({"cpu": {"gpus_per_node": 1.5, "sources": {"links": "x"}}},
     "devices.cpu.gpus_per_node=1.5: not a positive integer"),
    ({"cpu": [1]}, "devices.cpu: not an object of numbers with a 'sources' object"),
])
def test_a_bad_measured_profile_is_one_error_naming_the_file_and_field(tmp_path, content, message):
    path = _measured(tmp_path, content)
    with pytest.raises(ValueError) as e:
        profiles(measured=path)
    assert str(e.value).startswith(f"measured device profile {path}: {message}")


@pytest.mark.parametrize("text", ["{\"devices\": [", "{\"gpus\": {}}", "{\"devices\": [1]}"])
def test_an_unreadable_measured_profile_is_one_error(tmp_path, text):
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"measured device profile {path}: not a readable"):
        profiles(measured=str(path))
    with pytest.raises(ValueError, match="No such file"):
        profiles(measured=str(tmp_path / "missing.json"))


def test_cpu_profile_writes_a_file_the_planner_reads(tmp_path):
    """benchmarks/cpu_profile.py --write: every number it measures lands in the cpu profile with
    its source (the figures here are a recorded run's; the measurement itself is the script's)."""
    import importlib.util

    from tests.helpers.runner import REPO

    spec = importlib.util.spec_from_file_location("cpu_profile", REPO / "benchmarks" / "cpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    figures = {"threads": 1, "fp32_matmul_tflops": 0.168, "block_tflops": 0.131, "copy_gb_per_s": 13.8,
               "gloo_allreduce_bus_gb_per_s": 1.16, "all_gather_efficiency": 0.43, "reduce_scatter_efficiency": 0.32,
               "collective_latency_us": 1060.0, "concurrent_efficiency": 1.07, "op_overhead_us": 3.78, "cpu": "Xeon",
               "op_checkpoint_overhead_us": 42.0,
               "cores": 2, "oversubscribed_efficiency": 0.92}
    path = str(tmp_path / "cpu.json")
    module.write_profile(path, figures, 2048, 64)
    cpu = profiles(measured=path)["cpu"]
    assert cpu.fp32_tflops == 0.168 and cpu.mfu == pytest.approx(0.131 / 0.168)
    assert cpu.memory_tb_per_s == pytest.approx(0.0138) and cpu.intra_node_gb_per_s == cpu.inter_node_gb_per_s == 1.16
    assert cpu.concurrent_efficiency == 1.0  # a core shared is never faster than alone: the probe's noise capped
    assert (cpu.all_gather_efficiency, cpu.reduce_scatter_efficiency, cpu.op_overhead_us) == (0.43, 0.32, 3.78)
    assert cpu.oversubscribed_efficiency == 0.92 and cpu.op_checkpoint_overhead_us == 42.0
    assert "4 one-thread processes over 2" in cpu.sources["oversubscribed_efficiency"]
    assert all("measured with benchmarks/cpu_profile.py on Xeon" in s for s in cpu.sources.values())
    assert not (tmp_path / "cpu.json.tmp").exists()
