"""Reading trained weights outside the Trainer: checkpoint folders, whole models, tokenizers.

`open_checkpoint(path)` accepts what the tools take as `--checkpoint`:
    a checkpoint folder      run.dir/checkpoints/step-N (meta.json; format 2 shards or format 1 files)
    a run folder             run.dir: its newest complete checkpoint
    an exported folder       model.safetensors + config.yaml (tools/convert_checkpoint.py)
and gives a `CheckpointRef`: the run's config (validated), the step and random access to the full
(logical) tensors by parameter name. Format-2 tensors are assembled from their records (each
record's sha256 checked as it is read); only `model/` keys are read, never the optimizer state.

`save_exported(model, cfg, folder)` writes a model built in Python as an exported folder.
`load_model(ref)` builds the family's single-device model (models/) on the meta device and assigns
the checkpoint's tensors to it: peak host memory is about one model. `load_parallel_weights`
fills a model already built and parallelised by build.py (any pp/dp/tp layout, zero none or fsdp2)
with this rank's pieces only.

`load_tokenizer(cfg, ...)` finds the run's tokenizer: an explicit path, `data.tokenizer`, a
`tokenizer.model` in the checkpoint folder, or the one beside the data (`data.path/tokenizer.model`,
the built-in corpus's cache folder); a run trained on a `.npy` array with vocab 256 gets
`ByteTokenizer` (UTF-8 bytes as ids).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from megatron_taper.checkpoint.checkpointer import CheckpointError, checkpoint_root, list_checkpoints, load_logical
from megatron_taper.checkpoint.files import CheckpointReader, swiglu_layout
from megatron_taper.config import Config, ConfigError, from_dict, load_config
from megatron_taper.data import is_remote
from megatron_taper.models import build_model

if TYPE_CHECKING:
    from megatron_taper.data.tokenizer import Tokenizer
    from megatron_taper.parallel.model import ParallelModel

EXPORTED_WEIGHTS = "model.safetensors"
EXPORTED_CONFIG = "config.yaml"
TOKENIZER_FILE = "tokenizer.model"


@dataclass
class CheckpointRef:
    """A readable set of trained weights and the config of the run that wrote them."""

    path: str  # the folder the tensors are read from
    kind: str  # sharded (format 2) | logical (format 1) | exported (model.safetensors + config.yaml)
    config: Config
    step: int
    meta: dict | None = None  # meta.json of sharded / logical checkpoints
    _reader: CheckpointReader | None = field(default=None, repr=False)
    _state: dict[str, torch.Tensor] | None = field(default=None, repr=False)

    def names(self) -> list[str]:
        """Parameter names, sorted."""
        if self.kind == "sharded":  # SwiGLU's gate and up unfused (checkpoint/files.py), as exports name them
            return sorted(k[len("model/"):] for k in swiglu_layout(self.reader().keys("model/"), fused=False))
        if self.kind == "exported":
            from safetensors import safe_open

            with safe_open(self._exported_file(), "pt") as f:
                return sorted(f.keys())
        return sorted(self._logical_state())

    def shape(self, name: str) -> tuple[int, ...]:
        if self.kind == "sharded":
            return tuple(self._entry(name)["shape"])
        if self.kind == "exported":
            from safetensors import safe_open

            with safe_open(self._exported_file(), "pt") as f:
                return tuple(f.get_slice(name).get_shape())
        return tuple(self._logical_state()[name].shape)

    def tensor(self, name: str) -> torch.Tensor:
        """The full logical tensor of parameter `name` (CPU, the dtype it was saved in)."""
        if self.kind == "sharded":
            shape = tuple(self._entry(name)["shape"])
            return self.reader().read(f"model/{name}", (0,) * len(shape), shape)
        if self.kind == "exported":
            from safetensors import safe_open

            with safe_open(self._exported_file(), "pt") as f:
                if name not in f.keys():
                    raise CheckpointError(f"{self._exported_file()}: no tensor {name!r}")
                return f.get_tensor(name)
        state = self._logical_state()
        if name not in state:
            raise CheckpointError(f"{self.path}: no tensor for parameter {name!r}")
        return state[name]

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) for every parameter, one tensor read at a time (format 2)."""
        for name in self.names():
            yield name, self.tensor(name)

    def reader(self) -> CheckpointReader:
        assert self.kind == "sharded"
        if self._reader is None:
            self._reader = CheckpointReader(self.path, self.meta["tensors"], self.meta["files"])
        return self._reader

    def _entry(self, name: str) -> dict:
        entry = self.reader().index.get(f"model/{name}")  # stored, or the other SwiGLU layout's
        if entry is None:
            raise CheckpointError(f"{self.path}: no tensor for parameter {name!r}")
        return entry

    def _exported_file(self) -> str:
        return os.path.join(self.path, EXPORTED_WEIGHTS)

    def _logical_state(self) -> dict[str, torch.Tensor]:
        if self._state is None:
            from megatron_taper.checkpoint.checkpointer import verify_checkpoint

            verify_checkpoint(self.path)
            self._state, _ = load_logical(self.path, self.meta)
        return self._state


def open_checkpoint(path: str, flag: str = "--checkpoint") -> CheckpointRef:
    """The checkpoint that `path` names (see the module doc); CheckpointError naming `flag` else."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path}: no such folder")
    if os.path.isfile(os.path.join(path, "meta.json")):
        return _open_meta(path)
    found = list_checkpoints(checkpoint_root(path))
    if found:
        return _open_meta(found[-1][1])
    if os.path.isfile(os.path.join(path, EXPORTED_WEIGHTS)) and os.path.isfile(os.path.join(path, EXPORTED_CONFIG)):
        return _open_exported(path)
    raise CheckpointError(f"{flag} {path}: neither a checkpoint (meta.json), a run folder with complete "
                          f"checkpoints (checkpoints/step-N) nor an exported folder ({EXPORTED_WEIGHTS} + "
                          f"{EXPORTED_CONFIG})")


def _open_meta(path: str) -> CheckpointRef:
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({e})") from None
    cfg = _validated(lambda: from_dict(meta["config"], source=meta_path), meta_path)
    kind = "sharded" if meta.get("format", 1) >= 2 else "logical"
    return CheckpointRef(path, kind, cfg, int(meta["step"]), meta)


def _open_exported(path: str) -> CheckpointRef:
    from safetensors import safe_open

    config_path = os.path.join(path, EXPORTED_CONFIG)
    cfg = _validated(lambda: load_config(config_path), config_path)
    weights = os.path.join(path, EXPORTED_WEIGHTS)
    try:
        with safe_open(weights, "pt") as f:
            step = int((f.metadata() or {}).get("step", 0))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{weights}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    return CheckpointRef(path, "exported", cfg, step)


def _validated(make, where: str) -> Config:
    try:
        return make().validate()
    except ConfigError as e:
        raise CheckpointError(f"{where}: the saved run config is not valid here: {e}") from None


# -- whole models ------------------------------------------------------------------------------


def load_model(ref: CheckpointRef, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
               ) -> nn.Module:
    """The family's single-device model with the checkpoint's weights, in eval mode."""
    with torch.device("meta"):
        model = build_model(ref.config.model)
    expected = {name: tuple(p.shape) for name, p in model.named_parameters()}
    state = {}
    for name in expected:
        tensor = ref.tensor(name)
        if tuple(tensor.shape) != expected[name]:
            raise CheckpointError(f"{ref.path}: {name} has shape {list(tensor.shape)}, the model of its config "
                                  f"expects {list(expected[name])}")
        state[name] = tensor.to(device=device, dtype=dtype)
    if next(model.buffers(), None) is not None:  # buffers cannot be assigned from meta: build it for real
        model = build_model(ref.config.model)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def save_exported(model: nn.Module, cfg: Config, folder: str, step: int = 0) -> str:
    """Write `model`'s parameters and `cfg` as an exported folder (model.safetensors +
    config.yaml, the layout tools/convert_checkpoint.py writes), which open_checkpoint reads."""
    from safetensors.torch import save_file

    from megatron_taper.config import save_config

    os.makedirs(folder, exist_ok=True)
    state = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters()}
    save_file(state, os.path.join(folder, EXPORTED_WEIGHTS), metadata={"format": "pt", "step": str(step)})
    save_config(cfg, os.path.join(folder, EXPORTED_CONFIG))
    return folder


@torch.no_grad()
def load_parallel_weights(pm: ParallelModel, ref: CheckpointRef) -> None:
    """Fill the parameters of a built (and parallelised) model with this rank's pieces of the
    checkpoint's tensors; the optimizer state is not read. No collectives."""
    from megatron_taper.parallel.model import local_part

    for name, param in pm.module.named_parameters():
        local = local_part(param.data)
        if ref.kind == "sharded":
            _, offsets, _ = pm.piece_box(name, param)
            box = ref.reader().read(f"model/{name}", offsets, tuple(local.shape))
        else:
            full = ref.tensor(name)
            box = local_part(pm.local_tensor(name, full))
        if tuple(box.shape) != tuple(local.shape):
            raise CheckpointError(f"{ref.path}: {name}: the checkpoint's piece has shape {list(box.shape)}, this "
                                  f"rank's parameter {list(local.shape)}")
        local.copy_(box.to(dtype=local.dtype))


# -- tokenizers --------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (runs trained on a .npy array of bytes); no special ids."""

    vocab_size = 256
    eos_id = None
    bos_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def tokenizer_path(cfg: Config, checkpoint_dir: str = "", override: str = "") -> str | None:
    """The sentencepiece model of a run, or None when there is none (see the module doc)."""
    from megatron_taper.data.streaming import TOKENIZER_FILE as DATA_TOKENIZER

    if override:
        return override
    if cfg.data.tokenizer:
        return cfg.data.tokenizer
    beside = os.path.join(checkpoint_dir, TOKENIZER_FILE) if checkpoint_dir else ""
    if beside and os.path.isfile(beside):
        return beside
    data = cfg.data.path
    if data.endswith(".npy") or is_remote(data):
        return None
    if not data:
        from megatron_taper.data.builtin import builtin_data_dir
        from megatron_taper.data.sources import default_cache_dir

        data = builtin_data_dir(os.path.join(default_cache_dir(cfg.data), "builtin"), cfg.model.vocab_size)
    candidate = os.path.join(data, DATA_TOKENIZER)
    return candidate if os.path.isfile(candidate) else None


def load_tokenizer(cfg: Config, checkpoint_dir: str = "", override: str = "",
                   flag: str = "--tokenizer") -> Tokenizer | ByteTokenizer:
    """The run's tokenizer (sentencepiece, or bytes for a vocab-256 run without one)."""
    from megatron_taper.data.tokenizer import Tokenizer

    path = tokenizer_path(cfg, checkpoint_dir, override)
    if path is None:
        if cfg.model.vocab_size == 256:
            return ByteTokenizer()
        raise ValueError(f"no tokenizer is known for this run (data.tokenizer is empty and none was found beside "
                         f"data.path={cfg.data.path!r}); pass {flag} PATH.model")
    if not os.path.isfile(path):
        raise ValueError(f"{flag if override else 'data.tokenizer'}: tokenizer model not found: {path}")
    tokenizer = Tokenizer(path)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids, more than model.vocab_size="
                         f"{cfg.model.vocab_size}")
    return tokenizer
