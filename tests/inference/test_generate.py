"""Generation: each family's decoding state (FamilySpec.decoder) gives the model's own forward,
cached greedy decoding equals uncached greedy decoding token for token, sampling options, the
fallback for families without a decoder, and tools/generate.py (one run, one bad input).

Models are built in-process with a large init_std (0.5) so that next-token distributions are
peaked and argmax is never decided by float noise. The cached forward is compared with the full
one in float64, where it must agree to 1e-10 (measured ~2e-14: the same arithmetic, another
order); in fp32 the two differ by ~1e-7 at init_std 0.02 and ~2e-5 at 0.5 (logits ~10).
"""
import importlib.util

import numpy as np
import pytest
import torch

from megatron_taper.config import load_config
from megatron_taper.inference.generation import SamplingOptions, generate, make_decoder, next_token
from megatron_taper.inference.load import save_exported
from megatron_taper.models import build_model
from tests.helpers.runner import REPO

TINY = ["model.n_layers=3", "model.d_model=32", "model.n_heads=4", "model.mlp_width=48", "model.taper.multiple=8",
        "model.vocab_size=256", "model.seq_len=32", "model.init_std=0.5"]
LOGIT_TOL = 1e-10  # float64
VARIANTS = {
    "transformer_gqa": ["model.arch=transformer", "model.n_kv_heads=2"],
    "transformer_tied": ["model.arch=transformer", "model.tie_embeddings=true"],
    "gated_elementwise": ["model.arch=gated_attention", "model.gated.gate=elementwise", "model.n_kv_heads=2"],
    "gated_headwise": ["model.arch=gated_attention", "model.gated.gate=headwise"],
    # periods 3 and 6: chunk ends fall inside the 7-token prompt and between decoded tokens
    "hope_online": ["model.arch=hope_attention", "model.hope.chunk_size=3", "model.hope.chunk_growth=2"],
    "hope_offline": ["model.arch=hope_attention", "model.hope.online=false", "model.n_kv_heads=2"],
}


def _model(extra, seed=0):
    cfg = load_config(None, TINY + extra)
    model = build_model(cfg.model)
    model.init_weights(seed)
    return cfg, model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_forward_equals_full_forward(variant):
    _, model = _model(VARIANTS[variant])
    model = model.double()
    decoder = make_decoder(model, 2, 20)
    assert decoder is not None
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
    pieces = [decoder(tokens[:, :7])]  # a prompt, then one token at a time
    pieces += [decoder(tokens[:, i:i + 1]) for i in range(7, 20)]
    diff = (torch.cat(pieces, dim=1) - full).abs().max().item()
    print(f"{variant}: max |cached - full logits| (float64) = {diff:.1e}")
    assert diff < LOGIT_TOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_greedy_equals_uncached_greedy(variant):
    _, model = _model(VARIANTS[variant])
    opts = SamplingOptions(max_new_tokens=24, temperature=0)
    cached = generate(model, [5, 17, 99, 3], opts)
    full = generate(model, [5, 17, 99, 3], opts, use_cache=False)
    assert cached.cached and not full.cached
    assert cached.tokens == full.tokens and len(cached.tokens) == 24


def test_sampling_options():
    _, model = _model(VARIANTS["transformer_gqa"])
    greedy = generate(model, [1, 2, 3], SamplingOptions(max_new_tokens=10, temperature=0)).tokens
    assert generate(model, [1, 2, 3], SamplingOptions(10, temperature=1.0, top_k=1)).tokens == greedy
    assert generate(model, [1, 2, 3], SamplingOptions(10, temperature=1.0, top_p=1e-6)).tokens == greedy
    a = generate(model, [1, 2, 3], SamplingOptions(10, temperature=1.5, top_k=50, top_p=0.95, seed=7)).tokens
    b = generate(model, [1, 2, 3], SamplingOptions(10, temperature=1.5, top_k=50, top_p=0.95, seed=7)).tokens
    assert a == b
    stopped = generate(model, [1, 2, 3], SamplingOptions(10, temperature=0, stop_ids=(greedy[2],)))
    assert stopped.tokens == greedy[:3] and stopped.stopped_at_eos
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    picks = {int(next_token(logits, SamplingOptions(temperature=1.0, top_k=2), torch.Generator().manual_seed(s)))
             for s in range(40)}
    assert picks == {1, 2}


def test_families_without_cache_recompute_the_prefix():
    cfg, model = _model(["model.arch=titans"])
    assert make_decoder(model, 1, 8) is None
    out = generate(model, [4, 8, 15], SamplingOptions(max_new_tokens=3, temperature=0))
    ids = [4, 8, 15]
    with torch.no_grad():
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert not out.cached and out.tokens == ids[3:]
    with pytest.raises(ValueError, match="has no incremental decoding state"):
        generate(model, [1], SamplingOptions(max_new_tokens=1), use_cache=True)


def _tool():
    spec = importlib.util.spec_from_file_location("generate_tool", REPO / "tools" / "generate.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def test_generate_tool_on_a_byte_model(tmp_path, capsys):
    data = tmp_path / "bytes.npy"
    np.save(data, np.frombuffer(b"hello world " * 20, dtype=np.uint8).astype(np.uint16))
    cfg, model = _model(VARIANTS["transformer_gqa"] + [f"data.path={data}"])
    folder = save_exported(model, cfg, str(tmp_path / "exported"))
    tool = _tool()
    assert tool.main(["--checkpoint", folder, "--prompt", "hello", "--max-new-tokens", "8", "--temperature", "0"]) == 0
    out, err = capsys.readouterr()
    expected = generate(model, list(b"hello"), SamplingOptions(max_new_tokens=8, temperature=0)).tokens
    assert out == "hello" + bytes(expected).decode("utf-8", errors="replace") + "\n"
    assert "8 new tokens" in err and "kv cache" in err and "tokens/s" in err
    assert tool.main(["--checkpoint", folder, "--prompt", "hi", "--top-p", "0"]) == 2
    assert "--top-p" in capsys.readouterr().err
    assert tool.main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
