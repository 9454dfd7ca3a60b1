"""NeuralMemory.scan_features (the chunk loop batched over chunks, models/titans/neural_memory.py) against
the chunk-at-a-time loop it replaced (tests/helpers/titans_reference.py reference_chunked_scan, the
definition of the chunked math).

Float64: reads, final weights and surprise, and the gradients of every parameter, every input
feature and the starting state within 1e-10 (measured <= 5e-13 abs over all of them, depths 1-3);
whole models (Titans MAG / MAL / MAC, deep Memory Caching none / residual / grm / soup /
ssc, checkpoint and independent writes) with the reference monkeypatched in: logits and parameter
gradients within 1e-10 (measured <= 4e-13). Float32 against the float64 reference: within 2e-4 of each tensor's largest
entry and no further than the chunk-by-chunk reference in float32 (measured 1.9-3.4e-5 vs 1.3-1.7e-4).
"""
import copy

import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.models import build_model
from megatron_taper.models.titans.neural_memory import NeuralMemory
from tests.helpers.titans_reference import reference_chunked_scan

TOL = 1e-10
FP32_TOL = 2e-4
BASE = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
        "model.taper.multiple=16", "model.titans.chunk_size=6", "model.titans.max_lr=0.5"]


def memory(depth: int, dtype=torch.float64, conv: int = 0) -> NeuralMemory:
    cfg = load_config(None, BASE + ["model.arch=titans", f"model.titans.memory_depth={depth}",
                                    f"model.titans.conv_kernel={conv}"]).model
    model = build_model(cfg)
    model.init_weights(0)
    return model.layers["0"].memory.to(dtype)


def case(mem: NeuralMemory, seq: int, start: str, seed: int = 0):
    """Leaf features (k, v, q, theta, log eta, log keep) of seq tokens and a starting state:
    `initial` (init_state), or `carried` (weights and surprise away from it, leaves)."""
    g = torch.Generator().manual_seed(seed)
    dtype = mem.mem_w[0].dtype
    x = torch.randn(2, seq, mem.wq.in_features, generator=g, dtype=dtype)
    with torch.no_grad():
        features = mem.project(x, torch.randn(x.shape, generator=g, dtype=dtype))[0]
    features = tuple(f.detach().clone().requires_grad_() for f in features)
    state = mem.init_state(2)
    if start == "carried":
        weights = [(w + 0.1 * torch.randn(w.shape, generator=g, dtype=dtype)).detach().requires_grad_()
                   for w in state[0]]
        surprise = [(0.05 * torch.randn(w.shape, generator=g, dtype=dtype)).requires_grad_() for w in state[0]]
        state = (weights, surprise)
    return features, state


def soup_like_mix(mem: NeuralMemory, seq: int, cached: int, seed: int = 1):
    """A read hook as MemoryCachingMixer.soup_mix builds it: per token weights gamma [B, H, T, 1 + N]
    (indexed by the positions it is called with) over the online read and N memories (leaves)."""
    g = torch.Generator().manual_seed(seed)
    dtype = mem.mem_w[0].dtype
    gamma = torch.softmax(torch.randn(2, mem.mem_w[0].shape[0], seq, 1 + cached, generator=g, dtype=dtype),
                          -1).requires_grad_()
    stacked = [(w.detach().unsqueeze(0).expand(2, -1, -1, -1).unsqueeze(2)
                + 0.1 * torch.randn(2, w.shape[0], cached, *w.shape[1:], generator=g, dtype=dtype)
                ).flatten(3).requires_grad_() for w in mem.mem_w]  # per layer [B, H, N, i*o]

    def mix(layer, r, read, positions):
        weights = gamma[:, :, positions]
        mixed = (weights[..., 1:] @ stacked[layer]).unflatten(-1, (r.shape[-1], -1))  # [B, H, C, i, o]
        return weights[..., :1] * read + (r.unsqueeze(-2) @ mixed).squeeze(-2)

    return mix, [gamma, *stacked]


def outputs_and_grads(scan, mem, features, state, leaves, **kw):
    reads, (weights, surprise) = scan(mem, features, state, **kw)
    g = torch.Generator().manual_seed(7)
    outs = [reads, *weights, *surprise]
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype)).sum() for o in outs)
    inputs = [*mem.parameters(), *features, *leaves]
    inputs = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [o.detach() for o in outs], grads


def compare(mem, features, state, tol=TOL, rel=False, leaves=(), **kw):
    leaves = list(leaves) + [t for t in state[0] + state[1] if t.is_leaf and t.requires_grad]
    new, new_grads = outputs_and_grads(NeuralMemory.scan_features, mem, features, state, leaves, **kw)
    ref, ref_grads = outputs_and_grads(reference_chunked_scan, mem, features, state, leaves, **kw)
    worst = 0.0
    for a, b in zip(new + list(new_grads), ref + list(ref_grads)):
        if a is None or b is None:
            assert a is None and b is None or (a if b is None else b).abs().max() == 0
            continue
        assert a.shape == b.shape
        err = (a - b).abs().max().item() / (b.abs().max().item() + 1e-30 if rel else 1.0)
        worst = max(worst, err)
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("seq,chunk", [(24, 6), (23, 6), (7, 1), (5, 8)])
@pytest.mark.parametrize("start", ["initial", "carried"])
def test_scan_matches_the_chunk_by_chunk_reference(depth, seq, chunk, start):
    mem = memory(depth)
    features, state = case(mem, seq, start)
    compare(mem, features, state, chunk_size=chunk)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("seq", [24, 22, 4])
def test_whole_chunks_keeps_the_state_before_a_partial_chunk(depth, seq):
    mem = memory(depth)
    features, state = case(mem, seq, "carried")
    compare(mem, features, state, chunk_size=6, whole_chunks=True)
    if seq % 6:  # the trailing partial chunk is read, not written
        _, (w, s) = mem.scan_features(features, state, 6, whole_chunks=True)
        _, (w_whole, s_whole) = mem.scan_features(tuple(f[..., :seq - seq % 6] if f.dim() == 3 else
                                                        f[:, :, :seq - seq % 6] for f in features), state, 6)
        for a, b in zip(w + s, w_whole + s_whole):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("seq", [24, 23])
def test_scan_with_a_read_hook_matches(depth, seq):
    mem = memory(depth)
    features, state = case(mem, seq, "carried")
    mix, leaves = soup_like_mix(mem, seq, cached=3)
    compare(mem, features, state, leaves=leaves, chunk_size=6, mix=mix)


def test_scan_through_project_with_convolution_matches():
    mem = memory(2, conv=3)
    x = torch.randn(2, 17, mem.wq.in_features, dtype=torch.float64)
    ref = reference_chunked_scan(mem, mem.project(x, x)[0], mem.init_state(2), 4)
    out = mem.scan(x, x, mem.init_state(2), chunk_size=4)
    for a, b in zip([out[0], *out[1][0], *out[1][1]], [ref[0], *ref[1][0], *ref[1][1]]):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


def relative_errors(outs, truth):
    return [((a.double() - b).abs().max() / b.abs().max()).item() for a, b in zip(outs, truth) if b is not None]


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_float32_is_within_tolerance(depth):
    """In float32 against the float64 reference: outputs and gradients within FP32_TOL of the
    largest entry, and no further than the reference in float32 (measured: 1.9-3.4e-5 batched,
    1.3-1.7e-4 the chunk-by-chunk reference, max over outputs and gradients, depths 1-3)."""
    mem = memory(depth)
    features, state = case(mem, 23, "carried")
    single = copy.deepcopy(mem).float()
    leaves32 = [[t.detach().float().requires_grad_() for t in ts] for ts in state]
    features32 = tuple(f.detach().float().requires_grad_() for f in features)
    leaves = lambda s: [t for t in s[0] + s[1] if t.requires_grad]  # noqa: E731
    truth = outputs_and_grads(reference_chunked_scan, mem, features, state, leaves(state), chunk_size=6)
    errors = {}
    for name, scan in (("new", NeuralMemory.scan_features), ("reference", reference_chunked_scan)):
        outs, grads = outputs_and_grads(scan, single, features32, (leaves32[0], leaves32[1]), leaves(leaves32),
                                        chunk_size=6)
        errors[name] = max(relative_errors(outs + list(grads), truth[0] + list(truth[1])))
    assert errors["new"] <= FP32_TOL and errors["new"] <= errors["reference"], errors


# -- whole models: the blocks and the Memory Caching mixers through the batched scan --------------

MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.mlp_width=64", "model.vocab_size=64",
         "model.seq_len=20", "model.taper.multiple=16", "model.titans.chunk_size=3", "model.titans.max_lr=0.5",
         "model.titans.conv_kernel=2"]
MODELS = {f"titans_{v}": ["model.arch=titans", f"model.titans.variant={v}", "model.titans.window=8",
                          "model.titans.persistent_tokens=2"] for v in ("mag", "mal", "mac")}
MODELS |= {f"deep_{v}_{w}": ["model.arch=deep_memory", f"model.memory_caching.variant={v}",
                             "model.memory_caching.segment=8", f"model.memory_caching.write_mode={w}"]
           for v in ("none", "residual", "grm", "soup", "ssc") for w in ("checkpoint", "independent")
           if v != "none" or w == "checkpoint"}
MODELS["deep_grm_segment_6"] = ["model.arch=deep_memory", "model.memory_caching.variant=grm",
                                "model.memory_caching.segment=6"]


def model_outputs(model, tokens):
    model.zero_grad()
    logits = model(tokens)
    (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
    return [logits.detach(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("depth", [2])
def test_models_match_with_the_reference_scan(name, depth, monkeypatch):
    cfg = load_config(None, MODEL + MODELS[name] + [f"model.titans.memory_depth={depth}"]).model
    model = build_model(cfg)
    model.init_weights(0)
    model.double()
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(3))
    new = model_outputs(model, tokens)
    monkeypatch.setattr(NeuralMemory, "scan_features", reference_chunked_scan)
    ref = model_outputs(model, tokens)
    assert len(new) == len(ref)
    for a, b in zip(new, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL)


# -- the write loop as one autograd node (WriteLoop: its hand-written backward) --------------------

@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("target,whole_chunks", [("reads", False), ("state", False), ("state", True)])
def test_write_loop_gradients_of_part_of_the_outputs(depth, target, whole_chunks):
    """Gradients through only the reads or only the final state (the other outputs' gradients
    zero), over more chunks than the state has rows, against the reference in float64."""
    mem = memory(depth)
    features, state = case(mem, 40, "carried")
    leaves = [*mem.parameters(), *features, *state[0], *state[1]]
    grads = []
    for scan in (NeuralMemory.scan_features, reference_chunked_scan):
        reads, (weights, surprise) = scan(mem, features, state, chunk_size=1 if target == "reads" else 6,
                                          whole_chunks=whole_chunks)
        outs = [reads] if target == "reads" else [*weights, *surprise]
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view(o.shape)).sum() for o in outs)
        grads.append(torch.autograd.grad(loss, leaves, allow_unused=True))
    for a, b in zip(*grads):
        if a is None or b is None:
            assert (a if b is None else b) is None or (a if b is None else b).abs().max() == 0
        else:  # entries up to ~1e4 here
            torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_bf16_autocast_keeps_the_state_dtype_and_its_gradients(depth):
    """Under CPU bf16 autocast the float32 state stays float32 and the outputs and gradients stay
    within 5% of each tensor's largest entry of the float32 scan (measured 0.5-3.4%)."""
    mem = memory(depth, dtype=torch.float32)
    features, state = case(mem, 23, "carried")
    leaves = [t for t in state[0] + state[1] if t.requires_grad]
    truth = outputs_and_grads(NeuralMemory.scan_features, mem, features, state, leaves, chunk_size=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, (weights, surprise) = mem.scan_features(features, state, 6)
        outs, grads = outputs_and_grads(NeuralMemory.scan_features, mem, features, state, leaves, chunk_size=6)
    assert {t.dtype for t in weights + surprise} == {torch.float32}
    assert max(relative_errors(outs + list(grads), truth[0] + list(truth[1]))) <= 0.05


def test_write_loop_operators_per_chunk():
    """The write loop runs one chunk in <= 90 ATen operators forward + backward (cost/op_count.py's
    counter over a one-block Titans 125M at 512 and 1024 tokens, 8 chunks of 64 apart: 67.5; 168.5
    when autograd recorded every chunk's operators)."""
    from megatron_taper.cost.op_count import dispatched_ops, narrowed
    from tests.helpers.runner import REPO

    cfg = load_config(str(REPO / "configs/titans_125m_taper.yaml"), []).model
    (_, short), (_, long) = (dispatched_ops(narrowed(cfg, 1, seq)) for seq in (512, 1024))
    assert (long - short) / 8 <= 90
