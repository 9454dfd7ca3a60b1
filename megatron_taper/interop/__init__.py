"""Interoperability with other ecosystems: Hugging Face transformers checkpoints (hf.py) and the
modelling file for depth-tapered Llama models that exports carry (modeling_tapered_llama.py)."""
