"""launch/quickstart.sh hands paths to python as arguments, never inside `python -c` code: a cache
path with a quote in it is a path, not code (it used to be pasted into the code and run)."""
import os
import re
import subprocess
import sys

from tests.helpers.runner import REPO

SNIPPET = re.compile(r"""("\$py" -c '[^']*'(?: "\$\w+")*)""")


def test_quickstart_python_snippets_take_a_hostile_path_as_data(tmp_path):
    script = (REPO / "launch/quickstart.sh").read_text()
    assert not re.search(r'-c "[^"]*\$', script), "shell variables expanded inside python code"
    snippets = SNIPPET.findall(script)
    assert len(snippets) >= 2, snippets
    marker = tmp_path / "marker"
    hostile = str(tmp_path / f"x'); open({str(marker)!r}, 'w'); ('") + "/data"
    setup = f'py={sys.executable!r}; config=configs/tiny_taper.yaml; data="$HOSTILE"\n'
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    for snippet in snippets:
        proc = subprocess.run(["bash", "-c", setup + snippet], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HOSTILE": hostile, "PYTHONPATH": path})
        assert proc.returncode in (0, 1), (snippet, proc.stderr)  # is_complete: 1 (no shards there)
        assert not marker.exists(), snippet
    assert proc.returncode == 1 and proc.stderr == ""
