"""A Llama model whose layers have their own MLP widths (a depth-tapered megatron_taper model).

This file is copied into every folder that `tools/convert_checkpoint.py --to hf` writes for a
tapered model and is loaded by transformers with `trust_remote_code=True`:

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

It imports only torch and transformers. `TaperedLlamaConfig` is a LlamaConfig with one more field,
`intermediate_sizes` (one MLP width per layer; `intermediate_size` keeps the uniform width that
the budget is defined by). `TaperedLlamaForCausalLM` builds transformers' LlamaForCausalLM and
gives layer i a LlamaMLP of width intermediate_sizes[i]; attention, norms, RoPE, the KV cache and
generation are transformers' own Llama code. Tested with transformers 4.57.
"""
import copy

from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaMLP


class TaperedLlamaConfig(LlamaConfig):
    model_type = "tapered_llama"

    def __init__(self, intermediate_sizes=None, **kwargs):
        super().__init__(**kwargs)
        sizes = list(intermediate_sizes or [self.intermediate_size] * self.num_hidden_layers)
        if len(sizes) != self.num_hidden_layers:
            raise ValueError(f"intermediate_sizes has {len(sizes)} widths for {self.num_hidden_layers} layers")
        self.intermediate_sizes = [int(w) for w in sizes]


class TaperedLlamaForCausalLM(LlamaForCausalLM):
    config_class = TaperedLlamaConfig

    def __init__(self, config):
        super().__init__(config)
        for layer, width in zip(self.model.layers, config.intermediate_sizes):
            if width != config.intermediate_size:
                layer_config = copy.copy(config)
                layer_config.intermediate_size = width
                layer.mlp = LlamaMLP(layer_config)
        self.post_init()
