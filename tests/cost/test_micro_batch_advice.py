"""The planner's micro-batch advice (cost/plan.py micro_batch_advice, a line of tools/plan_layout.py):
the largest train.micro_batch whose predicted peak fits the memory, at the fastest layout's other
settings. Pure arithmetic of the planner on the tiny recipe (cpu profile, one process)."""
import dataclasses

from megatron_taper.config import load_config
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.memory import GIB
from megatron_taper.cost.plan import USABLE_FRACTION, micro_batch_advice, search
from tools import plan_layout

SPACE = (("train.micro_batch", (1, 2, 4, 8)),)


def test_the_largest_micro_batch_that_fits_the_memory():
    cfg = load_config("configs/tiny_taper.yaml", ["train.device=cpu", "train.global_batch=16"])
    cpu = dataclasses.replace(profiles()["cpu"], op_overhead_us=0.0)  # no operator count: the peaks decide
    roomy = search(cfg, 1, 64, cpu, SPACE)
    peaks = {x.values["train.micro_batch"]: x.peak for x in roomy.layouts}
    assert sorted(peaks) == [1, 2, 4, 8] and peaks[4] < peaks[8]
    assert micro_batch_advice(roomy)[0] == 8
    # memory for micro-batches of 4 but not 8
    tight = search(cfg, 1, (peaks[4] + peaks[8]) / 2 / USABLE_FRACTION / GIB, cpu, SPACE)
    micro, x = micro_batch_advice(tight)
    assert micro == 4 and x.peak == peaks[4] and x.fits
    assert micro_batch_advice(search(cfg, 1, peaks[1] / 2 / GIB, cpu, SPACE)) is None  # nothing fits


def test_plan_layout_prints_the_advice():
    cfg = load_config("configs/tiny_taper.yaml", ["train.device=cpu", "train.global_batch=16"])
    result = search(cfg, 1, 64, dataclasses.replace(profiles()["cpu"], op_overhead_us=0.0), SPACE)
    line = [x for x in plan_layout.to_text(result, 1, 0.0).splitlines() if x.startswith("micro-batch:")]
    assert len(line) == 1 and "train.micro_batch=8 is the largest of (1, 2, 4, 8) that fits" in line[0], line
