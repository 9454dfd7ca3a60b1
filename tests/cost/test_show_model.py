"""tools/show_model.py: the --json contract (as a script, in its own process), the text table and
one bad input (in this process, through the tool's main)."""
import json
import subprocess
import sys

from megatron_taper_tools import show_model

from tests.helpers.runner import REPO


def test_tapered_and_uniform_twin_report_equal_totals(capsys):
    out = subprocess.run([sys.executable, "tools/show_model.py", "--config", "configs/tiny_taper.yaml", "--json"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["widths"] == [576, 480, 288, 192]
    assert info["total_params"] == info["uniform_total_params"]
    assert info["total_flops"] == info["uniform_total_flops"]
    assert len(info["layer_params"]) == len(info["layer_flops"]) == 4
    assert info["layer_flops"][0] > info["layer_flops"][-1]
    assert show_model.main(["--config", str(REPO / "configs/tiny_taper.yaml"), "model.taper.schedule=linear"]) == 0
    assert "uniform twin" in capsys.readouterr().out


def test_bad_override_is_one_line_error(capsys):
    assert show_model.main(["--config", str(REPO / "configs/tiny_taper.yaml"), "model.taper.start=3"]) == 2
    assert capsys.readouterr().err.startswith("error: model.taper.start=3.0 is outside")
