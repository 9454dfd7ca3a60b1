"""Post-training: everything that starts from a finished checkpoint. The training loop imports none of it.

load.py                     open a checkpoint or an export, build the whole model, tokenizers
evaluate.py                 held-out loss / perplexity per sequence length at any layout
generation.py               sampling, with each family's decoding state (FamilySpec.decoder)
lm_eval_adapter.py          the lm-evaluation-harness model `megatron_taper`
hf.py                       Hugging Face export / import through each family's FamilySpec.hf adapter
(models/modeling_tapered_llama.py: the modelling file that tapered Llama exports carry, trust_remote_code)
"""
