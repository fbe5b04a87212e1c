"""The planted-bug table of docs/audit.md: each bug of tests/audit/broken.py against the
mechanism check that should catch it, with the number it reports.

    python benchmarks/audit_planted.py

Layer rules: the rule's ``analyse`` drops its layer's share of every example's norm (a
monkeypatch of the rule class, from outside the library), on the tiny model of
tests/audit/test_mechanism.py with one layer of that family and a Dense head, ζ = 0.05,
6 examples. Samplers and noises: the same run as the tests (n = 120, B = 12, 2 or 3 epochs).
Prints a Markdown table (about a minute on 2 CPU cores).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests.audit

import keras  # noqa: E402
import pytest  # noqa: E402

from tests.audit import broken  # noqa: E402
from tests.audit import test_mechanism as cases  # noqa: E402


def main():
    rows = []
    for family, rule in sorted(cases.FAMILIES.items()):
        with pytest.MonkeyPatch.context() as patch:
            keras.backend.clear_session()  # as the tests: fresh session, fixed initial weights
            keras.utils.set_random_seed(0)
            model, x = cases._family_model(family)
            good = cases._clipping(model, x)
            broken.drop_layer_share(patch, rule)
            bad = cases._clipping(model, x)
        rows.append((f"{family} layer: its share of the norm dropped", "clipping",
                     f"{'FAIL' if not bad.passed else 'pass'}: worst layer {bad.worst_layer[0]} (rule "
                     f"{bad.worst_layer[2]}) error {bad.worst_error:.2f}, largest contribution "
                     f"{bad.max_contribution:.2f} ζ (correct: error {good.worst_error:.1e})"))
    for name, plant, sampling in (("fixed-epochs batches overlapping by half", broken.overlapping_fixed_epochs,
                                   "fixed_epochs"),
                                  ("cyclic Poisson drawing from every partition", broken.poisson_from_every_partition,
                                   "cyclic_poisson")):
        with pytest.MonkeyPatch.context() as patch:
            run = cases._run("banded", sampling)
            plant(patch)
            result = cases.check_sampling(run=run)
        rows.append((f"sampler: {name}", "sampling",
                     f"{'FAIL' if not result.passed else 'pass'}: {result.offenders} of {run.num_examples} examples "
                     f"off the plan, smallest gap {result.min_gap} (allowed ≥ {result.separation})"))
    for name, factory in (("noise scaled by ½", broken.ScaledNoiseOptimizer),
                          ("C⁻¹ replaced by I (banded σ)", broken.IndependentNoiseOptimizer),
                          ("C instead of C⁻¹", broken.ForwardCOptimizer)):
        private, x, y = cases._private(cases._run("banded", epochs=3), factory=factory)
        result = cases.check_mechanism(model=private, x=x, y=y, checks=("noise",)).checks["noise"]
        rows.append((f"optimizer: {name}", "noise",
                     f"{'FAIL' if not result.passed else 'pass'}: std {result.scale:.3f} ζσ, max |cov − I| "
                     f"{result.covariance_error:.3f} (threshold {result.covariance_threshold:.3f})"))
    print("| planted bug | caught by | what the check reports |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
