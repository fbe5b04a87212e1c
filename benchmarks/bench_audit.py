"""White-box privacy audit of the real training path for every strategy at ε ∈ {1, 4, 16}.

For each strategy (DP-SGD, DP-BandMF, banded Toeplitz, BLT; fixed epochs: canaries
participate without sampling amplification; and DP-BandMF with cyclic Poisson sampling)
and each target ε (δ = 1e-5), ``keras_noisecurve.audit.audit_whitebox`` trains ONE run
through ``make_private`` + ``NoiseCurveOptimizer`` + ``PrivateRun`` with m white-box
gradient canaries (each included with probability ½) and reports

- the claimed ε (the accountant's, for the calibrated σ),
- the empirical lower bound at 95 % confidence (the largest of the audit's scores ×
  estimators, each at 1 − 0.05/K), which estimator gave it, and the Clopper–Pearson
  (ε, δ) bound alone (no Gaussian-shape argument),
- the point estimate of μ (Gaussian DP) of the claimed-C plan score, next to the μ the
  claim implies (fixed epochs: Δ_k/σ),
- the probe check (mean square of the C-whitened noise, 1 under the claim),

each over ``--seeds`` independent runs (the bound must stay below the claim in every one).

Run (about 1-2 minutes on 2 cores with the defaults):

    python benchmarks/bench_audit.py --out benchmarks/out/bench_audit.md
    python benchmarks/bench_audit.py --quick --out /tmp/audit.md      # seconds
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (strategy, sampling, resumed): "resumed" stops fit after T/2 + 1 steps, saves the model to a
# .keras file, loads it back and trains the rest (the resume path)
ROWS = (
    ("dpsgd", "fixed_epochs", False),
    ("banded", "fixed_epochs", False),
    ("banded", "fixed_epochs", True),
    ("toeplitz", "fixed_epochs", False),
    ("blt", "fixed_epochs", False),
    ("banded", "cyclic_poisson", False),
)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--canaries", type=int, default=100000)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 4.0, 16.0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps-per-epoch", type=int, default=8)
    parser.add_argument("--bands", type=int, default=4)
    parser.add_argument("--buffers", type=int, default=2)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--quick", action="store_true", help="2000 canaries, ε = 4, one seed")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.canaries, args.epsilons, args.seeds = 2000, [4.0], 1

    from keras_noisecurve.audit.whitebox import audit_whitebox

    lines = [
        "# White-box audit of the training path",
        "",
        f"m = {args.canaries} canaries, {args.epochs} epochs × {args.steps_per_epoch} steps, b = {args.bands} "
        f"(banded, Toeplitz), d = {args.buffers} (BLT), δ = {args.delta:g}, 95 % confidence, "
        f"{args.seeds} seed(s) per row; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs.",
        "",
        "| strategy | sampling | target ε | claimed ε | lower bound (95 %) | bound / claim | best estimator "
        "| CP (ε, δ) bound | μ̂ (plan score) | claimed μ | probe mean square | noise white | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for eps in args.epsilons:
        for strategy, sampling, resumed in ROWS:
            for seed in range(args.seeds):
                start = time.perf_counter()
                audit = audit_whitebox(strategy=strategy, epsilon=eps, delta=args.delta, canaries=args.canaries,
                                       epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                                       bands=args.bands, buffers=args.buffers, sampling=sampling, seed=seed,
                                       resume_at=args.epochs * args.steps_per_epoch // 2 + 1 if resumed else None)
                seconds = time.perf_counter() - start
                r = audit.result
                cp = max(b.epsilon for k, b in r.bounds.items() if k.endswith("clopper-pearson"))
                plan = r.bounds.get("claimed/plan/gaussian-dp")
                mu_hat = f"{plan.details['mu_point']:.3f}" if plan is not None else "–"
                claimed_mu = f"{r.info['claimed_mu']:.3f}" if "claimed_mu" in r.info else "–"
                worst = max(worst, r.ratio)
                lines.append(
                    f"| {strategy}{' (resumed)' if resumed else ''} | {sampling.replace('_', ' ')} | {eps:g} | {r.claimed_epsilon:.3f} | "
                    f"{r.epsilon_lower:.3f} | {r.ratio:.0%} | {r.best} | {cp:.3f} | {mu_hat} | {claimed_mu} | "
                    f"{r.info['probe_whitened_variance']:.4f} | {'yes' if r.info['noise_matches_claim'] else 'NO'} | "
                    f"{seconds:.1f} |")
                print(lines[-1], flush=True)
    lines += ["", f"Largest bound / claim over all rows: {worst:.0%} "
              f"({'never above the claim' if worst <= 1 else 'ABOVE THE CLAIM'}).", ""]
    text = "\n".join(lines)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
