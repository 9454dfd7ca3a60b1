"""Hugging Face transformers checkpoints: export (ours -> HF) and import (HF -> ours), for every
family whose FamilySpec has an `hf` adapter (models/spec.py HFAdapter; today the Transformer's,
models/hf_llama.py: Llama and tapered Llama). This module writes and reads the files; the
adapter says how names, tensors and config.json fields map.

Export (`export_hf`, `tools/convert_checkpoint.py CKPT --to hf --output DIR`) writes a folder that
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads:
    model.safetensors        HF parameter names, written one tensor at a time (fp32 unless dtype)
    config.json              the adapter's architecture fields, torch_dtype, special token ids, and
                             `megatron_taper`: the model section and step, for an exact way back
    the adapter's extra files (the tapered Llama modelling file for tapered models)
    generation_config.json   bos / eos ids when a tokenizer is known
    tokenizer.model, tokenizer_config.json, special_tokens_map.json
                             when the run has a sentencepiece model (LlamaTokenizer settings that
                             encode as ours: no BOS/EOS added, no prefix space)

Import (`import_hf`, `tools/convert_checkpoint.py HF_DIR --from hf --output RUN_DIR`): a folder
whose config.json model_type an adapter reads (safetensors, one file or an index), or one we
exported, becomes a run folder: RUN_DIR/config.yaml (a recipe's non-model sections, or the
defaults, with the model section from config.json; then overrides) and RUN_DIR/checkpoints/step-0,
a format-2 checkpoint written by the Trainer's own Checkpointer (no optimizer state; data position
0 of the run's data), so
    python -m megatron_taper.train --config RUN_DIR/config.yaml
continues training from the imported weights (or `run.resume=RUN_DIR/checkpoints/step-0` from
another run folder with the same model section, data and seed).
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
from typing import Iterator

import torch

from megatron_taper.checkpoint.checkpointer import CheckpointError
from megatron_taper.checkpoint.files import write_safetensors_streaming
from megatron_taper.config import Config, ParallelConfig, apply_override, from_dict, load_config, save_config
from megatron_taper.inference.load import open_checkpoint, tokenizer_path
from megatron_taper.models import cards, family
from megatron_taper.models.spec import HFAdapter
from megatron_taper.taper import layer_widths

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# -- export ------------------------------------------------------------------------------------


def hf_config(cfg: Config, adapter: HFAdapter, step: int, dtype: str, special_ids: dict[str, int]) -> dict:
    """config.json for the model section of `cfg`: the adapter's fields and ours."""
    m = cfg.model
    return {**adapter.export_config(m), "torch_dtype": str(DTYPES[dtype]).removeprefix("torch."), **special_ids,
            "megatron_taper": {"model": m.architecture_dict(), "step": step}}


def adapter_of(arch: str, flag: str) -> HFAdapter:
    """model.arch's Hugging Face adapter; ValueError naming the families that have one."""
    adapter = family(arch).hf
    if adapter is None:
        have = [name for name in cards() if family(name).hf is not None]
        raise ValueError(f"{flag}: model.arch={arch!r} has no Hugging Face adapter (families with one: "
                         f"{', '.join(have)}); export its weights with the default --to safetensors")
    return adapter


def export_hf(checkpoint: str, output: str, dtype: str = "fp32", tokenizer: str = "") -> dict:
    """Write the HF folder of a checkpoint (see the module doc); one JSON-ready summary."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype={dtype!r} is not one of: {', '.join(DTYPES)}")
    ref = open_checkpoint(checkpoint, flag="checkpoint")
    m = ref.config.model
    if m.moe.enabled:
        raise ValueError(f"--to hf: model.moe (experts={m.moe.experts}) has no Hugging Face export yet (no "
                         f"Mixtral / Qwen-MoE layout is written); export its weights with the default --to safetensors")
    adapter = adapter_of(m.arch, "--to hf")
    special_config = adapter.export_config(m)  # refuses what the target architecture cannot hold, before writing
    names = {}
    for ours in ref.names():
        try:
            names[adapter.export_name(ours)] = ours
        except KeyError:
            raise ValueError(f"--to hf: parameter {ours!r} has no place in a {special_config['model_type']} "
                             f"model") from None
    shapes = {theirs: (ref.shape(ours), str(DTYPES[dtype]).removeprefix("torch.")) for theirs, ours in names.items()}
    os.makedirs(output, exist_ok=True)
    target = os.path.join(output, HF_WEIGHTS)
    write_safetensors_streaming(target + ".tmp", shapes, _export_tensors(ref, adapter, names, DTYPES[dtype]),
                                {"format": "pt", "step": str(ref.step)})
    os.replace(target + ".tmp", target)
    spm = tokenizer_path(ref.config, ref.path, tokenizer)
    special = _write_tokenizer(spm, output, m.seq_len) if spm else {}
    config = hf_config(ref.config, adapter, ref.step, dtype, special)
    _write_json(os.path.join(output, "config.json"), config)
    _write_json(os.path.join(output, "generation_config.json"), {"_from_model_config": True, **special})
    extra = adapter.extra_files(m)
    for path in extra:
        shutil.copyfile(path, os.path.join(output, os.path.basename(path)))
    return {"path": output, "model_type": config["model_type"], "tensors": len(shapes), "step": ref.step,
            "parameters": sum(math.prod(s) for s, _ in shapes.values()), "tokenizer": spm or None,
            "trust_remote_code": "auto_map" in config}


def _export_tensors(ref, adapter: HFAdapter, names: dict[str, str], dtype: torch.dtype
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    for theirs in sorted(names):
        ours = names[theirs]
        yield theirs, adapter.export_tensor(ours, ref.tensor(ours), ref.config.model).to(dtype).contiguous()


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


def model_section_from_hf(hf: dict, where: str) -> tuple[dict, HFAdapter]:
    """Our model section for an HF config.json (one we exported is taken as it was), and the adapter."""
    ours = hf.get("megatron_taper", {}).get("model")
    if ours is not None:
        return copy.deepcopy(ours), adapter_of(ours.get("arch", "transformer"), "--from hf")
    kind = hf.get("model_type")
    for name in cards():
        adapter = family(name).hf
        if adapter is not None and kind in adapter.model_types:
            return adapter.import_config(hf, where), adapter
    readable = sorted({t for name in cards() if family(name).hf for t in family(name).hf.model_types})
    raise ValueError(f"{where}: model_type={kind!r}; --from hf reads {', '.join(readable)} folders")


def import_config(hf_dir: str, recipe: str | None, overrides: list[str]) -> Config:
    """The run config of an import: the recipe (or defaults) with the model section from
    HF_DIR/config.json, then the overrides; its widths must be the checkpoint's."""
    where = os.path.join(hf_dir, "config.json")
    hf = _read_json(where)
    base = load_config(recipe).to_dict() if recipe else Config().to_dict()
    base["model"], _ = model_section_from_hf(hf, where)
    cfg = from_dict(base, source=where)
    for item in overrides:
        apply_override(cfg, item)
    cfg.validate()
    expected = hf.get("intermediate_sizes") or [hf["intermediate_size"]] * hf["num_hidden_layers"]
    if layer_widths(cfg.model) != list(expected):
        raise ValueError(f"{where}: MLP widths {list(expected)} differ from the model section's "
                         f"{layer_widths(cfg.model)} (model.taper.* overridden?)")
    return cfg


def read_hf_state(hf_dir: str, cfg: Config) -> dict[str, torch.Tensor]:
    """Every parameter of an HF safetensors folder, under our names (as the family's adapter maps them)."""
    from safetensors import safe_open

    adapter = adapter_of(cfg.model.arch, "--from hf")
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
                try:
                    ours = adapter.import_name(name)
                except KeyError:
                    raise ValueError(f"{hf_dir}/{file}: tensor {name!r} has no place in a model.arch="
                                     f"{cfg.model.arch} model") from None
                if ours is not None:
                    state[ours] = adapter.import_tensor(ours, f.get_tensor(name), cfg.model)
    return state


def import_hf(hf_dir: str, output: str, recipe: str | None = None, overrides: list[str] = ()) -> dict:
    """Write OUTPUT/config.yaml and OUTPUT/checkpoints/step-0 from an HF Llama folder (module doc)."""
    from megatron_taper.checkpoint.checkpointer import Checkpointer, checkpoint_root
    from megatron_taper.data.sources import build_sources
    from megatron_taper.training.build import build_run

    if not os.path.isdir(hf_dir):
        raise ValueError(f"--from hf {hf_dir}: no such folder")
    cfg = import_config(hf_dir, recipe, list(overrides))
    cfg.run.dir = output
    os.makedirs(output, exist_ok=True)
    if os.path.isfile(os.path.join(hf_dir, "tokenizer.model")) and not cfg.data.tokenizer:
        shutil.copyfile(os.path.join(hf_dir, "tokenizer.model"), os.path.join(output, "tokenizer.model"))
        cfg.data.tokenizer = os.path.abspath(os.path.join(output, "tokenizer.model"))
    state = {k: v.float() for k, v in read_hf_state(hf_dir, cfg).items()}
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
