"""Typed run configuration: one small dataclass per section, YAML recipes, key=value overrides.

A config is built as: dataclass defaults <- YAML recipe <- command-line overrides, then validated.
Every user error is a `ConfigError` (a ValueError) that names the offending dotted key.

The ground floor of the package: it imports no torch and no model, parallel or data code (the
model families' option sections come from their torch-free cards, megatron_taper/models/cards.py),
so `--print-config`, `--list-keys` and config errors are fast (tests/config/test_layering.py).
"""
from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_taper.models import cards, family_card
from megatron_taper.recipe import apply_key_value, dataclass_keys, merge_mapping, read_recipe
from megatron_taper.taper import MoEConfig, TaperConfig
from megatron_taper.validation import ConfigError, check_choice, check_range

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "DeepSpeedConfig", "FaultConfig", "MoEConfig",
           "ModelConfig", "ParallelConfig", "RunConfig", "TaperConfig", "TrainConfig", "WandbConfig", "load_config"]


FUSED_SWIGLU_ARCHS = ("transformer", "gated_attention")  # families whose blocks build SwiGLU(fused=...)
MOE_ARCHS = ("transformer", "gated_attention")  # families whose blocks take a mixture of experts (models/moe.py)


@dataclass
class _ModelOptions:
    """model: the options every family shares; ModelConfig below adds one section per family."""

    arch: str = "transformer"
    n_layers: int = 12
    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int = 0  # 0 = same as n_heads; fewer gives grouped-query attention
    mlp_width: int = 2048  # the uniform SwiGLU width that defines the budget
    vocab_size: int = 32000
    seq_len: int = 1024
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    # rope | alibi (attention families) | none (the tree); "" = the family's default (its first)
    position: str = ""
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # SwiGLU's gate and up projections as one [2W, D] weight, one GEMM (models/layers.py SwiGLU); the
    # same function and initial values, another parameter layout: checkpoints read in either layout
    # (checkpoint/files.py), so it is no architecture key. Transformer and gated_attention only
    fused_swiglu: bool = False
    taper: TaperConfig = field(default_factory=TaperConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def architecture_dict(self) -> dict[str, Any]:
        """The keys that shape this architecture: the other families' sections and the parameter
        layout (fused_swiglu) are left out."""
        registered = cards()
        others = {c.section for c in registered.values() if c.section and c.name != self.arch}
        others -= set(registered[self.arch].reads_sections) if self.arch in registered else set()
        others.add("fused_swiglu")
        if not self.moe.enabled:  # a dense model's architecture reads as it did before model.moe existed
            others.add("moe")
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in others}

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def position_encoding(self) -> str:
        """model.position, or the family's default when it is empty."""
        return self.position or family_card(self.arch).positions[0]

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def validate(self, prefix: str) -> None:
        family_card(self.arch)
        for key in ("n_layers", "d_model", "n_heads", "mlp_width", "vocab_size", "seq_len"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.n_kv_heads", self.n_kv_heads, 0, None)
        if self.d_model % self.n_heads:
            raise ConfigError(f"{prefix}.n_heads={self.n_heads} must divide {prefix}.d_model={self.d_model}")
        allowed = family_card(self.arch).positions
        if self.position and self.position not in allowed:
            raise ConfigError(f"{prefix}.position={self.position!r}: model.arch={self.arch!r} supports "
                              f"{' | '.join(allowed)} (or empty for {allowed[0]})")
        if self.position_encoding == "rope" and self.head_dim % 2:
            raise ConfigError(f"{prefix}.d_model / {prefix}.n_heads = {self.head_dim} must be even "
                              f"(RoPE rotates pairs)")
        if self.n_heads % self.kv_heads:
            raise ConfigError(f"{prefix}.n_kv_heads={self.n_kv_heads} must divide {prefix}.n_heads={self.n_heads}")
        check_range(f"{prefix}.init_std", self.init_std, 0.0, None, open_low=True)
        check_range(f"{prefix}.norm_eps", self.norm_eps, 0.0, None, open_low=True)
        self.taper.validate(f"{prefix}.taper")
        if self.fused_swiglu and self.arch not in FUSED_SWIGLU_ARCHS:
            raise ConfigError(f"{prefix}.fused_swiglu=true: model.arch={self.arch!r} keeps its MLP unfused (fused: "
                              f"{', '.join(FUSED_SWIGLU_ARCHS)}); use {prefix}.fused_swiglu=false")
        self.moe.validate(f"{prefix}.moe")
        if self.moe.enabled:
            if self.arch not in MOE_ARCHS:
                raise ConfigError(f"{prefix}.moe.experts={self.moe.experts}: model.arch={self.arch!r} keeps a "
                                  f"dense MLP (mixture of experts: {', '.join(MOE_ARCHS)}); use {prefix}.moe.experts=0")
            if self.moe.first_dense >= self.n_layers:
                raise ConfigError(f"{prefix}.moe.first_dense={self.moe.first_dense} leaves no MoE layer of "
                                  f"{prefix}.n_layers={self.n_layers}; lower it or set {prefix}.moe.experts=0")
            if self.fused_swiglu:
                raise ConfigError(f"{prefix}.fused_swiglu=true with {prefix}.moe: the experts keep separate gate "
                                  f"and up weights; use {prefix}.fused_swiglu=false")
        for card in cards().values():
            if card.section:
                getattr(self, card.section).validate(f"{prefix}.{card.section}")


# model.<section> for every registered family that has options (models/cards.py defines the built-in ones)
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [(c.section, c.options, field(default_factory=c.options)) for c in cards().values() if c.section],
    bases=(_ModelOptions,), namespace={"__module__": __name__},
)


@dataclass
class DeepSpeedConfig:
    """Options of parallel.zero=deepspeed (ZeRO stage 3), passed through to DeepSpeed's config."""

    offload_optimizer: str = "none"  # none | cpu | nvme: where AdamW state and fp32 masters live
    offload_param: str = "none"  # none | cpu | nvme: where partitioned parameters rest
    nvme_path: str = ""  # folder for nvme offload
    reduce_bucket_size: int = 50_000_000  # elements per gradient reduce-scatter bucket
    prefetch_bucket_size: int = 50_000_000  # elements of parameters all-gathered ahead
    param_persistence_threshold: int = 100_000  # parameters smaller than this stay unpartitioned
    config: str = ""  # JSON file merged over the generated DeepSpeed config (anything else)

    def validate(self, prefix: str) -> None:
        for key in ("offload_optimizer", "offload_param"):
            check_choice(f"{prefix}.{key}", getattr(self, key), ("none", "cpu", "nvme"))
            if getattr(self, key) == "nvme" and not self.nvme_path:
                raise ConfigError(f"{prefix}.{key}=nvme needs {prefix}.nvme_path (a folder on a local NVMe disk)")
        for key in ("reduce_bucket_size", "prefetch_bucket_size"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.param_persistence_threshold", self.param_persistence_threshold, 0, None)
        if self.config and not os.path.isfile(self.config):
            raise ConfigError(f"{prefix}.config={self.config!r}: file not found")


CP_ATTENTIONS = ("allgather", "ring", "ulysses")  # parallel.cp_attention (parallel/cp/split.py, ulysses.py)
PP_BALANCE_MODES = ("flops", "uniform", "params", "profile")  # parallel.pp_balance (cost/partition.py)
# parallel.pp_schedule (parallel/pp/schedule.py); the zero-bubble ones split backward into input and
# weight gradients; zbv and dualpipev place 2 chunks per rank in a V (rank r: chunks r, 2 pp - 1 - r)
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "interleaved_zero_bubble")  # pp_virtual chunks, looped
V_SCHEDULES = ("zbv", "dualpipev")  # 2 chunks per rank, V-shaped
FLOAT8_RECIPES = ("tensorwise", "rowwise", "mxfp8")  # train.float8_recipe (parallel/float8.py)
ZERO_BUBBLE_SCHEDULES = ("interleaved_zero_bubble", *V_SCHEDULES)
EP_IMBALANCE = 1.25  # parallel.ep_imbalance's default (docs/moe.md "Planning": measured on the tiny MoE recipe)


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    # context parallelism: each sequence split over this many ranks (parallel/cp/split.py)
    cp: int = 1
    # how attention sees the whole sequence under cp: allgather (each rank gathers K and V of the whole
    # sequence) | ring (K and V blocks passed around the cp ranks) | ulysses (all-to-all from
    # sequence-sharded to head-sharded: each rank attends over the whole sequence for heads / cp of its
    # heads, then all-to-all back; parallel/cp/ulysses.py). Families whose cp also passes a state
    # between slices (parallel/cp/state.py) keep that exchange, except the per-head memories (Titans
    # MAG / MAL, Memory Caching), which scan the whole sequence for their heads; under ulysses the
    # query heads per tp rank must divide by cp (kv heads are repeated up to a multiple of cp)
    cp_attention: str = "allgather"
    zero: str = "none"  # none | fsdp2 | deepspeed
    # expert parallelism (model.moe, parallel/ep.py): each MoE layer's experts split over this many
    # ranks of the dp group (a divisor of dp; copied over the dp / ep groups), tokens sent to them and
    # back by all-to-all; with zero=none or fsdp2, pp and tp (cost/preflight.py check_moe_layout)
    ep: int = 1
    # what the planner and memory model assume at ep > 1: the rows the busiest ep rank's experts
    # compute over the mean (expert load max / mean); it scales that rank's expert GEMMs, their
    # activations and the all-to-all's time. Default: measured, docs/moe.md "Planning"
    ep_imbalance: float = EP_IMBALANCE
    pp_balance: str = "flops"  # flops | uniform | params | profile
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved_1f1b | interleaved_zero_bubble | zbv | dualpipev
    microbatches: int = 0  # 0 = gradient accumulation steps (pp > 1: at least pp)
    pp_virtual: int = 2  # chunks per pp rank with the interleaved schedules (zbv, dualpipev: always 2)
    pp_memory_gb: float = 0.0  # per-stage limit on the predicted peak (cost/memory.py); 0 = none
    sequence_parallel: bool = False
    # zero=fsdp2, HSDP (parallel/context.py): the dp ranks form a dp_replicate x dp_shard mesh; the
    # state is sharded over dp_shard and replicated over dp_replicate; dp_shard=0 = dp / dp_replicate
    dp_replicate: int = 1
    dp_shard: int = 0
    # zero=none, dp > 1: gradient all-reduce bucket size (torch DDP); 0 = scaled with the model and
    # dp (parallel/dp/ddp.py bucket_mb)
    ddp_bucket_mb: float = 0.0
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    # manual | auto: at start the layout planner (megatron_taper/cost/plan.py) sets tp, pp, schedule, zero, ep,
    # sequence_parallel, train.micro_batch, activation checkpointing and float8 to the fastest
    # predicted layout that fits the device memory per rank (layout_memory_gb GiB when > 0);
    # layout_profile: a file of this cluster's measured device numbers over cost/devices.json's
    # (cost/devices.py profiles; benchmarks/cpu_profile.py --write makes the CPU's)
    layout: str = "manual"
    layout_memory_gb: float = 0.0
    layout_profile: str = ""

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.layout", self.layout, ("manual", "auto"))
        check_range(f"{prefix}.layout_memory_gb", self.layout_memory_gb, 0.0, None)
        check_range(f"{prefix}.tp", self.tp, 1, None)
        check_range(f"{prefix}.pp", self.pp, 1, None)
        check_range(f"{prefix}.cp", self.cp, 1, None)
        check_range(f"{prefix}.ep", self.ep, 1, None)
        check_range(f"{prefix}.ep_imbalance", self.ep_imbalance, 1.0, None)
        check_range(f"{prefix}.microbatches", self.microbatches, 0, None)
        check_range(f"{prefix}.pp_virtual", self.pp_virtual, 1, None)
        check_range(f"{prefix}.pp_memory_gb", self.pp_memory_gb, 0.0, None)
        check_range(f"{prefix}.ddp_bucket_mb", self.ddp_bucket_mb, 0.0, None)
        check_range(f"{prefix}.dp_replicate", self.dp_replicate, 1, None)
        check_range(f"{prefix}.dp_shard", self.dp_shard, 0, None)
        check_choice(f"{prefix}.zero", self.zero, ("none", "fsdp2", "deepspeed"))
        check_choice(f"{prefix}.cp_attention", self.cp_attention, CP_ATTENTIONS)
        check_choice(f"{prefix}.pp_balance", self.pp_balance, PP_BALANCE_MODES)
        check_choice(f"{prefix}.pp_schedule", self.pp_schedule, PP_SCHEDULES)
        self.deepspeed.validate(f"{prefix}.deepspeed")

    def dp_split(self, dp: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) of a data-parallel size `dp` (cost/preflight.py checks that their
        product is dp)."""
        return self.dp_replicate, self.dp_shard or max(1, dp // self.dp_replicate)

    @property
    def virtual_stages(self) -> int:
        """Pipeline chunks per pp rank (pp_virtual under the interleaved schedules, 2 under the V
        ones, else 1)."""
        if self.pp_schedule in V_SCHEDULES:
            return 2
        return self.pp_virtual if self.pp_schedule in INTERLEAVED_SCHEDULES else 1


@dataclass
class TrainConfig:
    steps: int = 1000
    global_batch: int = 8  # sequences per optimizer step, over all data-parallel ranks
    micro_batch: int = 8  # sequences per forward pass on one rank
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 = off
    seed: int = 1234
    precision: str = "auto"  # auto (bf16 autocast on CUDA with bf16, else fp32) | fp32 | bf16
    device: str = "auto"  # auto | cpu | cuda
    exit_after: int = 0  # stop with a checkpoint after this many steps of this process; 0 = never
    log_interval: int = 10
    eval_interval: int = 0  # 0 = only at the end (when eval data exists)
    eval_batches: int = 8
    max_nonfinite: int = 5  # stop after this many non-finite steps in a row
    # recompute activations in backward: none | full (every block keeps only its input) |
    # selective (blocks whose global index is a multiple of ac_every; the others keep everything) |
    # op (every block keeps its input and its matmul and attention outputs, recomputes the rest)
    activation_checkpointing: str = "none"
    ac_every: int = 2
    # tokens per chunk of the cross entropy (parallel/loss.py): at most this many tokens' logits
    # in fp32 at once; 0 = the whole micro-batch at once (fp32 copies of all its logits)
    loss_chunk: int = 0
    # torch.compile each block, static shapes (parallel/block_options.py): auto | true | false; auto = on
    # where the device is CUDA (compiles())
    compile: str = "auto"
    # with compile, on CUDA: replay each compiled block as CUDA graphs (inductor's cudagraph trees, what
    # torch.compile's mode="reduce-overhead" does), removing the host's per-kernel launch cost
    cuda_graphs: bool = False
    float8: bool = False  # the blocks' linears in float8 through torchao (parallel/float8.py; tp = 1)
    # torchao's float8 training recipe: tensorwise (one scale per tensor) | rowwise (one per row; scales
    # powers of 2) | mxfp8 (one e8m0 scale per 32 elements; Blackwell, compute capability 10.x, only)
    float8_recipe: str = "tensorwise"
    # a linear converts only where its in and out features are both at least this (cost/float8.py: where
    # float8 pays, from torchao's table and our H200 runs)
    float8_min_dim: int = 4096
    peak_tflops: float = 0.0  # peak TFLOP/s of one device for MFU; 0 = look up (cost/flops.py PEAK_TFLOPS)
    # sequence-length warmup (seq_len_at): over the first seq_len_warmup_steps steps each window of
    # model.seq_len tokens is cut into windows of seq_len_warmup_start, then twice that, ... (powers of
    # two), the same tokens per step; 0 = off
    seq_len_warmup_steps: int = 0
    seq_len_warmup_start: int = 64

    def validate(self, prefix: str) -> None:
        for key in ("steps", "global_batch", "micro_batch", "log_interval", "eval_batches", "max_nonfinite"):
            check_range(f"{prefix}.{key}", getattr(self, key), 1, None)
        check_range(f"{prefix}.peak_tflops", self.peak_tflops, 0.0, None)
        for key in ("warmup_steps", "exit_after", "eval_interval", "seed", "loss_chunk", "seq_len_warmup_steps"):
            check_range(f"{prefix}.{key}", getattr(self, key), 0, None)
        check_range(f"{prefix}.lr", self.lr, 0.0, None, open_low=True)
        check_range(f"{prefix}.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range(f"{prefix}.weight_decay", self.weight_decay, 0.0, None)
        check_range(f"{prefix}.beta1", self.beta1, 0.0, 1.0, open_high=True)
        check_range(f"{prefix}.beta2", self.beta2, 0.0, 1.0, open_high=True)
        check_range(f"{prefix}.grad_clip", self.grad_clip, 0.0, None)
        check_choice(f"{prefix}.precision", self.precision, ("auto", "fp32", "bf16"))
        check_choice(f"{prefix}.device", self.device, ("auto", "cpu", "cuda"))
        check_choice(f"{prefix}.activation_checkpointing", self.activation_checkpointing,
                     ("none", "full", "selective", "op"))
        check_range(f"{prefix}.ac_every", self.ac_every, 1, None)
        self.compile = _switch(f"{prefix}.compile", self.compile)
        check_choice(f"{prefix}.float8_recipe", self.float8_recipe, FLOAT8_RECIPES)
        check_range(f"{prefix}.float8_min_dim", self.float8_min_dim, 16, None)
        if self.float8 and self.compile == "false":
            raise ConfigError(f"{prefix}.float8=true needs {prefix}.compile=true or auto (eager float8 on an H200 "
                              f"ran 2.4x slower than bf16: its casts and scales are separate kernels that only "
                              f"compile fuses)")
        if self.cuda_graphs and self.compile == "false":
            raise ConfigError(f"{prefix}.cuda_graphs=true needs {prefix}.compile=true or auto (the graphs are captured "
                              f"from the compiled blocks)")
        if self.cuda_graphs and self.device == "cpu":
            raise ConfigError(f"{prefix}.cuda_graphs=true needs a CUDA device ({prefix}.device=cpu)")
        if self.global_batch % self.micro_batch:
            raise ConfigError(f"{prefix}.micro_batch={self.micro_batch} must divide "
                              f"{prefix}.global_batch={self.global_batch}")
        check_range(f"{prefix}.seq_len_warmup_start", self.seq_len_warmup_start, 1, None)

    def seq_len_lengths(self, seq_len: int) -> list[int]:
        """The window lengths of a run, shortest first: seq_len_warmup_start doubling up to `seq_len`
        (model.seq_len; preflight checks it is start x a power of two), or [seq_len] without a warmup."""
        lengths = [self.seq_len_warmup_start if self.seq_len_warmup_steps else seq_len]
        while lengths[-1] < seq_len:
            lengths.append(2 * lengths[-1])
        return lengths

    def seq_len_at(self, step: int, seq_len: int) -> int:
        """The window length of the step after `step` completed ones (a function of the step alone, so
        a resumed run trains at the lengths an uninterrupted one did): the warmup's steps in equal
        phases, one per length below `seq_len`; `seq_len` from step seq_len_warmup_steps on."""
        if step >= self.seq_len_warmup_steps:
            return seq_len
        lengths = self.seq_len_lengths(seq_len)
        return lengths[step * (len(lengths) - 1) // self.seq_len_warmup_steps]

    @property
    def compile_setting(self) -> str:
        """`compile` as auto | true | false (a program may have set a bool)."""
        return _switch("train.compile", self.compile)

    def compiles(self, device_type: str) -> bool:
        """The compile rule: `compile` true, or auto on a CUDA device (the runtime passes its device's
        type, the planner "cuda" for a GPU profile)."""
        return self.compile_setting == "true" or (self.compile_setting == "auto" and device_type == "cuda")

    def uses_bf16(self, device_has_bf16: bool) -> bool:
        """The precision rule: bf16 autocast when `precision` is bf16, or auto on a device with bf16
        matrix units (the runtime asks CUDA; the planner its device table)."""
        return self.precision == "bf16" or (self.precision == "auto" and device_has_bf16)


@dataclass
class DataConfig:
    path: str = ""  # MDS folder (with train/ and val/), a .npy token file, or "" = built-in corpus
    tokenizer: str = ""  # sentencepiece .model; "" = the one next to the data
    cache_dir: str = ""  # local cache for a remote MDS path and the built-in corpus; "" = default
    eval_fraction: float = 0.05  # token files only: tail held out for evaluation
    # weighted MDS datasets instead of path: [{path, weight, name (default: the path's last part)}]
    mix: list = field(default_factory=list)
    # serve each global batch row a stream of consecutive windows (data/order.py RowStreams) instead of
    # shuffled packed samples; on by itself for a model that carries a state (model.bridge.carry_state)
    row_streams: bool = False
    # remote MDS data: one attempt at fetching one shard (3 attempts); the training thread waits at most
    # 3 x this for a shard, then this rank stops naming it (keep it well under the 600 s collective timeout)
    download_timeout_s: float = 60.0
    # packed documents: each token attends only inside its own document (the windows' documents are
    # found from the end-of-document id the data records; data/sources.py document_end_id); the
    # attention families only, for now
    document_mask: bool = False

    MIX_KEYS = ("path", "weight", "name")

    def mix_names(self) -> list[str]:
        """The name of each data.mix entry: its `name`, else the last part of its path."""
        return [str(e.get("name") or e["path"].rstrip("/").rsplit("/", 1)[-1]) for e in self.mix]

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.eval_fraction", self.eval_fraction, 0.0, 0.5)
        check_range(f"{prefix}.download_timeout_s", self.download_timeout_s, 1.0, None)
        if self.document_mask and self.path.endswith(".npy"):
            raise ConfigError(f"{prefix}.document_mask=true needs the data's end-of-document id, which the .npy "
                              f"token file {prefix}.path={self.path!r} does not record; use an MDS folder written by "
                              f"tools/preprocess_data.py (or the built-in corpus), or {prefix}.document_mask=false")
        for i, entry in enumerate(self.mix):
            key = f"{prefix}.mix[{i}]"
            if not isinstance(entry, dict):
                raise ConfigError(f"{key} must be a mapping {{path, weight}}, got {entry!r}")
            for name in entry:
                if name not in self.MIX_KEYS:
                    close = difflib.get_close_matches(str(name), self.MIX_KEYS, n=1)
                    raise ConfigError(f"unknown key {key}.{name}" + (f"; did you mean {close[0]!r}?" if close
                                                                      else f" (keys: {', '.join(self.MIX_KEYS)})"))
            path, weight = entry.get("path"), entry.get("weight")
            if not isinstance(path, str) or not path.strip("/"):
                raise ConfigError(f"{key}.path must be the path of an MDS dataset folder, got {path!r}")
            if path.endswith(".npy"):
                raise ConfigError(f"{key}.path={path!r}: a mixture reads MDS folders only (no .npy token files)")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
                raise ConfigError(f"{key}.weight must be a number > 0, got {weight!r}")
            if "name" in entry and (not isinstance(entry["name"], str) or not entry["name"]):
                raise ConfigError(f"{key}.name must be a non-empty string, got {entry['name']!r}")
        if self.mix and self.path:
            raise ConfigError(f"{prefix}.mix and {prefix}.path={self.path!r} are exclusive: set one of them "
                              f"(a one-dataset mixture is data.mix=[{{path: ..., weight: 1}}])")
        names = self.mix_names()
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(f"{prefix}.mix[{i}]: the name {name!r} is taken by {prefix}.mix[{names.index(name)}]"
                                  f" (set `name` on one of them; a dataset used twice needs no second entry: raise "
                                  f"its weight)")


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps between checkpoints; 0 = only at the end (and on exit_after)
    keep: int = 2  # newest complete checkpoints kept; 0 = all
    keep_every: int = 0  # also kept: every checkpoint whose step is a multiple of this; 0 = none
    async_save: bool = False  # write in a background thread after copying the shards to the CPU

    def validate(self, prefix: str) -> None:
        check_range(f"{prefix}.interval", self.interval, 0, None)
        check_range(f"{prefix}.keep", self.keep, 0, None)
        check_range(f"{prefix}.keep_every", self.keep_every, 0, None)


@dataclass
class FaultConfig:
    """fault: the hang watchdog (megatron_taper/fault/watchdog.py) and the bad-step policy
    (megatron_taper/fault/rollback.py); README "Surviving faults".

    A section's timeout: its `*_timeout_s` when > 0, else auto: timeout_factor x the longest
    completed section of that kind so far, at least min_timeout_s; startup_timeout_s before one
    of that kind has completed (the first step, save and evaluation)."""

    watchdog: bool = True
    startup_timeout_s: float = 900.0  # process start to the first step: joining, building, loading
    step_timeout_s: float = 0.0  # one step (and its log line and stop vote); 0 = auto
    save_timeout_s: float = 0.0  # a checkpoint save; 0 = auto
    eval_timeout_s: float = 0.0  # an evaluation; 0 = auto
    timeout_factor: float = 20.0
    min_timeout_s: float = 120.0
    # bad steps (megatron_taper/fault/rollback.py): after rollback_after of them in a row, reload the
    # newest checkpoint from before them and skip their data (RUN/data_skips.json); 0 = never
    # (non-finite steps are skipped and train.max_nonfinite applies)
    rollback_after: int = 0
    spike_factor: float = 0.0  # a loss above this x the running mean is a spike (logged); 0 = off
    spike_rollback: bool = False  # spikes count as bad steps for rollback_after
    # per-rank readiness at log intervals (megatron_taper/fault/straggler.py): a rank that makes
    # the steps this many times slower is named; 0 = off
    straggler_factor: float = 1.2

    def validate(self, prefix: str) -> None:
        for key in ("step_timeout_s", "save_timeout_s", "eval_timeout_s"):
            check_range(f"{prefix}.{key}", getattr(self, key), 0.0, None)
        for key in ("startup_timeout_s", "min_timeout_s"):
            check_range(f"{prefix}.{key}", getattr(self, key), 0.0, None, open_low=True)
        check_range(f"{prefix}.timeout_factor", self.timeout_factor, 1.0, None)
        check_range(f"{prefix}.rollback_after", self.rollback_after, 0, None)
        if self.straggler_factor != 0:
            check_range(f"{prefix}.straggler_factor", self.straggler_factor, 1.0, None, open_low=True)
        if self.spike_factor != 0:
            check_range(f"{prefix}.spike_factor", self.spike_factor, 1.0, None, open_low=True)
        if self.spike_rollback and not (self.spike_factor and self.rollback_after):
            raise ConfigError(f"{prefix}.spike_rollback=true needs {prefix}.spike_factor > 1 and "
                              f"{prefix}.rollback_after >= 1")


@dataclass
class WandbConfig:
    """run.wandb: Weights & Biases logging from the main rank (the scalars tensorboard gets)."""

    enabled: bool = False
    project: str = "megatron_taper"
    entity: str = ""  # team or user; "" = the account's default
    name: str = ""  # run name; "" = the last part of run.dir
    group: str = ""
    mode: str = "online"  # online | offline (writes RUN/wandb/ only; `wandb sync` uploads it later)

    def validate(self, prefix: str) -> None:
        check_choice(f"{prefix}.mode", self.mode, ("online", "offline"))
        if self.enabled and importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"{prefix}.enabled=true needs the wandb package: pip install 'megatron_taper[wandb]'")


@dataclass
class RunConfig:
    dir: str = "runs/default"
    resume: str = "auto"  # auto (newest complete checkpoint, if any) | never | path of a checkpoint
    init_from: str = ""  # a fresh run starts from these weights only: checkpoint, run folder or export
    tensorboard: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def validate(self, prefix: str) -> None:
        if not self.dir:
            raise ConfigError(f"{prefix}.dir must not be empty")
        self.wandb.validate(f"{prefix}.wandb")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> "Config":
        """Each section on its own; rules across sections and the world size are in cost/preflight.py."""
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Loading, merging, overrides


def load_config(path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file (merged over its `base:` recipes, if any) <- `key=value` overrides, validated."""
    data: dict[str, Any] = {}
    files: list[str] = []
    if path:
        data, files = read_recipe(path)
    try:
        cfg = from_dict(data, source=path or "config")
    except ConfigError as e:
        if len(files) < 2:
            raise
        raise ConfigError(f"{e} (in {path} or its base recipes: {', '.join(files[1:])})") from None
    for item in overrides:
        apply_override(cfg, item)
    return cfg.validate()


def from_dict(data: dict[str, Any], source: str = "config") -> Config:
    cfg = Config()
    merge_mapping(cfg, data, source, removed=REMOVED_KEYS)
    return cfg


def apply_override(cfg: Config, item: str) -> None:
    apply_key_value(cfg, item)


def all_keys(obj: Any = None, prefix: str = "") -> list[str]:
    return dataclass_keys(Config() if obj is None else obj, prefix)


def save_config(cfg: Config, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)
    os.replace(tmp, path)


# keys of type str that take auto | true | false (a bare --key on the command line means true: cli.py)
SWITCH_KEYS = ("train.compile",)


def _switch(key: str, value: Any) -> str:
    """auto | true | false from a switch key's value: a bool (a program, an older saved config), or
    those words and YAML's other boolean words in any case (YAML's true arrives as "True")."""
    words = {"auto": "auto", "true": "true", "yes": "true", "1": "true", "false": "false", "no": "false", "0": "false"}
    word = words.get(str(value).lower())
    if word is None:
        raise ConfigError(f"{key} must be auto, true or false, got {value!r}")
    return word


# keys that existed once: a saved config (a checkpoint's meta.json, an old run's config.yaml)
# that still has them loads with a warning instead of "unknown key"
REMOVED_KEYS = {
    "data.num_workers": "batches are packed in the training process (measured: ~1% of a step)",
}
