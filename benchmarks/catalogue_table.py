"""The KerasHub catalogue table: every backbone of ``tests/training/catalogue.py``, its rule
coverage, its error against a per-example float64 loop and its private / non-private step.

For each backbone (tiny config, a ``Dense(3)`` head over its pooled outputs, P = 5):

- coverage: how many layers each rule takes (``describe``), ``generic`` = the per-layer fallback;
- norm error, sum error: the default engine (``clipping="auto"``, in ``tf.function``) in
  float64 against an independent per-example ``tf.GradientTape`` loop, ζ = median norm
  (max |Δnorm| / max norm; ‖Δ clipped sum‖₂ / ‖clipped sum‖₂);
- ratio: median private step time / median non-private step time (Keras ``train_step``
  with SGD vs ``make_private`` + DP-SGD noise), float32, batch ``--batch-size`` (B = 8),
  interleaved over ``--repeats`` rounds of ``--steps`` steps, in one process.

Prints one Markdown row per backbone as it goes (the table of docs/models.md):

    python benchmarks/catalogue_table.py                      # every backbone
    python benchmarks/catalogue_table.py --models BertBackbone GPT2Backbone --no-timing
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.training.catalogue

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tests.training import catalogue  # noqa: E402


def _tile(x, batch):
    reps = -(-batch // catalogue.P)
    return tf.nest.map_structure(lambda t: np.concatenate([t] * reps)[:batch], x)


def ratio(name, batch, steps, repeats):
    """Median private / non-private step time of backbone ``name`` (float32, ``batch`` examples)."""
    from keras_noisecurve.training import NoiseCurveOptimizer, make_private

    plain = catalogue.make_case(name, dtype="float32", seed=0)
    plain.model.compile(optimizer=keras.optimizers.SGD(0.01), loss=plain.loss, jit_compile=False)
    case = catalogue.make_case(name, dtype="float32", seed=0)
    private = make_private(case.model)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.01, mixing="dpsgd", l2_norm_clip=1.0,
                                                  noise_multiplier=1.0, expected_batch_size=batch), loss=case.loss)
    x, y = _tile(case.x, batch), np.concatenate([case.y] * batch)[:batch]
    times = {}
    steps_of = {k: tf.function(lambda x, y, m=m: m.train_step((x, y)), reduce_retracing=True)
                for k, m in (("plain", plain.model), ("private", private))}
    for k, step in steps_of.items():  # trace and warm up
        step(x, y)
    for _ in range(repeats):
        for k, step in steps_of.items():
            start = time.perf_counter()
            for _ in range(steps):
                out = step(x, y)
            tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
            times.setdefault(k, []).append((time.perf_counter() - start) / steps)
    return float(np.median(times["private"]) / np.median(times["plain"]))


def row(name, args):
    case = catalogue.make_case(name, dtype="float64")
    cov = catalogue.coverage(case.model)
    got = catalogue.compare_with_loop(case)
    keras.backend.clear_session()
    r = f"{ratio(name, args.batch_size, args.steps, args.repeats):.2f}×" if args.timing else "—"
    keras.backend.clear_session()
    fallback = cov.get("generic", 0)
    rules = ", ".join(f"{k} {v}" for k, v in cov.items() if k != "generic")
    return f"| {name} | {rules} | {fallback} | {got.norm_error:.0e} | {got.sum_error:.0e} | {r} |"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(catalogue.BUILDERS), choices=sorted(catalogue.BUILDERS))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-timing", dest="timing", action="store_false", help="coverage and errors only")
    args = parser.parse_args(argv)
    print("| backbone | layers by rule | on the fallback | norm error | sum error | private / non-private |")
    print("|---|---|---|---|---|---|", flush=True)
    for name in args.models:
        try:
            print(row(name, args), flush=True)
        except Exception as error:  # noqa: BLE001 - a row that fails is reported, not hidden
            print(f"| {name} | failed: {type(error).__name__}: {str(error).splitlines()[0][:120]} | | | | |", flush=True)


if __name__ == "__main__":
    main()
