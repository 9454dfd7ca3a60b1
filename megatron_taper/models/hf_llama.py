"""The Transformer family's Hugging Face adapter (FamilySpec.hf): Llama, and tapered Llama.

inference/hf.py writes and reads the files; this module says how the Transformer maps to Llama:
config.json model_type llama (every layer has the same MLP width) or tapered_llama (per-layer
widths in `intermediate_sizes`, with auto_map to modeling_tapered_llama.py, copied next to the
export: load with trust_remote_code=True, because no text-only architecture in transformers 4.57
takes a width per layer; gemma3n's list-valued intermediate_size belongs to a different block).

Names: tok_embeddings -> model.embed_tokens, layers.i.attn_norm -> input_layernorm,
attn.wq/wk/wv/wo -> self_attn.q/k/v/o_proj, mlp_norm -> post_attention_layernorm, mlp.w1/w3/w2 ->
mlp.gate/up/down_proj, norm -> model.norm, output -> lm_head (absent when model.tie_embeddings:
tie_word_embeddings). RoPE: ours rotates (even, odd) pairs of each head's dimensions
(models/layers.py apply_rope), HF Llama rotates (i, i + E/2) halves (rotate_half), with the same
frequency for pair i. Within every head the rows of wq and wk are reordered from
[0, 1, 2, 3, ...] to [0, 2, 4, ..., 1, 3, 5, ...]: q.k is unchanged by a permutation applied to
both, and values are untouched. RMSNorm eps = model.norm_eps, rope_theta, GQA
(num_key_value_heads) map one to one; attention scale 1/sqrt(head_dim) on both sides.
"""
from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any

from megatron_taper.models.spec import HFAdapter
from megatron_taper.taper import layer_widths

if TYPE_CHECKING:
    import torch

    from megatron_taper.config import ModelConfig

REMOTE_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "modeling_tapered_llama.py")

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
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None:
        raise KeyError(name)
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"


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


def export_config(m: ModelConfig) -> dict[str, Any]:
    """The Llama (or tapered Llama) fields of config.json for a Transformer model section."""
    if m.position_encoding != "rope":
        raise ValueError(f"--to hf: model.position={m.position!r} has no Llama equivalent (Llama uses RoPE)")
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
    }
    if tapered:
        out["intermediate_sizes"] = widths
        module = os.path.basename(REMOTE_CODE).removesuffix(".py")
        out["auto_map"] = {"AutoConfig": f"{module}.TaperedLlamaConfig",
                           "AutoModelForCausalLM": f"{module}.TaperedLlamaForCausalLM"}
    return out


def import_config(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Our model section for a Llama config.json; ValueError naming `where` for what Llama has and we do not."""
    kind = hf.get("model_type")
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


def import_name(name: str) -> str | None:
    return None if _IGNORED_HF.search(name) else our_name(name)


def export_tensor(name: str, tensor: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    return pairs_to_halves(tensor, m.head_dim) if name.endswith(_ROPE_ROTATED) else tensor


def import_tensor(name: str, tensor: torch.Tensor, m: ModelConfig) -> torch.Tensor:
    """`name` is ours."""
    return halves_to_pairs(tensor, m.head_dim) if name.endswith(_ROPE_ROTATED) else tensor


def extra_files(m: ModelConfig) -> tuple[str, ...]:
    return (REMOTE_CODE,) if len(set(layer_widths(m))) > 1 else ()


LLAMA = HFAdapter(model_types=("llama", "tapered_llama"), export_config=export_config, import_config=import_config,
                  export_name=hf_name, import_name=import_name, export_tensor=export_tensor,
                  import_tensor=import_tensor, extra_files=extra_files)
