"""NoiseCurveOptimizer / NoiseCurveOptimizer: noise law, DP-SGD step by hand, guards, config."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.mixing import IdentityMixing, MixingMatrix
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.training.noise import key_from_seed, standard_normal
from tests.training.helpers import bandmf_like_c, random_banded_c

ETA, CLIP, SIGMA, B = 0.5, 2.0, 1.5, 4


def _noise_updates(mixing, steps, shapes, seed=3):
    """Run `steps` updates with ZERO clipped sums; return the (steps, p) updates."""
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
    opt = NoiseCurveOptimizer(
        learning_rate=ETA, mixing=mixing, l2_norm_clip=CLIP, noise_multiplier=SIGMA, expected_batch_size=B, seed=seed
    )
    zeros = [tf.zeros(s) for s in shapes]
    prev = np.concatenate([v.numpy().ravel() for v in variables])
    rows = []
    for _ in range(steps):
        opt.apply_clipped_sum(zeros, variables)
        cur = np.concatenate([v.numpy().ravel() for v in variables])
        rows.append(cur - prev)
        prev = cur
    return np.array(rows), opt


def _mixing(kind, steps, bands):
    rng = np.random.default_rng(0)
    if kind == "identity":
        return MixingMatrix.identity(steps)
    if kind == "bandmf-like":
        return bandmf_like_c(steps, bands)
    if kind == "noisecurve-like":  # small diagonal, strong couplings of both signs
        return random_banded_c(steps, bands, rng=rng, diag_scale=0.1)
    from keras_noisecurve.mixing import solve_mixing_matrix

    if kind == "solver-bandmf":
        return solve_mixing_matrix(steps=steps, bands=bands, objective="bandmf")
    return solve_mixing_matrix(steps=steps, bands=bands, objective="noisecurve",
                               spectrum=np.array([0.01, 0.5, 1.0, 1.5]), learning_rate=0.5)


@pytest.mark.parametrize(
    "kind", ["identity", "bandmf-like", "noisecurve-like", "solver-bandmf", "solver-noisecurve"]
)
def test_noise_law_covariance(kind):
    """Updates over T steps have covariance (ηζσ/B)²·C⁻¹C⁻ᵀ across steps."""
    steps, bands = 10, 4
    c = _mixing(kind, steps, bands)
    shapes = [(60, 50), (50,), (7, 3, 5)]  # several variables: index folding is exercised
    updates, _ = _noise_updates(c, steps, shapes)
    p = updates.shape[1]
    emp = updates @ updates.T / p
    cinv = np.linalg.inv(c.to_dense())
    expected = (ETA * CLIP * SIGMA / B) ** 2 * cinv @ cinv.T
    d = np.sqrt(np.diag(expected))
    # sampling std of a Gaussian covariance estimate: sqrt((Σss·Σtt + Σst²)/p)
    tol = 5 * np.sqrt((np.outer(d, d) ** 2 + expected**2) / p)
    assert np.all(np.abs(emp - expected) <= tol), np.max(np.abs(emp - expected) / tol)
    # and the noise is not trivially independent when C is not the identity
    if kind != "identity":
        corr = expected / np.outer(d, d)
        assert np.max(np.abs(corr - np.eye(steps))) > 0.2


def test_dpsgd_step_equals_textbook_by_hand():
    """mixing='dpsgd' through a private model's fit equals w − η(Σ clip(g_i) + ζσ z)/B computed by hand."""
    keras.utils.set_random_seed(1)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    w0 = [w.numpy() for w in base.trainable_variables]
    rng = np.random.default_rng(2)
    x = rng.normal(size=(5, 3)).astype("float32") * 3
    y = rng.integers(0, 2, 5)
    seed, clip = 11, 0.7
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(
            learning_rate=ETA, mixing="dpsgd", l2_norm_clip=clip, noise_multiplier=SIGMA, expected_batch_size=B, seed=seed
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(x, y, batch_size=5, epochs=1, shuffle=False, verbose=0)

    # by hand: a Python loop over examples
    kernel, bias = (tf.Variable(w) for w in w0)
    total = [np.zeros_like(w) for w in w0]
    for i in range(5):
        with tf.GradientTape() as tape:
            logits = tf.matmul(x[i : i + 1], kernel) + bias
            loss = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y[i : i + 1], logits=logits)[0]
        g = [t.numpy() for t in tape.gradient(loss, [kernel, bias])]
        norm = np.sqrt(sum(np.sum(gi**2) for gi in g))
        total = [a + gi * min(1.0, clip / norm) for a, gi in zip(total, g)]
    key = key_from_seed(seed)
    expected = [
        w - ETA * (s + clip * SIGMA * standard_normal(key, 0, k, w.shape).numpy()) / B
        for k, (w, s) in enumerate(zip(w0, total))
    ]
    for got, want in zip(base.trainable_variables, expected):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


def test_default_strategy_is_dpsgd_without_limit():
    """Without mixing= the optimizer is DP-SGD (C = I, no step plan): the same noise as
    mixing="dpsgd", draw for draw, and its config round-trips to the same strategy."""
    v1, v2 = keras.Variable(np.zeros(30, np.float32)), keras.Variable(np.zeros(30, np.float32))
    a = NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=2, seed=5)
    b = NoiseCurveOptimizer(learning_rate=0.1, mixing="dpsgd", l2_norm_clip=1.0, noise_multiplier=1.0,
                            expected_batch_size=2, seed=5)
    for _ in range(3):
        a.apply_clipped_sum([tf.ones(30)], [v1])
        b.apply_clipped_sum([tf.ones(30)], [v2])
    np.testing.assert_array_equal(v1.numpy(), v2.numpy())
    assert not np.array_equal(v1.numpy(), np.full(30, -3 * 0.1 / 2, np.float32))  # noise was added
    assert a.noise.steps is None
    assert a.mixing == b.mixing == IdentityMixing() and not a.mixing.has_plan
    assert a.get_config()["mixing"] == IdentityMixing().to_config() and a.name == "noisecurve_optimizer"
    assert a.noise_state_bytes() == 0  # C = I keeps no noise state


def test_step_past_plan_fails_in_eager_apply():
    v = keras.Variable(np.zeros(3, np.float32))
    opt = NoiseCurveOptimizer(learning_rate=0.1, mixing=MixingMatrix.identity(2), l2_norm_clip=1.0,
                              noise_multiplier=1.0, expected_batch_size=1, seed=0)
    opt.apply_clipped_sum([tf.zeros(3)], [v])
    opt.apply_clipped_sum([tf.zeros(3)], [v])
    before = v.numpy().copy()
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        opt.apply_clipped_sum([tf.zeros(3)], [v])
    np.testing.assert_array_equal(v.numpy(), before)


# ----------------------------------------------------------------- bad inputs
def _kw(**over):
    kw = dict(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=4)
    kw.update(over)
    return kw


@pytest.mark.parametrize(
    "over, match",
    [
        ({"l2_norm_clip": -1.0}, "l2_norm_clip must be > 0"),
        ({"l2_norm_clip": 0.0}, "l2_norm_clip must be > 0"),
        ({"noise_multiplier": -0.5}, "noise_multiplier must be > 0"),
        ({"expected_batch_size": 0}, "expected_batch_size must be >= 1"),
        ({"expected_batch_size": None}, "expected_batch_size is required"),
        ({"learning_rate": 0.0}, "learning_rate must be > 0"),
        ({"clipnorm": 1.0}, "clipnorm=1.0 is not supported.*NOISY sum"),
        ({"clipvalue": 1.0}, "clipvalue"),
        ({"global_clipnorm": 1.0}, "global_clipnorm"),
        ({"use_ema": True}, "use_ema"),
        ({"loss_scale_factor": 2.0}, "loss_scale_factor"),
        ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps"),
        ({"weight_decay": 1e-4}, "weight_decay=0.0001 is not supported.*regularizer"),
    ],
)
def test_bad_arguments(over, match):
    with pytest.raises(ValueError, match=match):
        NoiseCurveOptimizer(**_kw(**over))


def test_bad_mixing(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        NoiseCurveOptimizer(mixing=str(tmp_path / "missing.npz"), **_kw())
    bad = tmp_path / "bad.npz"
    np.savez(bad, something=np.ones(3))
    with pytest.raises(ValueError, match="not a valid mixing-matrix artifact"):
        NoiseCurveOptimizer(mixing=str(bad), **_kw())
    with pytest.raises(ValueError, match="no such file"):
        NoiseCurveOptimizer(mixing="bandmf", **_kw())
    with pytest.raises(ValueError, match="mixing must be a MixingMatrix"):
        NoiseCurveOptimizer(mixing=3, **_kw())


def test_mixing_from_path_and_learning_rate_warnings(tmp_path):
    c = MixingMatrix.identity(5).with_metadata(objective="noisecurve", learning_rate=0.2)
    path = tmp_path / "c.npz"
    c.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = NoiseCurveOptimizer(mixing=str(path), **_kw(learning_rate=0.2))
    assert opt.mixing == c
    with pytest.warns(UserWarning, match="differs from the learning rate 0.2"):
        NoiseCurveOptimizer(mixing=c, **_kw(learning_rate=0.1))
    schedule = keras.optimizers.schedules.ExponentialDecay(0.2, 10, 0.9)
    with pytest.warns(UserWarning, match="schedule"):
        NoiseCurveOptimizer(mixing=c, **_kw(learning_rate=schedule))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        NoiseCurveOptimizer(mixing="dpsgd", **_kw(learning_rate=schedule))


def test_unsupported_backend_is_refused(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "torch")
    with pytest.raises(RuntimeError, match="runs on the Keras backends tensorflow and jax.*'torch'"):
        NoiseCurveOptimizer(**_kw())


def test_config_round_trip_every_argument():
    c = random_banded_c(6, 3, rng=np.random.default_rng(1), metadata={"objective": "noisecurve", "learning_rate": 0.3})
    opt = NoiseCurveOptimizer(learning_rate=0.3, mixing=c, l2_norm_clip=1.7, noise_multiplier=0.9,
                              expected_batch_size=33, seed=42, name="my_opt")
    config = opt.get_config()
    again = NoiseCurveOptimizer.from_config(config)
    assert again.get_config() == config
    assert again.mixing == c and again.mixing.metadata == c.metadata
    for name in ("l2_norm_clip", "noise_multiplier", "expected_batch_size", "name"):
        assert getattr(again, name) == getattr(opt, name)
    assert "seed" not in config and again.seed is None  # a fixed seed never enters config.json
    assert float(again.learning_rate.numpy()) == pytest.approx(0.3)
    dp = NoiseCurveOptimizer(**_kw(seed=None))
    assert NoiseCurveOptimizer.from_config(dp.get_config()).get_config() == dp.get_config()
    assert "seed" not in dp.get_config()  # the secret key never enters the config


def test_plain_model_refused_at_first_step():
    """A plain keras.Model compiled with a DP optimizer fails, pointing to make_private."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=NoiseCurveOptimizer(**_kw()), loss="mse")
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(np.ones((4, 2)), np.ones((4, 1)), verbose=0)
    with pytest.raises(RuntimeError, match="CLIPPED"):
        NoiseCurveOptimizer(**_kw()).apply_gradients([(tf.ones(2), keras.Variable(np.zeros(2, np.float32)))])


@pytest.mark.parametrize("mixing", ["dpsgd", "identity", "banded"])
def test_update_is_the_counter_based_draw_of_each_variable(mixing):
    """With zero clipped sums the update of variable k at step t is exactly
    −(η/B)·ζσ·z̃_t with z_t = standard_normal(key, t, k): the per-step seed shared by
    all variables and the folded b = 1 scale give the same draws as the reference."""
    steps, shapes = 3, [(4, 3), (3,), (2, 2, 2)]
    c = {"dpsgd": "dpsgd", "identity": MixingMatrix.identity(steps),
         "banded": random_banded_c(steps, 2, rng=np.random.default_rng(1))}[mixing]
    updates, _ = _noise_updates(c, steps, shapes, seed=9)
    key = key_from_seed(9)
    z = np.array([np.concatenate([standard_normal(key, t, k, s).numpy().ravel() for k, s in enumerate(shapes)])
                  for t in range(steps)])
    z_tilde = z if mixing == "dpsgd" else np.linalg.solve(c.to_dense(), z)
    np.testing.assert_allclose(updates, -ETA * CLIP * SIGMA / B * z_tilde, rtol=1e-5, atol=1e-6)
