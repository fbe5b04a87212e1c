"""Does ``mixing="auto"`` deliver the gain it predicts? The demo's CNN at a budget where it predicts one.

``keras_noisecurve.choose_mixing`` scores every mechanism of a run by σ(b)²·Tr(W X⁻¹) (W the
update rule's running-sum workload) and picks the smallest. This script trains the demo's
model — the small GroupNorm CNN on MNIST-5k, 3,500 private images, B = 250, T = 140,
heavy-ball momentum 0.9, ε = 8 by default, where the chooser predicts a clear gain — with
four mechanisms, each at its own σ calibrated to the same (ε, δ):

- ``dpsgd``: C = I (b = 1);
- ``auto``: the chooser's b and C for the run and its update rule
  (``PrivateRun(epsilon=..., mixing=<the MixingChoice>)``);
- ``bandmf``: DP-BandMF at the fixed b the docs recommended until now (``--fixed-bands``,
  default 4), C = ``solve_mixing_matrix(steps=T, bands=4, update_rule=rule)``;
- ``noisecurve``: the curvature objective (``--objective``, default ``noisecurve``: paper
  eq. 1, as the demo and ``accuracy_cnn.py``) solved at auto's b, with the public-data
  spectrum exactly as ``benchmarks/accuracy_cnn.py`` estimates it.

For each it reports the predicted noise variance relative to DP-SGD,
σ²·Tr(W X⁻¹) / (σ₁²·Tr(W)) (``objective_value(C, objective="bandmf", update_rule=rule)``),
the predicted lowering of the noise std 1 − √ratio, and the measured test accuracy over
paired seeds (seed s: the same initial weights, sampling key and raw noise seed for every
method; only C, b and σ differ), with paired differences to DP-SGD and to auto and
two-sided p-values of the paired t-test and the Wilcoxon signed-rank test.

Training goes through ``PrivateRun`` (σ calibrated by the run at the target ε) and
``PrivateModel.fit(run.dataset(x, y))``, which also runs on the JAX backend (several times
faster on this CPU than TensorFlow). Learning rates are NOT tuned here: each method takes
the η that ``accuracy_cnn.py`` tuned on validation at ε = 2 with momentum 0.9
(docs/results.md): 0.4 for DP-SGD and DP-BandMF, 0.2 for NoiseCurve, and DP-BandMF's 0.4
for auto (a DP-BandMF C too); clip norm 1 for all. Override with ``--lr``.

Every finished run is appended to ``--runs`` (JSON lines) and skipped on a re-run, so an
interrupted study continues where it stopped. Seeded sampling and noise are for
benchmarks only: a known seed voids the privacy guarantee.

Run (the numbers in docs/results.md; about 1 min per training run on 2 cores with JAX):

    KERAS_BACKEND=jax python benchmarks/auto_study.py --seeds 10 --out benchmarks/out/auto_study.md

``--quick`` is a smoke test (1 epoch, 2 seeds, 100 test images; meaningless numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

METHODS = ("dpsgd", "auto", "bandmf", "noisecurve")
DEFAULT_LR = {"dpsgd": 0.4, "auto": 0.4, "bandmf": 0.4, "noisecurve": 0.2}
DEFAULT_RUNS = "benchmarks/out/auto_study_runs.jsonl"


def log(msg: str) -> None:
    print(f"[auto_study {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--fixed-bands", type=int, default=4, help="b of the fixed DP-BandMF row (default 4)")
    p.add_argument("--objective", default="noisecurve", help="curvature objective of the NoiseCurve row")
    p.add_argument("--lr", nargs="+", default=[], metavar="METHOD=ETA",
                   help="learning rates η (not effective rates), e.g. auto=0.4; default "
                        + " ".join(f"{m}={v:g}" for m, v in DEFAULT_LR.items()))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--first-seed", type=int, default=100)
    p.add_argument("--runs", default=None, help=f"JSON lines of finished runs (default {DEFAULT_RUNS}; "
                                                 "none with --quick; '' for none)")
    p.add_argument("--spectrum", default="benchmarks/out/auto_study_spectrum.npz",
                   help="spectrum cache (estimated once from the public digits, as accuracy_cnn.py does)")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    args = p.parse_args(argv)
    args.lrs = dict(DEFAULT_LR)
    for item in args.lr:
        method, _, value = item.partition("=")
        if method not in METHODS or not value:
            p.error(f"--lr takes METHOD=ETA with METHOD in {METHODS}, got {item!r}")
        args.lrs[method] = float(value)
    for name in ("epsilon", "epochs", "batch_size", "clip", "fixed_bands", "seeds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 <= args.momentum < 1:
        p.error("--momentum must lie in [0, 1)")
    if args.runs is None:
        args.runs = "" if args.quick else DEFAULT_RUNS
    if args.quick:
        args.epochs, args.seeds = 1, 2
    return args


class Study:
    """Data, spectrum, the chooser's choice and every method's C and σ."""

    def __init__(self, args):
        import warnings

        import accuracy_cnn

        import keras_noisecurve as knc
        from keras_noisecurve.mixing import objective_value

        self.args = args
        # data and spectrum exactly as accuracy_cnn.py (its Setup; b there is only used for its σ table)
        cnn_argv = ["--epsilon", str(args.epsilon), "--delta", str(args.delta), "--epochs", str(args.epochs),
                    "--batch-size", str(args.batch_size), "--clip", str(args.clip), "--momentum",
                    str(args.momentum), "--objective", args.objective, "--bands", str(args.fixed_bands),
                    "--spectrum", args.spectrum, "--runs", "",
                    "--methods", *(["dpsgd", "noisecurve"] if "noisecurve" in args.methods else ["dpsgd"])]
        setup = accuracy_cnn.Setup(accuracy_cnn.parse_args(cnn_argv + (["--quick"] if args.quick else [])))
        self.setup = setup
        self.n, self.steps = setup.n, setup.steps
        self.rule = knc.UpdateRule(momentum=args.momentum)
        t0 = time.perf_counter()
        self.choice = knc.choose_mixing(num_examples=self.n, batch_size=args.batch_size, steps=self.steps,
                                        epsilon=args.epsilon, delta=args.delta, update_rule=self.rule)
        log(f"choice in {time.perf_counter() - t0:.0f}s:\n{self.choice.summary()}")
        self.auto_bands = self.choice.chosen.size
        self.bands = {"dpsgd": 1, "auto": self.auto_bands, "bandmf": args.fixed_bands,
                      "noisecurve": self.auto_bands}
        self.mixing = {"dpsgd": knc.MixingMatrix.identity(self.steps), "auto": self.choice.mixing}
        t0 = time.perf_counter()
        self.mixing["bandmf"] = knc.solve_mixing_matrix(steps=self.steps, bands=args.fixed_bands,
                                                        objective="bandmf", update_rule=self.rule)
        if "noisecurve" in args.methods:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.mixing["noisecurve"] = knc.solve_mixing_matrix(
                    steps=self.steps, bands=self.auto_bands, objective=args.objective, spectrum=setup.curvature,
                    learning_rate=args.lrs["noisecurve"], update_rule=self.rule,
                    **({"blend_weight": "auto"} if args.objective == "noisecurve-blend" else {}))
        log(f"fixed-b DP-BandMF and NoiseCurve C solved in {time.perf_counter() - t0:.0f}s")
        # σ of each mechanism at the target (ε, δ), as its PrivateRun calibrates it
        self.sigma = {m: self.private_run(m, seed=None).noise_multiplier for m in self.mixing}
        # predicted noise variance ratio vs DP-SGD: σ²·Tr(W X⁻¹) / (σ₁²·Tr(W)), W = the rule's running sums
        error = {m: objective_value(c, objective="bandmf", update_rule=self.rule) for m, c in self.mixing.items()}
        self.ratio = {m: self.sigma[m] ** 2 * error[m] / (self.sigma["dpsgd"] ** 2 * error["dpsgd"])
                      for m in self.mixing}
        log("σ and predicted noise variance / DP-SGD: " + ", ".join(
            f"{m} (b={self.bands[m]}): σ {self.sigma[m]:.4f}, ratio {self.ratio[m]:.3f}" for m in self.mixing))
        if abs(self.ratio["auto"] - self.choice.relative_error) > 1e-6 * max(1.0, self.choice.relative_error):
            log(f"NOTE: auto's ratio rescored here ({self.ratio['auto']:.6f}) differs from the chooser's "
                f"relative_error ({self.choice.relative_error:.6f})")

    def private_run(self, method, *, seed):
        import keras_noisecurve as knc

        args = self.args
        mixing = self.choice if method == "auto" else self.mixing[method]
        return knc.PrivateRun(num_examples=self.n, batch_size=args.batch_size, steps=self.steps, mixing=mixing,
                              epsilon=args.epsilon, delta=args.delta, seed=seed)


def train_one(study, *, method, seed):
    """One private training run; returns (validation accuracy, test accuracy, σ, seconds)."""
    import warnings

    import keras

    import keras_noisecurve as knc
    from accuracy_cnn import _accuracy
    from keras_noisecurve.apps.models import small_groupnorm_cnn

    args, setup = study.args, study.setup
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixed-seed warnings: seeded runs are benchmarks only
        run = study.private_run(method, seed=20_000 + seed)
        keras.utils.set_random_seed(seed)
        model = small_groupnorm_cnn((28, 28, 1), num_classes=10, dense_size=32, seed=seed)
        schedule = knc.learning_rate_schedule(study.rule, learning_rate=args.lrs[method], steps=study.steps)
        private = knc.make_private(model)
        private.compile(
            optimizer=knc.NoiseCurveOptimizer(run=run, l2_norm_clip=args.clip, seed=10_000 + seed,
                                              inner=keras.optimizers.SGD(schedule, momentum=args.momentum)),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        private.fit(run.dataset(setup.x_train, setup.y_train), epochs=1, steps_per_epoch=study.steps, verbose=0)
    return (_accuracy(model, setup.x_val, setup.y_val), _accuracy(model, setup.x_test, setup.y_test),
            float(run.noise_multiplier), time.perf_counter() - t0)


def run_key(args, study, method, seed):
    return json.dumps([args.epsilon, args.delta, args.epochs, args.batch_size, args.momentum, args.clip,
                       method, study.bands[method], args.lrs[method],
                       args.objective if method == "noisecurve" else None, seed, args.quick])


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    from accuracy_cnn import Runs

    t_start = time.perf_counter()
    log(f"backend {keras.backend.backend()}; methods {args.methods}; seeds {args.seeds}; lr {args.lrs}")
    study = Study(args)
    runs = Runs(args.runs or None)
    seeds = list(range(args.first_seed, args.first_seed + args.seeds))
    results = {m: [] for m in args.methods}
    total, done = len(seeds) * len(args.methods), 0
    for seed in seeds:  # seed-major: an interrupted study has complete pairs
        for method in args.methods:
            done += 1
            key = run_key(args, study, method, seed)
            rec = runs.get(key)
            if rec is None:
                val, test, sigma, seconds = train_one(study, method=method, seed=seed)
                rec = {"key": key, "method": method, "bands": study.bands[method], "seed": seed,
                       "lr": args.lrs[method], "sigma": sigma, "val": val, "test": test, "seconds": seconds,
                       "backend": keras.backend.backend()}
                runs.add(rec)
                log(f"[{done}/{total}] {method:<10} b={study.bands[method]:<3} seed {seed}: val {100 * val:.1f} %, "
                    f"test {100 * test:.1f} % ({seconds:.0f}s; {(time.perf_counter() - t_start) / 60:.1f} min so far)")
            results[method].append(rec)
    report = render(args, argv, study, results, time.perf_counter() - t_start)
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        log(f"report written to {args.out}")
    return 0


# ------------------------------------------------------------------------------ report
LABELS = {"dpsgd": "DP-SGD", "auto": "auto", "bandmf": "DP-BandMF", "noisecurve": "NoiseCurve"}


def _ms(values, scale=100.0):
    v = scale * np.asarray(values, dtype=float)
    return f"{v.mean():.2f} ± {v.std(ddof=1):.2f}" if len(v) > 1 else f"{v.mean():.2f}"


def _p(x):
    return "—" if x is None or not np.isfinite(x) else (f"{x:.3f}" if x >= 0.001 else f"{x:.1e}")


def paired(ours, base):
    """Paired difference (pp) and two-sided p-values: paired t-test, Wilcoxon signed-rank."""
    from scipy import stats

    ours, base = 100 * np.asarray(ours, dtype=float), 100 * np.asarray(base, dtype=float)
    diff = ours - base
    out = {"diff": _ms(diff, 1.0), "wins": int(np.sum(diff > 0)), "losses": int(np.sum(diff < 0)),
           "p_t": None, "p_w": None}
    if len(diff) >= 2 and not np.allclose(diff, diff[0]):
        out["p_t"] = float(stats.ttest_rel(ours, base).pvalue)
    if np.any(diff != 0):
        out["p_w"] = float(stats.wilcoxon(ours, base).pvalue)
    return out


def render(args, argv, study, results, wall):
    import keras

    from _accuracy_report import machine_description

    cmd = "python benchmarks/auto_study.py " + " ".join(sys.argv[1:] if argv is None else argv)
    seconds = [r["seconds"] for recs in results.values() for r in recs]
    head = (f"Command: `KERAS_BACKEND={keras.backend.backend()} {cmd.strip()}` ({wall / 60:.1f} min this "
            f"invocation; {np.mean(seconds):.0f} s per training run on average over {len(seconds)} runs). "
            f"Machine: {machine_description()}; backend {keras.backend.backend()}, keras {keras.__version__}, "
            f"{_versions()}. Small GroupNorm CNN, MNIST-5k {study.n} train / {len(study.setup.y_val)} validation / "
            f"{len(study.setup.y_test)} test, B = {args.batch_size}, T = {study.steps}, cyclic Poisson, "
            f"(ε, δ) = ({args.epsilon:g}, {args.delta:g}), SGD momentum {args.momentum:g}, constant η, "
            f"clip ζ = {args.clip:g}. {args.seeds} paired seeds "
            f"{args.first_seed}…{args.first_seed + args.seeds - 1}.")
    lines = [head, "", "```", study.choice.summary(), "```", "",
             "| method | b | σ | η | predicted noise var. / DP-SGD | predicted std reduction | "
             "test % (mean ± sd) | test − DP-SGD, pp (wins/losses) | p t / p W vs DP-SGD | "
             "test − auto, pp (wins/losses) | p t / p W vs auto |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = [r["test"] for r in results.get("dpsgd", [])]
    auto = [r["test"] for r in results.get("auto", [])]
    for m in args.methods:
        tests = [r["test"] for r in results[m]]
        cells = []
        for ref, name in ((base, "dpsgd"), (auto, "auto")):
            if m == name or not ref:
                cells += ["—", "—"]
            else:
                d = paired(tests, ref)
                cells += [f"{d['diff']} ({d['wins']}/{d['losses']})", f"{_p(d['p_t'])} / {_p(d['p_w'])}"]
        ratio = study.ratio[m]
        label = LABELS[m] + (f" ({args.objective})" if m == "noisecurve" else "")
        lines.append(f"| {label} | {study.bands[m]} | {study.sigma[m]:.4f} | {args.lrs[m]:g} | {ratio:.3f} | "
                     f"{100 * (1 - np.sqrt(ratio)):+.1f} % | {_ms(tests)} | " + " | ".join(cells) + " |")
    lines += ["", "Validation accuracy (%, mean ± sd, same seeds): "
              + "; ".join(f"{LABELS[m]} {_ms([r['val'] for r in results[m]])}" for m in args.methods) + ".",
              "", "Per-seed test accuracy (%): " + "; ".join(
                  f"{LABELS[m]} " + " ".join(f"{100 * r['test']:.1f}" for r in results[m]) for m in args.methods)
              + ".",
              "", "p t: paired t-test, p W: Wilcoxon signed-rank (scipy defaults: zero differences dropped, "
              "exact distribution when possible); both two-sided."]
    return "\n".join(lines) + "\n"


def _versions():
    from importlib import metadata

    out = []
    for name in ("tensorflow", "jax", "jaxlib", "dp-accounting", "numpy", "scipy"):
        try:
            out.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
