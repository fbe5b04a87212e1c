"""A user-level run's batches on JAX (``KERAS_BACKEND=jax``): ``run.dataset(x, y, users=ids)``
serves ``run.padded_rows`` = P·k rows per step, user-major, whose gathered rows are the examples
``UserTable.rows`` names, with its masks (tests/privacy/test_user_level_run.py checks the rows
themselves and the ``tf.data`` pipeline)."""

from __future__ import annotations

import itertools

import numpy as np

import keras_noisecurve as knc
from keras_noisecurve.privacy.step_batches import Samplers


def test_the_jax_pipeline_serves_the_expanded_rows():
    ids = np.random.default_rng(0).permutation(np.repeat(np.arange(12), np.arange(1, 13)))
    x = np.arange(ids.size, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32) + 1.0
    y = ids.astype(np.int32)
    weight = np.random.default_rng(1).uniform(0.5, 1.5, ids.size)
    run = knc.PrivateRun(privacy_unit="user", num_users=12, examples_per_user=4, batch_size=3, steps=5,
                         noise_multiplier=1.0, delta=1e-5, seed=2)
    data = run.dataset(x, y, users=ids, sample_weight=weight)
    samplers = Samplers(run, data.source.sample_weight, users=data.users)
    batches = data.batches()
    assert len(batches) == run.steps
    for t, (xb, yb, mask, step) in enumerate(itertools.islice(iter(batches), 3)):
        rows, expected = samplers.batch(t, run.initial_key())
        assert xb.shape == (run.padded_rows, 3) and rows.size == run.padded_rows
        np.testing.assert_array_equal(mask, expected)
        keep = expected > 0
        np.testing.assert_array_equal(xb[keep], x[rows[keep]])
        np.testing.assert_array_equal(yb[keep], y[rows[keep]])
        np.testing.assert_array_equal(xb[~keep], 0.0)
        for j in range(run.padded_batch_size):  # slot j: one user's rows, whose masks average its weights
            slot, weights = rows[j * 4:(j + 1) * 4], mask[j * 4:(j + 1) * 4]
            assert len(set(ids[slot].tolist())) == 1
            if weights.any():
                real = slot[weights > 0]
                np.testing.assert_allclose(weights.sum(), weight[real].astype(np.float32).mean(), rtol=1e-6)
        assert set(np.asarray(step).tolist()) == {t}
