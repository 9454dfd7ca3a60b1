"""Both branches of the torchvision stand-in, each in a fresh interpreter."""
import os
import subprocess
import sys
import textwrap

from tests.helpers.runner import REPO

# Loads the module from its file, without the package (whose __init__ imports torch: seconds).
LOAD = f"""
import importlib.util
spec = importlib.util.spec_from_file_location(
    "compat", {os.path.join(REPO, "megatron_taper", "data", "torchvision_compat.py")!r})
compat = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compat)
ensure_torchvision, is_standin = compat.ensure_torchvision, compat.is_standin
"""


def _fake_torchvision(root, init_body):
    pkg = root / "torchvision"
    (pkg / "transforms").mkdir(parents=True)
    (pkg / "__init__.py").write_text(init_body)
    (pkg / "datasets.py").write_text("class VisionDataset:\n    real = True\n")
    (pkg / "transforms" / "__init__.py").write_text("")
    (pkg / "transforms" / "functional.py").write_text("def to_tensor(x):\n    return x\n")
    return str(root)


def _run(code, pythonpath=None, load=False):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (pythonpath, REPO, env.get("PYTHONPATH")) if p)
    code = textwrap.dedent(code)
    if load:  # after the test's own set-up lines (a meta-path blocker must come first)
        head, tail = code.split("# load\n")
        code = head + LOAD + tail
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_a_working_torchvision_is_used_as_is(tmp_path):
    path = _fake_torchvision(tmp_path, "__version__ = '9.9.9+working'\nfrom . import datasets, transforms\n")
    out = _run("""
        import sys
        # load
        assert ensure_torchvision() is True
        tv = sys.modules["torchvision"]
        assert tv.__version__ == "9.9.9+working" and not is_standin(tv) and tv.datasets.VisionDataset.real
        assert ensure_torchvision() is True
        print("ok")
    """, path, load=True)
    assert out.strip() == "ok"


def test_a_broken_torchvision_is_replaced_and_streaming_imports(tmp_path):
    # What the PyPI wheel does beside the CPU torch wheel.
    path = _fake_torchvision(tmp_path, "raise RuntimeError('operator torchvision::nms does not exist')\n")
    out = _run("""
        import sys, tempfile
        from megatron_taper.data.torchvision_compat import import_streaming, is_standin
        streaming = import_streaming()
        assert is_standin(sys.modules["torchvision"])
        from streaming.vision.base import VisionDataset
        try:
            VisionDataset()
        except RuntimeError as e:
            assert "stand-in" in str(e)
        else:
            raise AssertionError("the stand-in must refuse to be used")
        with tempfile.TemporaryDirectory() as d:
            with streaming.MDSWriter(out=d + "/x", columns={"t": "int"}) as w:
                w.write({"t": 1})
        assert import_streaming() is streaming
        print("ok")
    """, path)
    assert out.strip().endswith("ok")


def test_a_missing_torchvision_gets_the_standin():
    out = _run("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torchvision" or name.startswith("torchvision."):
                    raise ImportError("blocked for the test")
        sys.meta_path.insert(0, Block())
        # load
        assert ensure_torchvision() is False and is_standin(sys.modules["torchvision"])
        import importlib.util
        assert importlib.util.find_spec("torchvision") is not None  # transformers probes this
        from torchvision.transforms.functional import to_tensor
        assert "torch" not in sys.modules
        print("ok")
    """, load=True)
    assert out.strip() == "ok"


def test_streaming_imports_what_the_project_uses_without_transformers():
    """The package's and streaming.base's __init__s wait (they import transformers: ~2 s of CPU per
    process); MDS shards still write and read, and the first name only the __init__ defines runs it."""
    out = _run("""
        import sys, tempfile
        import numpy as np
        from megatron_taper.data.torchvision_compat import import_streaming
        streaming = import_streaming()
        from streaming.base.format import MDSWriter, reader_from_json
        from streaming.base.stream import Stream
        from streaming.base.storage.download import CloudDownloader
        from streaming.base.hashing import get_hash
        assert "transformers" not in sys.modules and "streaming.text" not in sys.modules
        with tempfile.TemporaryDirectory() as d:
            with MDSWriter(out=d, columns={"tokens": "ndarray:uint16"}, hashes=["xxh64"]) as w:
                w.write({"tokens": np.arange(5, dtype=np.uint16)})
            import json, os
            index = json.load(open(os.path.join(d, "index.json")))
            shard = reader_from_json(d, None, index["shards"][0])
            assert shard.get_item(0)["tokens"].tolist() == [0, 1, 2, 3, 4]
        import streaming as again
        assert again is streaming and "transformers" not in sys.modules
        assert streaming.StreamingDataset.__name__ == "StreamingDataset"  # runs the __init__ now
        assert "streaming.text" in sys.modules and streaming.base.StreamingDataLoader.__name__ == "StreamingDataLoader"
        assert streaming.MDSWriter is MDSWriter and import_streaming() is streaming
        print("ok")
    """)
    assert out.strip().endswith("ok")
