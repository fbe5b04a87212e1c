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
    assert "- Update rule (every method, and the non-private reference): SGD, momentum 0, constant" in text


@pytest.mark.benchmark
def test_accuracy_benchmark_quick_with_momentum_and_both_workloads(tmp_path):
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


CNN_SCRIPT = SCRIPT.parent / "accuracy_cnn.py"


def test_accuracy_cnn_refuses_bad_arguments(capsys):
    main = runpy.run_path(str(CNN_SCRIPT), run_name="bench")["main"]
    for argv, needle in ((["--momentum", "1.0"], "--momentum values must lie in [0, 1)"),
                         (["--lr-grid", "0"], "--lr-grid values must be > 0"),
                         (["--seeds", "0"], "--seeds must be > 0")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err


@pytest.mark.benchmark
def test_accuracy_cnn_quick_through_the_library_with_momentum(tmp_path, capsys):
    """The CNN benchmark's --quick run: momentum 0.5 (an inner SGD), C solved for the rule,
    every finished run recorded; a second invocation trains nothing and reports the same."""
    main = runpy.run_path(str(CNN_SCRIPT), run_name="bench")["main"]
    runs = tmp_path / "runs.jsonl"
    argv = ["--quick", "--momentum", "0.5", "--runs", str(runs), "--spectrum", str(tmp_path / "s.npz"),
            "--out", str(tmp_path / "cnn.md")]
    assert main(argv) == 0
    first = (tmp_path / "cnn.md").read_text()
    assert "| SGD, momentum 0.5, constant learning rate | DP-BandMF |" in first
    assert len(runs.read_text().splitlines()) == 6  # 3 methods x (1 tuning + 1 final) run
    capsys.readouterr()
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "] tune " not in out and "] final " not in out  # nothing trained again
    second = (tmp_path / "cnn.md").read_text()
    assert first.split("\n", 1)[1] == second.split("\n", 1)[1]  # all but the command/time line
