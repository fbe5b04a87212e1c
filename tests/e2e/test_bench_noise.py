"""``benchmarks/bench_noise.py`` at a tiny size in a subprocess: the table prints one row
per generator with a time, a throughput, a ratio to ``jax.random.normal`` and a
first-call time; the TensorFlow rows are there where TensorFlow imports,
and a blocked TensorFlow gives the "skipped" line instead."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_noise.py"

RUN = """
import runpy, sys
if sys.argv[1] == "block":
    sys.modules["tensorflow"] = None  # as on a machine without TensorFlow
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
CELL = r" [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|"


def _run(mode):
    env = dict(os.environ, KERAS_BACKEND="jax", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", RUN, mode, str(SCRIPT), "--sizes", "4097", "--repeats", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@pytest.mark.parametrize("mode", ["tensorflow", "block"])
def test_bench_noise_prints_the_table(mode):
    pytest.importorskip("jax")
    if mode == "tensorflow":
        pytest.importorskip("tensorflow")
    out = _run(mode)
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert rows[0] == "| generator | 4097: ms | M/s | × threefry | first call s |", rows[0]
    names = ["keras-noisecurve, one variable", "keras-noisecurve, 10 variables", "jax.random.normal (threefry)",
             "lax.rng_bit_generator (RNG_PHILOX), uint32", "lax.rng_bit_generator (RNG_PHILOX) + Box–Muller"]
    if mode == "tensorflow":
        names += ["tf.random.stateless_normal (philox)", "tf.random.stateless_normal (philox), XLA"]
    assert [row.split(" | ")[0][2:] for row in rows[1:]] == names
    for row in rows[1:]:
        assert re.fullmatch(r"\| [^|]+ \|" + CELL, row), row
    threefry = next(row for row in rows if row.startswith("| jax.random.normal"))
    assert threefry.split(" | ")[3] == "1.00"
    assert ("tf.random.stateless_normal: skipped" in out) == (mode == "block")
