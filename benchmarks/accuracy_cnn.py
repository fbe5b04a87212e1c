"""Accuracy benchmark through the library itself: the demo's GroupNorm CNN on MNIST-5k.

Where ``benchmarks/accuracy.py`` re-implements the private update in numpy on small
models, this script trains the demo's model with the library's own code path —
``make_private`` (ghost clipping), ``NoiseCurveOptimizer`` (optionally with an inner
``keras.optimizers.SGD(momentum=β)``), ``banded_poisson_dataset``, the accountant —
for DP-SGD, DP-BandMF and NoiseCurve side by side.

Protocol (each step logged):

- Data: ``load_mnist5k(seed=0)``: 3,500 train / 500 validation / 1,000 test images.
  Public data for the spectrum: scikit-learn's digits (unlabeled), as in the demo.
- Privacy: (ε, δ) with cyclic Poisson sampling, B = ``--batch-size``, T = epochs × n/B;
  σ from ``calibrate_noise_multiplier`` (b = 1 for DP-SGD, b = ``--bands`` otherwise).
- Update rule: for each β in ``--momentum``, SGD with heavy-ball momentum β and the
  ``--schedule``; every C is solved for that rule (``update_rule=``), DP-BandMF and the
  curvature objective alike.
- Tuning: the learning rate over ``--lr-grid`` (EFFECTIVE rates η/(1 − β), so the grids
  of different β cover the same step sizes), clip norm ``--clip``; each (method, β, η)
  scored by mean VALIDATION accuracy over ``--tune-seeds`` seeds. The test split is not
  looked at while tuning.
- Final: the tuned η of each (method, β) with ``--seeds`` fresh seeds (disjoint from
  the tuning seeds); mean ± std test accuracy; paired differences to DP-BandMF.
  Paired seeds: seed s gives every method the same initial weights, the same batches
  and the same raw noise z (only C⁻¹ and σ differ). Seeded noise is for benchmarks
  only: a known noise seed voids the privacy guarantee.

Every finished run is appended to ``--runs`` (JSON lines); a re-run skips finished runs,
so an interrupted sweep continues where it stopped.

Run (the numbers in docs/results.md; about 1 min per training run on 2 cores):

    python benchmarks/accuracy_cnn.py --out benchmarks/out/cnn.md

``--quick`` is a smoke test (seconds per run, meaningless numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

METHODS = ("dpsgd", "bandmf", "noisecurve")
LABELS = {"dpsgd": "DP-SGD", "bandmf": "DP-BandMF", "noisecurve": "NoiseCurve"}
DEFAULT_RUNS = "benchmarks/out/accuracy_cnn_runs.jsonl"


def log(msg: str) -> None:
    print(f"[accuracy_cnn {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--bands", type=int, default=4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--momentum", type=float, nargs="+", default=[0.0, 0.9])
    p.add_argument("--schedule", default="constant", choices=("constant", "cosine", "linear-cooldown"))
    p.add_argument("--lr-grid", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                   help="effective learning rates η/(1 − β) (default 0.5 1 2)")
    p.add_argument("--objective", default="noisecurve",
                   help="curvature objective of the NoiseCurve rows (default 'noisecurve', paper eq. 1)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--tune-seeds", type=int, default=1)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--runs", default=None,
                   help="JSON lines of finished runs, read to skip them and appended to (default "
                        f"{DEFAULT_RUNS}; none with --quick; '' for none)")
    p.add_argument("--spectrum", default="benchmarks/out/accuracy_cnn_spectrum.npz",
                   help="spectrum cache (estimated once from the public digits)")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    for name in ("epsilon", "batch_size", "bands", "clip", "epochs", "tune_seeds", "seeds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if any(not 0 <= b < 1 for b in args.momentum):
        p.error(f"--momentum values must lie in [0, 1), got {args.momentum}")
    if any(lr <= 0 for lr in args.lr_grid):
        p.error(f"--lr-grid values must be > 0, got {args.lr_grid}")
    if args.runs is None:
        args.runs = "" if args.quick else DEFAULT_RUNS
    if args.quick:
        args.epochs, args.seeds, args.tune_seeds = 1, 1, 1
        args.lr_grid = args.lr_grid[:1]
    return args


class Runs:
    """Finished runs, keyed by their configuration (a JSON-lines file)."""

    def __init__(self, path):
        self.path = path
        self.done = {}
        if path and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        rec = json.loads(line)
                        self.done[rec["key"]] = rec

    def get(self, key):
        return self.done.get(key)

    def add(self, rec):
        self.done[rec["key"]] = rec
        if self.path:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")


class Setup:
    """Data, spectrum, σ per b, and the mixing matrices (cached per rule and η)."""

    def __init__(self, args):
        import keras

        import keras_noisecurve as knc
        from keras_noisecurve.apps import data as kdata
        from keras_noisecurve.apps.models import small_groupnorm_cnn
        from keras_noisecurve.spectrum import clipping_scale

        self.args = args
        splits = kdata.load_mnist5k(seed=0)
        self.x_train, self.y_train = splits.x_train, splits.y_train
        self.x_val, self.y_val = splits.x_val, splits.y_val
        self.x_test, self.y_test = splits.x_test, splits.y_test
        if args.quick:  # a random 100 of each (the splits may be ordered by class)
            pick = np.random.default_rng(0).permutation(len(self.y_val))[:100]
            self.x_val, self.y_val = self.x_val[pick], self.y_val[pick]
            pick = np.random.default_rng(1).permutation(len(self.y_test))[:100]
            self.x_test, self.y_test = self.x_test[pick], self.y_test[pick]
        self.n = len(self.y_train)
        self.steps_per_epoch = max(1, round(self.n / args.batch_size))
        self.steps = args.epochs * self.steps_per_epoch
        self.sigma = {
            b: knc.calibrate_noise_multiplier(epsilon=args.epsilon, delta=args.delta, num_examples=self.n,
                                              batch_size=args.batch_size, steps=self.steps, bands=b)
            for b in sorted({1, args.bands})
        }
        log(f"n={self.n}, B={args.batch_size}, T={self.steps}, b={args.bands}, (ε, δ)=({args.epsilon}, "
            f"{args.delta}); σ: " + ", ".join(f"b={b}: {s:.3f}" for b, s in self.sigma.items()))
        self.curvature = None
        if "noisecurve" in args.methods:
            if os.path.exists(args.spectrum) and not args.quick:
                spectrum = knc.Spectrum.load(args.spectrum)
                log(f"spectrum from {args.spectrum}")
            else:
                t0 = time.perf_counter()
                base = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=0)
                base.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                x_public = kdata.load_public("digits", max_examples=128 if args.quick else 512, seed=0)
                spectrum = knc.estimate_spectrum(
                    base, x_public, pretrain_epochs=1 if args.quick else 4, method="lanczos",
                    top_k=8 if args.quick else 32, slq_probes=2 if args.quick else 4,
                    slq_steps=12 if args.quick else 24, seed=0, verbose=True)
                scale = clipping_scale(base, x_public, l2_norm_clip=args.clip, seed=0)
                spectrum = spectrum.scaled(scale)
                if not args.quick:
                    os.makedirs(os.path.dirname(args.spectrum) or ".", exist_ok=True)
                    spectrum.save(args.spectrum)
                log(f"spectrum estimated in {time.perf_counter() - t0:.0f}s (clipping scale {scale:.3f})")
            self.curvature = spectrum
            log(f"curvature: μ_max = {spectrum.max_eigenvalue:.4g}")
        self._mixing = {}

    def rule(self, momentum):
        import keras_noisecurve as knc

        return knc.UpdateRule(momentum=momentum, schedule=self.args.schedule)

    def mixing(self, method, momentum, eta):
        import warnings

        import keras_noisecurve as knc

        key = (method, momentum, eta if method == "noisecurve" else None)
        if key not in self._mixing:
            if method == "dpsgd":
                self._mixing[key] = knc.MixingMatrix.identity(self.steps)
            elif method == "bandmf":
                self._mixing[key] = knc.solve_mixing_matrix(steps=self.steps, bands=self.args.bands,
                                                            objective="bandmf", update_rule=self.rule(momentum))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._mixing[key] = knc.solve_mixing_matrix(
                        steps=self.steps, bands=self.args.bands, objective=self.args.objective,
                        spectrum=self.curvature, learning_rate=eta, update_rule=self.rule(momentum),
                        **({"blend_weight": "auto"} if self.args.objective == "noisecurve-blend" else {}))
        return self._mixing[key]


def _accuracy(model, x, y, batch_size=500):
    correct = 0
    for start in range(0, len(y), batch_size):
        logits = np.asarray(model(x[start:start + batch_size], training=False))
        correct += int(np.sum(np.argmax(logits, axis=1) == y[start:start + batch_size]))
    return correct / len(y)


def train_one(setup, *, method, momentum, eta, seed):
    """One private training run; returns (validation accuracy, test accuracy, seconds)."""
    import warnings

    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    args = setup.args
    bands = 1 if method == "dpsgd" else args.bands
    mixing = setup.mixing(method, momentum, eta)
    t0 = time.perf_counter()
    keras.utils.set_random_seed(seed)
    model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=seed)
    schedule = knc.learning_rate_schedule(setup.rule(momentum), learning_rate=eta, steps=setup.steps)
    if momentum == 0 and args.schedule == "constant":
        opt_kwargs = {"learning_rate": eta}
    else:
        opt_kwargs = {"inner": keras.optimizers.SGD(schedule, momentum=momentum)}
    private = knc.make_private(model)
    private.compile(
        optimizer=knc.NoiseCurveOptimizer(mixing=mixing, l2_norm_clip=args.clip, noise_multiplier=setup.sigma[bands],
                                          expected_batch_size=args.batch_size, seed=10_000 + seed, **opt_kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dataset = knc.banded_poisson_dataset(setup.x_train, setup.y_train, batch_size=args.batch_size, bands=bands,
                                         steps=setup.steps, seed=20_000 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        private.fit(dataset, epochs=1, steps_per_epoch=setup.steps, verbose=0)
    return _accuracy(model, setup.x_val, setup.y_val), _accuracy(model, setup.x_test, setup.y_test), \
        time.perf_counter() - t0


def run(setup, runs, *, method, momentum, eta_eff, seed, phase):
    args = setup.args
    eta = eta_eff * (1.0 - momentum)
    key = json.dumps([args.epsilon, args.epochs, args.batch_size, args.bands, args.clip, args.schedule,
                      args.objective if method == "noisecurve" else None, method, momentum, eta_eff, seed,
                      args.quick])
    rec = runs.get(key)
    if rec is None:
        try:
            val, test, seconds = train_one(setup, method=method, momentum=momentum, eta=eta, seed=seed)
        except ValueError as exc:  # e.g. η·μ_max beyond the stable range of the curvature objective
            log(f"{phase} {LABELS[method]} β={momentum:g} η={eta:.4g}: skipped ({exc})")
            return {"val": float("-inf"), "test": float("nan"), "skipped": str(exc)}
        rec = {"key": key, "method": method, "momentum": momentum, "eta_eff": eta_eff, "eta": eta, "seed": seed,
               "phase": phase, "val": val, "test": test, "seconds": seconds}
        runs.add(rec)
        log(f"{phase} {LABELS[method]:<10} β={momentum:g} η={eta:.4g} (η_eff {eta_eff:g}) seed {seed}: "
            f"val {100 * val:.1f} %, test {100 * test:.1f} % ({seconds:.0f}s)")
    return rec


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t_start = time.perf_counter()
    setup = Setup(args)
    runs = Runs(args.runs or None)
    tune_seeds = list(range(args.tune_seeds))
    final_seeds = list(range(100, 100 + args.seeds))
    tuned, final = {}, {}
    for momentum in args.momentum:
        for method in args.methods:
            scores = {}
            for eta_eff in args.lr_grid:
                recs = [run(setup, runs, method=method, momentum=momentum, eta_eff=eta_eff, seed=s, phase="tune")
                        for s in tune_seeds]
                scores[eta_eff] = float(np.mean([r["val"] for r in recs]))
            best = max(args.lr_grid, key=lambda e: (scores[e], -e))
            tuned[(method, momentum)] = {"eta_eff": best, "scores": scores}
            final[(method, momentum)] = [
                run(setup, runs, method=method, momentum=momentum, eta_eff=best, seed=s, phase="final")
                for s in final_seeds]
    report = render(args, argv, setup, tuned, final, time.perf_counter() - t_start)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        log(f"report written to {args.out}")
    return 0


def _mean_std(values):
    v = 100 * np.asarray(values, dtype=float)
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def _point(eta_eff, score):
    return f"{eta_eff:g}→refused" if score == float("-inf") else f"{eta_eff:g}→{100 * score:.1f}"


def render(args, argv, setup, tuned, final, wall):
    cmd = "python benchmarks/accuracy_cnn.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rule_text = {m: setup.rule(m).describe() for m in args.momentum}
    lines = [
        f"Command: `{cmd.strip()}` ({wall / 60:.0f} min). Small GroupNorm CNN "
        f"(`small_groupnorm_cnn(dense_size=32)`), MNIST-5k {setup.n} train / {len(setup.y_val)} validation / "
        f"{len(setup.y_test)} test, B = {args.batch_size}, T = {setup.steps}, b = {args.bands}, ζ = {args.clip}, "
        f"(ε, δ) = ({args.epsilon:g}, {args.delta:g}), σ = "
        + ", ".join(f"{s:.3f} (b = {b})" for b, s in setup.sigma.items())
        + f". Learning rate tuned on validation over effective rates η/(1 − β) ∈ {args.lr_grid} "
        f"({args.tune_seeds} seed(s)); test accuracy over {args.seeds} paired seeds. NoiseCurve objective "
        f"`{args.objective}`; every C solved for the training rule.",
        "",
        "| update rule | method | tuned η | validation % (tuning) | test % (mean ± std) | test − DP-BandMF (paired) |",
        "|---|---|---|---|---|---|",
    ]
    for momentum in args.momentum:
        base = final.get(("bandmf", momentum))
        for method in args.methods:
            t = tuned[(method, momentum)]
            tests = [r["test"] for r in final[(method, momentum)]]
            if base is not None and method != "bandmf":
                diff = 100 * (np.asarray(tests) - np.asarray([r["test"] for r in base]))
                wins = int(np.sum(diff > 0))
                paired = f"{diff.mean():+.2f} ({wins}/{len(diff)} seeds higher)"
            else:
                paired = "—"
            eta = t["eta_eff"] * (1 - momentum)
            lines.append(f"| {rule_text[momentum]} | {LABELS[method]} | {eta:g} | "
                         f"{100 * t['scores'][t['eta_eff']]:.1f} | {_mean_std(tests)} | {paired} |")
    lines.append("")
    lines.append("Validation accuracy of every tuning point (effective η → %): "
                 + "; ".join(f"{LABELS[m]} β={b:g}: " + ", ".join(_point(e, s) for e, s in tuned[(m, b)]["scores"].items())
                             for (m, b) in tuned))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
