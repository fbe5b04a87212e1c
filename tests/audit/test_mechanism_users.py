"""Mechanism checks on a user-level run (PrivateRun(privacy_unit="user")), TensorFlow: the clipping
check compares the engine, clipping each user's rows as one, with per-user sums of an independent
per-example gradient loop, and catches an engine that clips per row; the sampling check counts
users; every check passes on a correct user-level run with an adaptive clip."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.apps.cli import main
from keras_noisecurve.audit.mechanism import check_mechanism, check_sampling
from keras_noisecurve.audit.whitebox import build_mixing
from keras_noisecurve.privacy.users import UserTable

from . import broken

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
K = 3  # examples_per_user


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    yield


def _users(num_users=24, seed=0):
    """(users, x, y): 1 … 5 examples per user (some above k = 3, drawn k of), shuffled."""
    rng = np.random.default_rng(seed)
    users = np.repeat(np.arange(num_users), rng.integers(1, 6, num_users))
    rng.shuffle(users)
    x = rng.normal(size=(users.size, 6, 6, 2)).astype("float32")
    return users, x, rng.integers(0, 3, users.size)


def _run(sampling="cyclic_poisson", adaptive=True, num_users=24):
    steps = 12
    return knc.PrivateRun(
        privacy_unit="user", num_users=num_users, examples_per_user=K, batch_size=6, steps=steps,
        mixing=build_mixing(strategy="banded", steps=steps, bands=3), noise_multiplier=1.0, delta=1e-5, seed=0,
        sampling=sampling,
        adaptive_clip=knc.AdaptiveClip(initial=0.05, learning_rate=0.5, count_stddev=0.5) if adaptive else None)


def _private(run, clip=None):
    """A Conv2D (clipped per user by the per-layer fallback) and two Dense layers (their rule on
    merged rows), compiled with the user-level run."""
    inputs = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(3, 3, name="conv")(inputs)
    h = keras.layers.Dense(4, activation="tanh", name="body")(keras.layers.Flatten()(h))
    private = knc.make_private(keras.Model(inputs, keras.layers.Dense(3, name="head")(h)))
    extra = {} if clip is None else {"l2_norm_clip": clip}
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=2, **extra), loss=LOSS)
    return private


def _engine_clips_per_row(monkeypatch):
    """The planted bug: the engine ignores ``unit_rows`` and clips every row alone."""
    from keras_noisecurve.backend.tensorflow import dp_model

    original = dp_model.get_engine

    def get_engine(*args, **kwargs):
        engine = original(*args, **kwargs)
        return lambda *a, unit_rows=1, **kw: engine(*a, **kw)

    monkeypatch.setattr(dp_model, "get_engine", get_engine)


def test_the_clipping_check_runs_per_user_and_catches_an_engine_that_clips_per_row(monkeypatch):
    users, x, y = _users()
    private = _private(_run(adaptive=False), clip=0.05)
    good = check_mechanism(model=private, x=x, y=y, users=users, checks=("clipping",), batches=2,
                           batch_size=6).checks["clipping"]
    assert good.passed, good.line
    assert good.unit == "user" and good.unit_rows == K and good.examples == 12
    assert good.worst_error < 1e-4 and good.max_contribution <= 1 + 1e-4
    assert "12 users (k = 3 rows each)" in good.line and "per-user gradients" in good.line
    rules = {entry["layer"]: entry["rule"] for entry in good.layers}
    assert rules == {"conv": "generic", "body": "Dense", "head": "Dense"}  # the user-level plan
    _engine_clips_per_row(monkeypatch)
    bad = check_mechanism(model=private, x=x, y=y, users=users, checks=("clipping",), batches=1,
                          batch_size=6).checks["clipping"]
    assert not bad.passed and "clipping: FAIL" in bad.line
    # a user of m rows clipped row by row contributes up to m·ζ; its norm is off too
    assert bad.max_contribution > 1.5 and bad.norm_error > 0.1 and bad.sum_error > 0.1, bad.line


def test_check_clipping_with_unit_rows_against_the_engine_on_one_user_batch():
    """check_clipping(unit_rows=k) directly on a batch laid out by the run's UserTable (padding rows
    of weight 0 included), against ``_dp_engine_run(unit_rows=k)``; the batch must hold whole users."""
    from keras_noisecurve.audit.mechanism_clipping import check_clipping
    from keras_noisecurve._losses import per_example_loss_fn

    users, x, y = _users()
    private = _private(_run(adaptive=False), clip=0.05)
    table = UserTable(users, examples_per_user=K)
    rows, mask = table.rows(np.arange(5), np.ones(5), 0, np.array([3, 4], np.int64))
    assert np.any(mask == 0)  # a user with fewer than k examples: padding rows
    loss_fn = per_example_loss_fn(LOSS)
    check = check_clipping(private=private, loss_fn=loss_fn, l2_norm_clip=0.05, x=x[rows], y=y[rows],
                           sample_weight=mask, unit_rows=K)
    assert check.passed and check.examples == 5 and check.norm_error < 1e-4, check
    _, norms, _, layer_sq = private._dp_engine_run(loss_fn, x[rows], y[rows], mask, l2_norm_clip=0.05, unit_rows=K)
    assert norms.shape == (5,) and all(np.shape(sq) == (5,) for sq in layer_sq.values())
    with pytest.raises(ValueError, match="divide the batch's 15 rows"):
        check_clipping(private=private, loss_fn=loss_fn, l2_norm_clip=0.05, x=x[rows], y=y[rows],
                       sample_weight=mask, unit_rows=4)


def test_a_user_level_run_with_an_adaptive_clip_passes_every_check():
    users, x, y = _users()
    run = _run()
    report = check_mechanism(model=_private(run), x=x, y=y, users=users, batches=1, batch_size=6, noise_steps=12)
    assert report.passed, report.lines()
    assert report.checks["clipping"].unit == "user"
    sampling = report.checks["sampling"]
    assert sum(sampling.histogram.values()) == run.num_users and "participations per user" in sampling.line
    assert abs(report.checks["noise"].scale - 1) < 0.05


def test_the_sampling_check_counts_users_and_catches_a_sampler_or_a_slot_off_the_plan(monkeypatch):
    users, _, _ = _users()
    run = _run("fixed_epochs", adaptive=False)
    alone, real = check_sampling(run=run), check_sampling(run=run, users=users)
    assert alone.passed and real.passed, (alone.line, real.line)
    # n = num_users; the same sampler whatever the users' examples
    assert alone.histogram == real.histogram and sum(real.histogram.values()) == run.num_users
    rows = UserTable.rows

    def straddling(self, *args, **kwargs):  # every slot's rows moved by one: slots straddle two users
        got, mask = rows(self, *args, **kwargs)
        return np.roll(got, 1), np.roll(mask, 1)

    monkeypatch.setattr(UserTable, "rows", straddling)
    mixed = check_sampling(run=run, users=users)
    assert not mixed.passed and "user slots hold rows of more than one user" in mixed.line, mixed.line
    monkeypatch.setattr(UserTable, "rows", rows)
    broken.overlapping_fixed_epochs(monkeypatch)
    overlapping = check_sampling(run=run, users=users)
    assert not overlapping.passed and "users break the assumption" in overlapping.line, overlapping.line


def test_user_level_arguments_are_refused_with_what_to_do():
    users, x, y = _users()
    private = _private(_run())
    with pytest.raises(ValueError, match=r"clipping check clips per user and needs users="):
        check_mechanism(model=private, x=x, y=y, checks=("clipping",))
    with pytest.raises(ValueError, match=r"users= must have 70 entries"):
        check_mechanism(model=private, x=x[:70], y=y[:70], users=users, checks=("clipping",))
    with pytest.raises(ValueError, match=r"distinct users but the run was planned for num_users=24"):
        check_mechanism(model=private, x=x, y=y, users=users % 5, checks=("sampling",))
    example_run = knc.PrivateRun(num_examples=len(y), batch_size=6, epochs=1, epsilon=4.0, delta=1e-5,
                                 sampling="fixed_epochs", seed=0)
    with pytest.raises(ValueError, match="users= is for a user-level run"):
        check_mechanism(model=private, x=x, y=y, run=example_run, users=users, checks=("sampling",))
    with pytest.raises(ValueError, match="users= is for a user-level run"):
        check_sampling(run=example_run, users=users)


def test_noisecurve_audit_model_takes_the_users_of_the_data_file(tmp_path, capsys):
    users, x, y = _users()
    private = _private(_run())
    private(x[:1])
    private.save(tmp_path / "model.keras")
    np.savez(tmp_path / "data.npz", x=x, y=y, users=np.array([f"u{u}" for u in users]))
    rc = main(["audit", "--model", str(tmp_path / "model.keras"), "--data", str(tmp_path / "data.npz"),
               "--batches", "1", "--batch-size", "4", "--noise-steps", "8"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "clipping: PASS - 4 users (k = 3 rows each)" in text and "participations per user" in text
