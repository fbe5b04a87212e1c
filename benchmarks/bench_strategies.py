"""Mixing strategies over several epochs at the same (ε, δ): banded (amplified) vs BLT / BISR.

The question: a single pass flatters BLT. Training usually runs k epochs (k participations
of each example, at least ``steps_per_epoch`` steps apart). There a banded C is accounted
with cyclic Poisson sampling (b partitions, amplified by sampling, q = B·b/n), while BLT
and BISR (not banded) are accounted only under fixed epochs: ONE Gaussian mechanism with
the sensitivity Δ_k of k overlapping participations, computed from C (no amplification;
``keras_noisecurve.privacy.events``). Which strategy gives less noise, and better models,
at the SAME (ε, δ)?

Part 1, expected error (no training). For each plan (n = 3500, batch B, k epochs, T =
k·⌈n/B⌉ steps) and ε ∈ ``--epsilons`` (δ = 1e-5): σ is calibrated by
``keras_noisecurve.PrivateRun(..., epsilon=ε, sampling=...)`` (so σ holds the
multi-participation sensitivity of every accounting), and the expected error is the
total variance, per coordinate and clip norm 1, of the noise in the running sums over
all T prefixes,

    E Σ_{τ≤T} ‖Σ_{t<τ} noise_t‖² = σ²·‖A C⁻¹‖_F²,     A = lower-triangular ones,

with C normalised to largest column norm 1. ``‖A C⁻¹‖_F²`` is computed by ONE function
for every kind, ``keras_noisecurve.mixing.objective_value(C, objective="bandmf")``, and
checked against a dense triangular solve for T ≤ 2000. The table gives the RMSE ratio
``√(σ²‖AC⁻¹‖²_F / σ_SGD²‖A‖²_F)`` vs DP-SGD (C = I, b = 1): below 1 is less noise.

Part 2, accuracy. Softmax regression on the MNIST-5k PCA features of
``benchmarks/accuracy.py`` (``_accuracy_train.build_problem``/``make_model``), numpy loop
ĝ_t = (Σ clip(g_i, ζ) + ζσ·z̃_t)/B, w ← w − η·ĝ_t, z̃ = C⁻¹z by the strategy's own
recurrence (``inverse_apply``). Batches follow the accounting of each row: cyclic Poisson
(partition t mod b, q = B·b/n; ``_accuracy_train.cyclic_poisson_batches``) or fixed
epochs (one shuffled order of ⌈n/B⌉ batches repeated every epoch,
``fixed_epoch_batches``). Seed s fixes the raw noise z, the initial weights and the
sampler's randomness for every row (paired). Tuning: learning rate × clip × the row's
parameter set (b, or p for BISR; BLT has d = 4 only), the same lr × clip grid for every
row, scored by mean VALIDATION accuracy over ``--tune-seeds`` seeds; then ``--seeds``
fresh seeds on test; mean ± std and paired differences vs banded (cyclic Poisson).

Run (about 15 min on 2 cores; σ's are cached in ``benchmarks/out/``):

    python benchmarks/bench_strategies.py --out benchmarks/out/bench_strategies.md

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
import types
import warnings

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import scipy.linalg  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the _accuracy_* helpers beside this file

from _accuracy_report import fmt_ms, machine_description  # noqa: E402
from _accuracy_train import accuracy, build_problem, cyclic_poisson_batches, make_model  # noqa: E402

NUM_EXAMPLES = 3500  # MNIST-5k training split (build_problem)
DENSE_CHECK_MAX_STEPS = 2000
DENSE_CHECK_RTOL = 1e-6
BLT_BUFFERS = 4


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------- plans and rows
@dataclasses.dataclass(frozen=True)
class Plan:
    batch_size: int
    epochs: int
    num_examples: int = NUM_EXAMPLES

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.num_examples // self.batch_size)

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch

    def max_partitions(self) -> int:
        """Largest b with q = B·b/n < 1."""
        return (self.num_examples - 1) // self.batch_size

    def describe(self) -> str:
        return (f"B = {self.batch_size}, k = {self.epochs} epoch{'s' if self.epochs > 1 else ''} "
                f"(T = {self.steps}, {self.steps_per_epoch} steps per epoch)")


@dataclasses.dataclass(frozen=True)
class Row:
    """A strategy under one accounting; ``param`` is b (banded, toeplitz), d (blt) or p (bisr)."""

    label: str  # table name: dpsgd, banded, toeplitz, banded-fixed, blt, blt-1pass, bisr
    strategy: str  # dpsgd | banded | toeplitz | blt | bisr
    sampling: str  # cyclic_poisson | fixed_epochs
    param: int
    blt_participations: int = 1  # blt: the k it is optimised for

    def name(self) -> str:
        letter = {"blt": "d", "bisr": "p"}.get(self.strategy, "b")
        return f"{self.label} {letter}={self.param}"


def poisson_bands(plan: Plan, wanted) -> list:
    """The b of ``wanted`` that keep q = B·b/n < 1 and b ≤ T."""
    return [b for b in wanted if b <= plan.max_partitions() and b <= plan.steps]


def error_rows(plan: Plan, bands, bisr_bands) -> list:
    """Every strategy of part 1 for ``plan``."""
    spe, k = plan.steps_per_epoch, plan.epochs
    cp = poisson_bands(plan, bands)
    if not cp:  # e.g. B = 250: b = 16 gives q > 1
        cp = [plan.max_partitions()]
    fixed = sorted({min(b, spe) for b in cp} | {spe})
    rows = [Row("dpsgd", "dpsgd", "cyclic_poisson", 1)]
    rows += [Row("banded", "banded", "cyclic_poisson", b) for b in cp]
    rows += [Row("toeplitz", "toeplitz", "cyclic_poisson", b) for b in cp]
    rows += [Row("banded-fixed", "banded", "fixed_epochs", b) for b in fixed]
    rows += [Row("blt", "blt", "fixed_epochs", BLT_BUFFERS, blt_participations=k)]
    if k > 1:  # BLT optimised for one pass but accounted for k (the flattering single-pass choice)
        rows += [Row("blt-1pass", "blt", "fixed_epochs", BLT_BUFFERS, blt_participations=1)]
    rows += [Row("bisr", "bisr", "fixed_epochs", p) for p in bisr_bands if p <= plan.steps]
    return rows


# ------------------------------------------------------------------------ C, error, σ
class Lab:
    """Solved C's, their ‖AC⁻¹‖²_F and calibrated σ's (σ also cached on disk)."""

    def __init__(self, cache_path: str | None, delta: float, accountant: str = "pld"):
        self.delta = delta
        self.accountant = accountant
        self.mixings, self.errors = {}, {}
        self.cache_path = cache_path or None
        self.sigmas = {}
        if self.cache_path and os.path.exists(self.cache_path):
            with open(self.cache_path) as f:
                self.sigmas = json.load(f)
        self.calibrations = 0
        self.calibration_seconds = 0.0

    def mixing(self, plan: Plan, row: Row):
        import keras_noisecurve as knc
        from keras_noisecurve.mixing import solve_mixing_matrix

        key = (plan.steps, plan.steps_per_epoch, row.strategy, row.param, row.blt_participations)
        if key not in self.mixings:
            t0 = time.time()
            steps = plan.steps
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if row.strategy == "dpsgd":
                    mix = knc.MixingMatrix.identity(steps)
                elif row.strategy == "blt":
                    extra = ({} if row.blt_participations == 1 else
                             dict(participations=row.blt_participations, separation=plan.steps_per_epoch))
                    mix = solve_mixing_matrix(steps=steps, strategy="blt", buffers=row.param, **extra)
                else:
                    mix = solve_mixing_matrix(steps=steps, strategy=row.strategy, bands=row.param)
            self.mixings[key] = mix
            if time.time() - t0 > 2:
                log(f"  solved {row.name()} T={steps} in {time.time() - t0:.1f}s")
        return self.mixings[key]

    def error(self, plan: Plan, row: Row) -> float:
        """‖A C⁻¹‖²_F by ``objective_value(C, objective="bandmf")``, checked densely for T ≤ 2000."""
        from keras_noisecurve.mixing import objective_value

        mix = self.mixing(plan, row)
        key = id(mix)
        if key not in self.errors:
            value = objective_value(mix, objective="bandmf")
            if mix.steps <= DENSE_CHECK_MAX_STEPS:
                dense = dense_error(mix.to_dense())
                if not abs(value - dense) <= DENSE_CHECK_RTOL * dense:
                    raise AssertionError(f"{row.name()} T={mix.steps}: objective_value {value!r} != dense {dense!r}")
            self.errors[key] = value
        return self.errors[key]

    def sigma(self, plan: Plan, row: Row, epsilon: float) -> float:
        """σ of ``PrivateRun(..., epsilon=ε, sampling=row.sampling)``; runs whose run specs
        agree (same q, compositions and sensitivities) share one calibration."""
        import keras_noisecurve as knc

        mix = self.mixing(plan, row)
        n, batch, steps = plan.num_examples, plan.batch_size, plan.steps
        spec = knc.RunSpec(num_examples=n, batch_size=batch, steps=steps, sampling=row.sampling,
                           epochs=plan.epochs if row.sampling == "fixed_epochs" else None, mixing=mix)
        fields = dataclasses.asdict(spec)
        fields.pop("strategy")  # the event depends on the numbers only
        record = {k: (round(v, 10) if isinstance(v, float) else
                      [round(x, 10) for x in v] if isinstance(v, (tuple, list)) else v) for k, v in fields.items()}
        key = json.dumps([record, float(epsilon), self.delta, self.accountant], sort_keys=True)
        if key not in self.sigmas:
            t0 = time.time()
            run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=steps, mixing=mix, epsilon=epsilon,
                                 delta=self.delta, sampling=row.sampling, accountant=self.accountant)
            self.sigmas[key] = run.noise_multiplier
            self.calibrations += 1
            self.calibration_seconds += time.time() - t0
            self._save()
        return self.sigmas[key]

    def _save(self):
        if self.cache_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.cache_path)), exist_ok=True)
            tmp = self.cache_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(self.sigmas, f, indent=0, sort_keys=True)
            os.replace(tmp, self.cache_path)


def dense_error(c: np.ndarray) -> float:
    """‖A C⁻¹‖²_F from the dense lower-triangular C (A = lower-triangular ones)."""
    steps = c.shape[0]
    a = np.tril(np.ones((steps, steps)))
    y = scipy.linalg.solve_triangular(c.T, a.T, lower=False)  # Cᵀ Y = Aᵀ  ⇒  Y = (A C⁻¹)ᵀ
    return float(np.sum(y * y))


def expected_error_tables(args, lab: Lab) -> tuple[list, dict]:
    """Part 1: one Markdown table per plan; returns (lines, {(plan, ε): best row name})."""
    lines, best = [], {}
    for plan in args.plans:
        log(f"part 1: {plan.describe()}")
        rows = error_rows(plan, args.bands, args.bisr_bands)
        base = Row("dpsgd", "dpsgd", "cyclic_poisson", 1)
        base_err = lab.error(plan, base)
        cells = {}
        for row in rows:
            err = lab.error(plan, row)
            for eps in args.epsilons:
                sig = lab.sigma(plan, row, eps)
                ratio = np.sqrt(sig**2 * err / (lab.sigma(plan, base, eps) ** 2 * base_err))
                cells[(row, eps)] = (sig, ratio)
            log(f"  {row.name():<22} {row.sampling:<15} ‖AC⁻¹‖²={err:12.5g}  "
                + "  ".join(f"ε={e:g}: σ={cells[(row, e)][0]:.4g} ratio={cells[(row, e)][1]:.3f}"
                            for e in args.epsilons))
        lines += [f"### {plan.describe()}", "",
                  "| strategy | accounting | b / d / p | ‖AC⁻¹‖²_F | "
                  + " | ".join(f"σ (ε={e:g}) | RMSE / DP-SGD (ε={e:g})" for e in args.epsilons) + " |",
                  "|---|---|---|---|" + "---|---|" * len(args.epsilons)]
        winners = {e: min(rows, key=lambda r: cells[(r, e)][1]) for e in args.epsilons}
        for row in rows:
            letter = {"blt": "d", "bisr": "p"}.get(row.strategy, "b")
            acct = "cyclic Poisson" if row.sampling == "cyclic_poisson" else "fixed epochs"
            if row.strategy == "blt":
                acct += f" (solved for k = {row.blt_participations})"
            parts = []
            for e in args.epsilons:
                sig, ratio = cells[(row, e)]
                r = f"{ratio:.3f}"
                parts += [f"{sig:.4g}", f"**{r}**" if winners[e] == row else r]
            lines.append(f"| {row.label} | {acct} | {letter} = {row.param} | {lab.error(plan, row):.5g} | "
                         + " | ".join(parts) + " |")
        for e in args.epsilons:
            best[(plan, e)] = (winners[e].name(), cells[(winners[e], e)][1])
        lines.append("")
    return lines, best


# ------------------------------------------------------------------------------ training
def fixed_epoch_batches(n: int, batch_size: int, steps: int, rng: np.random.Generator) -> list:
    """Index arrays of T batches: ONE shuffled order cut into ⌈n/B⌉ batches of B (the last
    one shorter), repeated every epoch, so an example's participations are exactly
    ⌈n/B⌉ steps apart (the fixed-epochs accounting; the library's sampler does the same)."""
    order = rng.permutation(n)
    per_epoch = -(-n // batch_size)
    batches = [order[i * batch_size:(i + 1) * batch_size] for i in range(per_epoch)]
    return [batches[t % per_epoch] for t in range(steps)]


def plan_batches(plan: Plan, row: Row, seed: int) -> list:
    rng = np.random.default_rng([seed, 1])
    if row.sampling == "fixed_epochs":
        return fixed_epoch_batches(plan.num_examples, plan.batch_size, plan.steps, rng)
    return cyclic_poisson_batches(plan.num_examples, plan.batch_size, row.param, plan.steps, rng)


def train(problem, model, *, mixing, batches, sigma, lr, clip, batch_size, seed):
    """Plain DP-SGD-style loop with correlated noise z̃ = C⁻¹z (C's own recurrence); z and the
    initial weights depend only on ``seed`` (as in ``_accuracy_train.train_dp``)."""
    x, y = problem.x_train, problem.y_train
    steps = len(batches)
    z = np.random.default_rng([seed, 2]).standard_normal((steps, model.p))
    z_tilde = mixing.inverse_apply(z)
    w = model.init(np.random.default_rng([seed, 3]))
    for t in range(steps):
        idx = batches[t]
        gsum = model.clipped_sum(w, x[idx], y[idx], clip) if len(idx) else 0.0
        w = w - lr * (gsum + clip * sigma * z_tilde[t]) / batch_size
        if not np.all(np.isfinite(w)):
            return None
    return w


def accuracy_rows(plan: Plan, args) -> list:
    """Part 2 rows, each a list of Rows (its tuning set of b / d / p)."""
    cp = poisson_bands(plan, args.bands) or [plan.max_partitions()]
    return [
        [Row("dpsgd", "dpsgd", "cyclic_poisson", 1)],
        [Row("banded", "banded", "cyclic_poisson", b) for b in cp],
        [Row("toeplitz", "toeplitz", "cyclic_poisson", b) for b in cp],
        [Row("banded-fixed", "banded", "fixed_epochs", plan.steps_per_epoch)],
        [Row("blt", "blt", "fixed_epochs", BLT_BUFFERS, blt_participations=plan.epochs)],
        [Row("bisr", "bisr", "fixed_epochs", p) for p in args.bisr_bands if p <= plan.steps],
    ]


def paired(diff) -> str:
    from scipy import stats

    d = 100 * np.asarray(diff, dtype=float)
    sd = d.std(ddof=1)
    p = float(stats.ttest_rel(d, np.zeros_like(d)).pvalue) if sd > 0 else float("nan")
    return f"{d.mean():+.2f} ± {sd:.2f} | {int(np.sum(d > 0))}/{int(np.sum(d < 0))} | {p:.3g}"


def accuracy_tables(args, lab: Lab) -> tuple[list, dict]:
    plan = args.acc_plan
    log(f"part 2: building features (PCA {args.pca_dim} on public digits) ...")
    problem = build_problem(args.pca_dim)
    if len(problem.y_train) != plan.num_examples:
        raise SystemExit(f"error: the problem has {len(problem.y_train)} training examples, expected {plan.num_examples}")
    model = make_model(types.SimpleNamespace(model="softmax", hidden=0), problem)
    log(f"part 2: {model.name}, {model.p} parameters; {plan.describe()}; "
        f"grid lr {args.lr_grid} x clip {args.clip_grid}; {args.tune_seeds} tuning seeds, {args.seeds} final seeds")
    groups = accuracy_rows(plan, args)
    lines, summary = [], {}
    for eps in args.acc_epsilons:
        final, chosen = {}, {}
        for group in groups:
            label = group[0].label
            t0 = time.time()
            scores = {}
            for row, lr, clip in itertools.product(group, args.lr_grid, args.clip_grid):
                mix, sig = lab.mixing(plan, row), lab.sigma(plan, row, eps)
                vals = []
                for s in range(args.tune_seeds):
                    w = train(problem, model, mixing=mix, batches=plan_batches(plan, row, 10_000 + s), sigma=sig,
                              lr=lr, clip=clip, batch_size=plan.batch_size, seed=10_000 + s)
                    vals.append(accuracy(model, w, problem.x_val, problem.y_val))
                scores[(row, lr, clip)] = float(np.mean(vals))
            (row, lr, clip), val = max(scores.items(), key=lambda kv: kv[1])
            chosen[label] = (row, lr, clip, val, lab.sigma(plan, row, eps))
            mix = lab.mixing(plan, row)
            tests = []
            for s in range(args.seeds):
                w = train(problem, model, mixing=mix, batches=plan_batches(plan, row, s), sigma=chosen[label][4],
                          lr=lr, clip=clip, batch_size=plan.batch_size, seed=s)
                tests.append(accuracy(model, w, problem.x_test, problem.y_test))
            final[label] = tests
            edge = [name for name, v, grid in (("lr", lr, args.lr_grid), ("clip", clip, args.clip_grid))
                    if len(grid) > 1 and v in (min(grid), max(grid))]
            log(f"  ε={eps:g} {label:<13} tuned {len(scores)} configs: {row.name()} lr={lr:g} clip={clip:g} "
                f"val={val:.4f}{' (grid edge: ' + ', '.join(edge) + ')' if edge else ''}; "
                f"test {fmt_ms(tests)} ({time.time() - t0:.0f}s)")
        ref = final["banded"]
        lines += [f"### ε = {eps:g}", "",
                  "| strategy | accounting | tuned | σ | val (tuning) | test % (mean ± std) "
                  "| test − banded, pp (mean ± std) | wins/losses | paired t p |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for group in groups:
            label = group[0].label
            row, lr, clip, val, sig = chosen[label]
            acct = "cyclic Poisson" if row.sampling == "cyclic_poisson" else "fixed epochs"
            diff = "— | — | —" if label == "banded" else paired(np.subtract(final[label], ref))
            lines.append(f"| {label} | {acct} | {row.name().split(' ')[1]}, lr {lr:g}, clip {clip:g} | {sig:.4g} "
                         f"| {100 * val:.2f} | {fmt_ms(final[label])} | {diff} |")
        lines.append("")
        summary[eps] = {lab_: float(np.mean(v)) for lab_, v in final.items()}
    return lines, summary


# --------------------------------------------------------------------------------- main
def parse_plan(text: str) -> Plan:
    try:
        batch, epochs = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a plan is BxK (batch size x epochs), e.g. 50x5; got {text!r}") from None
    if batch < 1 or epochs < 1 or batch > NUM_EXAMPLES:
        raise argparse.ArgumentTypeError(f"a plan needs 1 <= B <= {NUM_EXAMPLES} and k >= 1; got {text!r}")
    return Plan(batch, epochs)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--plans", type=parse_plan, nargs="+", default=[Plan(50, 1), Plan(50, 5), Plan(50, 20), Plan(250, 10)],
                   help="part 1 plans, BxK (batch size x epochs); n = 3500")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--bands", type=int, nargs="+", default=[4, 8, 16],
                   help="b of the cyclic-Poisson banded and toeplitz rows (those with q = B·b/n < 1)")
    p.add_argument("--bisr-bands", type=int, nargs="+", default=[4, 16], help="p of the BISR rows")
    p.add_argument("--acc-plan", type=parse_plan, default=Plan(50, 5), help="part 2 plan, BxK (default 50x5)")
    p.add_argument("--acc-epsilons", type=float, nargs="+", default=[1.0, 2.0, 8.0])
    p.add_argument("--lr-grid", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0, 16.0, 32.0])
    p.add_argument("--clip-grid", type=float, nargs="+", default=[0.125, 0.25, 0.5, 1.0])
    p.add_argument("--tune-seeds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--pca-dim", type=int, default=128)
    p.add_argument("--accountant", choices=("pld", "rdp"), default="pld",
                   help="accountant of the σ calibration (default pld; --quick uses rdp, which is faster)")
    p.add_argument("--skip-error", action="store_true", help="skip part 1")
    p.add_argument("--skip-accuracy", action="store_true", help="skip part 2")
    p.add_argument("--cache", default="benchmarks/out/bench_strategies_sigma.json",
                   help="calibrated σ's are stored here and reused ('' disables)")
    p.add_argument("--out", default=None, help="write the Markdown report here")
    p.add_argument("--quick", action="store_true", help="tiny run for smoke tests (seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.plans = [Plan(250, 2)]
        args.epsilons = [8.0]
        args.bands = [4]
        args.bisr_bands = [4]
        args.acc_plan = Plan(250, 2)
        args.acc_epsilons = [8.0]
        args.lr_grid = [4.0, 8.0]
        args.clip_grid = [0.5]
        args.tune_seeds, args.seeds = 2, 2
        args.pca_dim = 16
        args.accountant = "rdp"
    if args.tune_seeds < 1 or args.seeds < 2:
        p.error("--tune-seeds must be >= 1 and --seeds >= 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    lab = Lab(args.cache, args.delta, args.accountant)
    out = ["# Mixing strategies over several epochs at the same (ε, δ)", "",
           f"Command: `python benchmarks/bench_strategies.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
           f"Machine: {machine_description()}.", "",
           f"n = {NUM_EXAMPLES}, δ = {args.delta:g}. σ from `PrivateRun(..., epsilon=ε, sampling=..., "
           f"accountant={args.accountant!r})` "
           "(cyclic Poisson: b partitions, amplified; fixed epochs: one Gaussian mechanism with the "
           "sensitivity of k participations, √k for a banded C, computed from C for BLT/BISR).", ""]
    if not args.skip_error:
        lines, best = expected_error_tables(args, lab)
        out += ["## Expected error: σ²·‖AC⁻¹‖²_F as RMSE relative to DP-SGD (lower is better; best in bold)", "",
                "‖AC⁻¹‖²_F by `objective_value(C, objective=\"bandmf\")` for every kind, checked against a "
                f"dense solve for T ≤ {DENSE_CHECK_MAX_STEPS}.", ""] + lines
        out += ["Best per plan and ε:", ""]
        out += [f"- {plan.describe()}, ε = {e:g}: {name} ({ratio:.3f})" for (plan, e), (name, ratio) in best.items()]
        out.append("")
    if not args.skip_accuracy:
        lines, summary = accuracy_tables(args, lab)
        out += [f"## Accuracy: softmax regression, {args.acc_plan.describe()}", "",
                f"PCA {args.pca_dim}; lr ∈ {args.lr_grid}, clip ∈ {args.clip_grid}, b ∈ "
                f"{poisson_bands(args.acc_plan, args.bands)} (banded, toeplitz), p ∈ {args.bisr_bands} (bisr), "
                f"d = {BLT_BUFFERS} (blt, solved for k = {args.acc_plan.epochs}), banded-fixed b = steps per epoch; "
                f"tuned on validation ({args.tune_seeds} seeds), then {args.seeds} paired seeds on test. "
                "Differences are paired per seed vs banded (cyclic Poisson); p two-sided.", ""] + lines
    wall = time.time() - start
    out += [f"Wall time {wall / 60:.1f} min ({lab.calibrations} σ calibrations, "
            f"{lab.calibration_seconds / 60:.1f} min)."]
    report = "\n".join(out) + "\n"
    print(report)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
