import json
import subprocess
import sys

from tests.helpers.runner import REPO


def show(*args):
    out = subprocess.run([sys.executable, "tools/show_model.py", *args], cwd=REPO, capture_output=True, text=True)
    return out


def test_tapered_and_uniform_twin_report_equal_totals():
    out = show("--config", "configs/tiny_taper.yaml", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["widths"] == [576, 480, 288, 192]
    assert info["total_params"] == info["uniform_total_params"]
    assert info["total_flops"] == info["uniform_total_flops"]
    assert len(info["layer_params"]) == len(info["layer_flops"]) == 4
    assert info["layer_flops"][0] > info["layer_flops"][-1]
    text = show("--config", "configs/tiny_taper.yaml", "model.taper.schedule=linear")
    assert text.returncode == 0 and "uniform twin" in text.stdout


def test_bad_override_is_one_line_error():
    out = show("--config", "configs/tiny_taper.yaml", "model.taper.start=3")
    assert out.returncode == 2 and out.stderr.startswith("error: model.taper.start=3.0 is outside")
