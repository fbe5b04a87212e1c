"""Accuracy benchmark: DP-SGD vs DP-BandMF vs NoiseCurve (every objective), paper protocol, scaled down.

Protocol (paper §5 and App. A, scaled to a 2-core CPU):

- Private data: the bundled MNIST-5k, fixed stratified split 3,500 train / 500
  validation / 1,000 test (``keras_noisecurve.apps.data.load_mnist5k(seed=0)``).
- Public data: scikit-learn's 1,797 digits, unlabeled, in MNIST format
  (``load_public_digits``). Features: PCA with ``--pca-dim`` components fitted on the
  PUBLIC images only, each feature vector scaled to unit L2 norm, plus a bias 1.
- Model: softmax regression on those features (convex; its exact Hessian is
  cheap). Spectrum: pre-train on the public features with random labels (paper
  §4.1), then the exact Hessian of the mean cross-entropy there, ``eigvalsh``.
- Methods: ``dpsgd`` (C = I), ``bandmf``, ``noisecurve`` (eq. 1),
  ``noisecurve-convergence`` (eq. 2), ``noisecurve-all-iterates``,
  ``noisecurve-blend`` (λ = "auto"); C from ``keras_noisecurve.solve_mixing_matrix``.
- Privacy: (ε, δ) for ε ∈ ``--epsilons``, δ = 1e-5, cyclic Poisson sampling with
  expected batch size B, T steps; σ from ``keras_noisecurve.calibrate_noise_multiplier``
  (the same σ for every method with the same band b).
- Tuning: grid search over learning rate × clip norm × bands (bands only for the
  matrix-factorisation methods; DP-SGD is b = 1), the SAME grid for every MF method,
  each configuration scored by mean VALIDATION accuracy over ``--tune-seeds`` runs.
  The test split is never looked at during tuning.
- Final: the tuned configuration of each (method, ε) is run with ``--seeds`` fresh
  seeds; mean ± std test accuracy; one-sided paired t-test and exact/Monte-Carlo
  permutation test (scipy.stats) of each curvature variant vs DP-BandMF. Seeds are
  paired: seed s gives every method the same batches and the same raw noise z
  (only C⁻¹ differs), which is what makes a paired test meaningful.

Training loop: the update of ``keras_noisecurve.NoiseCurveOptimizer``
written in numpy for speed (``_accuracy_train.py``) — per-example gradients of these
models are outer products, so clipping costs O(B·(d + k)):

    ĝ_t = (Σ_{i∈B_t} clip(g_i, ζ) + ζ·σ·z̃_t) / B,   z̃ = C⁻¹z,
    m_{t+1} = β·m_t − η·s_t·ĝ_t,   w_{t+1} = w_t + m_{t+1},   m_0 = 0

(Keras's ``SGD(momentum=β)``; β = ``--momentum``, s_t the multipliers of ``--schedule``,
``keras_noisecurve.UpdateRule``; the defaults are plain SGD, w ← w − η·ĝ_t), with z̃ from
``MixingMatrix.inverse_apply`` (the library's online recurrence) and batches from cyclic
Poisson sampling (partition t mod b, inclusion probability q = B·b/n), exactly the sampler
the accounting assumes.

Update rule and workload: every method trains with the same rule. ``--workload`` says
which rule the matrix-factorisation C's are solved for: ``plain`` (today's workloads,
no ``update_rule``), ``matched`` (``solve_mixing_matrix(update_rule=rule)``, rows
labelled ``+rule``) or ``both`` (each MF method twice, so the tables answer "does
matching the workload to the update rule help?"). Objectives whose workload is only
derived for plain SGD are skipped for the matched workload, with the reason logged.

Run (about 15 min on 2 cores with the defaults):

    python benchmarks/accuracy.py --workers 2 --out docs/results.md

``--quick`` runs a tiny version (seconds) for smoke tests.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _accuracy_* helpers beside this file

from _accuracy_report import (  # noqa: E402
    decide_default,
    matched_vs_plain,
    reference_bandmf,
    render,
    significance,
)
from _accuracy_train import (  # noqa: E402, F401  (tests read them from this script)
    Problem,
    SoftmaxRegression,
    TinyMLP,
    accuracy,
    build_problem,
    clipping_scale,
    cyclic_poisson_batches,
    make_model,
    nonprivate_reference,
    random_label_pretrain,
    random_labels,
    softmax,
    train_dp,
)

from keras_noisecurve.mixing import CURVATURE_OBJECTIVES, OBJECTIVES, SCHEDULES, UpdateRule  # noqa: E402

METHODS = OBJECTIVES  # DP-SGD, DP-BandMF and every curvature objective
CURVATURE = CURVATURE_OBJECTIVES
RULE_SUFFIX = "+rule"  # label suffix of a C solved for the training rule (matched workload)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A row of the report: ``method`` (solver objective) with C solved for the training rule
    (``matched``) or for plain SGD."""

    label: str
    method: str
    matched: bool = False


def rule_refusal(method, rule, spectrum):
    """None if ``solve_mixing_matrix`` accepts ``method`` with ``update_rule=rule``, else why not.

    Asks the solver itself (a T = 8, b = 1 call, which validates and returns C = I at once),
    so the benchmark knows no list of supported objectives of its own.
    """
    import inspect

    import keras_noisecurve as knc

    if "update_rule" not in inspect.signature(knc.solve_mixing_matrix).parameters:
        return "this keras_noisecurve's solve_mixing_matrix takes no update_rule"
    kwargs = dict(steps=8, bands=1, objective=method, update_rule=rule, max_iterations=0)
    if method in CURVATURE:
        kwargs.update(spectrum=spectrum, learning_rate=1e-3 / max(spectrum.max_eigenvalue, 1e-12))
    if method == "noisecurve-blend":
        kwargs["blend_weight"] = "auto"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            knc.solve_mixing_matrix(**kwargs)
    except ValueError as err:
        return str(err)
    return None


def plan_variants(args, spectrum):
    """The report's rows for ``--methods`` × ``--workload``; returns {"variants", "skipped"}."""
    rule, variants, skipped = args.rule, [], []
    if rule.is_plain and args.workload != "matched":
        log(f"--workload {args.workload}: the update rule is plain SGD, so the matched workload is the plain one "
            "(one row per method)")
    for m in args.methods:
        if m == "dpsgd" or rule.is_plain:
            variants.append(Variant(m, m))
            continue
        if args.workload in ("plain", "both"):
            variants.append(Variant(m, m))
        if args.workload in ("matched", "both"):
            reason = rule_refusal(m, rule, spectrum)
            if reason is None:
                variants.append(Variant(m + RULE_SUFFIX, m, matched=True))
            else:
                skipped.append((m + RULE_SUFFIX, reason))
                log(f"skipping {m + RULE_SUFFIX}: {reason}")
    if not variants:
        raise SystemExit("error: no method left to run (every one skipped, see above).")
    return {"variants": variants, "skipped": skipped}


# ---------------------------------------------------------------- mixing + sigma
class Cache:
    def __init__(self, args, spectrum, w_pub, y_pub, problem, model):
        self.args = args
        self.spectrum = spectrum
        self.w_pub = w_pub
        self.y_pub = y_pub
        self.problem = problem
        self.model = model
        self.mixings = {}
        self.sigmas = {}
        self.scales = {}
        self.solve_seconds = 0.0

    def scale(self, clip):
        if self.args.lr_scale == "none":
            return 1.0
        if clip not in self.scales:
            self.scales[clip] = clipping_scale(self.model, self.w_pub, self.problem.x_public, self.y_pub, clip)
        return self.scales[clip]

    def mixing_key(self, variant, bands, lr, clip):
        """(method, b, η_eff, rule) or None for C = I; η_eff = η·s(ζ) for curvature objectives;
        rule = the training rule's JSON record for a matched workload, None for plain SGD's."""
        if variant.method == "dpsgd" or bands == 1:
            return None
        eta = None if variant.method == "bandmf" else round(lr * self.scale(clip), 12)
        rule = json.dumps(self.args.rule.to_metadata(), sort_keys=True) if variant.matched else None
        return (variant.method, bands, eta, rule)

    def _path(self, key):
        if not self.args.cache_dir:
            return None
        import hashlib

        # a plain-workload key hashes as before update rules existed, so earlier caches stay valid
        record = [list(key[:3]), self.args.steps, self.args.solver_tol, self.spectrum.digest()]
        if key[3] is not None:
            record.append(json.loads(key[3]))
        text = json.dumps(record)
        return os.path.join(self.args.cache_dir, hashlib.sha256(text.encode()).hexdigest()[:24] + ".npz")

    def mixing(self, variant, bands, lr, clip):
        import keras_noisecurve as knc

        key = self.mixing_key(variant, bands, lr, clip)
        if key is None:
            return knc.MixingMatrix.identity(self.args.steps)
        if key not in self.mixings:
            path = self._path(key)
            if path and os.path.exists(path):
                self._loaded(key, knc.MixingMatrix.load(path))
            else:
                self.store(key, solve_one(key, self.args.steps, self.args.solver_tol, self.spectrum))
        return self.mixings[key]

    @staticmethod
    def _check_rule(key, mixing):
        """The C must record the rule it was solved for (no record: plain SGD)."""
        expected = UpdateRule.from_metadata(None if key[3] is None else json.loads(key[3]))
        recorded = UpdateRule.from_metadata(mixing.metadata.get("update_rule"))
        if recorded != expected:
            raise RuntimeError(f"the C for {key[:3]} records update rule {recorded!r}; expected {expected!r}.")

    def _loaded(self, key, mixing):
        self._check_rule(key, mixing)
        self.mixings[key] = mixing
        self.solve_seconds += mixing.metadata.get("solver", {}).get("total_seconds", 0.0) or 0.0

    def store(self, key, mixing):
        self._check_rule(key, mixing)
        self.mixings[key] = mixing
        self.solve_seconds += mixing.metadata.get("solver", {}).get("total_seconds", 0.0) or 0.0
        meta = mixing.metadata
        label = key[0] + ("" if key[3] is None else RULE_SUFFIX)
        log(f"  solved {label} b={key[1]} eta_eff={key[2]}: loss={meta.get('loss', float('nan')):.4g} "
            f"(DP-BandMF C: {meta.get('baseline_losses', {}).get('bandmf', float('nan')):.4g}), "
            f"peak running-sum std {meta.get('diagnostics', {}).get('prefix_std_max', float('nan')):.3g}, "
            f"{meta.get('solver', {}).get('total_seconds', float('nan')):.1f}s")
        path = self._path(key)
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            mixing.save(path)
        return mixing

    def precompute(self, keys, pool):
        """Solve every missing C, in parallel over the pool's workers."""
        import keras_noisecurve as knc

        todo = []
        for key in dict.fromkeys(keys):
            if key is None or key in self.mixings:
                continue
            path = self._path(key)
            if path and os.path.exists(path):
                self._loaded(key, knc.MixingMatrix.load(path))
            else:
                todo.append(key)
        log(f"solving {len(todo)} mixing matrices ({len(self.mixings)} cached) ...")
        if pool is None:
            results = (solve_one(k, self.args.steps, self.args.solver_tol, self.spectrum) for k in todo)
        else:
            results = pool.map(solve_one, todo, [self.args.steps] * len(todo), [self.args.solver_tol] * len(todo),
                               [self.spectrum] * len(todo))
        for key, mixing in zip(todo, results):
            self.store(key, mixing)

    def sigma(self, epsilon, bands):
        import keras_noisecurve as knc

        key = (epsilon, bands)
        if key not in self.sigmas:
            self.sigmas[key] = knc.calibrate_noise_multiplier(
                epsilon=epsilon, delta=self.args.delta, num_examples=len(self.problem.y_train),
                batch_size=self.args.batch_size, steps=self.args.steps, bands=bands,
            )
        return self.sigmas[key]


def solve_one(key, steps, tol, spectrum):
    """Solve C for key = (objective, b, η_eff, rule) (module-level so a process pool can run it)."""
    import keras_noisecurve as knc

    method, bands, eta, rule = key
    kwargs = dict(steps=steps, bands=bands, objective=method)
    if rule is not None:
        kwargs["update_rule"] = UpdateRule.from_metadata(json.loads(rule))
    if method != "bandmf":
        kwargs.update(spectrum=spectrum, learning_rate=eta, tol=tol)
    if method == "noisecurve-blend":
        kwargs["blend_weight"] = "auto"
    with warnings.catch_warnings():
        # excursion and eta*mu > 1 warnings are recorded in the artifact's metadata
        warnings.simplefilter("ignore")
        return knc.solve_mixing_matrix(**kwargs)


# --------------------------------------------------------------------- execution
_WORKER = {}


def _init_worker(problem, model):
    _WORKER["problem"] = problem
    _WORKER["model"] = model


def _run_task(task):
    mixing, sigma, lr, clip, batch_size, seed, rule = task
    problem, model = _WORKER["problem"], _WORKER["model"]
    w = train_dp(problem, model, mixing=mixing, sigma=sigma, lr=lr, clip=clip, batch_size=batch_size, seed=seed,
                 rule=rule)
    return accuracy(model, w, problem.x_val, problem.y_val), accuracy(model, w, problem.x_test, problem.y_test)


def run_tasks(tasks, pool):
    if pool is None:
        return [_run_task(t) for t in tasks]
    return list(pool.map(_run_task, tasks, chunksize=4))


def configs_for(variant, args):
    bands = [1] if variant.method == "dpsgd" else args.band_grid
    return list(itertools.product(args.lr_grid, args.clip_grid, bands))


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    from concurrent.futures import ProcessPoolExecutor

    import keras_noisecurve as knc

    log(f"building features (PCA {args.pca_dim} on public digits) ...")
    problem = build_problem(args.pca_dim)
    n = len(problem.y_train)
    model = make_model(args, problem)
    log(f"n_train={n} n_val={len(problem.y_val)} n_test={len(problem.y_test)}; {model.name}, {model.p} parameters")
    for b in args.band_grid:
        if args.batch_size * b > n:
            raise SystemExit(f"error: band {b} with batch size {args.batch_size} exceeds n={n} (q > 1).")

    log("random-label pre-training on public features, exact Hessian ...")
    w_pub, y_pub = random_label_pretrain(model, problem.x_public, problem.num_classes, steps=args.pretrain_steps,
                                         lr=args.pretrain_lr, seed=args.spectrum_seed)
    eig = np.linalg.eigvalsh(model.hessian(w_pub, problem.x_public, y_pub))
    spectrum = knc.Spectrum(eig, metadata={"method": "exact", "model": args.model})  # negatives clamped to 0
    log(f"spectrum: mu_max={spectrum.max_eigenvalue:.4g} trace={spectrum.trace():.4g} "
        f"distinct={spectrum.eigenvalues.size}")
    cache = Cache(args, spectrum, w_pub, y_pub, problem, model)
    log(f"update rule: {args.rule.describe()}; workload: {args.workload}")
    plan = plan_variants(args, spectrum)
    variants = plan["variants"]
    rule = None if args.rule.is_plain else args.rule  # None: the plain loop, bit for bit

    pool = (ProcessPoolExecutor(args.workers, initializer=_init_worker, initargs=(problem, model))
            if args.workers > 1 else None)
    _init_worker(problem, model)

    keys = [cache.mixing_key(v, b, lr, clip) for v in variants for (lr, clip, b) in configs_for(v, args)]
    cache.precompute(keys, pool)
    if args.precompute_only:
        log(f"precomputed {len(cache.mixings)} mixing matrices into {args.cache_dir}")
        return 0

    tuning = {}  # (eps, label) -> list of (config, mean val acc)
    best = {}
    for eps in args.epsilons:
        for variant in variants:
            method = variant.label
            configs = configs_for(variant, args)
            tasks, owners = [], []
            for cfg in configs:
                lr, clip, bands = cfg
                mix = cache.mixing(variant, bands, lr, clip)
                sig = cache.sigma(eps, bands)
                for s in range(args.tune_seeds):
                    tasks.append((mix, sig, lr, clip, args.batch_size, 10_000 + s, rule))
                    owners.append(cfg)
            results = run_tasks(tasks, pool)
            scores = {}
            for cfg, (val, _test) in zip(owners, results):
                scores.setdefault(cfg, []).append(val)
            table = sorted(((cfg, float(np.mean(v))) for cfg, v in scores.items()), key=lambda r: -r[1])
            tuning[(eps, method)] = table
            best[(eps, method)] = table[0][0]
            log(f"eps={eps:g} {method:<24} tuned over {len(configs)} configs x {args.tune_seeds} seeds: "
                f"best lr={table[0][0][0]:g} clip={table[0][0][1]:g} b={table[0][0][2]} "
                f"val={table[0][1]:.4f}  (solver time so far {cache.solve_seconds:.0f}s)")

    final = {}  # (eps, label) -> dict(val=[...], test=[...])
    for eps in args.epsilons:
        for variant in variants:
            method = variant.label
            lr, clip, bands = best[(eps, method)]
            mix = cache.mixing(variant, bands, lr, clip)
            sig = cache.sigma(eps, bands)
            tasks = [(mix, sig, lr, clip, args.batch_size, s, rule) for s in range(args.seeds)]
            res = run_tasks(tasks, pool)
            final[(eps, method)] = {"val": [r[0] for r in res], "test": [r[1] for r in res],
                                    "lr": lr, "clip": clip, "bands": bands, "sigma": sig}
            log(f"eps={eps:g} {method:<24} test={np.mean(final[(eps, method)]['test']):.4f}"
                f" ± {np.std(final[(eps, method)]['test'], ddof=1) if args.seeds > 1 else 0:.4f}")
    if pool is not None:
        pool.shutdown()

    nonprivate = nonprivate_reference(problem, model, args, rule)
    res = analyse(final, args, variants)
    res["plan"] = plan
    wall = time.time() - start
    log(f"done in {wall / 60:.1f} min")
    report = render(args, argv, problem, model, spectrum, res, wall, nonprivate, cache)
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
        log(f"wrote {args.out}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"update_rule": args.rule.to_metadata(), "workload": args.workload,
                       **{f"{e}|{m}": v for (e, m), v in final.items()}}, f, indent=1)
    return 0


def analyse(final, args, variants):
    """Reference DP-BandMF row, significance tests, matched-vs-plain tests and the default rule."""
    labels = [v.label for v in variants]
    curvature = [v.label for v in variants if v.method in CURVATURE]
    ref, ref_scores = reference_bandmf(final, args.epsilons, [v.label for v in variants if v.method == "bandmf"])
    if len(ref_scores) > 1:
        log(f"DP-BandMF reference for the tests: {ref} (pooled validation "
            + ", ".join(f"{lab} {v:.4f}" for lab, v in ref_scores.items()) + ")")
    plain = {v.method: v.label for v in variants if not v.matched}
    pairs = [(plain[v.method], v.label) for v in variants if v.matched and v.method in plain]
    return {"labels": labels, "final": final, "ref": ref, "ref_scores": ref_scores,
            "stats": significance(final, args.epsilons, curvature, ref),
            "matched": matched_vs_plain(final, args.epsilons, pairs),
            "decision": decide_default(final, args.epsilons, labels, curvature, ref)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epsilons", type=float, nargs="+", default=[2.0, 5.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seeds", type=int, default=10, help="final seeds per (method, ε) (≥ 5 for the protocol)")
    p.add_argument("--tune-seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=280)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--pca-dim", type=int, default=128)
    p.add_argument("--lr-grid", type=float, nargs="+", default=None,
                   help="(base) learning rates (default 4 8 16 for softmax, 2 4 8 for mlp, times 1 − momentum)")
    p.add_argument("--clip-grid", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    p.add_argument("--band-grid", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--solver-tol", type=float, default=1e-3,
                   help="relative optimality tolerance of the curvature solves (default 1e-3)")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--lr-scale", choices=("clip", "none"), default="clip")
    p.add_argument("--momentum", type=float, default=0.0,
                   help="heavy-ball momentum β of the training rule (Keras SGD(momentum=β); default 0)")
    p.add_argument("--schedule", choices=[s for s in SCHEDULES if s != "custom"], default="constant",
                   help="learning-rate schedule of the training rule (default constant)")
    p.add_argument("--cooldown-fraction", type=float, default=None,
                   help="share of the steps spent cooling down (--schedule linear-cooldown; default 0.25)")
    p.add_argument("--workload", choices=("plain", "matched", "both"), default="matched",
                   help="which rule the matrix-factorisation C's are solved for: plain SGD, the training rule "
                        "(rows labelled +rule), or both (each MF method twice); default matched (no difference "
                        "when the rule is plain)")
    p.add_argument("--spectrum-seed", type=int, default=0)
    p.add_argument("--model", choices=("softmax", "mlp"), default="softmax",
                   help="softmax regression (convex) or a tiny one-hidden-layer ReLU MLP (non-convex)")
    p.add_argument("--hidden", type=int, default=32, help="hidden units of --model mlp (default 32)")
    p.add_argument("--pretrain-steps", type=int, default=300, help="random-label full-batch GD steps (default 300)")
    p.add_argument("--pretrain-lr", type=float, default=None,
                   help="random-label pre-training learning rate (default 2 for softmax, 0.5 for mlp)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--cache-dir", default="benchmarks/out/mixing_cache",
                   help="solved mixing matrices are stored here and reused ('' disables)")
    p.add_argument("--precompute-only", action="store_true", help="solve (and cache) every C of the grid, then exit")
    p.add_argument("--out", default=None, help="write the Markdown report here (e.g. docs/results.md)")
    p.add_argument("--json", default=None, help="write raw per-seed results here")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests (seconds)")
    args = p.parse_args(argv)
    try:
        args.rule = UpdateRule(momentum=args.momentum, schedule=args.schedule,
                               cooldown_fraction=args.cooldown_fraction)
    except (TypeError, ValueError) as err:
        p.error(str(err))
    if args.lr_grid is None:  # the same effective rate η/(1 − β) under momentum
        base = [4.0, 8.0, 16.0] if args.model == "softmax" else [2.0, 4.0, 8.0]
        args.lr_grid = [float(f"{lr * (1.0 - args.momentum):.12g}") for lr in base]
    if args.quick:
        args.epsilons = args.epsilons[:1]
        args.seeds = min(args.seeds, 2)
        args.tune_seeds = 1
        args.steps = min(args.steps, 40)
        args.pca_dim = min(args.pca_dim, 16)
        args.lr_grid = args.lr_grid[:2]
        args.clip_grid = args.clip_grid[:1]
        args.band_grid = [b for b in args.band_grid if b <= 4][:2] or [1]
    if args.pretrain_lr is None:
        args.pretrain_lr = 2.0 if args.model == "softmax" else 0.5
    if args.seeds < 2:
        p.error(f"--seeds must be >= 2 for the statistics, got {args.seeds}")
    return args


if __name__ == "__main__":
    sys.exit(main())
