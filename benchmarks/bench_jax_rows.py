"""A tiny KerasHub ViT's private step on JAX: ``clipping="vectorized"`` (``jax.vmap`` of the
whole model's gradient) against ``"auto"`` (per-layer ghost norms, the position Embedding
on constant ids (1, L) clipped through its caller ``ViTPatchingAndEmbedding``,
:mod:`keras_noisecurve.backend.common.row_probe`; before that caller routing, ``"auto"``
handed this model to the vectorized engine).

The model is tests/training/catalogue.py's tiny ``ViTBackbone`` (16×16×3 images, patches
4×4, 2 layers, width 16) with a ``Dense(3)`` head, float32. Each configuration: one
``train_on_batch`` to compile, then ``--steps`` steps timed together with
``time.perf_counter`` (the last step's logs are host numbers: the steps are finished);
the two configurations are timed ``--rounds`` times, alternating, and the median printed.

    KERAS_BACKEND=jax python benchmarks/bench_jax_rows.py --batch 32 --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_noisecurve as knc  # noqa: E402
from tests.training import catalogue  # noqa: E402


def _private(clipping, batch):
    case = catalogue.make_case("ViTBackbone", dtype="float32", seed=0)
    private = knc.make_private(case.model, clipping=clipping)
    private.compile(optimizer=knc.NoiseCurveOptimizer(learning_rate=0.01, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                      expected_batch_size=batch, seed=0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 16, 16, 3)).astype("float32")
    y = rng.integers(0, catalogue.CLASSES, size=(batch,)).astype("int32")
    private.train_on_batch(x, y)  # compile
    return private, x, y


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    runs = {clipping: _private(clipping, args.batch) for clipping in ("vectorized", "auto")}
    times = {clipping: [] for clipping in runs}
    for _ in range(args.rounds):
        for clipping, (private, x, y) in runs.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                logs = private.train_on_batch(x, y, return_dict=True)
            float(logs["loss"])
            times[clipping].append((time.perf_counter() - start) / args.steps * 1e3)
    base = statistics.median(times["vectorized"])
    print(f"tiny ViT private step, B = {args.batch}, median of {args.rounds} rounds of {args.steps} steps "
          f"({keras.backend.backend()}, {__import__('jax').devices()[0].platform})")
    for clipping, values in times.items():
        ms = statistics.median(values)
        print(f"  clipping={clipping!r:13} {ms:8.2f} ms/step  ({ms / base:.2f}× vectorized)")


if __name__ == "__main__":
    main()
