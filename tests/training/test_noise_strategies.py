"""One noise generator for every strategy kind: banded, Toeplitz, BLT, BISR (FIR) and C = I.

For each kind: (a) the optimizer's streamed noise equals C⁻¹Z by a dense solve (Z
re-drawn with ``standard_normal``) and the numpy reference ``stream_apply`` equals the
dense solve; (b) Monte Carlo: the whitened noise C·z̃ is i.i.d. N(0, 1), while the same
checks reject the un-whitened noise; (c) ``get_config`` and ``.keras`` save/load round
trips continue bit for bit; (d) ``noise_state_bytes() == buffers × params × 4``.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from keras_noisecurve.mixing import MixingMatrix, load_mixing
from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing
from keras_noisecurve.mixing.stream import stream_apply
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.training.noise import StreamNoise, key_from_seed, standard_normal
from tests.training.helpers import random_banded_c

KINDS = ["banded", "toeplitz", "blt", "bisr", "identity"]
BUFFERS = {"banded": 3, "toeplitz": 3, "blt": 3, "bisr": 3, "identity": 0}
STATE_SUFFIX = {"banded": "_noise_ring", "toeplitz": "_noise_state", "blt": "_noise_state", "bisr": "_noise_state"}
SHAPES = [(4, 3), (3,), (2, 2, 2)]  # several variables: the index folding is exercised


def _strategy(kind, steps):
    """A valid C of each kind (b = 4, d = 3, p = 4), with a stable inverse for T ≤ 200."""
    if kind == "banded":  # rows differ from step to step: the (T, b) table is used
        return random_banded_c(steps, 4, rng=np.random.default_rng(0), diag_scale=2.0)
    if kind == "toeplitz":
        return ToeplitzMixing.normalised([1.0, 0.5, 0.25, 0.1], steps=steps, metadata={"objective": "test"})
    if kind == "blt":
        return BLTMixing(theta=[0.9, 0.6, 0.2], omega=[0.3, 0.2, 0.1], steps=steps, metadata={"objective": "test"})
    if kind == "bisr":
        return BISRMixing.closed_form(steps=steps, bands=4)
    return MixingMatrix.identity(steps)


def _optimizer(mixing, seed=3, **kw):
    # η = B = ζ = σ = 1: with a zero clipped sum the update of w is −z̃_t exactly
    return NoiseCurveOptimizer(learning_rate=1.0, mixing=mixing, l2_norm_clip=1.0, noise_multiplier=1.0,
                               expected_batch_size=1, seed=seed, **kw)


def _streamed_noise(mixing, steps, shapes, seed=3):
    """z̃_0 … z̃_{steps−1} of the optimizer (zero clipped sums, a compiled step, w reset
    to 0 before each step so the update is −z̃_t with one rounding), shape (steps, p)."""
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
    opt = _optimizer(mixing, seed)
    zeros = [tf.zeros(s) for s in shapes]

    @tf.function
    def step():
        for v in variables:
            v.assign(tf.zeros(v.shape))
        opt.apply_clipped_sum(zeros, variables)
        return tf.concat([tf.reshape(-v, [-1]) for v in variables], axis=0)

    rows = [step().numpy() for _ in range(steps)]
    return np.array(rows, dtype=np.float64), opt, step


def _draws(seed, steps, shapes):
    """Z re-drawn with the reference ``standard_normal(key, t, k)``, shape (steps, p), float64."""
    key = key_from_seed(seed)

    @tf.function
    def draw(t):
        return tf.concat([tf.reshape(standard_normal(key, t, k, s), [-1]) for k, s in enumerate(shapes)], axis=0)

    return np.array([draw(tf.constant(t, tf.int64)).numpy() for t in range(steps)], dtype=np.float64)


# ----------------------------------------------------------- (a) streaming = dense
@pytest.mark.parametrize("kind", KINDS)
def test_numpy_reference_and_float64_generator_equal_the_dense_solve(kind):
    """stream_apply (numpy) and the TensorFlow generator run in float64 both equal
    np.linalg.solve(C, Z) to 1e-12 for all T = 200 steps."""
    steps = 200
    mixing = _strategy(kind, steps)
    z = np.random.default_rng(1).normal(size=(steps, 3, 2))
    dense = np.linalg.solve(mixing.to_dense(), z.reshape(steps, -1)).reshape(z.shape)
    np.testing.assert_allclose(stream_apply(mixing.stream(), z), dense, rtol=0, atol=1e-12)

    noise = StreamNoise.from_mixing(mixing)
    assert noise.buffers == mixing.buffers == BUFFERS[kind] and noise.steps == steps
    state = None if noise.buffers == 0 else tf.zeros(noise.state_shape((3, 2)), tf.float64)
    out = []
    for t in range(steps):
        zt, state = noise.correlate(tf.constant(z[t]), tf.constant(t), state)
        out.append(zt.numpy())
    np.testing.assert_allclose(np.array(out), dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_noise_equals_dense_inverse_for_all_steps(kind):
    """The optimizer's z̃_t (float32, compiled step) equals (C⁻¹Z)_t, Z re-drawn by
    standard_normal(key, t, k), for every one of T = 200 steps; step T is refused."""
    steps, seed = 200, 5
    mixing = _strategy(kind, steps)
    noise, opt, step = _streamed_noise(mixing, steps, SHAPES, seed)
    dense = np.linalg.solve(mixing.to_dense(), _draws(seed, steps, SHAPES))
    # float32: the draw and each recurrence step round at ~6e-8 relative; |z̃| ≲ 6
    np.testing.assert_allclose(noise, dense, rtol=0, atol=2e-5)
    assert np.max(np.abs(noise - dense)) < 1e-3 * np.std(dense)  # not vacuous: z̃ is O(1)
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        step()
    states = [s for s in opt._rings if s is not None]
    assert len(states) == (len(SHAPES) if BUFFERS[kind] else 0)
    for s, shape in zip(states, SHAPES):
        assert tuple(s.shape) == (BUFFERS[kind], *shape) and s.path.endswith(STATE_SUFFIX[kind])


def test_the_generator_is_the_noise_property():
    mixing = _strategy("blt", 10)
    assert isinstance(_optimizer(mixing).noise, StreamNoise) and _optimizer(mixing).noise.kind == "blt"
    toeplitz = _strategy("toeplitz", 10)
    # the Toeplitz generator keeps the b coefficients only, never a (T, b) table
    assert StreamNoise.from_mixing(toeplitz).row(7, tf.float64).shape == (4,)


# ---------------------------------------------------------------- (b) Monte Carlo
def _iid_normal_violations(w):
    """The checks of 'rows of w (steps × coordinates) are i.i.d. N(0, 1)' that FAIL.

    Thresholds are ≥ 5 standard errors of each statistic under the null (and 5.5 for
    the max over the ~T²/2 pairs of steps), so a correct generator passes with
    probability > 0.999 while a correlation or variance error of a few percent fails.
    """
    steps, p = w.shape
    n = w.size
    failed = []
    if abs(w.mean()) > 5 / np.sqrt(n):
        failed.append("mean")
    if np.max(np.abs(w.var(axis=1) - 1.0)) > 5 * np.sqrt(2.0 / p):
        failed.append("variance")
    corr = np.corrcoef(w)
    if np.max(np.abs(corr - np.eye(steps))) > 5.5 / np.sqrt(p):
        failed.append("correlation")
    for lag in (1, 2, 3):
        mean_lag = np.mean(np.diag(corr, lag))
        if abs(mean_lag) > 5 / np.sqrt(p * (steps - lag)):
            failed.append(f"lag{lag}")
    if stats.kstest(w.ravel(), "norm").pvalue < 1e-3:
        failed.append("ks")
    return failed


@pytest.mark.parametrize("kind", KINDS)
def test_whitened_noise_is_iid_standard_normal(kind):
    """C·z̃ of the optimizer's noise (4000 coordinates × 48 steps) passes mean, per-step
    variance, pairwise and lag correlations and a KS test; the un-whitened z̃, and z̃
    whitened with another kind's C, fail them (for C ≠ I), so the checks have power."""
    steps, shapes = 48, [(40, 50), (2000,)]
    mixing = _strategy(kind, steps)
    noise, _, _ = _streamed_noise(mixing, steps, shapes, seed=11)
    c = mixing.to_dense()
    assert _iid_normal_violations(c @ noise) == []
    raw = _iid_normal_violations(noise)
    if kind == "identity":
        assert raw == []
        return
    assert "correlation" in raw and "variance" in raw, raw
    other = _strategy("bisr" if kind == "blt" else "blt", steps).to_dense()
    assert _iid_normal_violations(other @ noise) != []


# ---------------------------------------------------------- (c) config, save/load
B, FIT_STEPS = 4, 8


def _base():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(3, activation="tanh"), keras.layers.Dense(2)])


def _private(weights, mixing, seed=17):
    base = _base()
    base.set_weights(weights)
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(learning_rate=0.3, mixing=mixing, l2_norm_clip=0.5, noise_multiplier=2.0,
                                      expected_batch_size=B, seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_get_config_round_trip(kind):
    mixing = _strategy(kind, 12)
    opt = _optimizer(mixing, seed=42, name="opt")
    config = opt.get_config()
    assert json.loads(json.dumps(config)) == config
    if kind in ("banded", "identity"):  # today's format, exactly
        assert set(config["mixing"]) == {"band_values", "metadata"}
        assert config["mixing"]["band_values"] == mixing.band_values.tolist()
    else:
        assert config["mixing"] == mixing.to_config() and config["mixing"]["kind"] == kind
    again = NoiseCurveOptimizer.from_config(json.loads(json.dumps(config)))
    assert again.get_config() == config
    assert type(again.mixing) is type(mixing) and again.mixing == mixing
    assert again.mixing.digest() == mixing.digest() and again.mixing.metadata == mixing.metadata
    assert load_mixing(config["mixing"]) == mixing


@pytest.mark.parametrize("kind", KINDS)
def test_keras_save_load_continues_bit_for_bit(tmp_path, kind):
    """Train 4 of T = 8 steps, save .keras, then train 4 more steps both in memory and
    from the loaded file: the weights are equal bit for bit (the noise state is saved and
    restored); a restart without the optimizer state (C ≠ I) differs."""
    mixing = _strategy(kind, FIT_STEPS)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2 * B, 3)).astype("float32")  # one epoch = 2 steps
    y = rng.integers(0, 2, 2 * B)
    keras.utils.set_random_seed(2)
    weights = _base().get_weights()

    def fit(model, epochs):
        model.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)

    model = _private(weights, mixing)
    fit(model, FIT_STEPS // 4)
    path = tmp_path / "m.keras"
    model.save(path)
    halfway = model.get_weights()
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer.mixing) is type(mixing) and loaded.optimizer.mixing == mixing
    saved = [s.numpy() for s in model.optimizer._rings if s is not None]
    restored = [s.numpy() for s in loaded.optimizer._rings if s is not None]
    assert len(saved) == len(restored) == (4 if BUFFERS[kind] else 0)
    for a, b in zip(saved, restored):
        np.testing.assert_array_equal(a, b)
        assert np.any(a != 0)  # four steps in: the state is non-trivial
    fit(model, FIT_STEPS // 4)  # the uninterrupted run
    fit(loaded, FIT_STEPS // 4)
    assert int(loaded.optimizer.iterations.numpy()) == FIT_STEPS
    for a, b in zip(loaded.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        fit(loaded, 1)
    if BUFFERS[kind]:
        fresh = _private(halfway, mixing)
        fresh.optimizer.build(fresh.trainable_variables)
        fresh.optimizer.iterations.assign(FIT_STEPS // 2)
        fit(fresh, FIT_STEPS // 4)
        assert not np.allclose(fresh.get_weights()[0], model.get_weights()[0])


@pytest.mark.parametrize("kind", ["toeplitz", "blt"])
def test_run_with_a_strategy(kind):
    """run= a PrivateRun whose C is a strategy: its C is the optimizer's, the state is built
    from C.buffers, and the config round-trips."""
    from keras_noisecurve.privacy.run import PrivateRun

    mixing = _strategy(kind, 12)
    sampling = "cyclic_poisson" if kind == "toeplitz" else "fixed_epochs"
    run = PrivateRun(num_examples=48, batch_size=4, steps=12, mixing=mixing, noise_multiplier=1.0, delta=1e-5,
                     sampling=sampling)
    opt = NoiseCurveOptimizer(learning_rate=0.1, run=run, seed=1)
    assert opt.mixing == mixing
    variables = [keras.Variable(np.zeros(s, np.float32)) for s in SHAPES]
    opt.build(variables)
    params = sum(int(np.prod(s)) for s in SHAPES)
    assert opt.noise_state_bytes() == BUFFERS[kind] * params * 4
    again = NoiseCurveOptimizer.from_config(opt.get_config())
    assert again.mixing == mixing and again.get_config() == opt.get_config()


# ---------------------------------------------------------------- (d) state bytes
@pytest.mark.parametrize("kind", KINDS)
def test_noise_state_bytes_is_buffers_times_params(kind):
    mixing = _strategy(kind, 20)
    model = _base()
    opt = _optimizer(mixing)
    assert opt.noise_state_bytes() == 0  # not built yet
    opt.build(model.trainable_variables)
    params = model.count_params()
    assert opt.noise_state_bytes() == BUFFERS[kind] * params * 4 == mixing.stream().state_bytes(params)
    assert opt.noise.state_bytes([v.shape for v in model.trainable_variables]) == opt.noise_state_bytes()


# ------------------------------------------------------------ TF Privacy query
@pytest.mark.parametrize("kind", ["toeplitz", "blt", "bisr"])
def test_tf_privacy_query_equals_the_optimizer(kind):
    """The TF Privacy query adds exactly the optimizer's noise for the non-banded kinds."""
    tfp = pytest.importorskip("keras_noisecurve.integrations.tf_privacy",
                              reason="needs tensorflow-privacy: the tf-privacy extra (Python <= 3.11)")
    steps, seed = 10, 4
    mixing = _strategy(kind, steps)
    query = tfp.BandedMatrixFactorizationQuery(l2_norm_clip=1.0, noise_multiplier=1.0, mixing=mixing,
                                               template=SHAPES, seed=seed)
    state = query.initial_global_state()
    noise, _, _ = _streamed_noise(mixing, steps, SHAPES, seed)
    for t in range(steps):
        result, state, _ = query.get_noised_result(query.initial_sample_state(), state)
        got = np.concatenate([r.numpy().ravel() for r in result])
        np.testing.assert_allclose(got, noise[t], rtol=1e-5, atol=1e-5)
    with pytest.raises(tf.errors.InvalidArgumentError, match="privacy plan is spent"):
        query.get_noised_result(query.initial_sample_state(), state)
