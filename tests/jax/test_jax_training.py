"""Private training on the JAX backend: the same API as on TensorFlow.

Each train-step compilation costs seconds on CPU (the Philox noise per variable), so the
models here have few variables and each test compiles one or two steps.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve import NoiseCurveOptimizer, PrivateRun, make_private
from keras_noisecurve.backend.jax import noise as jax_noise
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.mixing.strategies import BISRMixing, BLTMixing, ToeplitzMixing
from keras_noisecurve.training.noise import key_from_seed
from tests.jax.helpers import reference_clipped_sum, weights_of

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KINDS = ["banded", "toeplitz", "blt", "bisr", "identity"]


def _strategy(kind, steps):
    if kind == "banded":
        return _banded(steps)
    if kind == "toeplitz":
        return ToeplitzMixing.normalised([1.0, 0.5, 0.25, 0.1], steps=steps, metadata={"objective": "test"})
    if kind == "blt":
        return BLTMixing(theta=[0.9, 0.6, 0.2], omega=[0.3, 0.2, 0.1], steps=steps, metadata={"objective": "test"})
    if kind == "bisr":
        return BISRMixing.closed_form(steps=steps, bands=4)
    return MixingMatrix.identity(steps)


def _banded(steps):
    from tests.training.helpers import random_banded_c

    return random_banded_c(steps, 3, rng=np.random.default_rng(0), diag_scale=2.0)


def _tiny(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="tanh", use_bias=False),
                             keras.layers.Dense(1, use_bias=False)])


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype("float32")
    return x, (x[:, :1] - x[:, 1:2]).astype("float32")


# ------------------------------------------------------------------ no TensorFlow
def test_the_training_api_imports_no_tensorflow_under_jax():
    code = (
        "import sys, numpy as np, keras\n"
        "import keras_noisecurve as knc\n"
        "from keras_noisecurve import training, callbacks\n"
        "from keras_noisecurve import *  # every export of the JAX backend\n"
        "run = knc.PrivateRun(num_examples=16, batch_size=8, steps=2, noise_multiplier=1.0, delta=1e-5, seed=0)\n"
        "m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])\n"
        "p = knc.make_private(m)\n"
        "p.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=0), loss='mse')\n"
        "x = np.ones((16, 2), 'float32'); p.fit(run.dataset(x, x[:, :1]), verbose=0,\n"
        "      callbacks=[callbacks.PrivacyBudget(run=run, verbose=0)])\n"
        "assert int(np.asarray(p.optimizer.iterations.value)) == 2\n"
        "print('tensorflow' in sys.modules)\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "False"


# ------------------------------------------------------------ noise of each kind
@pytest.mark.parametrize("kind", KINDS)
def test_optimizer_noise_equals_dense_inverse(kind):
    """With a zero clipped sum and η = B = ζ = σ = 1, the update of w is −z̃_t; over T = 6
    jitted steps it equals (C⁻¹Z)_t with Z re-drawn by ``standard_normal(key, t, k)``.
    float32: each step rounds at ~1e-7 relative, |z̃| ≲ 10 → atol 2e-5."""
    steps, shape, seed = 6, (3, 2), 5
    mixing = _strategy(kind, steps)
    variable = keras.Variable(np.zeros(shape, np.float32))
    opt = NoiseCurveOptimizer(learning_rate=1.0, mixing=mixing, l2_norm_clip=1.0, noise_multiplier=1.0,
                              expected_batch_size=1, seed=seed)
    opt.build([variable])

    @jax.jit
    def step(opt_values):
        new_w, new_opt = opt.stateless_apply_clipped_sum(opt_values, [jnp.zeros(shape)], [jnp.zeros(shape)])
        return -new_w[0], new_opt

    values = [v.value for v in opt.variables]
    rows = []
    for _ in range(steps):
        z_tilde, values = step(values)
        rows.append(np.asarray(z_tilde, np.float64).reshape(-1))
    words = jax_noise.key_words(key_from_seed(seed))
    draws = np.array([np.asarray(jax_noise.standard_normal(words, t, 0, shape)).reshape(-1) for t in range(steps)],
                     np.float64)
    dense = np.linalg.solve(mixing.to_dense(), draws)
    np.testing.assert_allclose(np.array(rows), dense, rtol=0, atol=2e-5)
    assert np.std(dense) > 0.3  # not vacuous


def test_a_step_draws_the_noise_of_all_variables_in_one_pass():
    """The optimizer's step draws every variable's z_t in one ``variable_normals`` pass:
    the traced step holds as many Philox rounds (``optimization_barrier``s, one per round)
    for 2 variables as for 8, and the 8-variable step's noise is each variable's own
    ``standard_normal(key, t, k)`` (a zero clipped sum, η = B = ζ = σ = 1, C = I)."""
    def barriers(count):
        variables = [keras.Variable(np.zeros((k + 1, 3), np.float32)) for k in range(count)]
        opt = NoiseCurveOptimizer(learning_rate=1.0, mixing="dpsgd", l2_norm_clip=1.0, noise_multiplier=1.0,
                                  expected_batch_size=1, seed=4)
        opt.build(variables)
        zeros = [jnp.zeros(v.shape) for v in variables]
        step = lambda values: opt.stateless_apply_clipped_sum(values, zeros, zeros)  # noqa: E731
        values = [v.value for v in opt.variables]
        text = str(jax.make_jaxpr(step)(values))
        return text.count("optimization_barrier"), jax.jit(step)(values)[0]

    few, _ = barriers(2)
    many, moved = barriers(8)
    assert few == many > 0
    words = jax_noise.key_words(key_from_seed(4))
    for k, w in enumerate(moved):
        np.testing.assert_allclose(-np.asarray(w), np.asarray(jax_noise.standard_normal(words, 0, k, (k + 1, 3))),
                                   rtol=1e-6, atol=1e-6)


def test_multi_variable_model_noise_is_the_numpy_philox_draw_of_each_variable():
    """Issue 31's z_t across backends, for a model of several variables: the private
    model's update with a zero clipped sum (every sample weight 0) and η = B = ζ = σ = 1
    over T = 3 banded steps (b = 3) is −z̃ = −(C⁻¹Z)_t per variable, Z drawn by the numpy Philox
    (``backend/common/philox.py`` run with numpy, which tests/backend/test_philox.py checks
    against TensorFlow's words) with seed fold_in(fold_in(key, t), k), k the variable's
    position in ``model.trainable_variables`` (as on TensorFlow)."""
    from keras_noisecurve.backend.common import philox

    steps, seed = 3, 7
    mixing = _banded(steps)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])  # 4 variables
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=1.0, mixing=mixing, l2_norm_clip=1.0,
                                                  noise_multiplier=1.0, expected_batch_size=1, seed=seed), loss="mse")
    x, y = np.ones((4, 4), np.float32), np.zeros((4, 2), np.float32)
    start = weights_of(model)
    moved = []
    for _ in range(steps):
        before = weights_of(model)
        private.train_on_batch(x, y, sample_weight=np.zeros(4, np.float32))
        moved.append([b - a for a, b in zip(weights_of(model), before)])  # z̃_t of each variable
    words = np.asarray(jax_noise.key_words(key_from_seed(seed)))
    shapes = [w.shape for w in start]
    draws = []  # draws[t][k], numpy
    for t in range(steps):
        lo, hi = philox.int64_words(t)
        step_words = philox.fold_in(np, words, lo, hi)
        draws.append(philox.variable_normals(np, step_words, list(range(len(shapes))),
                                             [int(np.prod(s)) for s in shapes], np.float32))
    inverse = np.linalg.inv(mixing.to_dense())
    for k, shape in enumerate(shapes):
        want = inverse @ np.array([draws[t][k] for t in range(steps)], np.float64)
        got = np.array([moved[t][k].reshape(-1) for t in range(steps)], np.float64)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        assert np.std(want) > 0.3


# ------------------------------------------------------------------ inner optimizers
@pytest.mark.parametrize("make_inner", [
    lambda: keras.optimizers.SGD(0.2, momentum=0.9),
    lambda: keras.optimizers.Adam(0.05),
], ids=["sgd_momentum", "adam"])
def test_inner_optimizer_runs_keras_update_on_the_privatized_mean(make_inner):
    """σ = 1e-9: two steps equal Keras's own optimizer applied to ĝ = Σ clip(g_i)/B,
    the sums from the independent loop."""
    model, twin = _tiny(1), _tiny(1)
    x, y = _data(12)
    weights = np.ones(12, np.float32)
    clip, batch = 0.3, 10
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(inner=make_inner(), l2_norm_clip=clip, noise_multiplier=1e-9,
                                                  expected_batch_size=batch, seed=0), loss="mse")
    reference = make_inner()
    for _ in range(2):
        sums, _ = reference_clipped_sum(twin, x, y, weights, clip)
        reference.apply([jnp.asarray(s / batch, jnp.float32) for s in sums], twin.trainable_variables)
        private.train_on_batch(x, y, sample_weight=weights)
    for got, want in zip(weights_of(model), weights_of(twin)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(np.asarray(private.optimizer.inner.iterations.value)) == 2


# ------------------------------------------------------------- run, resume, refusals
def test_run_trains_resumes_through_save_and_load_and_refuses_past_the_plan(tmp_path):
    n, steps = 40, 6
    x, y = _data(n, 3)
    run = PrivateRun(num_examples=n, batch_size=8, steps=steps, mixing=_banded(steps),
                     noise_multiplier=1.0, delta=1e-5, seed=11)
    private = make_private(_tiny(2))
    private.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.05, seed=4), loss="mse")
    with pytest.raises(ValueError, match="PrivateRun"):  # plain arrays: not the run's batches
        private.fit(x, y, verbose=0)
    budget = knc.callbacks.PrivacyBudget(run=run, verbose=0)
    private.fit(run.dataset(x, y), epochs=1, steps_per_epoch=3, verbose=0, callbacks=[budget])
    assert int(np.asarray(private.optimizer.iterations.value)) == 3
    path = str(tmp_path / "run.keras")
    private.save(path)
    loaded = keras.models.load_model(path)
    opt = loaded.optimizer
    assert opt.run.same_plan(run) and int(np.asarray(opt.iterations.value)) == 3
    np.testing.assert_array_equal(np.asarray(opt._noise_key.value), np.asarray(private.optimizer._noise_key.value))
    for a, b in zip(weights_of(loaded), weights_of(private)):
        np.testing.assert_array_equal(a, b)
    # the batches after the resume are steps 3, 4, 5 of an independent sampler of the plan
    batches = list(run.dataset(x, y).batches(opt))
    sampler = run.sampler(run.initial_key())
    assert [int(b[3][0]) for b in batches] == [3, 4, 5]
    for t, (xb, yb, mask, step) in zip(range(3, 6), batches):
        indices, want_mask, _ = sampler.batch(t)
        np.testing.assert_array_equal(mask, want_mask)
        real = (want_mask > 0)[:, None]  # padding rows are blanked
        np.testing.assert_array_equal(xb, np.where(real, x[indices], 0.0))
        assert np.all(step == t)
    history = loaded.fit(run.dataset(x, y), verbose=0)
    assert int(np.asarray(loaded.optimizer.iterations.value)) == steps
    assert len(history.history["loss"]) >= 1
    with pytest.raises(RuntimeError, match="plan of 6 steps is complete"):
        loaded.fit(run.dataset(x, y), verbose=0)


def test_low_level_plan_refuses_step_T_and_plain_models_are_refused():
    x, y = _data(8)
    private = make_private(_tiny())
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, mixing=MixingMatrix.identity(2),
                                                  noise_multiplier=1.0, expected_batch_size=8, seed=0), loss="mse")
    private.train_on_batch(x, y)
    private.train_on_batch(x, y)
    before = weights_of(private.inner)
    with pytest.raises(RuntimeError, match="past the mixing matrix's plan"):
        private.train_on_batch(x, y)
    for a, b in zip(before, weights_of(private.inner)):
        np.testing.assert_array_equal(a, b)
    plain = _tiny()
    plain.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=8),
                  loss="mse")
    with pytest.raises(RuntimeError, match="CLIPPED gradient sums"):
        plain.train_on_batch(x, y)


def test_optimizer_config_round_trip_on_jax():
    run = PrivateRun(num_examples=40, batch_size=8, steps=6, mixing=_banded(6), noise_multiplier=1.0,
                     delta=1e-5, seed=11)
    opt = NoiseCurveOptimizer(run=run, inner=keras.optimizers.Adam(0.01), seed=3)
    again = NoiseCurveOptimizer.from_config(opt.get_config())
    assert again.get_config() == opt.get_config()
    assert again.run.same_plan(run) and isinstance(again.inner, keras.optimizers.Adam)


@pytest.mark.parametrize("clipping", ["ghost", "vectorized"])
def test_a_model_trained_privately_is_freed_once_the_user_drops_it(clipping):
    # no cache of the library keeps the model, its variables or its compiled step alive
    import gc
    import weakref

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 1)).astype("float32")
    model = _tiny()
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, l2_norm_clip=1.0, noise_multiplier=1.0,
                                                  expected_batch_size=4, seed=0), loss="mse")
    private.fit(x, y, batch_size=4, epochs=1, verbose=0)
    refs = [weakref.ref(model), weakref.ref(private)]
    del model, private
    gc.collect()
    assert [r() for r in refs] == [None, None]
