"""``noisecurve audit``: audit one configuration of the real training path and print the
claimed ε, the empirical lower bound with its confidence interval, and a verdict; or, with
``--model FILE.keras --data FILE.npz``, run the mechanism checks on the user's own model
and run (:mod:`keras_noisecurve.apps.cli_audit_model`).

Exit status (:data:`EXIT_STATUS`): 0 consistent (and every check passed), 1 violation (the
bound exceeds the claim at the stated confidence), 3 a mechanism check failed (the canary
audit's noise check, or a check of ``--model``) without a violation, 2 bad arguments (one
line on stderr).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from keras_noisecurve.apps.strategy_table import AUDIT_KINDS, options_for

__all__ = ["EXIT_STATUS", "add_arguments", "run"]

#: what each exit status of ``noisecurve audit`` means
EXIT_STATUS = {
    0: "consistent: no evidence against the claim, and every mechanism check passed",
    1: "violation: the empirical lower bound exceeds the claimed epsilon at the stated confidence",
    2: "bad arguments or files (one line on stderr)",
    3: "a mechanism check failed (the noise check of a canary audit, or clipping/sampling/noise of --model), "
       "without a violation",
}


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from keras_noisecurve.apps import cli_audit_model

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "exit status:\n" + "\n".join(f"  {code}  {text}" for code, text in sorted(EXIT_STATUS.items()))
    parser.add_argument("--strategy", choices=AUDIT_KINDS, default="banded",
                        help="the mixing strategy C (default banded: DP-BandMF)")
    parser.add_argument("--epsilon", type=_positive_float, default=4.0, help="target epsilon (sigma is calibrated)")
    parser.add_argument("--delta", type=_positive_float, default=1e-5, help="delta, in (0, 1)")
    parser.add_argument("--canaries", type=_positive_int, default=10000, help="number of canaries m (>= 2)")
    parser.add_argument("--threat", choices=("white-box", "black-box"), default="white-box",
                        help="white-box: every iterate is released, gradient canaries; black-box: final model, "
                             "mislabelled input canaries scored by loss")
    parser.add_argument("--sampling", choices=("fixed_epochs", "cyclic_poisson"), default="fixed_epochs")
    parser.add_argument("--epochs", type=_positive_int, default=2)
    parser.add_argument("--steps-per-epoch", type=_positive_int, default=8, help="white-box only")
    parser.add_argument("--bands", type=_positive_int, default=4, help="b of a banded or Toeplitz C")
    parser.add_argument("--buffers", type=_positive_int, default=2, help="d of a BLT C")
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the bound, in (0, 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", default=None, help="also write the full result as JSON")
    cli_audit_model.add_arguments(parser)


def _check(args):
    if not 0 < args.delta < 1:
        raise ValueError(f"--delta must lie in (0, 1), got {args.delta}")
    if not 0 < args.confidence < 1:
        raise ValueError(f"--confidence must lie in (0, 1), got {args.confidence}")
    if args.canaries < 2:
        raise ValueError(f"--canaries must be >= 2, got {args.canaries}")
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    allowed = options_for(args.strategy).samplings
    if args.sampling not in allowed:
        raise ValueError(f"--strategy {args.strategy} needs --sampling {' or '.join(allowed)} (its C is not banded: "
                         "no amplification)")


def _audit(args):
    if args.threat == "white-box":
        from keras_noisecurve.audit.whitebox import audit_whitebox

        return audit_whitebox(strategy=args.strategy, epsilon=args.epsilon, delta=args.delta,
                              canaries=args.canaries, epochs=args.epochs, steps_per_epoch=args.steps_per_epoch,
                              sampling=args.sampling, bands=args.bands, buffers=args.buffers,
                              confidence=args.confidence, seed=args.seed).result
    from keras_noisecurve.audit.blackbox import audit_blackbox

    return audit_blackbox(strategy=args.strategy, epsilon=args.epsilon, delta=args.delta, canaries=args.canaries,
                          epochs=args.epochs, sampling=args.sampling, bands=args.bands, buffers=args.buffers,
                          confidence=args.confidence, seed=args.seed)


def run(args) -> int:
    from keras_noisecurve.apps import cli_audit_model

    try:
        if args.model is not None or args.data is not None:
            if args.model is None:
                raise ValueError("--data is the data of --model FILE.keras: give both")
            cli_audit_model.check_arguments(args)
        _check(args)
    except ValueError as err:
        print(f"noisecurve audit: error: {err}", file=sys.stderr)
        return 2
    from keras_noisecurve.apps.cli import _start_backend, quiet_startup

    quiet_startup(_start_backend)  # TensorFlow's C++ start-up notices silenced, as for `demo`
    if args.model is not None:
        return cli_audit_model.run_checks(args)
    try:
        result = _audit(args)
    except (ValueError, TypeError) as err:
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"noisecurve audit: error: {message}", file=sys.stderr)
        return 2
    info = result.info
    conf = f"{100 * result.confidence:g} %"
    print(f"audit: {info.get('strategy')} ({info.get('sampling', '').replace('_', ' ')}), {args.threat}, "
          f"T = {info.get('steps')}, sigma = {info.get('noise_multiplier'):.4g}, "
          f"{result.canaries_in + result.canaries_out} canaries ({result.canaries_in} in / {result.canaries_out} out)")
    print(f"claimed epsilon:        {result.claimed_epsilon:.4f}   (delta = {result.delta:g}, the accountant's)")
    print(f"empirical lower bound:  {result.epsilon_lower:.4f}   {conf} confidence interval for the achieved "
          f"epsilon: [{result.epsilon_lower:.4f}, inf)   ({result.best})")
    best = result.bounds[result.best].details
    if "epsilon_point" in best:
        print(f"point estimate:         {best['epsilon_point']:.4f}   (Gaussian DP, mu = {best['mu_point']:.4f}"
              + (f"; claimed mu = {info['claimed_mu']:.4f})" if "claimed_mu" in info else ")"))
    if "noise_matches_claim" in info:
        if info["noise_matches_claim"]:
            print(f"noise check: the C-whitened noise of {info['probes']} probe coordinates is white, as claimed "
                  f"(max |cov - I| = {info['probe_covariance_error']:.3f} <= {info['probe_threshold']:.3f})")
        else:
            print(f"noise check: MISMATCH - the C-whitened probe noise is not white (max |cov - I| = "
                  f"{info['probe_covariance_error']:.3f} > {info['probe_threshold']:.3f}): the noise added is not "
                  "the claimed C^-1 z")
    if result.verdict == "violation":
        print(f"verdict: VIOLATION - the run leaks more than claimed: epsilon >= {result.epsilon_lower:.4f} > "
              f"{result.claimed_epsilon:.4f} with {conf} confidence")
    else:
        strength = "" if result.ratio >= 0.5 else " (a weak audit: the bound is under half the claim)"
        print(f"verdict: consistent - no evidence against the claim; the bound reaches {result.ratio:.0%} of it"
              f"{strength}. An audit bounds epsilon from below only: it cannot certify privacy.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result.to_dict(), handle, indent=2, default=float)
    if result.verdict == "violation":
        return 1
    if info.get("noise_matches_claim") is False:
        print("mechanism check failed: the noise check (exit status 3)")
    return 3 if info.get("noise_matches_claim") is False else 0
