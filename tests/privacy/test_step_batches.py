"""``StepBatches`` split between input processes: part k of N serves rows [k·R, (k+1)·R) of
step t's batch, the batch padded (mask 0) to a multiple of lcm(N, multiple); the parts
put together are the one-process batch, row for row. Imports no framework (numpy only)."""

import numpy as np
import pytest

from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.privacy.sources import as_source
from keras_noisecurve.privacy.step_batches import StepBatches


def _run_and_source(n=40):
    run = PrivateRun(num_examples=n, batch_size=8, steps=6, noise_multiplier=1.0, delta=1e-5, seed=5)
    x = np.arange(n, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(n, dtype=np.int32)
    return run, as_source(x, y)


@pytest.mark.parametrize("parts, multiple", [(2, 1), (3, 1), (2, 4), (1, 3), (4, 2)])
def test_the_parts_of_a_step_are_the_one_process_batch_padded(parts, multiple):
    run, source = _run_and_source()
    whole = StepBatches(run, source, (1, run.initial_key()))
    pieces = [StepBatches(run, source, (1, run.initial_key()), parts=parts, part=k, multiple=multiple)
              for k in range(parts)]
    p = run.padded_batch_size
    unit = np.lcm(parts, multiple)
    padded = -(-p // unit) * unit
    assert whole.padded_size == p and whole.rows == p
    for i in range(len(whole)):
        x, y, mask, step = whole[i]
        got = [piece[i] for piece in pieces]
        assert all(g[0].shape == (padded // parts, 3) for g in got)
        xs, ys, masks, steps = (np.concatenate([g[j] for g in got]) for j in range(4))
        np.testing.assert_array_equal(xs[:p], x)
        np.testing.assert_array_equal(ys[:p], y)
        np.testing.assert_array_equal(masks[:p], mask)
        np.testing.assert_array_equal(masks[p:], 0.0)  # the padding rows count for nothing
        assert set(steps.tolist()) == {1 + i} and set(step.tolist()) == {1 + i}
    assert len(pieces[0]) == len(whole) == run.steps - 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(parts=0), "parts must be a positive int, got 0"),
    (dict(parts=2, part=2), r"part must be an int in \[0, 2\) \(parts=2\), got 2"),
    (dict(parts=2, part=-1), r"part must be an int in \[0, 2\)"),
    (dict(multiple=1.5), "multiple must be a positive int, got 1.5"),
])
def test_bad_parts_are_refused_with_what_was_received(kwargs, match):
    run, source = _run_and_source()
    with pytest.raises(ValueError, match=match):
        StepBatches(run, source, (0, run.initial_key()), **kwargs)
