"""Persistent GRU memory bridge (model.arch=bridge): identity at initialisation, causality by
segment, the batched read against a segment-by-segment reference, the auxiliary loss's
gradient, parameter/FLOP model, layouts it refuses, training + exact resume, the probe.
tp=2 and pp=2 against one process: tests/models/test_arch_tensor_parallel.py (case "bridge")."""

import pytest
import torch
import torch.nn.functional as F
from megatron_taper_tools.probe_bridge import (  # noqa: E402
    L2_GRID,
    choose_l2,
    fit_logistic,
    kjv_chapters,
    position_windows,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_taper.config import load_config
from megatron_taper.cost.flops import model_costs
from megatron_taper.cost.preflight import preflight
from megatron_taper.models import build_model
from megatron_taper.models.layers import cross_entropy
from megatron_taper.validation import ConfigError
from tests.helpers.datahelpers import corpus, dataset, tokenizer_model  # noqa: F401
from tests.helpers.runner import TINY, assert_resumes_exactly, losses, train_in_process

SEQ, SEGMENT = 40, 16  # segments [0, 16), [16, 32), [32, 40): the last one shorter
SMALL = ["model.arch=bridge", "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.mlp_width=128",
         "model.vocab_size=256", f"model.seq_len={SEQ}", "model.taper.multiple=16", "model.bridge.slots=4",
         f"model.bridge.segment={SEGMENT}"]


def build(*extra: str, read_weights: bool = True):
    """The small bridge model; `read_weights`: give the read's output projection (zero at
    initialisation) random weights, so the bridge changes the outputs."""
    cfg = load_config(None, SMALL + list(extra)).model
    model = build_model(cfg)
    model.init_weights(0)
    if read_weights:
        with torch.no_grad():
            model.bridge.read.wo.weight.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(1))
    return cfg, model


def tokens(batch: int = 2, seq: int = SEQ, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_identity_at_initialisation():
    cfg, model = build(read_weights=False)
    transformer = build_model(load_config(None, SMALL + ["model.arch=transformer"]).model)
    transformer.load_state_dict({k: v for k, v in model.state_dict().items() if ".bridge." not in k}, strict=True)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(model(x), transformer(x))  # read.wo = 0: the bridge adds exactly zero
    assert model.bridge.read.wo.weight.abs().sum() == 0 and model.bridge.gate.weight.abs().sum() > 0
    _, trained = build()
    with torch.no_grad():
        assert not torch.allclose(trained(x), transformer(x), atol=1e-3)  # the bridge is on the path
    none = build_model(load_config(None, SMALL + ["model.bridge.slots=0"]).model)
    assert none.bridge is None
    assert sorted(none.state_dict()) == sorted(transformer.state_dict())  # slots=0: exactly the Transformer


@pytest.mark.parametrize("cut", [SEGMENT - 1, SEGMENT + 5, 2 * SEGMENT - 1])
def test_segments_see_only_earlier_segments(cut):
    """Changing tokens after position `cut` changes no output at or before it: at a segment's end
    (nothing of segment s reaches the state that segment s or earlier ones read) and inside one
    (the self-attention's causality)."""
    _, model = build()
    x = tokens()
    changed = x.clone()
    changed[:, cut + 1:] = tokens(seq=SEQ - cut - 1, seed=1)
    with torch.no_grad():
        a, b = model(x), model(changed)
        h_a, h_b = model.lower_half(x), model.lower_half(changed)
        states_a, states_b = model.bridge.states(h_a, last=True), model.bridge.states(h_b, last=True)
    torch.testing.assert_close(a[:, :cut + 1], b[:, :cut + 1], rtol=0, atol=0)
    assert (a[:, cut + 1:] - b[:, cut + 1:]).abs().max() > 1e-3
    written = (cut + 1) // SEGMENT  # S_0 .. S_written have read only unchanged segments
    torch.testing.assert_close(states_a[:, :written + 1], states_b[:, :written + 1], rtol=0, atol=0)
    assert (states_a[:, written + 1:] - states_b[:, written + 1:]).abs().max() > 1e-4


def test_earlier_segments_reach_later_ones_through_the_state():
    """The bridge's output for segments 1, 2 changes when only segment 0 of its input does: the
    state carries it (the bridge itself mixes tokens only through the state)."""
    _, model = build()
    x = tokens()
    changed = x.clone()
    changed[:, 3] = (x[:, 3] + 1) % 256
    with torch.no_grad():
        h_a, h_b = model.lower_half(x), model.lower_half(changed)
        h_b[:, SEGMENT:] = h_a[:, SEGMENT:]  # the lower half's own path from token 3 cut off
        out_a, out_b = model.bridge(h_a), model.bridge(h_b)
    assert (out_a[:, SEGMENT:] - out_b[:, SEGMENT:]).abs().max() > 1e-4


def reference_read(bridge, x: torch.Tensor) -> torch.Tensor:
    """The bridge's forward one segment at a time, with the written states."""
    states = bridge.states(x)  # [B, n, m, D]
    outs = []
    for s, start in enumerate(range(0, x.shape[1], SEGMENT)):
        seg = x[:, start:start + SEGMENT]
        normed = bridge.read_norm(seg)
        kv = bridge.read_state_norm(states[:, s])
        q, k, v = (bridge.read.heads(w(t)) for w, t in ((bridge.read.wq, normed), (bridge.read.wk, kv),
                                                        (bridge.read.wv, kv)))
        att = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v  # [B, H, T, E]
        r = bridge.read.wo(att.transpose(1, 2).flatten(2))
        outs.append(seg + torch.sigmoid(bridge.gate(normed)) * r)
    return torch.cat(outs, dim=1)


def test_batched_read_matches_segment_by_segment_reference():
    _, model = build()
    with torch.no_grad():
        h = model.lower_half(tokens())
        torch.testing.assert_close(model.bridge(h), reference_read(model.bridge, h), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", ["next_hidden", "random"])
def test_auxiliary_loss_reaches_the_gradients_with_its_weight(target):
    """Training-mode backward of the plain next-token loss equals, parameter by parameter, that of
    next-token loss + aux_weight x the auxiliary loss computed explicitly; evaluation ignores it."""
    cfg, model = build("model.bridge.aux_weight=0.3", f"model.bridge.aux_target={target}")
    x = tokens(seq=SEQ + 1)
    model.train()
    loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
    loss.backward()
    carried = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    captured = {}
    handle = model.bridge.register_forward_pre_hook(lambda module, args: captured.update(h=args[0]))
    model.bridge.eval()  # the same forward, without the carried loss
    explicit = cross_entropy(model(x[:, :-1]), x[:, 1:])
    handle.remove()
    h = captured["h"]
    aux = model.bridge.aux_loss(h, model.bridge.states(h))
    (explicit + 0.3 * aux).backward()
    assert float(loss.detach()) == float(explicit.detach()) and float(aux.detach()) > 0
    for name, p in model.named_parameters():
        torch.testing.assert_close(carried[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert carried["layers.2.bridge.aux_head.weight"].abs().sum() > 0


def test_random_targets_carry_no_information_about_the_text():
    _, model = build("model.bridge.aux_weight=0.3", "model.bridge.aux_target=random")
    with torch.no_grad():
        h = model.lower_half(tokens())
        states = model.bridge.states(h)
        model.bridge.aux_head.weight.zero_()  # prediction 0: the loss is the targets' mean square
        assert model.bridge.aux_loss(h, states) == model.bridge.aux_loss(h * 3 + 1, states)


@pytest.mark.parametrize("extra", [[], ["model.bridge.aux_weight=0.1"], [f"model.seq_len={3 * SEGMENT}"],
                                   ["model.bridge.carry_state=true"]])
def test_cost_model_matches_module_and_flop_counter(extra):
    cfg, model = build(*extra)
    costs = model_costs(cfg, causal=False)
    assert costs.total_params == sum(p.numel() for p in model.parameters())
    for layer, cost in zip(model.layers.values(), costs.layers):
        assert cost.params == sum(p.numel() for p in layer.parameters())
    counter = FlopCounterMode(display=False)
    model.eval()
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(tokens(seq=cfg.seq_len))
    assert counter.get_total_flops() / (2 * cfg.seq_len) == pytest.approx(costs.total_flops, rel=1e-9)
    plain = model_costs(load_config(None, SMALL + extra + ["model.bridge.slots=0", "model.bridge.aux_weight=0",
                                                           "model.bridge.carry_state=false"]).model)
    overhead = costs.total_params - plain.total_params
    assert overhead == sum(p.numel() for p in model.bridge.parameters())


@pytest.mark.parametrize("extra,world,message", [
    (["parallel.tp=2", "parallel.sequence_parallel=true"], 2,
     "parallel.sequence_parallel is not supported for model.arch='bridge'"),
    (["model.bridge.segment=40"], 1, "model.bridge.segment=40 must be smaller than model.seq_len=40"),
    (["model.n_layers=1"], 1, "model.arch='bridge' needs at least 2 layers"),
    (["model.bridge.carry_state=true", "parallel.pp=2"], 2, "model.bridge.carry_state=true is supported with "
                                                            "parallel.pp=1 and parallel.zero none or fsdp2"),
    (["model.bridge.carry_state=true", "parallel.zero=deepspeed"], 2, "got pp=1, zero=deepspeed"),
])
def test_refused_layouts(extra, world, message):
    cfg = load_config(None, SMALL + extra)
    with pytest.raises(ConfigError, match=message):
        preflight(cfg, world)
    with pytest.raises(ConfigError, match="model.bridge.aux_weight=0.1 needs a bridge"):
        load_config(None, SMALL + ["model.bridge.slots=0", "model.bridge.aux_weight=0.1"])
    with pytest.raises(ConfigError, match="model.bridge.aux_target"):
        load_config(None, SMALL + ["model.bridge.aux_target=noise"])


def test_trains_and_resumes_exactly(dataset, tmp_path):
    """Through the Trainer with the recipe's carried state and the auxiliary loss on (2 micro-batches
    per step), split at step 3: the resumed run continues bitwise (the rows' states are in the
    checkpoint). The same run with the state reset at every window logs other losses, so the carried
    state is what the resume had to restore."""
    recipe = ["--config", "configs/tiny_bridge.yaml", *TINY, "model.n_layers=2", "model.bridge.segment=8",
              "model.vocab_size=512", "model.bridge.aux_weight=0.1", f"data.path={dataset}", "train.steps=6",
              "train.eval_interval=4"]
    straight = assert_resumes_exactly(recipe, tmp_path)
    assert train_in_process([*recipe, "model.bridge.carry_state=false", "data.row_streams=true",
                             f"run.dir={tmp_path / 'reset'}"]).returncode == 0
    reset = losses(tmp_path / "reset")
    assert reset[0] == straight[0] and reset[1:] != straight[1:]


def test_probe_pieces(tmp_path):
    text = tmp_path / "kjv.txt"
    text.write_text("\nGenesis 1\n\n  1 In the beginning\nGod created.\n  2 And the earth\n\nGenesis 2\n\n"
                    "  1 Thus the heavens\n")
    assert kjv_chapters(str(text)) == [("Genesis 1", "In the beginning God created.\nAnd the earth"),
                                       ("Genesis 2", "Thus the heavens")]
    windows, labels, owners = position_windows([list(range(30)), list(range(7))], seq_len=10)
    assert windows.tolist() == [list(range(10)), list(range(10, 20)), list(range(20, 30))]
    assert labels.tolist() == [0, 1, 2] and owners.tolist() == [0, 0, 0]  # the 7-token document has no window
    gen = torch.Generator().manual_seed(0)
    y = torch.arange(60) % 3
    x = F.one_hot(y, 3).float() * 2 + torch.randn(60, 5, generator=gen)[:, :3] * 0.1
    assert fit_logistic(x[:30], y[:30], x[30:], y[30:]) == 1.0
    assert choose_l2(x[:30], y[:30], torch.arange(30) // 3) in L2_GRID
