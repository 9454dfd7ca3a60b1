"""train.cuda_graphs: where it is accepted, and what it applies (parallel/block_options.py). The graphs
themselves need CUDA; here only what the CPU shows: the refusals, each naming its key, and the blocks'
options."""
import pytest

from megatron_taper.config import ConfigError, load_config
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.parallel.block_options import apply_block_options
from megatron_taper.parallel.context import init_parallel
from megatron_taper.parallel.parallelize import parallelize

TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.taper.multiple=8",
        "model.vocab_size=64", "model.seq_len=16", "train.global_batch=2", "train.micro_batch=1"]


@pytest.mark.parametrize("overrides, fragment", [
    (["train.cuda_graphs=true", "train.compile=false"], "train.cuda_graphs=true needs train.compile=true or auto"),
    (["train.cuda_graphs=true", "train.compile=true", "train.device=cpu"], "needs a CUDA device"),
])
def test_config_refuses_cuda_graphs_without_compile_or_on_cpu(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(None, TINY + overrides)


@pytest.mark.parametrize("overrides, world, fragment", [
    (["parallel.zero=fsdp2"], 2, "parallel.zero=fsdp2"),
    (["parallel.pp=2"], 2, "parallel.pp=2"),
    (["parallel.cp=2"], 2, "parallel.cp=2"),
])
def test_preflight_refuses_layouts_a_graph_cannot_replay(overrides, world, fragment):
    cfg = load_config(None, TINY + ["train.compile=true", "train.cuda_graphs=true"] + overrides)
    with pytest.raises(ConfigError, match=f"train.cuda_graphs=true with {fragment}"):
        preflight(cfg, world)


def test_cpu_rank_refuses_and_blocks_record_the_option():
    cfg = load_config(None, TINY + ["train.compile=true", "train.cuda_graphs=true"])
    preflight(cfg, 1)  # a plain layout passes
    ctx = init_parallel(cfg.parallel, "cpu")
    with pytest.raises(ConfigError, match="train.cuda_graphs=true needs a CUDA device"):
        parallelize(build_model(cfg.model), ctx, cfg.model, cfg.parallel, cfg.train)
    model = build_model(cfg.model)
    apply_block_options(model, "selective", 2, compile_blocks=True, cuda_graphs=True)
    assert [b.options for b in model.layers.values()] == [("recompute", "compile", "cuda_graphs"),
                                                         ("compile", "cuda_graphs")]


def test_planner_counts_a_graph_launch_per_block_instead_of_its_operators():
    from megatron_taper.cost.devices import profiles
    from megatron_taper.cost.plan import GRAPH_LAUNCHES_PER_BLOCK, Predictor

    h100 = profiles()["h100"]
    titans = TINY + ["model.arch=titans", "model.seq_len=64", "train.compile=true"]
    eager, graphs = (load_config(None, titans + [f"train.cuda_graphs={on}"]) for on in ("false", "true"))
    predictor = Predictor(eager, h100)
    before, after = (predictor.predict(c, 1, float("inf")) for c in (eager, graphs))
    ops = predictor.op_counts(1)
    assert predictor.rank_ops(1, 1, "1f1b", [0], 1, graphs=True) == [2 * GRAPH_LAUNCHES_PER_BLOCK + ops.ends]
    assert predictor.rank_ops(1, 1, "1f1b", [0], 1) == [2 * ops.block + ops.ends]
    assert after.step.total < before.step.total


def test_planner_counts_the_write_kernels_where_a_gpu_run_selects_them(monkeypatch):
    from megatron_taper.cost.devices import profiles
    from megatron_taper.cost.plan import Predictor
    from megatron_taper.models.kernels.state_passing import KERNELS_ENV

    cfg = load_config(None, TINY + ["model.arch=titans", "model.seq_len=64"])
    counts = {}
    for name, env in (("h100", "auto"), ("h100", "triton"), ("cpu", "triton")):
        monkeypatch.setenv(KERNELS_ENV, env)
        counts[name, env] = Predictor(cfg, profiles()[name]).op_counts(1).block
    assert counts["h100", "triton"] < counts["h100", "auto"] == counts["cpu", "triton"]
