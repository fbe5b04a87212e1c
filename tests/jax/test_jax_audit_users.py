"""Mechanism checks on a user-level run (PrivateRun(privacy_unit="user")) on the JAX backend: the
clipping check compares the engine, clipping each user's rows as one, with per-user sums of an
independent per-example ``jax.grad`` loop in float64 and catches an engine that clips per row; every
check passes on a correct user-level run with an adaptive clip."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.audit.mechanism import check_mechanism

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
K = 3  # examples_per_user


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield


def _users(num_users=24):
    """(users, x, y): 1 … 5 examples per user (some above k = 3, drawn k of), shuffled."""
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(num_users), rng.integers(1, 6, num_users))
    rng.shuffle(users)
    return users, rng.normal(size=(users.size, 6, 6, 2)).astype("float32"), rng.integers(0, 3, users.size)


def _private(adaptive, clipping="auto"):
    steps = 12
    run = knc.PrivateRun(
        privacy_unit="user", num_users=24, examples_per_user=K, batch_size=6, steps=steps,
        mixing=knc.solve_mixing_matrix(steps=steps, bands=3, objective="bandmf"), noise_multiplier=1.0, delta=1e-5,
        seed=0, adaptive_clip=knc.AdaptiveClip(initial=0.05, learning_rate=0.5, count_stddev=0.5) if adaptive else None)
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, name="conv")(inputs)
    h = keras.layers.Dense(4, activation="tanh", name="body")(keras.layers.Flatten()(h))
    private = knc.make_private(keras.Model(inputs, keras.layers.Dense(3, name="head")(h)), clipping=clipping)
    extra = {} if adaptive else {"l2_norm_clip": 0.05}
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=2, **extra), loss=LOSS)
    return private


def test_the_clipping_check_runs_per_user_and_catches_an_engine_that_clips_per_row_on_jax():
    users, x, y = _users()
    private = _private(adaptive=False)
    good = check_mechanism(model=private, x=x, y=y, users=users, checks=("clipping",), batches=1,
                           batch_size=6).checks["clipping"]
    assert good.passed, good.line
    assert good.unit == "user" and good.unit_rows == K and good.examples == 6
    assert good.worst_error < 1e-4 and good.max_contribution <= 1 + 1e-4
    assert "6 users (k = 3 rows each)" in good.line and good.reference_dtype == "float64"
    engine = private._dp_clipped_sum

    def per_row():  # the planted bug: the engine ignores unit_rows and clips every row alone
        clipped_sum = engine()
        return lambda *a, unit_rows=1, **kw: clipped_sum(*a, **kw)

    private._dp_clipped_sum = per_row
    bad = check_mechanism(model=private, x=x, y=y, users=users, checks=("clipping",), batches=1,
                          batch_size=6).checks["clipping"]
    assert not bad.passed and "clipping: FAIL" in bad.line
    assert bad.max_contribution > 1.5 and bad.norm_error > 0.1 and bad.sum_error > 0.1, bad.line


def test_a_user_level_run_with_an_adaptive_clip_passes_every_check_on_jax():
    users, x, y = _users()
    report = check_mechanism(model=_private(adaptive=True), x=x, y=y, users=users, batches=1, batch_size=4,
                             noise_steps=12)
    assert report.passed, report.lines()
    assert report.checks["clipping"].unit == "user"
    assert sum(report.checks["sampling"].histogram.values()) == 24
    assert abs(report.checks["noise"].scale - 1) < 0.05
