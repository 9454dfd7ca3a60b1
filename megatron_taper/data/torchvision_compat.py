"""The one way this project imports mosaicml-streaming.

Two things about `import streaming` (0.13.0):
- Its package __init__ imports every dataset family (streaming.text's C4 tokenizer and
  streaming.base.dataloader import transformers: ~2 s of CPU in every process that reads shards)
  though this project uses only streaming.base's writers, readers, streams, hashing and
  downloaders. `import_streaming` registers `streaming` and `streaming.base` without running their
  __init__s; the submodules the project imports (`from streaming.base.format import MDSWriter`) load
  as usual, and the first read of a name the package's __init__ defines (`streaming.StreamingDataset`,
  `streaming.text`, ...) runs that __init__ then, so the package behaves as a plain import would.
- It imports `streaming.vision`, which imports torchvision. The PyPI torchvision wheel does not load
  beside the CPU torch wheel ("operator torchvision::nms does not exist"), and installing a
  matching one would replace torch. This project never uses `streaming.vision`, so when (and only
  when) the real torchvision cannot be imported, a stand-in with the two names `streaming.vision`
  imports is registered in `sys.modules` before importing streaming. Any use of the stand-in
  raises, so nothing silently computes with it.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

STANDIN_VERSION = "0.0.0+megatron_taper_standin"
_STANDIN_MODULES = ("torchvision", "torchvision.datasets", "torchvision.transforms",
                    "torchvision.transforms.functional")


def import_streaming() -> types.ModuleType:
    """Return the `streaming` package, its and streaming.base's __init__ deferred (module doc), with
    the torchvision stand-in if needed. Import what you use from its submodules."""
    if "streaming" not in sys.modules:
        if importlib.util.find_spec("streaming") is None:
            raise ValueError(
                "data: MDS shards need mosaicml-streaming, which is not installed; run `bash launch/install.sh` "
                "(it installs mosaicml-streaming==0.13.0 with --no-deps plus launch/requirements-lean.txt, "
                "because its declared dependencies would replace torch), or use data.path=<tokens>.npy"
            )
        ensure_torchvision()
        _register_deferred("streaming")
        _register_deferred("streaming.base")
    return sys.modules["streaming"]


def _register_deferred(name: str) -> None:
    """Put package `name` in sys.modules with its __path__ but without running its __init__, which
    runs (once) when a name it would define is first read."""
    spec = importlib.util.find_spec(name)
    module = importlib.util.module_from_spec(spec)

    def complete(attribute: str) -> object:
        del module.__dict__["__getattr__"]
        spec.loader.exec_module(module)
        return getattr(module, attribute)

    module.__getattr__ = complete
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def ensure_torchvision() -> bool:
    """Make `import torchvision` succeed; True when the real one is used, False for the stand-in."""
    current = sys.modules.get("torchvision")
    if current is not None:
        return not is_standin(current)
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # ImportError, or RuntimeError from a wheel built for another torch
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
    sys.modules.update(_build_standin())
    return False


def is_standin(module: types.ModuleType) -> bool:
    return getattr(module, "__version__", None) == STANDIN_VERSION


class _UnavailableVisionDataset:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("torchvision is not importable here (megatron_taper stand-in); "
                           "vision datasets of mosaicml-streaming are unavailable")


def _unavailable_to_tensor(*args: object, **kwargs: object) -> None:
    raise RuntimeError("torchvision is not importable here (megatron_taper stand-in); "
                       "to_tensor is unavailable")


def _build_standin() -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in _STANDIN_MODULES}
    root, datasets = modules["torchvision"], modules["torchvision.datasets"]
    transforms, functional = modules["torchvision.transforms"], modules["torchvision.transforms.functional"]
    datasets.VisionDataset = _UnavailableVisionDataset
    functional.to_tensor = _unavailable_to_tensor
    root.datasets, root.transforms, transforms.functional = datasets, transforms, functional
    root.__version__ = STANDIN_VERSION
    for name, module in modules.items():
        # transformers probes importlib.util.find_spec("torchvision"), which needs a __spec__.
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return modules
