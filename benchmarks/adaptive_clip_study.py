"""Adaptive clipping with correlated noise: does the clip find the data's norms, and what does it cost?

The demo's model (the small GroupNorm CNN on MNIST-5k: 3,500 private images, B = 250, heavy-ball
momentum 0.9, ε = 8, δ = 1e-6 by default) trained with three mechanisms, each with a fixed clip
(``--clip``, default 1, the value the accuracy benchmarks tuned) and with
``knc.AdaptiveClip()`` at the paper's defaults (ζ_0 = 0.1, the median, η = 0.2, count noise B/20):

- ``dpsgd``: C = I, cyclic Poisson with b = 1;
- ``bandmf``: DP-BandMF with ``--bands`` (default 4) under cyclic Poisson sampling;
- ``blt``: a BLT C (``--buffers``, default 2) under fixed epochs (no amplification).

Every run is calibrated to the same (ε, δ) by its ``PrivateRun``; an adaptive run's σ includes its
count queries. For each it reports σ, the final ζ, and the test accuracy over paired seeds (seed s:
the same initial weights, sampling key and noise seed for fixed and adaptive), with the paired
difference adaptive − fixed. Learning rates are the ones ``accuracy_cnn.py`` tuned at ε = 2 (0.4);
not re-tuned.

Run (the numbers in docs/results.md; about 1 min per training run on 2 cores with JAX):

    KERAS_BACKEND=jax python benchmarks/adaptive_clip_study.py --seeds 3 --out benchmarks/out/adaptive_clip.md

``--quick`` is a smoke test (1 epoch, 1 seed, 100 test images; meaningless numbers). Seeded sampling
and noise are for benchmarks only: a known seed voids the privacy guarantee.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("dpsgd", "bandmf", "blt")


def log(msg: str) -> None:
    print(f"[adaptive_clip_study] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-6)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--clip", type=float, default=1.0, help="the fixed clip norm compared with")
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--buffers", type=int, default=2)
    p.add_argument("--target-quantile", type=float, default=0.5, help="AdaptiveClip's target quantile")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds = 1, 1
    return args


def _accuracy(model, x, y) -> float:
    logits = np.asarray(model.predict(x, batch_size=500, verbose=0))
    return float(np.mean(np.argmax(logits, axis=-1) == y))


class Study:
    def __init__(self, args):
        import keras_noisecurve as knc
        from keras_noisecurve.apps import data as kdata

        self.args = args
        splits = kdata.load_mnist5k(seed=0)
        self.x, self.y = splits.x_train, splits.y_train
        self.x_test, self.y_test = splits.x_test, splits.y_test
        if args.quick:
            pick = np.random.default_rng(1).permutation(len(self.y_test))[:100]
            self.x_test, self.y_test = self.x_test[pick], self.y_test[pick]
        self.n = len(self.y)
        self.per_epoch = -(-self.n // args.batch_size)
        self.steps = args.epochs * self.per_epoch
        self.rule = knc.UpdateRule(momentum=args.momentum)
        t0 = time.perf_counter()
        self.mixing = {
            "dpsgd": knc.MixingMatrix.identity(self.steps),
            "bandmf": knc.solve_mixing_matrix(steps=self.steps, bands=args.bands, objective="bandmf",
                                              update_rule=self.rule),
        }
        if "blt" in args.methods:
            kwargs = {"participations": args.epochs, "separation": self.per_epoch} if args.epochs > 1 else {}
            self.mixing["blt"] = knc.solve_mixing_matrix(steps=self.steps, strategy="blt", buffers=args.buffers,
                                                         objective="bandmf", **kwargs)
        log(f"n={self.n}, B={args.batch_size}, T={self.steps}; C solved in {time.perf_counter() - t0:.0f}s")

    def run(self, method, *, adaptive, seed):
        import keras_noisecurve as knc

        args = self.args
        sampling = "fixed_epochs" if method == "blt" else "cyclic_poisson"
        return knc.PrivateRun(num_examples=self.n, batch_size=args.batch_size, steps=self.steps,
                              mixing=self.mixing[method], epsilon=args.epsilon, delta=args.delta,
                              sampling=sampling, seed=seed,
                              adaptive_clip=knc.AdaptiveClip(target_quantile=args.target_quantile) if adaptive else None)


def train_one(study, *, method, adaptive, seed):
    """(test accuracy, σ, final ζ, seconds) of one run."""
    import warnings

    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    args = study.args
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed-seed warnings: seeded runs are benchmarks only
        run = study.run(method, adaptive=adaptive, seed=20_000 + seed)
        keras.utils.set_random_seed(seed)
        model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=seed)
        schedule = knc.learning_rate_schedule(study.rule, learning_rate=args.lr, steps=study.steps)
        private = knc.make_private(model)
        optimizer = knc.NoiseCurveOptimizer(run=run, l2_norm_clip=None if adaptive else args.clip,
                                            seed=10_000 + seed,
                                            inner=keras.optimizers.SGD(schedule, momentum=args.momentum))
        private.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        private.fit(run.dataset(study.x, study.y), epochs=1, steps_per_epoch=study.steps, verbose=0)
    zeta = float(np.asarray(keras.ops.convert_to_numpy(optimizer.current_clip())))
    return (_accuracy(model, study.x_test, study.y_test), float(run.noise_multiplier), zeta,
            time.perf_counter() - t0)


def render(args, study, results) -> str:
    lines = [
        f"Adaptive clipping, demo CNN, eps = {args.epsilon:g}, delta = {args.delta:g}, n = {study.n}, "
        f"B = {args.batch_size}, T = {study.steps}, momentum {args.momentum:g}, lr {args.lr:g}, "
        f"{args.seeds} paired seeds; fixed clip {args.clip:g} vs AdaptiveClip(target_quantile="
        f"{args.target_quantile:g}) (zeta_0 = 0.1, eta = 0.2, count stddev B/20)", "",
        "| method | clip | sigma | final zeta (mean) | test % (mean ± sd) | adaptive − fixed, pp (mean ± sd) |",
        "|---|---|---|---|---|---|",
    ]
    for method in args.methods:
        fixed = results[(method, False)]
        adapt = results[(method, True)]
        diff = 100 * (np.array([r[0] for r in adapt]) - np.array([r[0] for r in fixed]))
        for label, rows, extra in (("fixed", fixed, ""), ("adaptive", adapt, f"{diff.mean():+.2f} ± {diff.std(ddof=1) if len(diff) > 1 else 0.0:.2f}")):
            acc = 100 * np.array([r[0] for r in rows])
            sd = acc.std(ddof=1) if len(acc) > 1 else 0.0
            lines.append(f"| {method} | {label} | {rows[0][1]:.4f} | {np.mean([r[2] for r in rows]):.3f} | "
                         f"{acc.mean():.2f} ± {sd:.2f} | {extra} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    study = Study(args)
    results = {}
    started = time.perf_counter()
    for seed in range(args.seeds):
        for method in args.methods:
            for adaptive in (False, True):
                acc, sigma, zeta, sec = train_one(study, method=method, adaptive=adaptive, seed=seed)
                results.setdefault((method, adaptive), []).append((acc, sigma, zeta))
                log(f"seed {seed} {method:6s} {'adaptive' if adaptive else 'fixed':8s}: test {100 * acc:.2f} %, "
                    f"sigma {sigma:.4f}, final zeta {zeta:.3f} ({sec:.0f}s)")
    table = render(args, study, results)
    print(table)
    log(f"total {time.perf_counter() - started:.0f}s")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
