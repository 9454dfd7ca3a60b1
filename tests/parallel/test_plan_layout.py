"""The layout planner (megatron_taper/cost/plan.py, cost/step_time.py, tools/plan_layout.py): the
70B recipe at 512 x 80 GiB and a 1.3B recipe at 8 GPUs plan, their best layout is one the
trainer accepts and fits its own predicted memory, which is the trainer's pipeline planner's;
a model that cannot fit is one error naming the nearest layout."""
from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest

from megatron_taper.config import load_config
from megatron_taper.cost.devices import profiles
from megatron_taper.cost.memory import GIB
from megatron_taper.cost.partition import split_backward_activations, zbv_actions
from megatron_taper.cost.plan import SEARCH_SPACE, USABLE_FRACTION, Predictor, reason, with_values
from megatron_taper.cost.preflight import preflight
from megatron_taper.cost.step_time import RankWork, StepLayout, bandwidth, bubble_fraction, ring_seconds, step_time
from megatron_taper.parallel.pp.schedule import plan_stages
from megatron_taper.validation import ConfigError
from tests.helpers.runner import REPO


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _plan(capsys, recipe: str, *argv: str) -> tuple[int, dict]:
    code = _tool("plan_pipeline").main(["--config", str(REPO / "configs" / recipe), *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("recipe, gpus, device", [
    # ~15 s of CPU: 291,648 layouts (cp > 1 leaves fewer than plan.CP_MIN_TOKENS tokens per rank: not
    # searched; the train values of a refused combination counted, not checked)
    pytest.param("transformer_70b_taper.yaml", 512, "h100", marks=pytest.mark.slow),
    ("transformer_1.3b_taper.yaml", 8, "h200"),
])
def test_best_layout_is_legal_and_fits_its_predicted_memory(capsys, recipe, gpus, device):
    code, out = _plan(capsys, recipe, "--gpus", str(gpus), "--gpu-memory", "80", "--device", device, "--top", "3")
    assert code == 0
    best = out["layouts"][0]
    assert best["fits"] and best["peak_gib"] <= USABLE_FRACTION * 80 and len(out["layouts"]) == 3
    assert [x["step_s"] for x in out["layouts"]] == sorted(x["step_s"] for x in out["layouts"])
    assert sum(out["dropped"].values()) + len(out["layouts"]) <= out["candidates"] and out["legal"] > 0
    assert any(k.startswith("predicted peak over") for k in out["dropped"])
    # the trainer accepts it as printed, and its pipeline planner predicts the same peak for v = 1
    cfg = load_config(str(REPO / "configs" / recipe), best["overrides"])
    assert preflight(cfg, gpus).dp == best["dp"]
    if best["virtual"] == 1:
        plan = plan_stages(cfg.model, cfg.parallel, cfg.train, best["dp"], bf16=True)
        trainer_peaks = [s.peak_bytes / GIB for s in plan.stages]
        assert best["rank_peaks_gib"] == pytest.approx(trainer_peaks, rel=1e-12)


def test_a_model_that_cannot_fit_names_the_nearest_layout(capsys):
    code = _tool("plan_layout").main(["--config", str(REPO / "configs" / "transformer_1.3b_taper.yaml"),
                                      "--gpus", "2", "--gpu-memory", "4"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: no legal layout fits 2 x 4 GiB (h100): the nearest, ")
    assert "parallel.zero=" in err[0] and "GiB per rank, i.e. devices of" in err[0]


def test_a_measured_profile_is_what_the_plan_predicts_with(capsys, tmp_path):
    """--measured-profile / parallel.layout_profile: the cluster's own numbers over the table's,
    printed with the plan; a bad file is one error naming it, before any search."""
    good = tmp_path / "measured.json"
    good.write_text(json.dumps({"devices": {"h100": {"inter_node_gb_per_s": 12.5, "mfu": 0.3, "sources": {
        "links": "nccl-tests all_reduce_perf across 2 nodes", "mfu": "our 8B run's logged MFU"}}}}))
    recipe = ["--config", str(REPO / "configs" / "transformer_1.3b_taper.yaml"), "--gpus", "16", "--top", "1", "--json"]
    assert _tool("plan_layout").main([*recipe, "--measured-profile", str(good)]) == 0
    measured = json.loads(capsys.readouterr().out)
    assert measured["device"]["inter_node_gb_per_s"] == 12.5 and measured["device"]["mfu"] == 0.3
    assert measured["device"]["sources"]["links"] == "nccl-tests all_reduce_perf across 2 nodes"
    assert _tool("plan_layout").main(recipe) == 0
    assert json.loads(capsys.readouterr().out)["layouts"][0]["step_s"] < measured["layouts"][0]["step_s"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"devices": {"h100": {"mfu": 0.3}}}))
    assert _tool("plan_layout").main([*recipe, "--measured-profile", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: measured device profile {bad}: devices.h100.mfu: no "
                                               "sources.mfu saying where it was measured")
    from megatron_taper.cost.auto_layout import choose_layout

    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
                             "model.seq_len=32", "parallel.layout=auto", f"parallel.layout_profile={bad}"])
    with pytest.raises(ConfigError, match=rf"^parallel.layout_profile: measured device profile {bad}: devices.h100"):
        choose_layout(cfg, 1)
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"devices": {"cpu": {"fp32_tflops": 0.5, "sources": {"flops": "here"}}}}))
    _, why = choose_layout(with_values(cfg, {"parallel.layout_profile": str(cpu), "train.precision": "fp32"}), 1)
    assert f"; measured numbers from {cpu}; " in why


def test_refusals_count_by_kind():
    cfg = load_config(None, ["parallel.pp=3"])
    with pytest.raises(ConfigError) as a:
        preflight(cfg, 4)
    with pytest.raises(ConfigError) as b:
        preflight(load_config(None, ["parallel.pp=3"]), 5)
    assert reason(a.value) == reason(b.value) == "parallel.tp=N x parallel.pp=N = N does not divide the world size N"
    assert len({k for k, _ in SEARCH_SPACE}) == len(SEARCH_SPACE)


def test_step_time_by_hand():
    h100 = profiles()["h100"]
    assert bandwidth(8, h100) == 450e9 and bandwidth(16, h100) == 50e9
    assert ring_seconds(100.0, 4, 10.0, all_reduce=True) == 15.0 and ring_seconds(100.0, 4, 10.0, False) == 7.5
    assert [bubble_fraction(4, 2, s) for s in ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
            ] == [3.0, 3.0, 1.5, 0.5, 0.5]
    # one rank, no parallelism: 3 x forward FLOPs at mfu x peak, plus AdamW over the parameters
    work = [RankWork(flops=1e9, linear_flops=8e8, recompute_flops=0.0, blocks=2, recomputed_blocks=0, params=1e6)]
    layout = StepLayout(tp=1, pp=1, dp=1, virtual=1, schedule="1f1b", zero="none", sequence_parallel=False,
                        micro_batch=2, microbatches=3, bf16=True, float8=False, overlap=True)
    t = step_time(work, layout, d_model=64, seq_len=128, device=h100)
    compute = 3 * 1e9 * 256 / (0.4 * 989e12)
    assert t.compute == pytest.approx(3 * compute) and t.bubble == t.tp == t.pp == t.dp == 0
    assert t.total == pytest.approx(3 * compute + 32 * 1e6 / 3.35e12)
    # cp = 4, all-gather: per block a gather of K and V of the whole sequence and a reduce-scatter
    # of their gradients; the compute is that of S / 4 tokens; DDP spans dp x cp = 4 ranks
    kv = 2 * 32 * (2 * 128) * 2  # K and V (32 elements a token each) of 2 sequences of 128 tokens, bf16
    gathered = [dataclasses.replace(w, cp_messages=((("allgather", kv),),) * w.blocks) for w in work]
    cp = step_time(gathered, dataclasses.replace(layout, cp=4), d_model=64, seq_len=128, device=h100)
    assert cp.compute == pytest.approx(t.compute / 4) and cp.cp == pytest.approx(3 * 2 * 2 * 0.75 * kv / 450e9)
    assert cp.dp == pytest.approx(max(0.0, 1.5 * 4e6 / 450e9 - cp.compute / 3 * 2 / 3))
    # ring, not overlapped: per block (cp - 1) K/V blocks of S / cp tokens forward, 2 cp - 1 backward
    passed = [dataclasses.replace(w, cp_messages=((("ring", kv / 4),),) * w.blocks) for w in work]
    ring = step_time(passed, dataclasses.replace(layout, cp=4, cp_attention="ring", overlap=False), d_model=64,
                     seq_len=128, device=h100)
    assert ring.cp == pytest.approx(3 * 2 * (3 + 7) * kv / 4 / 450e9)
    # ulysses: per block two all-to-alls forward and two backward, each moving 3/4 of its buffer
    # (a rank's q, k, v and its output: `both` bytes in all, half each on average)
    both = 2 * 32 * (2 * 4 + 2 * 1) * 8 * 2
    swapped = [dataclasses.replace(w, cp_messages=((("alltoall", both),),) * w.blocks) for w in work]
    ulysses = step_time(swapped, dataclasses.replace(layout, cp=4, cp_attention="ulysses"), d_model=64, seq_len=128,
                        device=h100)
    assert ulysses.cp == pytest.approx(3 * 2 * 4 * 0.75 * both / 2 / 450e9)


def test_memory_aware_partition_counts_tp_and_zero_sharding():
    """parallel.pp_memory_gb: a limit no split meets at tp = 1 without ZeRO is met at tp = 2 and
    with fsdp2 over dp = 4 (the memory model's setup carries tp and the engine's sharding)."""
    def plan(*extra: str, dp: int = 1):
        cfg = load_config(str(REPO / "configs" / "transformer_1.3b_taper.yaml"),
                          ["parallel.pp=4", "parallel.microbatches=16", "parallel.pp_memory_gb=110", *extra])
        return plan_stages(cfg.model, cfg.parallel, cfg.train, dp, bf16=True)

    with pytest.raises(ValueError, match="parallel.pp_memory_gb"):
        plan()
    for stages in (plan("parallel.tp=2").stages, plan("parallel.zero=fsdp2", dp=4).stages):
        assert max(s.peak_bytes for s in stages) <= 110 * GIB


def test_search_computes_the_layer_widths_once(monkeypatch):
    """The widths are per model, not per layout: a search computes them once and hands them to
    preflight, which then does not recompute them (it did twice per candidate at tp > 1)."""
    from megatron_taper import taper
    from megatron_taper.cost import plan
    from megatron_taper.cost import preflight as preflight_module

    calls = []

    def counted(model_cfg):
        calls.append(model_cfg)
        return taper.layer_widths(model_cfg)

    monkeypatch.setattr(plan, "layer_widths", counted)
    monkeypatch.setattr(preflight_module, "layer_widths", counted)
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "train.global_batch=8"])
    space = (("parallel.tp", (1, 2)), ("parallel.pp", (1, 2)), ("train.micro_batch", (1, 2)))
    result = plan.search(cfg, 4, 1.0, profiles()["cpu"], space=space)
    assert result.legal > 0 and len(calls) == 1


def test_a_long_sequence_fits_only_with_context_parallelism():
    """An 8B-shaped transformer at 128K tokens per sequence on 64 x 24 GiB: no layout without
    context parallelism fits (one sequence's activations at tp = 8 with sequence parallelism,
    full checkpointing and fsdp2 alone exceed the device: 27.8 GiB), so the best is one with
    cp > 1; its cp is legal by preflight and its step time counts cp's messages."""
    from megatron_taper.cost import plan

    cfg = load_config(str(REPO / "configs" / "transformer_70b_taper.yaml"), [
        "model.n_layers=32", "model.d_model=4096", "model.n_heads=32", "model.n_kv_heads=8",
        "model.mlp_width=14336", "model.vocab_size=128256", "model.seq_len=131072", "train.global_batch=16"])
    space = (("parallel.tp", (4, 8)), ("parallel.pp", (1, 2, 4)), ("parallel.zero", ("none", "fsdp2")),
             ("parallel.sequence_parallel", (False, True)), ("parallel.cp", (1, 2, 4, 8)),
             ("parallel.cp_attention", ("allgather", "ring", "ulysses")),
             ("train.activation_checkpointing", ("none", "full")))
    result = plan.search(cfg, 64, 24, profiles()["h100"], space=space)
    best = result.layouts[0]
    assert best.layout.cp > 1 and f"cp={best.layout.cp}" in best.describe()
    # the all-gathered K and V are exposed; the ring's sends hide behind the attention on a GPU
    assert all(x.step.cp > 0 for x in result.layouts if x.layout.cp_attention != "ring")
    assert all(x.layout.cp > 1 for x in result.layouts)
    # Ulysses is searched: it fits where its heads per tp rank divide by cp (32 / tp 4 = 8), and is
    # refused where they do not (32 / tp 8 = 4 heads at cp = 8)
    assert any(x.layout.cp_attention == "ulysses" for x in result.layouts)
    assert any("parallel.cp_attention='ulysses' splits each tp rank's heads" in r for r in result.dropped)
    no_cp = plan.search(cfg, 64, 24, profiles()["h100"], space=[row for row in space if row[0] != "parallel.cp"])
    assert no_cp.legal > 0 and not no_cp.layouts
    assert preflight(with_values(cfg, best.values), 64).cp == best.layout.cp


def test_refusals_skipped_at_other_train_values_are_the_ones_preflight_gives():
    """search checks a combination of the other sections once per refusal that names no train key
    and counts the train values left under it: the same counts as preflight on every candidate."""
    import itertools
    import warnings

    from megatron_taper.cost import plan

    cfg = load_config(None, ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "train.global_batch=16"])
    space = (("parallel.tp", (1, 2)), ("parallel.pp", (1, 2, 4)), ("parallel.pp_schedule", ("1f1b", "dualpipev")),
             ("parallel.zero", ("none", "deepspeed")), ("parallel.cp", (1, 2)),
             # descending: a count of micro-batches too small for dualpipev comes before one that is not
             ("train.micro_batch", (8, 4, 2, 1)), ("train.activation_checkpointing", ("none", "full")))
    result = plan.search(cfg, 8, 1.0, profiles()["h100"], space=space, cp_min_tokens=0)
    keys, seen, dropped = [k for k, _ in space], set(), {}
    for row in itertools.product(*(v for _, v in space)):
        values = plan._canonical(dict(zip(keys, row)), cfg)
        if tuple(values.items()) in seen:
            continue
        seen.add(tuple(values.items()))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                preflight(with_values(cfg, values), 8)
        except ConfigError as e:
            dropped[reason(e)] = dropped.get(reason(e), 0) + 1
    assert result.candidates == len(seen) and result.legal == len(seen) - sum(dropped.values())
    assert {k: v for k, v in result.dropped.items() if not k.startswith("predicted peak")} == dropped
    assert any("dualpipev" in k for k in dropped)


def test_a_profile_without_the_precisions_peak_is_one_clear_error():
    """The cpu profile has no bf16 (nor fp8) peak: predicting a bf16 or float8 step on it names the
    setting, the profile and the field (step_time would divide by the zero peak), fp32 predicts."""
    cfg = load_config(None, ["model.n_layers=2", "model.d_model=64", "model.n_heads=4", "model.vocab_size=256",
                             "model.seq_len=32", "train.precision=bf16"])
    cpu = profiles()["cpu"]
    with pytest.raises(ConfigError, match=r"^train.precision=bf16: the cpu device profile .* has bf16_tflops 0,"):
        Predictor(cfg, cpu).predict(cfg, 1, float("inf"))
    fp8 = with_values(cfg, {"train.precision": "fp32", "train.float8": True})
    with pytest.raises(ConfigError, match=r"^train.float8=true: the cpu device profile .* has fp8_tflops 0,"):
        Predictor(fp8, cpu).predict(fp8, 1, float("inf"))
    fp32 = with_values(cfg, {"train.precision": "fp32"})
    assert Predictor(fp32, cpu).predict(fp32, 1, float("inf")).step.total > 0


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_zbv_actions_are_torchs(pp):
    """partition.zbv_actions (torch-free, for the memory rule) is ScheduleZBVZeroBubble's own action
    list: its _calculate_single_rank_operations, run on the schedule's sizes alone."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "I",
             _ComputationType.BACKWARD_WEIGHT: "W"}
    for m in (1, 2, pp, 2 * pp - 1, 2 * pp + 3):
        for rank in range(pp):
            sizes = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
            theirs = [(kinds[a.computation_type], 0 if a.stage_index == rank else 1, a.microbatch_index)
                      for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(sizes, rank) if a is not None]
            assert zbv_actions(pp, m, rank) == theirs, (pp, m, rank)


def test_zbv_rank_activations_by_hand():
    """split_backward_activations on ZB-V pp = 2, 4 micro-batches, pp rank 1 (chunks: stage 1 keeps
    10 per micro-batch, top 15, retained 3; stage 2: 20, 30, 5). Its actions: F0 F1 F0 F1 I1 W1
    (F0 I0 W0 F1 I1 W1) x 2, then I0 I1 I0 W0 W1 W0. The peak is the steady state's I1 / W1 beside
    two micro-batches of stage 1 and one of stage 2: 2 x 10 + 20 + 30 = 70. With retained 10 / 20,
    the cool-down's I0(3) holds stage 1's micro-batch 2 and stage 2's 3 after their I (20 + 40)
    beside stage 1's top: 75; and W0(2) holds all three after I: 20 + 20 + 40 = 80, as the steady
    state's W1 (2 x 10 + 20 + 40)."""
    actions = zbv_actions(2, 4, 1)
    assert [f"{k}{c}" for k, c, _ in actions] == ("F0 F1 F0 F1 I1 W1 " + "F0 I0 W0 F1 I1 W1 " * 2
                                                  + "I0 I1 I0 W0 W1 W0").split()
    assert split_backward_activations(actions, [10, 20], [15, 30], [3, 5], None) == 70
    assert split_backward_activations(actions, [10, 20], [15, 30], [10, 20], None) == 80
    # pp rank 0 at one micro-batch: F0 F1 I1 W1 I0 W0; chunk 0 is the first stage (torch skips its
    # I and runs the whole backward at W): peak max(10 + 30, 10 + max(30, 20 + 5), 15) = 40
    assert zbv_actions(2, 1, 0) == [("F", 0, 0), ("F", 1, 0), ("I", 1, 0), ("W", 1, 0), ("I", 0, 0), ("W", 0, 0)]
    assert split_backward_activations(zbv_actions(2, 1, 0), [10, 20], [15, 30], [3, 5], 0) == 40


def test_zbv_rank_peaks_are_the_plans():
    """The planner and tools/plan_pipeline (PipelinePlan.rank_peak_bytes) give a ZB-V rank the same
    predicted peak: one rule (partition.multi_chunk_activations)."""
    cfg = load_config(None, ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.vocab_size=512",
                             "model.seq_len=64", "train.global_batch=16", "train.micro_batch=2", "parallel.pp=2",
                             "parallel.microbatches=4", "parallel.pp_schedule=zbv", "parallel.zero=fsdp2",
                             "train.precision=fp32"])
    dp = preflight(cfg, 4).dp
    plan = plan_stages(cfg.model, cfg.parallel, cfg.train, dp, bf16=False)
    predicted = Predictor(cfg, profiles()["cpu"]).predict(cfg, dp, float("inf"))
    assert [plan.rank_peak_bytes(r) for r in range(2)] == pytest.approx(predicted.rank_peaks, rel=1e-12)
    assert all(p > plan.rank_static_bytes(r) for r, p in enumerate(predicted.rank_peaks))
