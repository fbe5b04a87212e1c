"""``noisecurve demo``: the whole pipeline, end to end, on data that ships with PyPI packages.

1. Data: private = the bundled MNIST-5k training split (3,500 images, labels
   used); public = scikit-learn's digits in MNIST format (no labels), or an
   unlabeled held-out MNIST slice with ``--public mnist-heldout``
   (``keras_noisecurve.data``).
2. Model: the paper's small GroupNorm CNN adapted to 28×28×1
   (``keras_noisecurve.models.small_groupnorm_cnn``).
3. Spectrum: random-label pre-training on the public images, then Lanczos top-k +
   SLQ count + power-law tail (paper §4), scaled by the public clipping factor.
4. Mixing matrices: NoiseCurve (objective ``NOISECURVE_OBJECTIVE``) and DP-BandMF
   for the same T and b; DP-SGD is C = I.
5. Accounting: σ calibrated for (ε, δ) under cyclic Poisson sampling (b bands for
   the matrix-factorisation methods, b = 1 for DP-SGD).
6. Training: DP-SGD, DP-BandMF and NoiseCurve side by side, same initial weights,
   learning rate, clip norm, batch size and steps; one table and plots
   (spectrum, |C|, per-step and running-sum noise std, test accuracy per epoch)
   in ``--out``.

Default run ≈ 10 min on a 2-core CPU; ``--quick`` ≈ 1–2 min (fewer public images,
steps and Lanczos iterations: a smoke test, not a meaningful comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from keras_noisecurve.mixing import DEFAULT_OBJECTIVE as _LIBRARY_DEFAULT
from keras_noisecurve.mixing import workloads as _workloads

#: The curvature objective the demo uses for its NoiseCurve row. It is taken from
#: ``keras_noisecurve.mixing.DEFAULT_OBJECTIVE`` when that is a curvature objective,
#: else the curvature objective that did best on VALIDATION data in the accuracy
#: benchmark's non-convex model (docs/results.md: "noisecurve-all-iterates"; no
#: curvature objective beat DP-BandMF there, so the library default may be "bandmf").
CURVATURE_OBJECTIVES = tuple(_workloads.CURVATURE_OBJECTIVES)
_BEST_CURVATURE_OBJECTIVE = "noisecurve-all-iterates"
NOISECURVE_OBJECTIVE = _LIBRARY_DEFAULT if _LIBRARY_DEFAULT in CURVATURE_OBJECTIVES else _BEST_CURVATURE_OBJECTIVE
_OBJECTIVE_SOURCE = (
    "keras_noisecurve.mixing.DEFAULT_OBJECTIVE"
    if _LIBRARY_DEFAULT in CURVATURE_OBJECTIVES
    else "keras_noisecurve.demo.NOISECURVE_OBJECTIVE"
)

METHODS = ("DP-SGD", "DP-BandMF", "NoiseCurve")


class _Fail(Exception):
    """A user error: message printed, exit status 2."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``noisecurve demo``."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about 1-2 min): 128 public images, 2 epochs, b=4, a rough top-8 spectrum")
    parser.add_argument("--out", default="noisecurve_out", help="output folder for plots and results (default ./noisecurve_out)")
    parser.add_argument("--epsilon", type=float, default=2.0, help="target epsilon (default 2)")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 10; --quick 2)")
    parser.add_argument("--bands", type=int, default=None, help="band width b of the correlated methods (default 4; B*b must not exceed the 3,500 training images)")
    parser.add_argument("--batch-size", type=int, default=250, help="expected batch size B (default 250)")
    parser.add_argument("--learning-rate", type=float, default=None, help="SGD learning rate (default 1.0)")
    parser.add_argument("--clip", type=float, default=1.0, help="per-example L2 clip norm (default 1)")
    parser.add_argument("--objective", default=NOISECURVE_OBJECTIVE, choices=CURVATURE_OBJECTIVES,
                        help=f"curvature objective of the NoiseCurve row (default {NOISECURVE_OBJECTIVE})")
    parser.add_argument("--public", default="digits", choices=("digits", "mnist-heldout"),
                        help="public (unlabeled) data: scikit-learn digits (default) or a held-out MNIST slice")
    parser.add_argument("--public-size", type=int, default=None,
                        help="number of public images for the spectrum (default 512; --quick 128)")
    parser.add_argument("--top-k", type=int, default=None, help="Lanczos eigenvalues (default 32; --quick 8)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the initial weights, the public subset and the spectrum (default 0)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also seed the batch sampler and the noise from --seed (reproducible, for tests; "
                             "a known noise seed voids the privacy guarantee). Default: OS entropy")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")


def _defaults(args) -> dict:
    quick = args.quick
    cfg = {
        "epochs": args.epochs if args.epochs is not None else (2 if quick else 10),
        "bands": args.bands if args.bands is not None else 4,
        "learning_rate": args.learning_rate if args.learning_rate is not None else 1.0,
        "top_k": args.top_k if args.top_k is not None else (8 if quick else 32),
        "public_size": args.public_size,
        "pretrain_epochs": 1 if quick else 4,
        "slq_probes": 2 if quick else 4,
        "slq_steps": 12 if quick else 24,
        "val_size": 500,
        "test_size": 1000,
        "eval_size": 500 if quick else 1000,
    }
    if cfg["public_size"] is None:
        cfg["public_size"] = 128 if quick else 512
    return cfg


def _validate(args, cfg) -> None:
    def need(cond, msg):
        if not cond:
            raise _Fail(msg)

    need(args.epsilon > 0, f"--epsilon must be > 0, got {args.epsilon}")
    need(0 < args.delta < 1, f"--delta must lie in (0, 1), got {args.delta}")
    need(cfg["epochs"] >= 1, f"--epochs must be >= 1, got {cfg['epochs']}")
    need(cfg["bands"] >= 2, f"--bands must be >= 2 (b = 1 is DP-SGD, which the demo always runs), got {cfg['bands']}")
    need(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    need(cfg["learning_rate"] > 0, f"--learning-rate must be > 0, got {cfg['learning_rate']}")
    need(args.clip > 0, f"--clip must be > 0, got {args.clip}")
    need(cfg["top_k"] >= 2, f"--top-k must be >= 2, got {cfg['top_k']}")
    need(cfg["public_size"] >= 16, f"--public-size must be >= 16, got {cfg['public_size']}")
    need(args.seed >= 0, f"--seed must be >= 0, got {args.seed}")
    if args.public == "digits":
        need(cfg["public_size"] <= 1797, f"--public-size must be <= 1797 for --public digits, got {cfg['public_size']}")
    else:
        need(cfg["public_size"] <= 2000, f"--public-size must be <= 2000 for --public mnist-heldout, got {cfg['public_size']}")


def _log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(args) -> int:
    """Run the demo; returns 0 on success, 2 on a bad flag."""
    cfg = _defaults(args)
    try:
        _validate(args, cfg)
        return _run(args, cfg)
    except _Fail as exc:
        print(f"noisecurve demo: error: {exc}", file=sys.stderr)
        return 2


def _run(args, cfg) -> int:
    started = time.perf_counter()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise _Fail(f"--out {args.out!r} cannot be created: {exc}") from exc
    import numpy as np

    from keras_noisecurve import data as kdata

    _log(f"NoiseCurve objective: {args.objective!r}"
         + (f" (default, from {_OBJECTIVE_SOURCE})" if args.objective == NOISECURVE_OBJECTIVE else " (from --objective)"))
    _log("loading data: private = bundled MNIST-5k, public = "
         + ("scikit-learn digits (unlabeled)" if args.public == "digits" else "held-out MNIST slice (unlabeled)"))
    if args.public == "mnist-heldout":
        splits = kdata.load_mnist5k(public_size=cfg["public_size"])
        x_public = kdata.load_public("mnist-heldout", splits=splits)
    else:
        splits = kdata.load_mnist5k()
        x_public = kdata.load_public("digits", max_examples=cfg["public_size"], seed=args.seed)
    x_train, y_train = splits.x_train, splits.y_train
    x_test, y_test = splits.x_test[: cfg["eval_size"]], splits.y_test[: cfg["eval_size"]]
    n = len(y_train)
    batch = args.batch_size
    bands = cfg["bands"]
    if batch * bands > n:
        raise _Fail(f"--batch-size {batch} x --bands {bands} = {batch * bands} exceeds the {n} training images "
                    "(cyclic Poisson sampling needs B*b <= n)")
    steps_per_epoch = max(1, round(n / batch))
    steps = cfg["epochs"] * steps_per_epoch
    if bands > steps:
        raise _Fail(f"--bands {bands} exceeds the number of steps {steps}")
    _log(f"private n={n}, public {len(x_public)} images, test {len(y_test)}; B={batch}, "
         f"T={steps} steps ({cfg['epochs']} epochs x {steps_per_epoch}), b={bands}, "
         f"eta={cfg['learning_rate']}, clip={args.clip}")

    import keras
    import tensorflow as tf

    import keras_noisecurve as knc
    from keras_noisecurve.mixing.diagnostics import noise_diagnostics

    tf.get_logger().setLevel("ERROR")  # vectorized_map's "uses a while_loop" notices are not progress
    from keras_noisecurve.models import small_groupnorm_cnn
    from keras_noisecurve.spectrum import clipping_scale

    keras.utils.set_random_seed(args.seed)
    base = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=args.seed)
    base.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial_weights = [w.copy() for w in base.get_weights()]
    _log(f"model: small GroupNorm CNN, {base.count_params():,} parameters")
    _check_training_steps(x_train, y_train, batch=batch, bands=bands, eta=cfg["learning_rate"], clip=args.clip,
                          seed=args.seed)

    # ---------------------------------------------------------------- spectrum
    t0 = time.perf_counter()
    _log(f"spectrum: random-label pre-training ({cfg['pretrain_epochs']} epochs) on public data, "
         f"then Lanczos top-{cfg['top_k']} + SLQ + tail fit ...")
    spectrum = knc.estimate_spectrum(
        base, x_public, pretrain_epochs=cfg["pretrain_epochs"], method="lanczos", top_k=cfg["top_k"],
        slq_probes=cfg["slq_probes"], slq_steps=cfg["slq_steps"], seed=args.seed, verbose=True,
    )
    scale = clipping_scale(base, x_public, l2_norm_clip=args.clip, seed=args.seed)
    curvature = spectrum.scaled(scale)
    spectrum.save(os.path.join(args.out, "spectrum.npz"))
    eta = cfg["learning_rate"]
    _log(f"spectrum: mu_max={spectrum.max_eigenvalue:.4g}, trace={spectrum.trace():.4g}, "
         f"clipping scale s={scale:.3f} -> eta*s*mu_max={eta * curvature.max_eigenvalue:.3g} "
         f"({time.perf_counter() - t0:.0f}s)")
    if eta * curvature.max_eigenvalue >= 2:
        raise _Fail(f"--learning-rate {eta} makes eta*mu_max = {eta * curvature.max_eigenvalue:.3g} >= 2 "
                    "(gradient descent on the upper bound diverges); lower it")

    # ---------------------------------------------------------- mixing matrices
    t0 = time.perf_counter()
    _log(f"solving C: DP-BandMF and {args.objective} (T={steps}, b={bands}) ...")
    mixings = {
        "DP-SGD": knc.MixingMatrix.identity(steps),
        "DP-BandMF": knc.solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf"),
    }
    kwargs = {"blend_weight": "auto"} if args.objective == "noisecurve-blend" else {}
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixings["NoiseCurve"] = knc.solve_mixing_matrix(
            steps=steps, bands=bands, objective=args.objective, spectrum=curvature, learning_rate=eta, **kwargs
        )
    for w in caught:
        _log(f"solver warning: {w.message}")
    for name, mixing in mixings.items():
        if name != "DP-SGD":
            mixing.save(os.path.join(args.out, f"mixing_{name.lower().replace('-', '')}.npz"))
    diagnostics = {name: noise_diagnostics(m) for name, m in mixings.items()}
    _log(f"solved ({time.perf_counter() - t0:.0f}s); peak running-noise-sum std: "
         + ", ".join(f"{k} {d['prefix_std_max']:.2f}" for k, d in diagnostics.items()))

    # --------------------------------------------------------------- accounting
    t0 = time.perf_counter()
    sigmas = {}
    for name in METHODS:
        b = 1 if name == "DP-SGD" else bands
        if b not in sigmas:
            sigmas[b] = knc.calibrate_noise_multiplier(
                epsilon=args.epsilon, delta=args.delta, num_examples=n, batch_size=batch, steps=steps, bands=b
            )
    epsilons = {
        b: knc.compute_epsilon(noise_multiplier=s, delta=args.delta, num_examples=n, batch_size=batch,
                               steps=steps, bands=b)
        for b, s in sigmas.items()
    }
    _log(f"calibrated sigma for (eps={args.epsilon}, delta={args.delta}): "
         + ", ".join(f"b={b}: sigma={s:.3f}" for b, s in sigmas.items()) + f" ({time.perf_counter() - t0:.0f}s)")

    # ----------------------------------------------------------------- training
    results = {}
    for i, name in enumerate(METHODS):
        b = 1 if name == "DP-SGD" else bands
        t0 = time.perf_counter()
        _log(f"training {name} ({i + 1}/3): b={b}, sigma={sigmas[b]:.3f} ...")
        model, private = _private_cnn(mixing=mixings[name], eta=eta, clip=args.clip, sigma=sigmas[b], batch=batch,
                                      seed=args.seed,
                                      noise_seed=(args.seed + 1000 * i + 1) if args.deterministic else None)
        model.set_weights(initial_weights)
        dataset = knc.banded_poisson_dataset(x_train, y_train, batch_size=batch, bands=b, steps=steps,
                                             seed=(args.seed + 1) if args.deterministic else None)
        curve = _epoch_accuracy_callback(model, x_test, y_test, steps_per_epoch, name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[curve])
        acc = _accuracy(model, x_test, y_test)
        results[name] = {
            "test_accuracy": acc, "epsilon": epsilons[b], "sigma": sigmas[b], "bands": b,
            "seconds": time.perf_counter() - t0, "accuracy_per_epoch": curve.history,
        }
        _log(f"{name}: test accuracy {100 * acc:.2f} % ({results[name]['seconds']:.0f}s)")

    # ------------------------------------------------------------------ output
    table = _table(results)
    print()
    print(f"Results (eps={args.epsilon}, delta={args.delta}; MNIST-5k, {n} private / {len(y_test)} test images; "
          f"NoiseCurve objective {args.objective!r}):")
    print(table)
    summary = {
        "objective": args.objective, "epsilon": args.epsilon, "delta": args.delta, "steps": steps,
        "bands": bands, "batch_size": batch, "learning_rate": eta, "clip": args.clip, "seed": args.seed,
        "clipping_scale": scale, "results": results,
        "noise": {k: {kk: v for kk, v in d.items() if not isinstance(v, list)} for k, d in diagnostics.items()},
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")
    if not args.no_plots:
        _plots(args.out, spectrum, mixings, diagnostics, results, steps_per_epoch)
        _log(f"plots: {', '.join(PLOT_FILES)} in {args.out}/")
    _log(f"done in {time.perf_counter() - started:.0f}s; results in {args.out}/results.json")
    return 0


def _private_cnn(*, mixing, eta, clip, sigma, batch, seed, noise_seed):
    """The demo's private model: the small GroupNorm CNN, per-example clipping, correlated noise."""
    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.models import small_groupnorm_cnn

    model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=seed)
    private = knc.make_private(model)
    private.compile(
        optimizer=knc.NoiseCurveOptimizer(
            learning_rate=eta, mixing=mixing, l2_norm_clip=clip, noise_multiplier=sigma,
            expected_batch_size=batch, seed=noise_seed,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model, private


def _check_training_steps(x, y, *, batch, bands, eta, clip, seed) -> None:
    """Trace and run one training step of each configuration the demo trains (b = 1, b = bands).

    Same model, clipping engine, optimizer and sampler as the real runs, on a
    two-band-cycle plan; the models are thrown away. A step that cannot run on this
    machine (a kernel, a layer rule) fails here, in seconds, not after the minutes of
    spectrum estimation.
    """
    import warnings

    import keras_noisecurve as knc

    t0 = time.perf_counter()
    _log("checking one training step of each configuration (b=1 and b=%d) ..." % bands)
    for b in sorted({1, bands}):
        mixing = (knc.MixingMatrix.identity(2) if b == 1
                  else knc.solve_mixing_matrix(steps=2 * b, bands=b, objective="bandmf"))
        _, private = _private_cnn(mixing=mixing, eta=eta, clip=clip, sigma=1.0, batch=batch, seed=seed,
                                  noise_seed=0)
        dataset = knc.banded_poisson_dataset(x, y, batch_size=batch, bands=b, steps=mixing.steps, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private.fit(dataset, epochs=1, steps_per_epoch=1, verbose=0)
    _log(f"training steps run ({time.perf_counter() - t0:.0f}s)")


def _accuracy(model, x, y, batch_size: int = 500) -> float:
    import numpy as np

    correct = 0
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size], training=False)
        correct += int(np.sum(np.argmax(np.asarray(logits), axis=1) == y[start : start + batch_size]))
    return correct / len(y)


def _epoch_accuracy_callback(model, x, y, steps_per_epoch, name):
    """A Keras callback: test accuracy every ``steps_per_epoch`` optimizer steps (one epoch on average)."""
    import keras

    class EpochAccuracy(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.history = []

        def on_train_batch_end(self, batch, logs=None):
            if (batch + 1) % steps_per_epoch == 0:
                acc = _accuracy(model, x, y)
                self.history.append(acc)
                _log(f"  {name} epoch {len(self.history)}: test accuracy {100 * acc:.2f} %")

    return EpochAccuracy()


def _table(results) -> str:
    lines = ["| method | test accuracy | epsilon | sigma | b | wall time |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {100 * r['test_accuracy']:.2f} % | {r['epsilon']:.3f} | {r['sigma']:.3f} | "
                     f"{r['bands']} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


PLOT_FILES = ("spectrum.png", "mixing_matrices.png", "noise.png", "accuracy.png")


def _plots(out, spectrum, mixings, diagnostics, results, steps_per_epoch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    # spectrum: eigenvalue vs index (cumulative multiplicity), Lanczos part and fitted tail
    values, mults = spectrum.eigenvalues, spectrum.multiplicities
    index = np.cumsum(mults)
    tail = spectrum.tail_info()
    fig, ax = plt.subplots(figsize=(6, 4))
    keep = values > 0
    if tail:
        first = tail["first_index"]
        top = keep & (index < first)
        rest = keep & (index >= first)
        ax.loglog(index[top], values[top], "o", ms=3, label="Lanczos top-k")
        ax.loglog(index[rest], values[rest], "-", label=f"fitted tail (alpha={tail.get('alpha', float('nan')):.2f})")
    else:
        ax.loglog(index[keep], values[keep], "o-", ms=3, label="eigenvalues")
    ax.set_xlabel("index i (cumulative multiplicity)")
    ax.set_ylabel("eigenvalue mu_i of the Hessian upper bound")
    ax.set_title("Spectrum (public data, random-label pre-training)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "spectrum.png"), dpi=110)
    plt.close(fig)

    names = [k for k in mixings if k != "DP-SGD"]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4.2))
    for ax, name in zip(np.atleast_1d(axes), names):
        dense = np.abs(mixings[name].to_dense())
        im = ax.imshow(np.log10(np.maximum(dense, 1e-6)), cmap="viridis", vmin=-4, vmax=0)
        ax.set_title(f"log10 |C|: {name}")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "mixing_matrices.png"), dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, d in diagnostics.items():
        a1.plot(d["step_std"], label=name)
        a2.plot(d["prefix_std"], label=name)
    a1.set_title("per-step noise std ||C^-1[t,:]||")
    a2.set_title("running-sum noise std ||(A C^-1)[t,:]||")
    for ax in (a1, a2):
        ax.set_xlabel("step t")
        ax.legend()
    a1.set_yscale("log")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "noise.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in results.items():
        hist = r["accuracy_per_epoch"]
        ax.plot(np.arange(1, len(hist) + 1), [100 * a for a in hist], "o-", label=name)
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Accuracy per epoch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=110)
    plt.close(fig)
