"""Hugging Face transformers checkpoints: export (ours -> HF) and import (HF Llama -> ours).

Export (`export_hf`, `tools/convert_checkpoint.py CKPT --to hf --output DIR`) writes a folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads:
    model.safetensors        HF parameter names, written one tensor at a time (fp32 unless dtype)
    config.json              model_type llama (every layer has the same MLP width) or tapered_llama
                             (per-layer widths in `intermediate_sizes`, with auto_map to
                             modeling_tapered_llama.py: load with trust_remote_code=True, because no
                             text-only architecture in transformers 4.57 takes a width per layer;
                             gemma3n's list-valued intermediate_size belongs to a different block)
    modeling_tapered_llama.py  tapered models only (this package's inference/modeling_tapered_llama.py)
    generation_config.json   bos / eos ids when a tokenizer is known
    tokenizer.model, tokenizer_config.json, special_tokens_map.json
                             when the run has a sentencepiece model (LlamaTokenizer settings that
                             encode as ours: no BOS/EOS added, no prefix space)
config.json also carries `megatron_taper`: the model section and step, for an exact way back.

Mapping (model.arch=transformer): tok_embeddings -> model.embed_tokens, layers.i.attn_norm ->
input_layernorm, attn.wq/wk/wv/wo -> self_attn.q/k/v/o_proj, mlp_norm -> post_attention_layernorm,
mlp.w1/w3/w2 -> mlp.gate/up/down_proj, norm -> model.norm, output -> lm_head (absent when
model.tie_embeddings: tie_word_embeddings). RoPE: ours rotates (even, odd) pairs of each head's
dimensions (models/layers.py apply_rope), HF Llama rotates (i, i + E/2) halves (rotate_half), with
the same frequency for pair i. Within every head the rows of wq and wk are reordered from
[0, 1, 2, 3, ...] to [0, 2, 4, ..., 1, 3, 5, ...]: q.k is unchanged by a permutation applied to
both, and values are untouched. RMSNorm eps = model.norm_eps, rope_theta, GQA (num_key_value_heads)
map one to one; attention scale 1/sqrt(head_dim) on both sides.

Import (`import_hf`, `tools/convert_checkpoint.py HF_DIR --from hf --output RUN_DIR`): a
LlamaForCausalLM folder (safetensors, one file or an index) or one we exported becomes a run
folder: RUN_DIR/config.yaml (a recipe's non-model sections, or the defaults, with the model section
from config.json; then overrides) and RUN_DIR/checkpoints/step-0, a format-2 checkpoint written
by the Trainer's own Checkpointer (no optimizer state; data position 0 of the run's data), so
    python -m megatron_taper.train --config RUN_DIR/config.yaml
continues training from the imported weights (or `run.resume=RUN_DIR/checkpoints/step-0` from
another run folder with the same model section, data and seed).
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from typing import Iterator

import torch

from megatron_taper.checkpoint.checkpointer import CheckpointError
from megatron_taper.checkpoint.files import write_safetensors_streaming
from megatron_taper.config import Config, ParallelConfig, apply_override, from_dict, load_config, save_config
from megatron_taper.inference.load import open_checkpoint, tokenizer_path
from megatron_taper.taper import layer_widths

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
REMOTE_CODE = "modeling_tapered_llama.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

_LAYER_NAMES = {  # ours (after "layers.{i}.") -> HF (after "model.layers.{i}.")
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w1.weight": "mlp.gate_proj.weight",
    "mlp.w3.weight": "mlp.up_proj.weight",
    "mlp.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_IGNORED_HF = re.compile(r"\.rotary_emb\.inv_freq$")  # a buffer some older exports saved
_ROPE_ROTATED = ("attn.wq.weight", "attn.wk.weight")


def hf_name(name: str) -> str:
    """Our parameter name -> the HF Llama one (KeyError for a name Llama has no place for)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"


def our_name(name: str) -> str:
    """The HF Llama parameter name -> ours (KeyError for an unknown one)."""
    for ours, theirs in _TOP_NAMES.items():
        if name == theirs:
            return ours
    match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(name)
    inverse = {theirs: ours for ours, theirs in _LAYER_NAMES.items()}
    return f"layers.{match.group(1)}.{inverse[match.group(2)]}"


def pairs_to_halves(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of wq / wk [heads * E, D]: within each head, (even, odd) pair order -> halves order."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, head_dim // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def halves_to_pairs(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of pairs_to_halves."""
    rows, cols = weight.shape
    return weight.reshape(rows // head_dim, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


# -- export ------------------------------------------------------------------------------------


def hf_config(cfg: Config, step: int, dtype: str, special_ids: dict[str, int]) -> dict:
    """config.json for the model section of `cfg` (llama, or tapered_llama for unequal widths)."""
    m = cfg.model
    widths = layer_widths(m)
    tapered = len(set(widths)) > 1
    out = {
        "architectures": ["TaperedLlamaForCausalLM" if tapered else "LlamaForCausalLM"],
        "model_type": "tapered_llama" if tapered else "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_key_value_heads": m.kv_heads, "head_dim": m.head_dim,
        "intermediate_size": m.mlp_width if tapered else widths[0], "hidden_act": "silu",
        "max_position_embeddings": m.seq_len, "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta,
        "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "tie_word_embeddings": m.tie_embeddings, "initializer_range": m.init_std, "use_cache": True,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        **special_ids,
        "megatron_taper": {"model": m.architecture_dict(), "step": step},
    }
    if tapered:
        out["intermediate_sizes"] = widths
        module = REMOTE_CODE.removesuffix(".py")
        out["auto_map"] = {"AutoConfig": f"{module}.TaperedLlamaConfig",
                           "AutoModelForCausalLM": f"{module}.TaperedLlamaForCausalLM"}
    return out


def export_hf(checkpoint: str, output: str, dtype: str = "fp32", tokenizer: str = "") -> dict:
    """Write the HF folder of a checkpoint (see the module doc); one JSON-ready summary."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
    ref = open_checkpoint(checkpoint, flag="checkpoint")
    m = ref.config.model
    if m.arch != "transformer":
        raise ValueError(f"--to hf: model.arch={m.arch!r} has no transformers architecture yet (transformer only; "
                         f"export its weights with the default --to safetensors)")
    if m.position_encoding != "rope":
        raise ValueError(f"--to hf: model.position={m.position!r} has no Llama equivalent (Llama uses RoPE)")
    names = {hf_name(n): n for n in ref.names()}
    shapes = {theirs: (ref.shape(ours), str(DTYPES[dtype]).removeprefix("torch.")) for theirs, ours in names.items()}
    os.makedirs(output, exist_ok=True)
    target = os.path.join(output, HF_WEIGHTS)
    write_safetensors_streaming(target + ".tmp", shapes, _export_tensors(ref, names, DTYPES[dtype]),
                                {"format": "pt", "step": str(ref.step)})
    os.replace(target + ".tmp", target)
    spm = tokenizer_path(ref.config, ref.path, tokenizer)
    special = _write_tokenizer(spm, output, m.seq_len) if spm else {}
    config = hf_config(ref.config, ref.step, dtype, special)
    _write_json(os.path.join(output, "config.json"), config)
    _write_json(os.path.join(output, "generation_config.json"), {"_from_model_config": True, **special})
    if config["model_type"] == "tapered_llama":
        shutil.copyfile(os.path.join(os.path.dirname(__file__), REMOTE_CODE), os.path.join(output, REMOTE_CODE))
    return {"path": output, "model_type": config["model_type"], "tensors": len(shapes), "step": ref.step,
            "parameters": sum(math.prod(s) for s, _ in shapes.values()), "tokenizer": spm or None,
            "trust_remote_code": config["model_type"] == "tapered_llama"}


def _export_tensors(ref, names: dict[str, str], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    head_dim = ref.config.model.head_dim
    for theirs in sorted(names):
        ours = names[theirs]
        tensor = ref.tensor(ours)
        if ours.endswith(_ROPE_ROTATED):
            tensor = pairs_to_halves(tensor, head_dim)
        yield theirs, tensor.to(dtype).contiguous()


def _write_tokenizer(spm_path: str, output: str, max_length: int) -> dict[str, int]:
    """tokenizer.model + LlamaTokenizer settings that encode exactly as megatron_taper's Tokenizer
    (data/tokenizer.py: no BOS/EOS added, no dummy prefix); returns the special ids it has."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=spm_path)
    shutil.copyfile(spm_path, os.path.join(output, "tokenizer.model"))
    ids = {"bos_token_id": sp.bos_id(), "eos_token_id": sp.eos_id(), "unk_token_id": sp.unk_id()}
    pieces = {key.removesuffix("_id"): sp.id_to_piece(i) for key, i in ids.items() if i >= 0}
    _write_json(os.path.join(output, "special_tokens_map.json"), pieces)
    _write_json(os.path.join(output, "tokenizer_config.json"), {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": False, "add_eos_token": False,
        "add_prefix_space": False, "legacy": False, "clean_up_tokenization_spaces": False,
        "spaces_between_special_tokens": False, "model_max_length": max_length, "pad_token": None,
        "sp_model_kwargs": {}, **pieces})
    return {k: i for k, i in ids.items() if i >= 0 and k != "unk_token_id"}


def _write_json(path: str, obj: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


# -- import ------------------------------------------------------------------------------------


def model_section_from_hf(hf: dict, where: str) -> dict:
    """Our model section for a Llama config.json (or the one we exported, taken as it was)."""
    kind = hf.get("model_type")
    if kind not in ("llama", "tapered_llama"):
        raise ValueError(f"{where}: model_type={kind!r}; --from hf reads llama (and our tapered_llama) folders")
    ours = hf.get("megatron_taper", {}).get("model")
    if ours is not None:
        return copy.deepcopy(ours)
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    problems = [(key, hf.get(key)) for key, ok in (
        ("rope_scaling", hf.get("rope_scaling") is None), ("attention_bias", not hf.get("attention_bias", False)),
        ("mlp_bias", not hf.get("mlp_bias", False)), ("hidden_act", hf.get("hidden_act", "silu") == "silu"),
        ("head_dim", head_dim * heads == hf["hidden_size"]), ("intermediate_size", kind == "llama"))
        if not ok]
    if problems:
        raise ValueError(f"{where}: not representable as model.arch=transformer: "
                         + ", ".join(f"{k}={v!r}" for k, v in problems))
    width = hf["intermediate_size"]
    return {"arch": "transformer", "n_layers": hf["num_hidden_layers"], "d_model": hf["hidden_size"],
            "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads") or heads, "mlp_width": width,
            "vocab_size": hf["vocab_size"], "seq_len": hf.get("max_position_embeddings", 2048),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_theta": float(hf.get("rope_theta", 10000.0)), "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "init_std": float(hf.get("initializer_range", 0.02)),
            "taper": {"schedule": "uniform", "multiple": math.gcd(width, 64)}}


def import_config(hf_dir: str, recipe: str | None, overrides: list[str]) -> Config:
    """The run config of an import: the recipe (or defaults) with the model section from
    HF_DIR/config.json, then the overrides; its widths must be the checkpoint's."""
    where = os.path.join(hf_dir, "config.json")
    hf = _read_json(where)
    base = load_config(recipe).to_dict() if recipe else Config().to_dict()
    base["model"] = model_section_from_hf(hf, where)
    cfg = from_dict(base, source=where)
    for item in overrides:
        apply_override(cfg, item)
    cfg.validate()
    expected = hf.get("intermediate_sizes") or [hf["intermediate_size"]] * hf["num_hidden_layers"]
    if layer_widths(cfg.model) != list(expected):
        raise ValueError(f"{where}: MLP widths {list(expected)} differ from the model section's "
                         f"{layer_widths(cfg.model)} (model.taper.* overridden?)")
    return cfg


def read_hf_state(hf_dir: str, head_dim: int) -> dict[str, torch.Tensor]:
    """Every parameter of a Llama safetensors folder, under our names (wq / wk rows reordered)."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, HF_INDEX)
    if os.path.isfile(index):
        by_file: dict[str, list[str]] = {}
        for name, file in _read_json(index)["weight_map"].items():
            by_file.setdefault(file, []).append(name)
    elif os.path.isfile(os.path.join(hf_dir, HF_WEIGHTS)):
        by_file = {HF_WEIGHTS: None}
    else:
        raise ValueError(f"{hf_dir}: no {HF_WEIGHTS} or {HF_INDEX} (only safetensors checkpoints are read)")
    state = {}
    for file, wanted in by_file.items():
        with safe_open(os.path.join(hf_dir, file), "pt") as f:
            for name in wanted or f.keys():
                if _IGNORED_HF.search(name):
                    continue
                try:
                    ours = our_name(name)
                except KeyError:
                    raise ValueError(f"{hf_dir}/{file}: tensor {name!r} has no place in a model.arch=transformer "
                                     f"model") from None
                tensor = f.get_tensor(name)
                state[ours] = halves_to_pairs(tensor, head_dim) if ours.endswith(_ROPE_ROTATED) else tensor
    return state


def import_hf(hf_dir: str, output: str, recipe: str | None = None, overrides: list[str] = ()) -> dict:
    """Write OUTPUT/config.yaml and OUTPUT/checkpoints/step-0 from an HF Llama folder (module doc)."""
    from megatron_taper.build import build_run
    from megatron_taper.checkpoint.checkpointer import Checkpointer, checkpoint_root
    from megatron_taper.data.sources import build_sources

    if not os.path.isdir(hf_dir):
        raise ValueError(f"--from hf {hf_dir}: no such folder")
    cfg = import_config(hf_dir, recipe, list(overrides))
    cfg.run.dir = output
    os.makedirs(output, exist_ok=True)
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")) and not cfg.data.tokenizer:
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.model"), os.path.join(output, "tokenizer.model"))
        cfg.data.tokenizer = os.path.abspath(os.path.join(output, "tokenizer.model"))
    state = {k: v.float() for k, v in read_hf_state(hf_dir, cfg.model.head_dim).items()}
    if cfg.model.tie_embeddings:
        state.pop("output.weight", None)  # some tied checkpoints also store lm_head
    one_process = copy.deepcopy(cfg)
    one_process.parallel = ParallelConfig()
    one_process.train.global_batch = one_process.train.micro_batch
    run = build_run(one_process)
    expected = {n: tuple(p.shape) for n, p in run.model.module.named_parameters()}
    got = {n: tuple(t.shape) for n, t in state.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:4]
        raise ValueError(f"{hf_dir}: its tensors do not fit the model section (first differences: {diff})")
    run.model.load_logical_state(run.optimizer, state, {}, missing=lambda n: CheckpointError(f"{hf_dir}: no {n}"))
    data_state = build_sources(cfg.data, seq_len=cfg.model.seq_len, micro_batch=cfg.train.micro_batch,
                               seed=cfg.train.seed, vocab_size=cfg.model.vocab_size, dp_rank=0,
                               dp_size=1)[0].state_dict()
    Checkpointer(checkpoint_root(output), cfg.checkpoint, run.model).save(
        run.optimizer, 0, cfg.to_dict(), {"skipped": 0}, data_state)
    save_config(cfg, os.path.join(output, "config.yaml"))
    return {"path": os.path.join(checkpoint_root(output), "step-0"), "run_dir": output,
            "config": os.path.join(output, "config.yaml"), "tensors": len(state),
            "parameters": sum(t.numel() for t in state.values()), "source": hf_dir}


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
