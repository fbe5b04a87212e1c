"""benchmarks/bench_strategies.py --quick in a subprocess: both parts run and report every strategy."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_strategies.py"


def test_bench_strategies_quick(tmp_path):
    out = tmp_path / "report.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--cache", "", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "## Expected error" in text and "## Accuracy" in text
    for row in ("| dpsgd | cyclic Poisson | b = 1 | 406 |", "| banded | cyclic Poisson | b = 4 |",
                "| toeplitz | cyclic Poisson | b = 4 |", "| banded-fixed | fixed epochs | b = 14 |",
                "| blt | fixed epochs (solved for k = 2) | d = 4 |", "| blt-1pass |", "| bisr | fixed epochs | p = 4 |"):
        assert row in text, row
    # DP-SGD is the reference of the error ratios; ‖A‖²_F = T(T+1)/2 = 406 for T = 28
    assert "| dpsgd | cyclic Poisson | b = 1 | 406 | " in text and " | 1.000 |" in text
    for label in ("dpsgd", "banded", "toeplitz", "banded-fixed", "blt", "bisr"):
        assert f"\n| {label} | " in text.split("## Accuracy")[1], label
