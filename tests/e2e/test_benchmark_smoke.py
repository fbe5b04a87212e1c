"""The accuracy benchmark's --quick mode (a script, not CI: marked benchmark)."""

import inspect
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
    assert "- Update rule (every method, and the non-private reference): SGD, momentum 0, constant" in text


@pytest.mark.benchmark
def test_accuracy_benchmark_quick_with_momentum_and_both_workloads(tmp_path):
    import keras_noisecurve as knc

    if "update_rule" not in inspect.signature(knc.solve_mixing_matrix).parameters:
        pytest.skip("solve_mixing_matrix takes no update_rule yet")
    main = runpy.run_path(str(SCRIPT), run_name="bench")["main"]
    out = tmp_path / "results.md"
    assert main(["--quick", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--momentum", "0.5",
                 "--schedule", "linear-cooldown", "--workload", "both",
                 "--methods", "dpsgd", "bandmf", "noisecurve", "noisecurve-all-iterates"]) == 0
    text = out.read_text()
    assert "SGD, momentum 0.5, linear cooldown" in text
    for row in ("| bandmf |", "| bandmf+rule |", "| noisecurve |", "| noisecurve+rule |",
                "| noisecurve-all-iterates |", "| 2 | bandmf+rule vs bandmf |"):
        assert row in text
    assert "- Skipped `noisecurve-all-iterates+rule`:" in text and "| noisecurve-all-iterates+rule |" not in text
    assert "## Matched vs plain workload" in text and "## Significance vs DP-BandMF" in text
    # a second run reads every C back from the cache, keyed by the rule
    assert main(["--quick", "--cache-dir", str(tmp_path / "cache"), "--out", str(out), "--momentum", "0.5",
                 "--schedule", "linear-cooldown", "--workload", "both",
                 "--methods", "dpsgd", "bandmf", "noisecurve", "noisecurve-all-iterates"]) == 0
    assert out.read_text().split("## Test accuracy")[1] == text.split("## Test accuracy")[1]
