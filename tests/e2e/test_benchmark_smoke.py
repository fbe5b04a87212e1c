"""The accuracy benchmark's --quick mode (a script, not CI: marked benchmark)."""

import pathlib
import runpy

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy.py"


@pytest.mark.benchmark
def test_accuracy_benchmark_quick(tmp_path):
    main = runpy.run_path(str(SCRIPT), run_name="bench")["main"]
    out = tmp_path / "results.md"
    assert main(["--quick", "--cache-dir", "", "--out", str(out)]) == 0
    text = out.read_text()
    assert "## Default objective" in text and "## Conclusion" in text
