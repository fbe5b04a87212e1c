"""benchmarks/bench_audit.py --quick in a subprocess: every row is audited and none exceeds its claim."""

import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_audit.py"


def test_bench_audit_quick(tmp_path):
    out = tmp_path / "audit.md"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for row in ("| dpsgd | fixed epochs | 4 |", "| banded | fixed epochs | 4 |", "| banded (resumed) | fixed epochs | 4 |",
                "| toeplitz | fixed epochs | 4 |", "| blt | fixed epochs | 4 |", "| banded | cyclic poisson | 4 |"):
        assert row in text, row
    assert "never above the claim" in text
