"""Consolidate a training checkpoint into one safetensors file plus its config; or convert to and
from Hugging Face transformers folders.

    python tools/convert_checkpoint.py runs/X/checkpoints/step-N --output exported/ [--source auto]
    python tools/convert_checkpoint.py runs/X --output exported/      (a run folder: its newest checkpoint)
    python tools/convert_checkpoint.py CKPT --output exported/ --swiglu unfused   (or fused: the layout)
    python tools/convert_checkpoint.py CKPT --to hf --output hf_dir/ [--dtype bf16] [--tokenizer X.model]
    python tools/convert_checkpoint.py HF_DIR --from hf --output runs/Y [--config RECIPE] [key=value ...]

Default (--to safetensors): reads any checkpoint the Trainer writes (parallel.zero = none | fsdp2 |
deepspeed, any pp/dp/tp layout), then
  --source logical     the parameters' records (shards/, format 2: assembled and written one
                       tensor at a time, each record's sha256 checked as it is read; format 1:
                       the logical per-stage files model-pp*.pt, verified first)
  --source deepspeed   DeepSpeed's own ZeRO files (deepspeed/state/), consolidated with
                       DeepSpeed's zero_to_fp32 (only for parallel.tp=1 checkpoints: ZeRO's
                       files hold tp-local shards otherwise)
  --source auto        logical when present, else deepspeed
Writes OUTPUT/model.safetensors (fp32 unless --dtype, full logical tensors keyed by parameter
name, metadata: step, source; peak memory about one tensor for format 2), OUTPUT/config.yaml
(the run's resolved config) and prints one JSON line: path, tensors, parameters, step, source.
--swiglu fused | unfused writes SwiGLU's gate and up weights in that layout (model.fused_swiglu:
one mlp.w13 of rows interleaved per hidden unit, or mlp.w1 and mlp.w3) and sets model.fused_swiglu
in config.yaml to match; stored (default) keeps the checkpoint's.
Writing goes through a temporary name + rename. A new run starts from such a folder's weights
(or any checkpoint's) with `run.init_from=exported/`.

--to hf: a folder transformers loads (AutoModelForCausalLM.from_pretrained; a tapered model with
trust_remote_code=True), see megatron_taper/inference/hf.py. CKPT may also be a run folder or a
folder written by the default mode. --from hf: a Llama folder (safetensors) becomes a run folder
with config.yaml and checkpoints/step-0 that `python -m megatron_taper.train --config
runs/Y/config.yaml` continues from; key=value overrides apply to that config (e.g. model.seq_len,
data.path). Both print one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from megatron_taper.checkpoint.checkpointer import (
    CheckpointError,
    checkpoint_root,
    list_checkpoints,
    load_logical,
    verify_checkpoint,
)
from megatron_taper.checkpoint.files import (
    CheckpointReader,
    deepspeed_loads_allowlisted,
    gate_up_aliases,
    swiglu_layout,
    write_safetensors_streaming,
)
from megatron_taper.cli import OVERRIDES_HELP, parse_with_overrides
from megatron_taper.config import from_dict, save_config
from megatron_taper.models.layers import fuse_gate_up, split_gate_up

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SWIGLU_LAYOUTS = ("stored", "fused", "unfused")


def _read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, "meta.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/meta.json: unreadable checkpoint metadata ({e})") from None


def consolidated_state(path: str, source: str = "auto") -> tuple[dict[str, torch.Tensor], dict, str]:
    """(full tensors by name, checkpoint metadata, source used) of a format-1 or DeepSpeed source."""
    meta = verify_checkpoint(path)
    native = os.path.join(path, "deepspeed")
    if source == "logical":
        state, _ = load_logical(path, meta)
        return state, meta, source
    if not os.path.isdir(native):
        raise CheckpointError(f"{path}: no DeepSpeed files (deepspeed/); written with parallel.zero="
                              f"{meta['config']['parallel'].get('zero')}")
    if meta["layout"]["tp"] != 1:
        raise CheckpointError(f"{path}: DeepSpeed's zero_to_fp32 cannot merge tp={meta['layout']['tp']} shards; "
                              f"use --source logical")
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from megatron_taper.parallel.dp.zero_deepspeed import NATIVE_TAG

    with deepspeed_loads_allowlisted():  # zero_to_fp32 unpickles with weights_only=False: allow-listed here
        state = get_fp32_state_dict_from_zero_checkpoint(native, tag=NATIVE_TAG)
    return dict(state), meta, source


def checkpoint_folder(path: str) -> str:
    """`path` itself when it holds meta.json, else the newest complete checkpoint of the run folder `path`."""
    if os.path.isfile(os.path.join(path, "meta.json")):
        return path
    found = list_checkpoints(checkpoint_root(path))
    if not found:
        raise CheckpointError(f"{path}: neither a checkpoint folder (meta.json) nor a run folder with complete "
                              f"checkpoints (checkpoints/step-N)")
    return found[-1][1]


def convert(path: str, output: str, source: str = "auto", dtype: str = "fp32", swiglu: str = "stored") -> dict:
    if source not in ("auto", "logical", "deepspeed"):
        raise ValueError(f"--source={source!r} is not one of: auto, logical, deepspeed")
    if swiglu not in SWIGLU_LAYOUTS:
        raise ValueError(f"--swiglu={swiglu!r} is not one of: {', '.join(SWIGLU_LAYOUTS)}")
    path = checkpoint_folder(path)
    meta = _read_meta(path)
    sharded = meta.get("format", 1) >= 2
    has_logical = sharded or any(n.startswith("model-pp") for n in meta["files"])
    used = ("logical" if has_logical else "deepspeed") if source == "auto" else source
    if used == "logical" and not has_logical:
        raise CheckpointError(f"{path}: no logical model files (model-pp*.pt); try --source deepspeed")
    os.makedirs(output, exist_ok=True)
    target = os.path.join(output, "model.safetensors")
    out_dtype = DTYPES[dtype]
    name = str(out_dtype).removeprefix("torch.")
    cfg = from_dict(meta["config"], source=os.path.join(path, "meta.json"))
    if used == "logical" and sharded:
        reader = CheckpointReader(path, meta["tensors"], meta["files"])
        if swiglu == "stored":
            keys = [k for k in reader.keys("model/") if k not in reader.aliases]
        else:
            keys = swiglu_layout(reader.keys("model/"), fused=swiglu == "fused")
        shapes = {k[len("model/"):]: (tuple(reader.index[k]["shape"]), name) for k in keys}
        tensors = ((k[len("model/"):], reader.read(k, (0,) * len(reader.index[k]["shape"]),
                                                   tuple(reader.index[k]["shape"])).to(out_dtype))
                   for k in sorted(keys))
    else:
        state, meta, used = consolidated_state(path, used)
        if swiglu != "stored":
            state = _swiglu_state(state, fused=swiglu == "fused")
        shapes = {k: (tuple(v.shape), name) for k, v in state.items()}
        tensors = ((k, state[k].detach().to(out_dtype)) for k in sorted(state))
    write_safetensors_streaming(target + ".tmp", shapes, tensors,
                                {"format": "pt", "step": str(meta["step"]), "source": used})
    os.replace(target + ".tmp", target)
    if swiglu != "stored":
        cfg.model.fused_swiglu = swiglu == "fused"
    save_config(cfg, os.path.join(output, "config.yaml"))
    return {"path": target, "tensors": len(shapes), "parameters": sum(_numel(s) for s, _ in shapes.values()),
            "step": meta["step"], "source": used}


def _swiglu_state(state: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """`state` with SwiGLU's gate and up weights in one layout (checkpoint/files.py aliases)."""
    index = {f"model/{k}": {"shape": list(v.shape)} for k, v in state.items()}
    aliases = gate_up_aliases(index)
    out = {}
    for key in swiglu_layout([*index, *aliases], fused):
        name = key[len("model/"):]
        if key in index:
            out[name] = state[name]
            continue
        kind, *stored, _ = aliases[key]
        tensors = [state[k[len("model/"):]] for k in stored]
        out[name] = fuse_gate_up(*tensors) if kind == "fused" else split_gate_up(tensors[0])[kind == "up"]
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                     epilog=f"--from hf: {OVERRIDES_HELP.split('; see')[0]}, of the run config "
                                            f"(python -m megatron_taper.train --list-keys lists the keys)")
    parser.add_argument("checkpoint", help="a checkpoint folder (run.dir/checkpoints/step-N) or a run folder (its "
                                           "newest); with --from hf, a Hugging Face Llama folder")
    parser.add_argument("--output", required=True, help="folder to write")
    parser.add_argument("--to", default="safetensors", choices=("safetensors", "hf"),
                        help="safetensors: model.safetensors + config.yaml (default); hf: a transformers folder")
    parser.add_argument("--from", dest="source_format", default="checkpoint", choices=("checkpoint", "hf"),
                        help="hf: import a Hugging Face Llama folder into a run folder")
    parser.add_argument("--source", default="auto", choices=("auto", "logical", "deepspeed"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--swiglu", default="stored", choices=SWIGLU_LAYOUTS,
                        help="default mode: SwiGLU's gate/up weights as stored, or fused (mlp.w13) or unfused "
                             "(mlp.w1, mlp.w3); config.yaml's model.fused_swiglu follows")
    parser.add_argument("--tokenizer", default="", help="--to hf: sentencepiece model to include")
    parser.add_argument("--config", default=None, help="--from hf: recipe for the non-model sections")
    args, overrides = parse_with_overrides(parser, argv)
    try:
        if overrides and args.source_format != "hf":
            raise ValueError(f"key=value overrides ({overrides[0]!r}) only apply with --from hf")
        if args.source_format == "hf":
            if args.to == "hf":
                raise ValueError("--from hf and --to hf together: nothing to convert")
            from megatron_taper.inference.hf import import_hf

            info = import_hf(args.checkpoint, args.output, args.config, overrides)
        elif args.to == "hf":
            from megatron_taper.inference.hf import export_hf

            info = export_hf(args.checkpoint, args.output, args.dtype, args.tokenizer)
        else:
            info = convert(args.checkpoint, args.output, args.source, args.dtype, args.swiglu)
        print(json.dumps(info))
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
