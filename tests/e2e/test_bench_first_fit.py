"""benchmarks/bench_first_fit.py runs, and a KerasHub model's private step is traced once."""

import importlib.util
import pathlib
import re
import sys

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_first_fit.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_first_fit_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_bench_first_fit_times_both_steps_and_counts_one_trace_each(capsys):
    bench = _load()
    assert bench.main(["--models", "bert", "--batch-size", "4", "--length", "8", "--width", "16", "--vocab", "50",
                       "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^\| bert \| (\d+) \| ([\d.]+) \((\d+)\) \| ([\d.]+) \((\d+)\) \| ([\d.]+)x \|$", out, re.M)
    assert row is not None, out
    variables, plain_s, plain_traces, private_s, private_traces, ratio = row.groups()
    assert int(variables) > 10 and float(plain_s) > 0 and float(private_s) > 0
    assert (int(plain_traces), int(private_traces)) == (1, 1)
