"""The TensorFlow recurrence of every registered strategy equals the numpy one.

``StreamNoise`` runs the stream's ``init``/``coefficients``/``next`` with
``TensorFlowOps``; ``stream_apply`` runs them with ``NumpyOps``. For every kind of
``STRATEGY_CLASSES`` (examples from tests/mixing/test_strategy_registry.py, which checks
``stream_apply`` against a dense solve), in float64: the unfused functional step, the
unfused in-place step and the fused XLA in-place step (the stream's ``next_in_place``)
all equal ``stream_apply`` on the same draws.
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.mixing import STRATEGY_CLASSES, IdentityMixing
from keras_noisecurve.mixing.stream import stream_apply
from keras_noisecurve.training.noise import StreamNoise
from tests.mixing.test_strategy_registry import EXAMPLES

STEPS = 9
SHAPE = (3, 2)


def _run(noise, z, *, in_place, scale=None):
    state_shape = noise.state_shape(SHAPE)
    state = None
    if state_shape is not None:
        state = tf.Variable(tf.zeros(state_shape, tf.float64)) if in_place else tf.zeros(state_shape, tf.float64)
    out = []
    for t in range(z.shape[0]):
        zt = tf.constant(z[t])
        if state is None:
            coefficients = noise.step_coefficients(t, tf.float64)
            factor = noise.folded_scale(tf.constant(1.0 if scale is None else scale, tf.float64), coefficients)
            out.append((zt * factor).numpy())
        elif in_place:
            out.append(noise.advance_in_place(zt, tf.constant(t), state, scale=scale).numpy())
        else:
            z_tilde, state = noise.correlate(zt, tf.constant(t), state)
            out.append(z_tilde.numpy())
    return np.array(out)


@pytest.mark.parametrize("kind", sorted(STRATEGY_CLASSES))
def test_tensorflow_recurrence_equals_numpy(kind):
    strategy = EXAMPLES[kind](STEPS)
    z = np.random.default_rng(4).standard_normal((STEPS,) + SHAPE)
    reference = stream_apply(strategy.stream(), z)
    unfused = StreamNoise(strategy.stream(), fused=False)
    np.testing.assert_allclose(_run(unfused, z, in_place=False), reference, rtol=0, atol=1e-12)
    np.testing.assert_allclose(_run(unfused, z, in_place=True), reference, rtol=0, atol=1e-12)
    fused = StreamNoise.from_mixing(strategy)
    np.testing.assert_allclose(_run(fused, z, in_place=True, scale=2.0), 2.0 * reference, rtol=0, atol=1e-12)
    assert fused.buffers == strategy.buffers and fused.steps == strategy.steps


def test_identity_without_a_plan_is_the_unlimited_stateless_stream():
    noise = StreamNoise.from_mixing("dpsgd")
    assert noise.steps is None and noise.buffers == 0 and noise.assert_in_plan(10**9) is None
    assert noise.step_coefficients(5, tf.float32) is None
    assert StreamNoise.from_mixing(IdentityMixing(steps=3)).steps == 3
