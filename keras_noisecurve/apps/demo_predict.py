"""``noisecurve demo``: the predicted side of the comparison, and the noise in model units.

- :func:`choose` runs ``choose_mixing`` (``PrivateRun(mixing="auto")``'s choice) for the
  demo's run and update rule: DP-BandMF's b and C, and σ(1), σ(b) of the candidates.
- :func:`predictions`: each method's predicted noise of the updates against DP-SGD at the
  same (ε, δ): ``(ζσ)²·Tr(W X⁻¹)`` with W the running-sum workload of the method's update
  rule (``objective="bandmf"``, momentum and schedule included), relative to DP-SGD's
  ``(ζ₁σ₁)²·Tr(W)``: the chooser's ``relative_error`` for DP-BandMF, the same score of the
  curvature-solved C for NoiseCurve.
- :func:`noise_curves`: per-step and running-sum noise std per coordinate in the units the
  model sees (ζσ‖C⁻¹[t, :]‖ and ζσ‖(A_rule C⁻¹)[t, :]‖, units of 1/B and η/B), for the plot.
- :func:`comparison_lines`: predicted beside measured (paired accuracy differences).

numpy/scipy only: nothing here imports TensorFlow.
"""

from __future__ import annotations

import math

from keras_noisecurve.apps.demo_configs import METHODS
from keras_noisecurve.privacy.choice import RUNNING_SUMS as BANDMF

__all__ = ["BANDMF", "QUICK_MAX_BANDS", "banded_fallback", "choose", "comparison_lines", "comparison_rows",
           "noise_curves", "predictions"]

# BANDMF: the running-sum objective (DP-BandMF's), the workload every prediction is scored under.

#: ``--quick`` caps the auto choice at this many bands (a smoke test: few calibrations).
QUICK_MAX_BANDS = 4


def _rule(m):
    import keras_noisecurve as knc

    return knc.UpdateRule(momentum=m["momentum"], schedule=m["schedule"])


def choose(*, num_examples, batch_size, steps, epsilon, delta, config, max_bands=None):
    """``choose_mixing`` for the demo's run and ``config``'s update rule (a ``MixingChoice``)."""
    import keras_noisecurve as knc

    return knc.choose_mixing(num_examples=num_examples, batch_size=batch_size, steps=steps, epsilon=epsilon,
                             delta=delta, sampling="cyclic_poisson", update_rule=_rule(config),
                             max_bands=max_bands)


def auto_bands(methods, *, num_examples, batch_size, steps, epsilon, delta, quick, log):
    """Resolve every ``AUTO`` b of ``methods`` (in place) by ``choose_mixing`` for DP-BandMF's
    configuration; returns ``(choice, picked)`` (the ``MixingChoice`` and the candidate trained
    as DP-BandMF), ``(None, None)`` when no b is ``AUTO``."""
    import time

    from keras_noisecurve.apps.demo_configs import is_auto

    if not any(is_auto(m["bands"]) for m in methods.values()):
        return None, None
    started = time.perf_counter()
    cap = QUICK_MAX_BANDS if quick else None
    log(f"mixing='auto': choose_mixing for DP-BandMF's run (n={num_examples}, B={batch_size}, T={steps}, "
        f"eps={epsilon:g}, the update rule of its configuration{f', b <= {cap} (--quick)' if cap else ''}) ...")
    choice = choose(num_examples=num_examples, batch_size=batch_size, steps=steps, epsilon=epsilon, delta=delta,
                    config=methods["DP-BandMF"], max_bands=cap)
    for line in choice.summary().splitlines():
        log("  " + line)
    picked = choice.chosen if choice.chosen.buffers else banded_fallback(choice)
    if picked is None:
        raise ValueError("choose_mixing found no banded candidate (b >= 2) for this run: give --bands, or a "
                         "smaller --batch-size")
    if picked is not choice.chosen:
        log(f"the chooser chose DP-SGD; DP-BandMF trains at the best banded candidate, {picked.label}, "
            "to show the comparison")
    for m in methods.values():
        if is_auto(m["bands"]):
            m["bands"] = picked.size
    log(f"auto choice: b={picked.size} for DP-BandMF and NoiseCurve ({time.perf_counter() - started:.0f}s)")
    return choice, picked


def banded_fallback(choice):
    """The best banded candidate (b ≥ 2, solved exactly) of ``choice``: what the demo trains as
    DP-BandMF when the chooser picked DP-SGD (amplification outweighs correlation)."""
    banded = [c for c in choice.candidates if c.buffers > 0 and c.solved != "screen"] or \
        [c for c in choice.candidates if c.buffers > 0]
    return min(banded, key=lambda c: c.relative_error) if banded else None


def predictions(mixings, sigmas, methods) -> dict:
    """Per method: the predicted noise variance of its updates relative to DP-SGD's
    (``variance_ratio``), ``noise_std_reduction`` = 1 − √ratio, and the numbers behind them."""
    from keras_noisecurve.mixing import objective_value

    def score(name):
        m = methods[name]
        error = objective_value(mixings[name], objective=BANDMF, update_rule=_rule(m))
        return error, (m["clip"] * sigmas[name]) ** 2 * error

    _, reference = score("DP-SGD")
    out = {}
    for name in METHODS:
        error, value = score(name)
        ratio = value / reference
        out[name] = {"variance_ratio": ratio, "noise_std_reduction": 1.0 - math.sqrt(ratio),
                     "trace_w_xinv": error, "sigma": sigmas[name], "clip": methods[name]["clip"],
                     "objective": BANDMF, "update_rule": _rule(methods[name]).to_metadata()}
    return out


def noise_curves(mixings, sigmas, methods) -> dict:
    """Per method, per coordinate, in the model's units: ``step_std`` = ζσ‖C⁻¹[t, :]‖ (the noise
    of the step's summed clipped gradients: divide by B for the averaged gradient) and
    ``sum_std`` = ζσ‖(A_rule C⁻¹)[t, :]‖ (the noise in the weights after step t, with A_rule the
    prefix map of the method's update rule (momentum, schedule): multiply by η/B)."""
    import numpy as np

    from keras_noisecurve.mixing.rule_workloads import prefix_map_matrix

    out = {}
    for name, mixing in mixings.items():
        m = methods[name]
        c = np.asarray(mixing.to_dense(), dtype=np.float64)
        c_inv = np.linalg.inv(c)
        scale = m["clip"] * sigmas[name]
        a_rule = prefix_map_matrix(c.shape[0], _rule(m))
        out[name] = {"step_std": (scale * np.linalg.norm(c_inv, axis=1)).tolist(),
                     "sum_std": (scale * np.linalg.norm(a_rule @ c_inv, axis=1)).tolist()}
    return out


def attach(results, paired, predicted) -> list:
    """Add ``predicted`` and ``measured`` (accuracy, paired difference against DP-SGD: mean and
    sample sd over the seeds; one seed: the difference, no sd) to each method's ``results``
    entry; returns :func:`comparison_rows`."""
    reference = results[METHODS[0]]
    for name in METHODS:
        r, d = results[name], paired.get(f"{name} - DP-SGD")
        r["predicted"] = predicted[name]
        r["measured"] = {"test_accuracy": r["test_accuracy"], "test_accuracy_std": r["test_accuracy_std"],
                         "difference": None if name == METHODS[0] else (
                             r["test_accuracy"] - reference["test_accuracy"] if d is None else d["mean"]),
                         "difference_std": None if d is None else d["std"], "n": r["n"]}
    return comparison_rows(predicted, results)


def comparison_rows(predicted, results) -> list:
    """One dict per method: b, σ, predicted std reduction and variance ratio, measured paired
    accuracy difference against DP-SGD (mean, sd, N)."""
    rows = []
    for name in METHODS:
        p, r = predicted[name], results[name]
        rows.append({"method": name, "bands": r["bands"], "sigma": r["sigma"],
                     "predicted_noise_std_reduction": p["noise_std_reduction"],
                     "predicted_variance_ratio": p["variance_ratio"],
                     "measured_accuracy": r["test_accuracy"], "measured_accuracy_std": r["test_accuracy_std"],
                     "measured_difference": r["measured"]["difference"],
                     "measured_difference_std": r["measured"]["difference_std"], "n": r["n"]})
    return rows


def comparison_lines(rows, *, rule, choice=None) -> list:
    """The predicted-against-measured table (markdown) and the chooser's sentence (``choice``,
    a ``MixingChoice``, when the auto choice ran). ``rule``: the configuration whose update
    rule the predictions are for."""
    from keras_noisecurve.privacy.choice import rule_text

    n = rows[0]["n"]
    lines = [f"Predicted against measured, vs DP-SGD at the same (eps, delta). Predicted: noise of the updates "
             f"({rule_text(_rule(rule).to_metadata())}; running sums, (clip*sigma)^2 Tr(W X^-1), per unit of each "
             "method's own learning rate); measured: test "
             "accuracy, paired by seed"
             + (f", mean ± sd over N = {n}" if n > 1 else " (one seed: no sd; use --seeds 3)") + ":",
             "| method | b | sigma | predicted noise std | predicted variance | measured accuracy "
             "| measured difference (paired) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        acc = f"{100 * row['measured_accuracy']:.2f}" + \
            ("" if row["measured_accuracy_std"] is None else f" ± {100 * row['measured_accuracy_std']:.2f}") + " %"
        if row["method"] == METHODS[0]:
            std, var, diff = "reference", "x1", "reference"
        else:
            std = f"{-100 * row['predicted_noise_std_reduction']:+.0f} %"
            var = f"x{row['predicted_variance_ratio']:.2f}"
            diff = f"{100 * row['measured_difference']:+.2f}" + (
                " pp (one seed)" if row["measured_difference_std"] is None
                else f" ± {100 * row['measured_difference_std']:.2f} pp")
        lines.append(f"| {row['method']} | {row['bands']} | {row['sigma']:.3f} | {std} | {var} | {acc} | {diff} |")
    if choice is not None:
        lines.append(f"mixing='auto' (choose_mixing): {choice.expectation()}")
    return lines
