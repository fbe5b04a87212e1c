"""An example whose loss or gradient is not finite contributes zero, and the run goes on.

Engine checks compare the clipped sum of a batch holding non-finite examples against the
clipped sum of its FINITE examples alone, computed by an independent per-example loop
(``loop_reference``: one ``tf.GradientTape`` per example), on the ghost engine (its
rules for Dense, Conv2D on both kernel-gradient paths, Embedding, LayerNormalization,
LSTM, and the per-layer fallback for a custom layer) and on the vectorized engine.
Sources of non-finiteness: an ``inf`` or ``nan`` feature, a layer whose output overflows
for one example, a ``nan`` label. ``fit`` checks: a ``PrivateRun`` keeps its weights
finite, logs the count and warns once; a batch of non-finite examples only stops ``fit``
before the weights change.

Run once with each oneDNN setting (``TF_ENABLE_ONEDNN_OPTS=0`` and ``=1``): the kernels
differ (e.g. the grouped per-example conv kernel gradients run with oneDNN only).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from keras_noisecurve.backend.tensorflow import features
from keras_noisecurve.backend.tensorflow.clipping import vectorized_clipped_sum
from keras_noisecurve.backend.tensorflow.ghost import describe, ghost_clipped_sum
from tests.training.helpers import float64_layers, loop_reference, mse

P = 7
BAD = 3  # the example made non-finite
RTOL = 1e-6


class Explode(keras.layers.Layer):
    """No weights: ``exp(x)``, which overflows to ``inf`` for a large finite input."""

    def call(self, x):
        return tf.exp(x)


class Scale(keras.layers.Layer):
    """A custom layer with its own weight (no ghost rule: the per-layer fallback clips it)."""

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="w")

    def call(self, x):
        return x * self.w + tf.sin(x) * tf.square(self.w)


def _dense():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])


def _exploding():
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4), Explode(), keras.layers.Dense(2)])


def _conv(filters, size):
    # filters=2 on 6x6: the per-example kernel gradients are formed; filters=16 on 4x4:
    # the Gram norms and one contraction of the windows (L² < K·c_in·c_out, common/ghost_conv)
    return keras.Sequential([
        keras.Input((size, size, 3)), keras.layers.Conv2D(filters, 3, activation="tanh"),
        keras.layers.Flatten(), keras.layers.Dense(2),
    ])


def _layernorm():
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(6), keras.layers.LayerNormalization(), keras.layers.Dense(2),
    ])


def _custom():
    return keras.Sequential([keras.Input((5,)), Scale(), keras.layers.Dense(2)])


def _lstm():
    return keras.Sequential([keras.Input((4, 3)), keras.layers.LSTM(3), keras.layers.Dense(2)])


def _embedding():
    return keras.Sequential([
        keras.Input((4,), dtype="int32"), keras.layers.Embedding(10, 3),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2),
    ])


MODELS = {
    "dense": (_dense, (5,)),
    "exploding": (_exploding, (5,)),
    "conv-examples": (lambda: _conv(2, 6), (6, 6, 3)),
    "conv-gram": (lambda: _conv(16, 4), (4, 4, 3)),
    "layernorm": (_layernorm, (5,)),
    "custom": (_custom, (5,)),
    "lstm": (_lstm, (4, 3)),
    "embedding": (_embedding, None),
}


def _batch(name, case, rng):
    """``x, y`` of P examples with example ``BAD`` made non-finite by ``case``."""
    shape = MODELS[name][1]
    x = rng.integers(0, 10, size=(P, 4)).astype("int32") if shape is None else rng.normal(size=(P, *shape))
    y = rng.normal(size=(P, 2))
    if case == "inf-feature":
        x.reshape(P, -1)[BAD, 1] = np.inf
    elif case == "minus-inf-feature":  # a tanh layer saturates: the loss stays finite, the gradient does not
        x.reshape(P, -1)[BAD, 1] = -np.inf
    elif case == "nan-feature":
        x.reshape(P, -1)[BAD, 0] = np.nan
    elif case == "overflow":  # finite input, exp() overflows in the Explode layer
        x[BAD] = 800.0
    elif case == "nan-label":
        y[BAD, 0] = np.nan
    return x, y


CASES = [
    *[("dense", c) for c in ("inf-feature", "minus-inf-feature", "nan-feature", "nan-label")],
    ("exploding", "overflow"),
    *[(m, c) for m in ("conv-examples", "conv-gram", "layernorm", "custom", "lstm")
      for c in ("inf-feature", "nan-label")],
    ("embedding", "nan-label"),
]
ENGINES = {"ghost": ghost_clipped_sum, "vectorized": vectorized_clipped_sum}


@pytest.fixture
def float64():
    yield from float64_layers()


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("name,case", CASES, ids=[f"{m}-{c}" for m, c in CASES])
def test_a_non_finite_example_contributes_zero(float64, engine, name, case):
    rng = np.random.default_rng(0)
    model = MODELS[name][0]()
    x, y = _batch(name, case, rng)
    w = rng.uniform(0.5, 2.0, size=P)
    w[5] = 0.0  # a padding row
    good = [i for i in range(P) if i != BAD]
    norms, _ = loop_reference(model, mse, x[good], y[good], w[good], np.inf)
    clip = float(np.median(norms[norms > 0]))  # some finite examples clipped, some not
    _, want = loop_reference(model, mse, x[good], y[good], w[good], clip)

    got = ENGINES[engine](model, mse, x, y, w, l2_norm_clip=clip, training=False)
    expected = np.zeros(P, bool)
    expected[BAD] = True
    np.testing.assert_array_equal(got.nonfinite.numpy(), expected)
    scale = max(np.max(np.abs(r)) for r in want)
    for g, r in zip(got.grads, want):
        assert np.all(np.isfinite(g.numpy()))
        np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=RTOL * scale)
    np.testing.assert_allclose(got.norms.numpy()[good], norms, rtol=RTOL)
    if engine == "ghost":
        kinds = {kind for _, _, kind in describe(model)}
        assert ("generic" in kinds) == (name == "custom")  # the fallback is what the custom case tests


@pytest.mark.parametrize("case", ["inf-feature", "nan-label"])
def test_float32_conv_on_the_kernel_this_process_runs(case):
    """float32: with oneDNN the per-example kernel gradients come from ONE grouped
    Conv2DBackpropFilter per chunk of examples (ghost_conv.conv_chunk); a non-finite
    example must not reach the other examples of its chunk (their norms, their sum)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(2)
    model = _conv(2, 6)
    x, y = _batch("conv-examples", case, rng)
    x, y = x.astype("float32"), y.astype("float32")
    w = np.ones(P, np.float32)
    good = [i for i in range(P) if i != BAD]
    norms, _ = loop_reference(model, mse, x[good], y[good], w[good], np.inf)
    clip = float(np.median(norms))
    _, want = loop_reference(model, mse, x[good], y[good], w[good], clip)
    got = ghost_clipped_sum(model, mse, x, y, w, l2_norm_clip=clip, training=False)
    assert got.nonfinite.numpy().tolist() == [i == BAD for i in range(P)]
    np.testing.assert_allclose(got.norms.numpy()[good], norms, rtol=1e-4)
    scale = max(np.max(np.abs(r)) for r in want)
    for g, r in zip(got.grads, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_chunks_and_non_finite_padding(float64, engine):
    """Microbatches give the same sum; a non-finite padding row (weight 0) is dropped too."""
    rng = np.random.default_rng(1)
    model = _dense()
    x, y = _batch("dense", "nan-feature", rng)
    x[5, 2] = np.inf
    w = np.ones(P)
    w[5] = 0.0
    good = [i for i in range(P) if i not in (BAD, 5)]
    _, want = loop_reference(model, mse, x[good], y[good], w[good], 0.3)
    got = ENGINES[engine](model, mse, x, y, w, l2_norm_clip=0.3, microbatch_size=3, training=False)
    assert got.nonfinite.numpy().tolist() == [i in (BAD, 5) for i in range(P)]
    for g, r in zip(got.grads, want):
        np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=1e-12)


def test_count_ignores_padding_and_an_empty_batch_is_no_error():
    mask = tf.constant([True, False, True, False])
    dropped, real = features.count_dropped(mask, tf.constant([1.0, 1.0, 0.0, 0.0]), tf.zeros(4))
    assert (int(dropped), int(real)) == (1, 2)
    dropped, real = features.count_dropped(mask, None, tf.zeros(4))
    assert (int(dropped), int(real)) == (2, 4)
    assert not bool(features.all_dropped(tf.constant(0, tf.int64), tf.constant(0, tf.int64)))  # empty Poisson batch
    assert bool(features.all_dropped(tf.constant(2, tf.int64), tf.constant(2, tf.int64)))
    assert not bool(features.all_dropped(tf.constant(1, tf.int64), tf.constant(2, tf.int64)))


# ------------------------------------------------------------------------ fit

N, BATCH, STEPS = 256, 32, 16
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(bad):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype("float32")
    y = rng.integers(0, 3, N)
    x[bad, 3] = np.inf
    return x, y


def _private(run, clipping, **compile_kwargs):
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=1), loss=LOSS,
                    metrics=["accuracy"], **compile_kwargs)
    return private


def _sampled(run, x):
    """How many real rows of the plan's batches are not finite (an independent count)."""
    total = 0
    for xb, _, mask, _ in run.dataset(x, np.zeros(N, np.int64)).batches().as_numpy_iterator():
        total += int(np.sum((mask > 0) & ~np.all(np.isfinite(xb), axis=1)))
    return total


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_fit_drops_non_finite_examples_counts_them_and_warns_once(clipping):
    bad = [17, 40, 41, 100, 200, 201, 202, 255]
    x, y = _data(bad)
    run = PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=1e-5, seed=3)
    expected = _sampled(run, x)
    assert expected > 0  # the plan samples some of them
    private = _private(run, clipping)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = private.fit(run.dataset(x, y), verbose=0)
    assert all(np.all(np.isfinite(v)) for v in private.get_weights())
    counts = history.history[features.METRIC]
    assert len(counts) == run.epochs and sum(counts) == expected  # per epoch, summed
    assert all(np.isfinite(history.history["loss"]))
    dropped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "dropped" in str(w.message)]
    assert len(dropped) == 1 and f"dropped {expected} example(s)" in dropped[0] and "step" in dropped[0]
    assert int(private.optimizer.iterations.numpy()) == STEPS


def test_fit_distributed_counts_them_and_warns_once_as_fit():
    """fit_distributed (two replicas of a MirroredStrategy, each clipping half of every
    global batch) logs the same count as fit, over the whole global batches, and warns once."""
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    from keras_noisecurve.training.distributed import fit_distributed

    bad = [17, 40, 41, 100, 200, 201, 202, 255]
    x, y = _data(bad)
    run = PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=1e-5, seed=3)
    expected = _sampled(run, x)
    assert expected > 0
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    with strategy.scope():
        private = _private(run, "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit_distributed(private, x, y, run=run, verbose=0)
    assert history.history[features.METRIC] == [expected]  # one epoch: every step of the call
    assert all(np.all(np.isfinite(v)) for v in private.get_weights())
    dropped = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning) and "dropped" in str(w.message)]
    assert len(dropped) == 1 and f"dropped {expected} example(s)" in dropped[0]
    assert int(private.optimizer.iterations.numpy()) == STEPS


def test_a_clean_fit_logs_zero_and_does_not_warn():
    x, y = _data([])
    run = PrivateRun(num_examples=N, batch_size=BATCH, steps=4, noise_multiplier=1.0, delta=1e-5, seed=3)
    private = _private(run, "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = private.fit(run.dataset(x, y), verbose=0)
    assert history.history[features.METRIC] == [0]
    assert not [w for w in caught if "dropped" in str(w.message)]


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_a_batch_of_non_finite_examples_only_stops_fit_before_the_weights_change(clipping):
    x, y = _data(list(range(N)))  # every example is non-finite
    run = PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=1e-5, seed=3)
    private = _private(run, clipping)
    private.build((None, 8))
    before = [w.copy() for w in private.get_weights()]
    with pytest.raises(tf.errors.InvalidArgumentError,
                       match="every real example of the batch of this step has a non-finite"):
        private.fit(run.dataset(x, y), verbose=0)
    for a, b in zip(private.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    assert int(private.optimizer.iterations.numpy()) == 0  # the step was not taken: the plan resumes at step 0


def test_without_a_run_too():
    """Arrays and an optimizer without a run (no sample weights): the same check."""
    x, y = _data(list(range(N)))
    keras.utils.set_random_seed(2)
    model = make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)]))
    model.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=8, seed=0),
                  loss=LOSS)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-finite"):
        model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)
    x[1:, :] = 1.0  # one bad example among 16: dropped, counted
    history = model.fit(x[:16], y[:16], batch_size=8, epochs=2, verbose=0)
    assert history.history[features.METRIC] == [1, 1]
    assert all(np.all(np.isfinite(v)) for v in model.get_weights())


def test_under_xla_the_step_is_refused_and_fit_raises_after_it():
    """XLA drops assertions: the step is refused (noise only, no data) and fit raises after it."""
    x, y = _data(list(range(N)))
    run = PrivateRun(num_examples=N, batch_size=BATCH, steps=STEPS, noise_multiplier=1.0, delta=1e-5, seed=3)
    private = _private(run, "auto", jit_compile=True)
    with pytest.raises(RuntimeError, match="every real example of its batch had a non-finite loss"):
        private.fit(run.dataset(x, y), verbose=0)
    assert int(private._dp_refused.numpy()[1]) == 8
    assert all(np.all(np.isfinite(v)) for v in private.get_weights())
