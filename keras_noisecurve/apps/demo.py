"""``noisecurve demo``: the whole pipeline, end to end, on data that ships with PyPI packages.

1. Data: private = the bundled MNIST-5k training split (3,500 images, labels
   used); public = scikit-learn's digits in MNIST format (no labels), or an
   unlabeled held-out MNIST slice with ``--public mnist-heldout``
   (``keras_noisecurve.apps.data``).
2. Model: the paper's small GroupNorm CNN adapted to 28×28×1
   (``keras_noisecurve.apps.models.small_groupnorm_cnn``).
3. Spectrum: random-label pre-training on the public images, then Lanczos top-k +
   SLQ count + power-law tail (paper §4), scaled by the public clipping factor.
4. Mixing matrices: DP-BandMF's b and C are ``choose_mixing``'s choice for the run and
   its update rule (``PrivateRun(mixing="auto")``; ``--bands`` overrides it); NoiseCurve
   (its objective, default ``NOISECURVE_OBJECTIVE``) is solved at the same b for its update
   rule; DP-SGD is C = I.
5. Accounting: σ calibrated for (ε, δ) under cyclic Poisson sampling (b bands for
   the matrix-factorisation methods, b = 1 for DP-SGD; the chooser's calibrations).
6. Training: DP-SGD, DP-BandMF and NoiseCurve side by side, each with its training
   configuration from ``keras_noisecurve.apps.demo_configs`` (learning rate, clip norm,
   momentum, schedule, b; flags override every method), the same batch size and
   steps, ``--seeds N`` times with paired seeds (seed s: the same initial weights for
   every method and, with ``--deterministic``, the same batches and raw noise). The
   spectrum and the mixing matrices are computed once. One table (mean ± std test
   accuracy over the N seeds), one of predicted against measured (each method's predicted
   noise of the updates against DP-SGD beside its paired accuracy difference,
   ``demo_predict``) and plots (spectrum, band values C[t, t − j] of each correlated C,
   per-step and running-sum noise std in model units, test accuracy per epoch) in
   ``--out``; results.json keeps every run.

The default (ε = 8, B = 250, 5 epochs: T = 70, 3 seeds) is a setting where the chooser
predicts a clear gain (DP-BandMF b = 12, noise std −42 %); at ε = 2 it predicts −10 % (b = 7).
``--quick`` runs one seed, fewer public images, steps and Lanczos iterations and caps the
auto choice at b ≤ 4: a smoke test, not a meaningful comparison. Run times:
docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from keras_noisecurve.apps import demo_configs
from keras_noisecurve.apps import demo_predict
from keras_noisecurve.apps import demo_report
from keras_noisecurve.apps.demo_report import PLOT_FILES
from keras_noisecurve.apps.demo_configs import CONFIGS, CURVATURE_OBJECTIVES, METHODS, PROVENANCE, is_auto
from keras_noisecurve.mixing.objectives import get_objective
from keras_noisecurve.mixing.rule_workloads import check_rule_objective

#: The curvature objective the demo uses for its NoiseCurve row: the "objective" of
#: ``keras_noisecurve.apps.demo_configs.CONFIGS["NoiseCurve"]`` (by default
#: ``keras_noisecurve.mixing.DEFAULT_OBJECTIVE`` when that is a curvature objective, else
#: the curvature objective that did best on VALIDATION data in the accuracy benchmark's
#: non-convex model; see ``demo_configs.NOISECURVE_OBJECTIVE``).
NOISECURVE_OBJECTIVE = CONFIGS["NoiseCurve"]["objective"]
_OBJECTIVE_SOURCE = (
    demo_configs.OBJECTIVE_SOURCE if NOISECURVE_OBJECTIVE == demo_configs.NOISECURVE_OBJECTIVE
    else "keras_noisecurve.apps.demo_configs.CONFIGS"
)

#: The band width the step check runs for a method whose b is chosen later (``AUTO``).
_CHECK_BANDS = 2

#: Command-line flags that override a field of every method's configuration.
_OVERRIDES = {"learning_rate": "--learning-rate", "clip": "--clip", "momentum": "--momentum", "bands": "--bands"}


class _Fail(Exception):
    """A user error: message printed, exit status 2."""


def _per_method(field: str) -> str:
    values = {m: CONFIGS[m][field] for m in METHODS if not (field == "bands" and m == "DP-SGD")}
    if len(set(values.values())) == 1:
        who = "DP-BandMF and NoiseCurve" if field == "bands" else "every method"
        value = next(iter(values.values()))
        if field == "bands" and is_auto(value):
            return ("'auto' (DP-BandMF's b and C chosen by choose_mixing for the run and its update rule, "
                    "NoiseCurve at the same b)")
        return f"{value} for {who}"
    return ", ".join(f"{m} {v}" for m, v in values.items())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``noisecurve demo``."""
    parser.add_argument("--quick", action="store_true",
                        help="smoke run (about 2 min): one seed, 128 public images, 2 epochs, a rough top-8 "
                             f"spectrum, the auto choice capped at b <= {demo_predict.QUICK_MAX_BANDS}")
    parser.add_argument("--out", default="noisecurve_out", help="output folder for plots and results (default ./noisecurve_out)")
    parser.add_argument("--epsilon", type=float, default=8.0,
                        help="target epsilon (default 8: the chooser predicts a clear gain of correlated noise "
                             "there; at 2 it predicts about 10 %% lower noise std, a gain too small to see over 3 seeds)")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--epochs", type=int, default=None, help="training epochs (default 5; --quick 2)")
    parser.add_argument("--seeds", type=int, default=None,
                        help="train each method N times, with paired seeds --seed, --seed+1, ...; the table shows "
                             "mean ± std test accuracy over the N runs, results.json keeps every run; the spectrum "
                             "and the mixing matrices are computed once (default 3; --quick 1)")
    parser.add_argument("--bands", type=int, default=None,
                        help="band width b of DP-BandMF and NoiseCurve, overriding both methods' configuration "
                             "and the auto choice (choose_mixing is then not run; DP-BandMF's C is solved for b; "
                             "DP-SGD is b=1; B*b must not exceed the 3,500 training images). Default from "
                             f"keras_noisecurve.apps.demo_configs: {_per_method('bands')}")
    parser.add_argument("--batch-size", type=int, default=250, help="expected batch size B (default 250)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="SGD learning rate eta of EVERY method, overriding the per-method configuration. "
                             f"Default from keras_noisecurve.apps.demo_configs: {_per_method('learning_rate')}")
    parser.add_argument("--clip", type=float, default=None,
                        help="per-example L2 clip norm of EVERY method, overriding the per-method configuration. "
                             f"Default from keras_noisecurve.apps.demo_configs: {_per_method('clip')}")
    parser.add_argument("--momentum", type=float, default=None,
                        help="heavy-ball momentum beta in [0, 1) of EVERY method, overriding the per-method "
                             "configuration (recorded in results.json); momentum > 0 trains with "
                             "NoiseCurveOptimizer(inner=keras.optimizers.SGD(lr, momentum=beta)) and the mixing "
                             "matrices are solved for that update rule. Default from "
                             f"keras_noisecurve.apps.demo_configs: {_per_method('momentum')}")
    parser.add_argument("--objective", default=None, choices=CURVATURE_OBJECTIVES,
                        help=f"curvature objective of the NoiseCurve row (default {NOISECURVE_OBJECTIVE})")
    parser.add_argument("--public", default="digits", choices=("digits", "mnist-heldout"),
                        help="public (unlabeled) data: scikit-learn digits (default) or a held-out MNIST slice")
    parser.add_argument("--public-size", type=int, default=None,
                        help="number of public images for the spectrum (default 128)")
    parser.add_argument("--top-k", type=int, default=None, help="Lanczos eigenvalues (default 12; --quick 8)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the public subset and the spectrum, and the first training seed "
                             "(run r of --seeds uses seed S+r for the initial weights) (default 0)")
    parser.add_argument("--deterministic", action="store_true",
                        help="also seed the batch sampler and the noise from each run's seed (reproducible, for "
                             "tests; a known noise seed voids the privacy guarantee). Default: OS entropy")
    parser.add_argument("--no-plots", action="store_true", help="skip the matplotlib plots")


def _defaults(args) -> dict:
    quick = args.quick
    cfg = {
        "epochs": args.epochs if args.epochs is not None else (2 if quick else 5),
        "top_k": args.top_k if args.top_k is not None else (8 if quick else 12),
        "public_size": args.public_size,
        # what the NoiseCurve objective needs: the top of the spectrum to ~1e-4 and a rough tail
        "pretrain_epochs": 1 if quick else 2,
        "slq_probes": 2,
        "slq_steps": 12,
        "lanczos_tol": 1e-4,
        "val_size": 500,
        "test_size": 1000,
        "eval_size": 500 if quick else 1000,
        "seeds": args.seeds if args.seeds is not None else (1 if quick else 3),
    }
    if cfg["public_size"] is None:
        cfg["public_size"] = 128
    methods, overridden = {}, {}
    objective = args.objective if args.objective is not None else CONFIGS["NoiseCurve"]["objective"]
    for name in METHODS:
        m = dict(CONFIGS[name])
        for field, flag in _OVERRIDES.items():
            value = getattr(args, field)
            if value is None or (field == "bands" and name == "DP-SGD"):
                continue
            m[field] = value
            overridden.setdefault(name, []).append(flag)
        if name == "NoiseCurve":
            m["objective"] = objective
            if args.objective is not None:
                overridden.setdefault(name, []).append("--objective")
        methods[name] = m
    cfg["methods"] = methods
    cfg["overridden"] = overridden
    return cfg


def _validate(args, cfg) -> None:
    def need(cond, msg):
        if not cond:
            raise _Fail(msg)

    need(args.epsilon > 0, f"--epsilon must be > 0, got {args.epsilon}")
    need(0 < args.delta < 1, f"--delta must lie in (0, 1), got {args.delta}")
    need(cfg["epochs"] >= 1, f"--epochs must be >= 1, got {cfg['epochs']}")
    need(cfg["seeds"] >= 1, f"--seeds must be >= 1 (the number of training runs per method), got {cfg['seeds']}")
    if args.bands is not None:
        need(args.bands >= 2, f"--bands must be >= 2 (b = 1 is DP-SGD, which the demo always runs), got {args.bands}")
    need(args.batch_size >= 1, f"--batch-size must be >= 1, got {args.batch_size}")
    if args.learning_rate is not None:
        need(args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate}")
    if args.clip is not None:
        need(args.clip > 0, f"--clip must be > 0, got {args.clip}")
    if args.momentum is not None:
        need(0 <= args.momentum < 1, f"--momentum must lie in [0, 1), got {args.momentum}")
    need(cfg["top_k"] >= 2, f"--top-k must be >= 2, got {cfg['top_k']}")
    need(cfg["public_size"] >= 16, f"--public-size must be >= 16, got {cfg['public_size']}")
    need(args.seed >= 0, f"--seed must be >= 0, got {args.seed}")
    if args.public == "digits":
        need(cfg["public_size"] <= 1797, f"--public-size must be <= 1797 for --public digits, got {cfg['public_size']}")
    else:
        need(cfg["public_size"] <= 2000, f"--public-size must be <= 2000 for --public mnist-heldout, got {cfg['public_size']}")
    try:
        demo_configs.validate_configs(cfg["methods"])
        nc = cfg["methods"]["NoiseCurve"]
        # an objective derived only for plain SGD, with momentum or a schedule: say so now,
        # not after minutes of spectrum estimation
        check_rule_objective(nc["objective"], _update_rule(nc))
    except ValueError as exc:
        raise _Fail(f"NoiseCurve: {exc}" if "update rule" in str(exc) else str(exc)) from exc


def _source(name, field, cfg) -> str:
    flag = _OVERRIDES.get(field, "--objective" if field == "objective" else None)
    return flag if flag in cfg["overridden"].get(name, ()) else "keras_noisecurve.apps.demo_configs"


def _is_plain(m) -> bool:
    """Plain SGD with a constant learning rate: what every C was solved for before update rules."""
    return m["momentum"] == 0 and m["schedule"] == "constant"


def _update_rule(m):
    import keras_noisecurve as knc

    return knc.UpdateRule(momentum=m["momentum"], schedule=m["schedule"])


def _solve(*, steps, bands, objective, m, **kwargs):
    """``solve_mixing_matrix`` for the update rule of configuration ``m``. For plain SGD with a
    constant learning rate nothing is added to the call (the solver's default rule)."""
    import keras_noisecurve as knc

    if not _is_plain(m):
        kwargs["update_rule"] = _update_rule(m)
    return knc.solve_mixing_matrix(steps=steps, bands=bands, objective=objective, **kwargs)


def _describe(m) -> str:
    text = (f"eta={m['learning_rate']:g}, clip={m['clip']:g}, momentum={m['momentum']:g}, {m['schedule']} lr, "
            f"b={m['bands']}")
    if "objective" in m:
        text += f", objective {m['objective']!r}"
    return text


def _log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(args) -> int:
    """Run the demo; returns 0 on success, 2 on a bad flag."""
    try:
        cfg = _defaults(args)
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

    from keras_noisecurve.apps import data as kdata

    methods = cfg["methods"]
    objective = methods["NoiseCurve"]["objective"]
    _log(f"NoiseCurve objective: {objective!r}"
         + (" (from --objective)" if args.objective is not None
            else f" (default, from {_OBJECTIVE_SOURCE})"))
    _log(f"training configuration ({PROVENANCE}):")
    for name, m in methods.items():
        flags = cfg["overridden"].get(name)
        _log(f"  {name}: {_describe(m)}" + (f" ({', '.join(flags)} from the command line)" if flags else ""))
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
    steps_per_epoch = max(1, round(n / batch))
    steps = cfg["epochs"] * steps_per_epoch
    for name, m in methods.items():
        b = m["bands"]
        if is_auto(b):  # the chooser considers the b the sampling allows: B*b < n
            if (n - 1) // batch < 2:
                raise _Fail(f"--batch-size {batch}: no b >= 2 has B*b < {n} for the auto choice; give a smaller one")
            continue
        if batch * b > n:
            where = "--bands" if _source(name, "bands", cfg) == "--bands" else f"{name}'s bands"
            raise _Fail(f"--batch-size {batch} x {where} {b} = {batch * b} exceeds the {n} training images "
                        "(cyclic Poisson sampling needs B*b <= n)")
        if b > steps:
            raise _Fail(f"{name}: bands {b} exceeds the number of steps {steps}")
    seeds = [args.seed + r for r in range(cfg["seeds"])]
    _log(f"private n={n}, public {len(x_public)} images, test {len(y_test)}; B={batch}, "
         f"T={steps} steps ({cfg['epochs']} epochs x {steps_per_epoch}); "
         f"{len(seeds)} seed{'s' if len(seeds) > 1 else ''} ({', '.join(map(str, seeds))})")

    import keras

    import keras_noisecurve as knc
    from keras_noisecurve import backend
    from keras_noisecurve.mixing.diagnostics import noise_diagnostics

    backend.module("devices").quiet_python_logs()  # notices that are not progress
    from keras_noisecurve.apps.models import small_groupnorm_cnn
    from keras_noisecurve.spectrum import clipping_scale

    keras.utils.set_random_seed(args.seed)
    base = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=args.seed)
    base.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial_weights = {args.seed: [w.copy() for w in base.get_weights()]}
    _log(f"model: small GroupNorm CNN, {base.count_params():,} parameters")
    _check_training_steps(x_train, y_train, batch=batch, configs=methods, seed=args.seed)

    # ----------------------------------------------------- the auto choice of b and C
    choice, picked = demo_predict.auto_bands(methods, num_examples=n, batch_size=batch, steps=steps,
                                             epsilon=args.epsilon, delta=args.delta, quick=args.quick, log=_log)

    # ---------------------------------------------------------------- spectrum
    t0 = time.perf_counter()
    _log(f"spectrum: random-label pre-training ({cfg['pretrain_epochs']} epochs) on public data, "
         f"then Lanczos top-{cfg['top_k']} + SLQ + tail fit ...")
    spectrum = knc.estimate_spectrum(
        base, x_public, pretrain_epochs=cfg["pretrain_epochs"], method="lanczos", top_k=cfg["top_k"],
        slq_probes=cfg["slq_probes"], slq_steps=cfg["slq_steps"], lanczos_tol=cfg["lanczos_tol"], seed=args.seed,
        verbose=True,
    )
    scales = {}
    for m in methods.values():
        if m["clip"] not in scales:
            scales[m["clip"]] = clipping_scale(base, x_public, l2_norm_clip=m["clip"], seed=args.seed)
    spectrum.save(os.path.join(args.out, "spectrum.npz"))
    nc = methods["NoiseCurve"]
    scale = scales[nc["clip"]]
    curvature = spectrum.scaled(scale)
    _log(f"spectrum: mu_max={spectrum.max_eigenvalue:.4g}, trace={spectrum.trace():.4g}, "
         f"clipping scale s={scale:.3f} (clip {nc['clip']:g}) -> NoiseCurve eta*s*mu_max="
         f"{nc['learning_rate'] * curvature.max_eigenvalue:.3g} ({time.perf_counter() - t0:.0f}s)")
    for name, m in methods.items():
        rate = m["learning_rate"] * scales[m["clip"]] * spectrum.max_eigenvalue
        limit = _update_rule(m).max_stable_rate()  # heavy ball on a quadratic: stable iff eta*mu < 2(1 + beta)
        if rate >= limit:
            raise _Fail(f"{name}: learning rate {m['learning_rate']:g} (from {_source(name, 'learning_rate', cfg)}) "
                        f"makes eta*mu_max = {rate:.3g} >= {limit:g} (gradient descent on the upper bound "
                        "diverges); lower it")

    # ---------------------------------------------------------- mixing matrices
    t0 = time.perf_counter()
    bm = methods["DP-BandMF"]
    _log(f"solving C: DP-BandMF (b={bm['bands']}) and {objective} (b={nc['bands']}), T={steps} ...")
    from_choice = choice is not None and picked is choice.chosen and bm["bands"] == picked.size
    mixings = {
        "DP-SGD": knc.MixingMatrix.identity(steps),
        "DP-BandMF": choice.mixing if from_choice else _solve(steps=steps, bands=bm["bands"],
                                                              objective=demo_predict.BANDMF, m=bm),
    }
    kwargs = {"blend_weight": "auto"} if get_objective(objective).blend else {}
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mixings["NoiseCurve"] = _solve(steps=steps, bands=nc["bands"], objective=objective, m=nc,
                                       spectrum=curvature, learning_rate=nc["learning_rate"], **kwargs)
    for w in caught:
        _log(f"solver warning: {w.message}")
    for name, mixing in mixings.items():
        if name != "DP-SGD":
            mixing.save(os.path.join(args.out, f"mixing_{name.lower().replace('-', '')}.npz"))
    diagnostics = {name: noise_diagnostics(m) for name, m in mixings.items()}
    _log(f"solved ({time.perf_counter() - t0:.0f}s); peak plain running-noise-sum std per unit sigma: "
         + ", ".join(f"{k} {d['prefix_std_max']:.2f}" for k, d in diagnostics.items()))

    # --------------------------------------------------------------- accounting
    t0 = time.perf_counter()
    # the chooser's calibrations (the same accountant and target) where it made them
    sigmas = {} if choice is None else {1: choice.dpsgd.noise_multiplier, picked.size: picked.noise_multiplier}
    for name in METHODS:
        b = methods[name]["bands"]
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
    runs = {name: [] for name in METHODS}
    total = len(seeds) * len(METHODS)
    t_train = time.perf_counter()
    for r, seed in enumerate(seeds):
        if seed not in initial_weights:
            initial_weights[seed] = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32,
                                                        seed=seed).get_weights()
        for i, name in enumerate(METHODS):
            m = methods[name]
            b = m["bands"]
            t0 = time.perf_counter()
            label = name if len(seeds) == 1 else f"{name} seed {seed}"
            _log(f"training {label} ({r * len(METHODS) + i + 1}/{total}): b={b}, sigma={sigmas[b]:.3f} ...")
            run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=steps, mixing=mixings[name],
                                 noise_multiplier=sigmas[b], delta=args.delta,
                                 seed=(seed + 1) if args.deterministic else None)
            model, private = _private_cnn(run=run, config=m, seed=seed,
                                          noise_seed=(seed + 1) if args.deterministic else None)
            model.set_weights(initial_weights[seed])
            curve = _epoch_accuracy_callback(model, x_test, y_test, steps_per_epoch, label)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                private.fit(run.dataset(x_train, y_train), epochs=1, steps_per_epoch=steps, verbose=0,
                            callbacks=[curve, knc.callbacks.PrivacyBudget(run=run, verbose=0)])
            acc = _accuracy(model, x_test, y_test)
            runs[name].append({"seed": seed, "test_accuracy": acc, "seconds": time.perf_counter() - t0,
                               "accuracy_per_epoch": curve.history})
            _log(f"{label}: test accuracy {100 * acc:.2f} % ({runs[name][-1]['seconds']:.0f}s)")
    train_seconds = time.perf_counter() - t_train

    results = {}
    for name in METHODS:
        b = methods[name]["bands"]
        accs = [run_["test_accuracy"] for run_ in runs[name]]
        curves = np.array([run_["accuracy_per_epoch"] for run_ in runs[name]], dtype=np.float64)
        results[name] = {
            "test_accuracy": demo_report.mean(accs), "test_accuracy_std": demo_report.std(accs), "n": len(accs),
            "epsilon": epsilons[b], "sigma": sigmas[b], "bands": b, "config": methods[name],
            "seconds": demo_report.mean([run_["seconds"] for run_ in runs[name]]),
            "accuracy_per_epoch": curves.mean(axis=0).tolist(),
            "runs": runs[name],
        }
    paired = demo_report.paired_differences(runs) if len(seeds) > 1 else {}
    method_sigmas = {k: sigmas[methods[k]["bands"]] for k in METHODS}
    rows = demo_predict.attach(results, paired, demo_predict.predictions(mixings, method_sigmas, methods))
    comparison = demo_predict.comparison_lines(rows, rule=methods["DP-BandMF"], choice=choice)

    # ------------------------------------------------------------------ output
    table = demo_report.table(results)
    print()
    print(f"Results (eps={args.epsilon}, delta={args.delta}; MNIST-5k, {n} private / {len(y_test)} test images; "
          f"NoiseCurve objective {objective!r}"
          + (f"; mean ± std over {len(seeds)} paired seeds {seeds[0]}..{seeds[-1]}" if len(seeds) > 1 else "")
          + "):")
    print(table)
    for line in demo_report.paired_lines(paired):
        print(line)
    print()
    for line in comparison:
        print(line)
    print(f"Training configuration: {PROVENANCE}.")
    summary = {
        "objective": objective, "epsilon": args.epsilon, "delta": args.delta, "steps": steps,
        "batch_size": batch, "seed": args.seed, "seeds": seeds, "deterministic": bool(args.deterministic),
        "configs": methods, "overridden": cfg["overridden"], "provenance": PROVENANCE,
        "clipping_scale": scale, "clipping_scales": {str(k): v for k, v in scales.items()},
        "training_seconds": train_seconds, "results": results, "paired_differences": paired,
        "noise": {k: {kk: v for kk, v in d.items() if not isinstance(v, list)} for k, d in diagnostics.items()},
        "bands_from": "--bands" if args.bands is not None else ("auto" if choice is not None
                                                                else "keras_noisecurve.apps.demo_configs"),
        "mixing_choice": None if choice is None else dict(
            choice.to_metadata(), trained=picked.label, expectation=choice.expectation(), summary=choice.summary()),
        "comparison": rows,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n" + "".join(line + "\n" for line in demo_report.paired_lines(paired))
                + "\n" + "".join(line + "\n" for line in comparison))
    if not args.no_plots:
        curves = demo_predict.noise_curves(mixings, method_sigmas, methods)
        demo_report.write_plots(args.out, spectrum, mixings, curves, results, steps_per_epoch)
        _log(f"plots: {', '.join(PLOT_FILES)} in {args.out}/")
    _log(f"done in {time.perf_counter() - started:.0f}s; results in {args.out}/results.json")
    return 0


def _private_cnn(*, run, config, seed, noise_seed):
    """The demo's private model: the small GroupNorm CNN, per-example clipping, the correlated
    noise of ``run`` (a ``PrivateRun``), trained with ``config``'s learning rate (and schedule
    over C's T steps), clip norm and momentum."""
    import keras

    import keras_noisecurve as knc
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=seed)
    private = knc.make_private(model)
    common = dict(run=run, l2_norm_clip=config["clip"], seed=noise_seed)
    # eta for a constant schedule, else a Keras schedule with eta*s_t over C's T steps
    learning_rate = knc.learning_rate_schedule(_update_rule(config), learning_rate=config["learning_rate"],
                                               steps=run.mixing.steps)
    if config["momentum"] > 0:
        optimizer = knc.NoiseCurveOptimizer(
            inner=keras.optimizers.SGD(learning_rate, momentum=config["momentum"]), **common
        )
    else:
        optimizer = knc.NoiseCurveOptimizer(learning_rate=learning_rate, **common)
    private.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model, private


def _check_training_steps(x, y, *, batch, configs, seed) -> None:
    """Trace and run one training step of each distinct configuration the demo trains.

    Same model, clipping engine, optimizer and sampler as the real runs, on a
    two-band-cycle plan (C solved for the configuration's update rule); the models are
    thrown away. A step that cannot run on this machine (a kernel, a layer rule, an
    optimizer option) fails here, in seconds, not after the minutes of spectrum estimation.
    """
    import warnings

    import keras_noisecurve as knc

    # the learning rate and the clip norm are numbers the same traced step takes: a
    # configuration that differs from a checked one only in those is not checked again
    distinct = {}
    for m in configs.values():
        if is_auto(m["bands"]):  # b is chosen later; the step's code is the same for every b >= 2
            m = dict(m, bands=_CHECK_BANDS)
        key = tuple(m[f] for f in demo_configs.FIELDS if f not in ("learning_rate", "clip"))
        distinct.setdefault(key, m)
    t0 = time.perf_counter()
    _log(f"checking one training step of each configuration ({len(distinct)}: "
         + ", ".join(f"b={m['bands']}" + ("" if _is_plain(m) else f" momentum {m['momentum']:g} {m['schedule']}")
                     for m in distinct.values()) + ") ...")
    for m in distinct.values():
        b = m["bands"]
        mixing = (knc.MixingMatrix.identity(2) if b == 1
                  else _solve(steps=2 * b, bands=b, objective=demo_predict.BANDMF, m=m))
        run = knc.PrivateRun(num_examples=len(y), batch_size=batch, steps=mixing.steps, mixing=mixing,
                             noise_multiplier=1.0, delta=1e-5, seed=0)
        _, private = _private_cnn(run=run, config=m, seed=seed, noise_seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private.fit(run.dataset(x, y), epochs=1, steps_per_epoch=1, verbose=0)
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
                _ = self.model  # on JAX, reading it puts the step's values into the variables (jax_state_sync)
                acc = _accuracy(model, x, y)
                self.history.append(acc)
                _log(f"  {name} epoch {len(self.history)}: test accuracy {100 * acc:.2f} %")

    return EpochAccuracy()
