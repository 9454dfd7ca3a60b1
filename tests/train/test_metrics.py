"""Metric names (train/, eval/, perf/ groups), the MFU peak table and train.peak_tflops, and the
run.wandb section's checks."""
import pytest
import torch

from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.flops import PEAK_TFLOPS, lookup_peak_tflops, peak_flops
from megatron_taper.training.metrics import scalar_tag, scalars


def test_tags_are_grouped():
    assert [scalar_tag(k) for k in ("loss", "lr", "grad_norm", "tokens_seen", "skipped_steps")] == \
        ["train/loss", "train/lr", "train/grad_norm", "train/tokens_seen", "train/skipped_steps"]
    assert [scalar_tag(k) for k in ("eval_loss", "eval_ppl", "eval_loss/web")] == \
        ["eval/loss", "eval/ppl", "eval/loss/web"]
    assert [scalar_tag(k) for k in ("tokens_per_s", "step_time_s", "mfu", "peak_memory_gb")] == \
        ["perf/tokens_per_s", "perf/step_time_s", "perf/mfu", "perf/peak_memory_gb"]
    assert scalar_tag("mix/web") == "mix/web"  # already grouped
    record = {"step": 3, "loss": 2.5, "eval_loss": float("nan"), "flag": True, "note": "x", "mfu": 0.4}
    assert scalars(record) == {"train/loss": 2.5, "perf/mfu": 0.4}


@pytest.mark.parametrize("name, bf16, tflops", [
    ("NVIDIA B200", True, 2250.0),
    ("NVIDIA GB200", True, 2500.0),
    ("NVIDIA H100 80GB HBM3", True, 989.0),  # SXM
    ("NVIDIA H100 PCIe", True, 756.0),
    ("NVIDIA H100 NVL", True, 835.0),
    ("NVIDIA H200", True, 989.0),
    ("NVIDIA GH200 480GB", True, 989.0),
    ("NVIDIA A100-SXM4-80GB", True, 312.0),
    ("NVIDIA A100 80GB PCIe", False, 19.5),
    ("NVIDIA A10G", True, 125.0),
    ("NVIDIA L40S", True, 362.0),
    ("NVIDIA L40", True, 181.0),
    ("NVIDIA L4", True, 121.0),
    ("AMD Instinct MI300X", True, 1307.4),
    ("AMD Instinct MI325X", True, 1307.4),
    ("AMD Instinct MI250X", False, 47.9),
    ("Some Future GPU", True, None),
])
def test_peak_table_takes_the_longest_matching_name(name, bf16, tflops):
    assert lookup_peak_tflops(name, bf16) == tflops
    assert all(bf > fp for bf, fp in PEAK_TFLOPS.values())


def test_peak_override_and_unknown_devices():
    cpu = torch.device("cpu")
    assert peak_flops(cpu, bf16=False) is None
    assert peak_flops(cpu, bf16=False, override_tflops=150.0) == 150e12
    with pytest.raises(ConfigError, match="train.peak_tflops"):
        load_config(None, ["train.peak_tflops=-1"])


def test_wandb_section_is_checked():
    with pytest.raises(ConfigError, match="run.wandb.mode"):
        load_config(None, ["run.wandb.mode=sometimes"])
    cfg = load_config(None, ["run.wandb.enabled=true", "run.wandb.mode=offline"])
    assert cfg.run.wandb.enabled and cfg.run.wandb.mode == "offline"
