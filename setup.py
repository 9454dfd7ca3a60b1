"""Install megatron_taper: `pip install -e .[dev]` (tests), `.[deepspeed]`, `.[float8]` (torchao, for
train.float8), `.[hf]` (Hugging Face
export/import and datasets inputs: transformers, datasets), `.[data]` (MDS data and the parquet /
zstd readers: mosaicml-streaming, pyarrow, zstandard), `.[wandb]` (Weights & Biases logging, run.wandb), `.[plot]`
(matplotlib, for tools/sweep.py's plot), `.[kernels]` (triton, for the Triton kernels of
megatron_taper/models/kernels on CUDA and their tests on CPU) or `.[lmeval]` (lm-evaluation-harness;
a large dependency tree, not installed by launch/install.sh). Install extras with a constraints file pinning the
installed torch (launch/install.sh does), so that none of them replaces it.

Commands (console_scripts): megatron-taper-train and one per tool in tools/, which is installed as
the package megatron_taper_tools; the tools stay runnable as files (python tools/X.py)."""
from setuptools import find_packages, setup

setup(
    name="megatron_taper",
    version="0.1.0",
    description="Pretraining of depth-tapered language models with Megatron-style parallelism",
    packages=[*find_packages(include=["megatron_taper", "megatron_taper.*"]), "megatron_taper_tools"],
    package_dir={"megatron_taper_tools": "tools"},
    package_data={"megatron_taper.cost": ["devices.json", "speedups.json"]},  # the device table, measured ratios
    entry_points={"console_scripts": [
        "megatron-taper-train = megatron_taper.train:main",
        "megatron-taper-preprocess = megatron_taper_tools.preprocess_data:main",
        "megatron-taper-tokenizer = megatron_taper_tools.train_tokenizer:main",
        "megatron-taper-evaluate = megatron_taper_tools.evaluate:main",
        "megatron-taper-generate = megatron_taper_tools.generate:main",
        "megatron-taper-convert = megatron_taper_tools.convert_checkpoint:main",
        "megatron-taper-sweep = megatron_taper_tools.sweep:main",
        "megatron-taper-plan = megatron_taper_tools.plan_pipeline:main",
        "megatron-taper-plan-layout = megatron_taper_tools.plan_layout:main",
        "megatron-taper-show = megatron_taper_tools.show_model:main",
        "megatron-taper-lm-eval = megatron_taper.inference.lm_eval_adapter:main",
    ]},
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
        "dev": ["pytest>=8", "hypothesis>=6.100", "pytest-timeout>=2.3", "pytest-xdist>=3.5", "ruff==0.8.4"],
        "deepspeed": ["deepspeed==0.19.8"],
        "float8": ["torchao==0.18.0"],  # train.float8 (parallel/float8.py); declares no dependencies
        "hf": ["transformers>=4.40,<5", "datasets>=2.14"],
        # MDS shards (mosaicml-streaming, pinned as launch/requirements-lean.txt pins its needs) and the
        # parquet / zstd readers of tools/preprocess_data.py and tools/train_tokenizer.py
        "data": ["mosaicml-streaming==0.13.0", "pyarrow>=14", "zstandard>=0.22"],
        "wandb": ["wandb>=0.17"],
        "plot": ["matplotlib>=3.7"],
        "kernels": ["triton==3.9.0"],  # declares no dependencies; launch/install.sh installs it with --no-deps
        "lmeval": ["lm_eval>=0.4.9", "transformers>=4.40,<5"],
    },
)
