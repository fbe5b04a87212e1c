"""The adaptive-clip benchmark scripts in their smallest settings (scripts, not CI: marked benchmark)."""

import pathlib
import runpy

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.benchmark
def test_adaptive_clip_study_quick_writes_its_table(tmp_path):
    main = runpy.run_path(str(BENCHMARKS / "adaptive_clip_study.py"), run_name="bench")["main"]
    out = tmp_path / "adaptive.md"
    assert main(["--quick", "--methods", "dpsgd", "blt", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| dpsgd | fixed | " in text and "| blt | adaptive | " in text and "| bandmf |" not in text


@pytest.mark.benchmark
def test_bench_adaptive_clip_prints_the_ratio(capsys):
    main = runpy.run_path(str(BENCHMARKS / "bench_adaptive_clip.py"), run_name="bench")["main"]
    assert main(["--steps", "2", "--warmup", "1", "--rounds", "1", "--batch-size", "32"]) == 0
    assert "ratio adaptive / fixed = " in capsys.readouterr().out
