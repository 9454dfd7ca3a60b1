"""Hugging Face interop (megatron_taper.inference.hf, tools/convert_checkpoint.py --to hf / --from hf).

- A tapered GQA model trained 2 steps by the Trainer (sharded checkpoint) exports to a folder
  that transformers loads as TaperedLlamaForCausalLM (trust_remote_code=True): per-layer MLP
  widths, logits equal to ours, transformers' cached greedy generation equal to ours, and the
  tokenizer files encode as our sentencepiece Tokenizer.
- A uniform model with tied embeddings exports as a plain LlamaForCausalLM, logits equal.
- A Llama made by transformers (GQA, untied, other eps / rope_theta) imports into a run folder:
  logits equal to transformers', the Trainer resumes from its step-0 checkpoint and trains; and
  ours -> HF -> ours gives back the same tensors bit for bit.
- Bad inputs (an architecture without an HF counterpart, a folder that is not Llama) exit 2.
Tolerance on logits (fp32, both sides): 1e-5 absolute (logits ~1; measured ~1e-7).
"""
import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatron_taper.config import load_config  # noqa: E402
from megatron_taper.inference.load import load_model, open_checkpoint, save_exported  # noqa: E402
from megatron_taper.models import build_model  # noqa: E402
from tests.helpers.runner import REPO  # noqa: E402

TOL = 1e-5
MODEL = ["model.n_layers=3", "model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.mlp_width=48",
         "model.taper.multiple=8", "model.vocab_size=320", "model.seq_len=32"]
TRAIN = ["train.steps=2", "train.global_batch=2", "train.micro_batch=2", "train.warmup_steps=1", "train.lr=3e-3",
         "train.log_interval=1", "train.eval_batches=1", "train.device=cpu", "train.precision=fp32",
         "run.tensorboard=false"]


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def _convert(*argv):
    assert _tool().main([str(a) for a in argv]) == 0


def _max_diff(ours, hf, tokens):
    with torch.no_grad():
        return (ours(tokens) - hf(tokens).logits).abs().max().item()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from megatron_taper.data.tokenizer import train_tokenizer

    prefix = tmp_path_factory.mktemp("tok") / "spm"
    docs = ["def main(argv):\n    return 0  # done\n" * 30, "the quick brown fox jumps over the lazy dog. " * 30]
    train_tokenizer(docs, str(prefix), 300)
    return str(prefix) + ".model"


@pytest.fixture(scope="module")
def tapered_run(tmp_path_factory, byte_tokens, tokenizer):
    from megatron_taper.training.trainer import Trainer

    run = tmp_path_factory.mktemp("hf") / "run"
    overrides = MODEL + TRAIN + [f"run.dir={run}", f"data.path={byte_tokens}", f"data.tokenizer={tokenizer}"]
    assert Trainer(load_config(None, overrides)).fit() == 0
    return run


def test_tapered_export_loads_with_its_widths_and_our_logits(tapered_run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_taper.data.tokenizer import Tokenizer
    from megatron_taper.inference.generation import SamplingOptions, generate

    out = tmp_path / "hf"
    _convert(tapered_run, "--to", "hf", "--output", out)
    config = json.loads((out / "config.json").read_text())
    ref = open_checkpoint(str(tapered_run))
    ours = load_model(ref)
    assert config["model_type"] == "tapered_llama" and config["intermediate_sizes"] == ours.mlp_widths
    assert len(set(ours.mlp_widths)) == 3
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert type(hf).__name__ == "TaperedLlamaForCausalLM"
    assert [layer.mlp.up_proj.out_features for layer in hf.model.layers] == ours.mlp_widths
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    diff = _max_diff(ours, hf, tokens)
    print(f"tapered export: max |logits ours - transformers| = {diff:.1e}")
    assert diff < TOL
    prompt = [5, 60, 7, 200]
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                             pad_token_id=0, min_new_tokens=12)
    ours_out = generate(ours, prompt, SamplingOptions(max_new_tokens=12, temperature=0)).tokens
    assert hf_out[0, len(prompt):].tolist() == ours_out
    hf_tok, our_tok = AutoTokenizer.from_pretrained(out), Tokenizer(ref.config.data.tokenizer)
    for text in ["def main(argv):\n    return 0", "  the lazy dog\n\n\tfox", "héllo wörld"]:
        assert hf_tok.encode(text, add_special_tokens=False) == our_tok.encode(text)
        assert hf_tok(text)["input_ids"] == our_tok.encode(text)  # no BOS added by default
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == our_tok.eos_id


def test_uniform_tied_export_is_a_plain_llama(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    cfg = load_config(None, MODEL + ["model.taper.schedule=uniform", "model.tie_embeddings=true",
                                     "model.rope_theta=500.0", "model.norm_eps=1e-6"])
    model = build_model(cfg.model)
    model.init_weights(1)
    folder = save_exported(model, cfg, str(tmp_path / "exported"))
    _convert(folder, "--to", "hf", "--output", tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf) is LlamaForCausalLM and hf.config.tie_word_embeddings and hf.config.intermediate_size == 48
    assert not (tmp_path / "hf" / "modeling_tapered_llama.py").exists()
    tokens = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))  # beyond seq_len too
    diff = _max_diff(model.eval(), hf, tokens)
    print(f"uniform tied export: max |logits ours - transformers| = {diff:.1e}")
    assert diff < TOL


def test_llama_imports_trains_and_round_trips(tmp_path, byte_tokens):
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_taper.training.trainer import Trainer

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path / "llama")
    run = tmp_path / "imported"
    _convert(tmp_path / "llama", "--from", "hf", "--output", run, f"data.path={byte_tokens}", "model.seq_len=32",
             *TRAIN)
    ref = open_checkpoint(str(run))
    assert ref.kind == "sharded" and ref.step == 0 and ref.config.model.mlp_width == 96
    ours = load_model(ref)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    diff = _max_diff(ours, hf, tokens)
    print(f"imported Llama: max |logits ours - transformers| = {diff:.1e}")
    assert diff < TOL
    cfg = load_config(str(run / "config.yaml"))
    assert Trainer(cfg).fit() == 0  # run.dir is the import: resumes from checkpoints/step-0
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "loss" in r] == [1, 2]
    _convert(run, "--to", "hf", "--output", tmp_path / "back_to_hf")  # ours (trained) -> HF -> ours
    _convert(tmp_path / "back_to_hf", "--from", "hf", "--output", tmp_path / "back", f"data.path={byte_tokens}",
             *TRAIN)
    trained, back = open_checkpoint(str(run)), open_checkpoint(str(tmp_path / "back"))
    assert back.config.model == trained.config.model and trained.names() == back.names()
    assert all(torch.equal(trained.tensor(n), back.tensor(n)) for n in trained.names())


def test_bad_inputs(tmp_path, capsys):
    cfg = load_config(None, MODEL + ["model.arch=gated_attention"])
    model = build_model(cfg.model)
    model.init_weights(0)
    folder = save_exported(model, cfg, str(tmp_path / "gated"))
    assert _tool().main([folder, "--to", "hf", "--output", str(tmp_path / "out")]) == 2
    assert "model.arch='gated_attention'" in capsys.readouterr().err
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert _tool().main([str(tmp_path / "bert"), "--from", "hf", "--output", str(tmp_path / "out")]) == 2
    assert "model_type='bert'" in capsys.readouterr().err
    assert _tool().main([folder, "--output", str(tmp_path / "out"), "train.steps=3"]) == 2
    assert "--from hf" in capsys.readouterr().err
