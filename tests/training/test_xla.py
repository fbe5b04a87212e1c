"""Private models under XLA (``jit_compile=True``): the same steps as without XLA, and a
batch out of step, or a step past the plan, has no influence on the weights (the step
applies its noise only) and is reported on the host right after the step, although XLA
drops assertions."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training.helpers import noiseless
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import random_banded_c

N, B, STEPS, BANDS = 48, 6, 10, 3
C = random_banded_c(STEPS, BANDS, rng=np.random.default_rng(4), diag_scale=0.5)
PLAN = dict(num_examples=N, batch_size=B, steps=STEPS, mixing=C, noise_multiplier=1.5, delta=1e-5)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, 3)).astype("float32"), rng.integers(0, 2, N)


def _base():
    keras.utils.set_random_seed(2)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])


def _model(run, *, jit, clipping="vectorized"):
    model = make_private(_base(), clipping=clipping)
    model.compile(
        optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.3, l2_norm_clip=0.5, seed=11),
        loss=LOSS,
        jit_compile=jit,
    )
    return model


def _rings(model):
    return [r.numpy() for r in model.optimizer._rings if r is not None]


@pytest.mark.parametrize("clipping", ["vectorized", "ghost"])
def test_jit_fit_on_a_run_equals_the_fit_without_xla(data, clipping):
    states = {}
    for jit in (False, True):
        run = PrivateRun(**PLAN, seed=7)
        model = _model(run, jit=jit, clipping=clipping)
        history = model.fit(run.dataset(*data), verbose=0)
        assert int(model.optimizer.iterations.numpy()) == STEPS
        states[jit] = (model.get_weights() + _rings(model), history.history["loss"])
    start = _base().get_weights()
    for a, b in zip(states[True][0], states[False][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 rounding (XLA fuses)
    for a, w0 in zip(states[True][0][:4], start):
        assert np.max(np.abs(a - w0)) > 1e-2  # it trained
    np.testing.assert_allclose(states[True][1], states[False][1], rtol=1e-5)


class _Rewind(keras.callbacks.Callback):
    """Moves the optimizer back to step 0 before batch ``at`` (as a restore in the middle
    of fit would): the dataset then delivers step ``at``'s batch to step 0. Keeps the
    weights and optimizer variables as they are right before that step."""

    def __init__(self, at):
        super().__init__()
        self.at, self.snapshot = at, None

    def on_train_batch_begin(self, batch, logs=None):
        if batch == self.at:
            self.model.optimizer.iterations.assign(0)
            self.snapshot = (self.model.get_weights(), [v.numpy() for v in self.model.optimizer.variables])


def test_jit_fit_refuses_a_batch_out_of_step_on_the_host_and_ignores_its_data(data):
    run = PrivateRun(**PLAN, seed=7)
    model = _model(run, jit=True)
    rewind = _Rewind(at=2)
    with pytest.raises(RuntimeError, match=r"belongs to step 2, not to the optimizer's step 0.*restarted at batch 0"):
        model.fit(run.dataset(*data), verbose=0, callbacks=[rewind])
    assert int(model.optimizer.iterations.numpy()) == 1  # the refused step ran (noise only), then fit stopped

    # the same state, then a step with a ZERO clipped sum (noise only), without XLA
    twin = _model(PrivateRun(**PLAN, seed=7), jit=False)
    twin.optimizer.build(twin.trainable_variables)
    weights, variables = rewind.snapshot
    twin.set_weights(weights)
    for v, value in zip(twin.optimizer.variables, variables):
        v.assign(value)
    zeros = [tf.zeros_like(v) for v in twin.trainable_variables]
    tf.function(lambda: twin.optimizer.apply_clipped_sum(zeros, twin.trainable_variables))()
    for a, b in zip(model.get_weights() + _rings(model), twin.get_weights() + _rings(twin)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert max(np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), weights)) > 1e-3  # the noise moved them


def _private_mlp(optimizer, *, jit):
    model = make_private(_base(), clipping="vectorized")
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=jit)
    model.optimizer.build(model.trainable_variables)
    return model


def _batch(data, step):
    x, y = data
    return tf.constant(x[:B]), tf.constant(y[:B]), tf.ones([B]), tf.fill([B], tf.constant(step, tf.int64))


def test_an_xla_step_with_a_wrong_step_index_leaves_the_weights_unchanged(data):
    model = _private_mlp(noiseless(NoiseCurveOptimizer(learning_rate=0.3, noise_multiplier=1.0, expected_batch_size=B)), jit=True)
    train = tf.function(model.train_step, jit_compile=True)
    before = model.get_weights()
    train(_batch(data, 5))  # the optimizer is at step 0
    for a, b in zip(model.get_weights(), before):
        np.testing.assert_array_equal(a, b)  # σ = 0: a noise-only step changes nothing
    count, reasons, batch_step, iteration = model._dp_refused.numpy()
    assert (count, reasons, batch_step, iteration) == (1, 1, 5, 0)
    train(_batch(data, 1))  # the right step: it trains
    assert max(np.max(np.abs(a - b)) for a, b in zip(model.get_weights(), before)) > 1e-3
    assert model._dp_refused.numpy()[0] == 1


def test_an_xla_step_past_the_plan_is_refused(data):
    plan = MixingMatrix.identity(2)
    model = _private_mlp(
        noiseless(NoiseCurveOptimizer(learning_rate=0.3, mixing=plan, noise_multiplier=1.0, expected_batch_size=B,
                                      seed=1)),
        jit=True,
    )
    x, y = data
    ds = tf.data.Dataset.from_tensor_slices((x[: 3 * B], y[: 3 * B])).batch(B)
    weights = []
    with pytest.raises(RuntimeError, match="step 2 .*past the mixing matrix's plan"):
        model.fit(ds, verbose=0, callbacks=[keras.callbacks.LambdaCallback(
            on_train_batch_begin=lambda batch, logs: weights.append(model.get_weights()))])
    assert len(weights) == 3
    for a, b in zip(model.get_weights(), weights[2]):
        np.testing.assert_array_equal(a, b)  # step 2 used no data (σ = 0: nothing changed)


def test_the_noise_stream_under_xla_is_tensorflows_philox_stream():
    """XLA's own stateless kernels truncate int64 seeds to 32 bits; the noise's seeds
    (fold_in) and bits must equal TensorFlow's kernels without XLA for ANY int64 seed."""
    from keras_noisecurve.training import noise

    rng = np.random.default_rng(0)
    fold_ref = tf.function(lambda s, t: tf.random.experimental.stateless_fold_in(s, t))
    bits_ref = tf.function(
        lambda s: tf.random.stateless_uniform([5], seed=s, minval=None, maxval=None, dtype=tf.uint32, alg="philox"))
    fold_xla = tf.function(noise.fold_in, jit_compile=True)
    bits_xla = tf.function(lambda s: noise._philox_bits(s, 5), jit_compile=True)
    draw = lambda s, t: noise.normal_from_seed(noise.variable_seed(noise.step_seed(s, t), 3), (7,))  # noqa: E731
    draw_ref, draw_xla = tf.function(draw), tf.function(draw, jit_compile=True)
    for seed in rng.integers(-(2**63), 2**63 - 1, size=(20, 2), dtype=np.int64):
        seed, t = tf.constant(seed), tf.constant(int(rng.integers(0, 10**6)), tf.int64)
        np.testing.assert_array_equal(fold_xla(seed, t).numpy(), fold_ref(seed, t).numpy())
        np.testing.assert_array_equal(bits_xla(seed).numpy(), bits_ref(seed).numpy())
        np.testing.assert_allclose(draw_xla(seed, t).numpy(), draw_ref(seed, t).numpy(), rtol=1e-5, atol=1e-6)


def test_layers_xla_cannot_compile_fail_clearly(data):
    recurrent = make_private(keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4), keras.layers.Dense(2)]))
    with pytest.raises(ValueError, match="'lstm.*' \\(LSTM\\) is recurrent.*jit_compile=False"):
        recurrent.compile(optimizer=NoiseCurveOptimizer(learning_rate=0.1, noise_multiplier=1.0, expected_batch_size=B), loss=LOSS, jit_compile=True)

    class HostCopy(keras.layers.Layer):  # a host (numpy) op: no XLA kernel
        def call(self, x):
            out = tf.numpy_function(lambda a: a.copy(), [x], tf.float32)
            return tf.reshape(out, tf.shape(x))

    run = PrivateRun(**PLAN, seed=7)
    model = make_private(keras.Sequential([keras.Input((3,)), HostCopy(), keras.layers.Dense(2)]))
    model.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.3, seed=1), loss=LOSS, jit_compile=True)
    with pytest.raises(RuntimeError, match="failed under XLA.*jit_compile=False"):
        model.fit(run.dataset(*data), verbose=0)
