"""check_participations against hand-written plans (numpy only)."""

from __future__ import annotations

import numpy as np
import pytest

from keras_noisecurve.audit.participation import check_participations, participation_counts
from keras_noisecurve.privacy.spec import RunSpec


def _fixed(n=6, batch=2, steps=6):
    return RunSpec(num_examples=n, batch_size=batch, steps=steps, sampling="fixed_epochs")


def test_the_fixed_order_passes_and_its_histogram_is_exact():
    spec = _fixed()  # 3 steps per epoch, 2 epochs
    batches = [[0, 1], [2, 3], [4, 5]] * 2
    result = check_participations(batches=batches, spec=spec)
    assert result.passed and result.histogram == {2: 6} and result.min_gap == 3 == result.separation
    assert result.max_allowed == 2 and "sampling: PASS" in result.line
    assert participation_counts(batches, 6).tolist() == [2] * 6


@pytest.mark.parametrize("batches, why", [
    ([[0, 1], [1, 3], [4, 5], [0, 1], [2, 3], [4, 5]], "example 1 two steps in a row (gap 1 < 3)"),
    ([[0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 0]], "example 0 three times (> 2)"),
    ([[0, 0], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5]], "example 0 twice in one step (gap 0)"),
])
def test_fixed_epochs_offenders_are_named(batches, why):
    result = check_participations(batches=batches, spec=_fixed())
    assert not result.passed and result.offenders == 1, why
    assert "sampling: FAIL - 1 examples" in result.line


def test_cyclic_poisson_needs_each_example_in_the_steps_of_one_partition():
    spec = RunSpec(num_examples=8, batch_size=2, steps=8, bands=2, sampling="cyclic_poisson")  # q = 0.5
    partitions = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7])]
    good = [[0, 1], [4, 5], [2, 3], [6, 7], [0, 2], [5, 7], [1, 3], [4, 6]]
    assert check_participations(batches=good, spec=spec, partitions=partitions).passed
    other = [list(b) for b in good]
    other[1] = [4, 0]  # example 0 (partition 0) at step 1 (partition 1)
    result = check_participations(batches=other, spec=spec, partitions=partitions)
    assert not result.passed and result.first_offender[0] == 0
    # without the partitions, the residues of example 0's steps (0, 1, 4) still disagree
    assert not check_participations(batches=other, spec=spec).passed


def test_cyclic_poisson_rate_far_from_q_fails():
    spec = RunSpec(num_examples=400, batch_size=10, steps=40, bands=2, sampling="cyclic_poisson")  # q = 0.05
    parts = [np.arange(0, 200), np.arange(200, 400)]
    everyone = [parts[t % 2] for t in range(40)]  # every example at every visit: rate 1, not q
    result = check_participations(batches=everyone, spec=spec, partitions=parts)
    assert not result.passed and result.offenders == 0 and result.rate_z > 5
    assert "the realised rate is not q" in result.line


def test_the_whole_plan_is_required():
    with pytest.raises(ValueError, match="batches must hold the 6 steps of the whole plan, got 2"):
        check_participations(batches=[[0], [1]], spec=_fixed())
