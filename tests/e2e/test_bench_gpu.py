"""``benchmarks/bench_gpu.py --small`` under ``KERAS_BACKEND=jax`` in a subprocess, with
TensorFlow unimportable (as on the GPU machines): the tables print, with a plain step
time, time to the first step and planned memory for every model asked for (two of the four: the
CI budget), and the recurrence row. ``--max-seconds 30`` bounds the run: private
configurations not yet started by then say "not run" (their first step compiles the whole
private step, minutes on a loaded 2-core CPU)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_gpu.py"

#: the models the smoke test runs: a dense one and a transformer (every model of --small: the benchmark)
MODELS = ("mlp", "transformer_small")

RUN = """
import runpy, sys
sys.modules["tensorflow"] = None  # as on a machine without TensorFlow
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_bench_gpu_small_prints_the_table():
    pytest.importorskip("jax")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", RUN, str(SCRIPT), "--small", "--models", *MODELS, "--repeats", "2",
                           "--max-seconds", "30"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "devices: cpu" in out and "keras 3." in out and "jax " in out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0].startswith("| model | parameters | B | plain Keras-JAX step | DP-SGD (this library) | banded b = 16 "
                              "| BLT d = 4 | jax_privacy Keras API (DP-SGD) |")
    for name in MODELS:
        row = next(line for line in rows if line.startswith(f"| {name}"))
        assert re.match(r"\| [^|]+ \| [0-9.]+[Mk] \| \d+ \| [0-9.]+ ms \|", row), row
    recurrence = next(line for line in rows if line.startswith("| noise recurrence alone, b = 16"))
    assert re.search(r"ring step \d+ GB/s \| copy \d+ GB/s \| \d+ % of copy", recurrence), recurrence
    # the time to the first step and the memory XLA plans for one step, each model's plain cell filled
    first = out.split("Time to the first step")[1].split("Memory of one step")[0]
    memory = out.split("Memory of one step")[1].split("Where the compilation goes")[0]
    split = out.split("Where the compilation goes")[1]
    for name in MODELS:
        assert re.search(rf"\| {name}[^|]* \| [0-9.]+ s \|", first), first
        assert re.search(rf"\| {name}[^|]* \| [0-9.]+ MiB \|", memory), memory
        # tracing + XLA compilation of the step compiled alone, after clearing JAX's caches: the plain
        # step is compiled anew (a cached one would cost 0.00 s)
        cell = re.search(rf"\| {name}[^|]* \| ([0-9.]+) \+ ([0-9.]+) s", split)
        assert cell and float(cell.group(2)) > 0, split
    assert "tensorflow imported: False" in out
    if (ROOT / "keras_noisecurve" / "backend" / "jax" / "optimizer.py").exists():  # the JAX training step is in
        assert "import of tensorflow halted" not in out, "a cell imported TensorFlow"  # what a blocked import says


def test_bench_gpu_gpt2_rows_train_privately():
    """The GPT-2 rows (KerasHub's GPT2CausalLM from a config, no weights; ``--small``: 2 layers,
    d = 64) print a plain step and a private DP-SGD step, without TensorFlow."""
    pytest.importorskip("jax")
    pytest.importorskip("keras_hub")
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", RUN, str(SCRIPT), "--small", "--models", "gpt2", "gpt2_long",
                           "--configs", "plain", "dpsgd", "--no-memory", "--repeats", "2",
                           "--recurrence-params", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| gpt2")]
    assert len(rows) == 4, done.stdout  # the step table and the first-step table
    for length, batch in ((16, 4), (32, 4)):
        row = next(line for line in rows if f"L = {length} |" in line and " ms " in line)
        assert re.match(rf"\| gpt2[a-z_]* L = {length} \| [0-9.]+M \| {batch} \| [0-9.]+ ms \| [0-9.]+ ms \([0-9.]+×\) \|$",
                        row), row
    assert "tensorflow imported: False" in done.stdout
