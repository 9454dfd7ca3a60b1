"""Install megatron_taper: `pip install -e .[dev]` (tests), `.[deepspeed]`, `.[hf]` (Hugging Face
export/import: transformers), `.[plot]` (matplotlib, for tools/sweep.py's plot) or `.[lmeval]`
(lm-evaluation-harness; a large dependency tree, not installed by launch/install.sh). Install
extras with a constraints file pinning the installed torch (launch/install.sh does), so that none
of them replaces it."""
from setuptools import find_packages, setup

setup(
    name="megatron_taper",
    version="0.1.0",
    description="Pretraining of depth-tapered language models with Megatron-style parallelism",
    packages=find_packages(include=["megatron_taper", "megatron_taper.*"]),
    python_requires=">=3.10",
    # torch is pinned loosely on purpose: the installed wheel (CPU or CUDA) must never be replaced.
    install_requires=[
        "torch>=2.6",
        "numpy>=1.24,<2.2",
        "pyyaml>=6.0",
        "tensorboard>=2.14",
        "sentencepiece==0.2.3",
        "tqdm>=4.60",
        "filelock>=3.12",
        "safetensors>=0.4",
    ],
    extras_require={
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "ruff==0.8.4"],
        "deepspeed": ["deepspeed==0.19.8"],
        "hf": ["transformers>=4.40,<5"],
        "plot": ["matplotlib>=3.7"],
        "lmeval": ["lm_eval>=0.4.9", "transformers>=4.40,<5"],
    },
)
