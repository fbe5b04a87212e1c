"""The README quick start (and its copy in docs/index.md) is the recommended path,
DP-BandMF with C solved for the rule it trains with, and runs as written (with one
epoch instead of ten, to stay fast)."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _quick_start(path):
    text = open(os.path.join(ROOT, path), encoding="utf-8").read()
    section = text[text.index("## Quick start (Python)"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_and_index_show_the_same_recommended_path():
    readme, index = _quick_start("README.md"), _quick_start("docs/index.md")
    assert readme.replace("docs/", "") == index.replace("docs/", "")
    assert 'objective="bandmf"' in readme and 'objective="noisecurve"' not in readme
    assert "update_rule=rule" in readme and "momentum=beta" in readme  # C solved for the rule trained
    assert "run.dataset(x, y)" in readme and "run=run" in readme


def test_the_readme_quick_start_runs():
    code = _quick_start("README.md")
    line = "B, T, b, eta, beta, clip = 250, 140, 4, 0.4, 0.9, 1.0"
    assert line in code
    code = code.replace(line, line.replace("250, 140,", "250, 14,"))  # one epoch
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                          text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "'accuracy'" in proc.stdout and "epsilon" in proc.stdout
