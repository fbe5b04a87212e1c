"""The README quick start on both Keras backends: test accuracy per seed, side by side.

Runs the README's quick start (bundled MNIST, the GroupNorm CNN, DP-BandMF b = 4 solved
for momentum SGD, ε = 2, δ = 1e-5, T = 140 steps of B = 250) once per seed and backend,
each in a fresh process (the backend is chosen when keras is imported), with the seed
fixing the weights' initialisation, the sampler and the noise key (a fixed seed is for
measurements only: it voids the privacy guarantee for whoever knows it). Prints one row per
seed and the mean difference of test accuracy, JAX − TensorFlow.

    python benchmarks/quickstart_backends.py --seeds 0 1 2
    python benchmarks/quickstart_backends.py --seeds 0 --steps 20     # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, time
import keras
import keras_noisecurve as knc
from keras_noisecurve.apps import data, models

seed, steps = int(sys.argv[1]), int(sys.argv[2])
splits = data.load_mnist5k()
x, y, n = splits.x_train, splits.y_train, len(splits.y_train)
B, T, b, eta, beta, clip = 250, steps, 4, 0.4, 0.9, 1.0
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rule = knc.UpdateRule(momentum=beta)
C = knc.solve_mixing_matrix(steps=T, bands=b, objective="bandmf", update_rule=rule)
run = knc.PrivateRun(num_examples=n, batch_size=B, steps=T, mixing=C, epsilon=2.0, delta=1e-5, seed=seed)
keras.utils.set_random_seed(seed)
model = models.small_groupnorm_cnn((28, 28, 1), 10, dense_size=32)
private = knc.make_private(model)
private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, l2_norm_clip=clip, seed=seed,
                                                  inner=keras.optimizers.SGD(eta, momentum=beta)),
                loss=loss, weighted_metrics=["accuracy"])
start = time.perf_counter()
private.fit(run.dataset(x, y), verbose=0)
seconds = time.perf_counter() - start
result = private.evaluate(splits.x_test, splits.y_test, return_dict=True, verbose=0)
print("RESULT " + json.dumps({"backend": keras.backend.backend(), "seed": seed, "steps": T,
                              "test_accuracy": float(result["accuracy"]), "fit_seconds": seconds}))
"""


def run_one(backend: str, seed: int, steps: int) -> dict:
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(seed), str(steps)], env=env, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{backend} seed {seed} failed:\n{proc.stderr[-3000:]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=140, help="T (the README's is 140)")
    parser.add_argument("--backends", nargs="+", default=["tensorflow", "jax"], choices=["tensorflow", "jax"])
    args = parser.parse_args(argv)
    rows = []
    print(f"{'seed':>4} " + " ".join(f"{b:>22}" for b in args.backends), flush=True)
    for seed in args.seeds:
        start = time.perf_counter()
        results = {b: run_one(b, seed, args.steps) for b in args.backends}
        rows.append(results)
        cells = " ".join(f"{results[b]['test_accuracy']:>10.4f} ({results[b]['fit_seconds']:6.1f} s)"
                         for b in args.backends)
        print(f"{seed:>4} {cells}   [{time.perf_counter() - start:.0f} s]", flush=True)
    if set(args.backends) == {"tensorflow", "jax"}:
        diffs = [r["jax"]["test_accuracy"] - r["tensorflow"]["test_accuracy"] for r in rows]
        print(f"mean test accuracy, JAX - TensorFlow: {100 * sum(diffs) / len(diffs):+.2f} points "
              f"(per seed: {', '.join(f'{100 * d:+.2f}' for d in diffs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
