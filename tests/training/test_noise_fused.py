"""The fused in-place noise step (``StreamNoise.advance_in_place``: one XLA function per
variable that reads the state once and writes it in place) against the dense solve
C⁻¹Z, the numpy reference ``stream_apply`` and the unfused TensorFlow form.

The fused step is compiled once per (shape, dtype) and takes the state's resource
handle: two variables of the same shape must each keep their own state (a function
traced with one variable argument would silently reuse it for the other).
"""

import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.mixing.stream import stream_apply
from keras_noisecurve.training.noise import StreamNoise, fused_blt_step, fused_ring_step
from tests.training.test_noise_strategies import _strategy

STATE_KINDS = ["banded", "toeplitz", "blt", "bisr"]
STEPS = 60
SHAPES = [(4, 3), (3,), (4, 3)]  # two variables of the same shape


def _run(noise, z, dtype, scale=None):
    """z̃ of ``advance_in_place`` for every step, z of shape (T, p) split over SHAPES;
    returns (z̃ (times ``scale`` if given) of shape (T, p), final states)."""
    states = [tf.Variable(tf.zeros(noise.state_shape(s), dtype)) for s in SHAPES]
    sizes = [int(np.prod(s)) for s in SHAPES]
    step = tf.Variable(0, dtype=tf.int64)

    @tf.function
    def one_step(z_row):
        coefficients = noise.step_coefficients(step, dtype)
        parts = tf.split(z_row, sizes)
        out = [tf.reshape(noise.advance_in_place(tf.reshape(p, s), step, v, coefficients, scale=scale),
                          [-1])
               for p, s, v in zip(parts, SHAPES, states)]
        step.assign_add(1)
        return tf.concat(out, axis=0)

    rows = [one_step(tf.constant(z[t], dtype)).numpy() for t in range(z.shape[0])]
    return np.array(rows, dtype=np.float64), [v.numpy() for v in states]


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_fused_step_equals_dense_solve_in_float64(kind):
    """Fused, float64: z̃ equals np.linalg.solve(C, Z) to 1e-12 for all T steps, every
    variable (the two of the same shape included) on its own columns of Z."""
    mixing = _strategy(kind, STEPS)
    noise = StreamNoise.from_mixing(mixing)
    assert noise.fused and noise.buffers > 0
    p = sum(int(np.prod(s)) for s in SHAPES)
    z = np.random.default_rng(7).normal(size=(STEPS, p))
    out, _ = _run(noise, z, tf.float64)
    dense = np.linalg.solve(mixing.to_dense(), z)
    np.testing.assert_allclose(out, dense, rtol=0, atol=1e-12)
    np.testing.assert_allclose(stream_apply(mixing.stream(), z), dense, rtol=0, atol=1e-12)
    assert np.std(out[:, :12] - out[:, -12:]) > 0.5  # same-shape variables differ: own states


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_fused_equals_unfused_in_float32(kind):
    """float32, the noise standard deviation 2.5 folded in: the fused and the unfused
    forms give the same 2.5·z̃ and the same final (unscaled) state up to float32 round-off
    (only the order of the sum over the buffers differs)."""
    mixing = _strategy(kind, STEPS)
    p = sum(int(np.prod(s)) for s in SHAPES)
    z = np.random.default_rng(8).normal(size=(STEPS, p)).astype(np.float32)
    fused, fused_states = _run(StreamNoise(mixing.stream(), fused=True), z, tf.float32, scale=2.5)
    plain, plain_states = _run(StreamNoise(mixing.stream(), fused=False), z, tf.float32, scale=2.5)
    np.testing.assert_allclose(fused, plain, rtol=0, atol=5e-5)
    unscaled, _ = _run(StreamNoise(mixing.stream(), fused=False), z, tf.float32)
    np.testing.assert_allclose(fused, 2.5 * unscaled, rtol=0, atol=5e-5)
    for a, b in zip(fused_states, plain_states):
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-5)
    assert np.abs(fused_states[0]).max() > 0.1  # the states were written


def test_fused_ring_step_writes_one_slot_and_reads_all():
    """One direct call: z̃ = (z − Σ_s mix_s·ring_s) / lead, only ring[slot] changes (to z̃);
    with keeps_draw, z̃ = lead·z + Σ and ring[slot] becomes z."""
    rng = np.random.default_rng(3)
    ring0 = rng.normal(size=(3, 2, 5))
    z, mix = rng.normal(size=(2, 5)), np.array([0.5, -0.25, 2.0])
    expected = (z - np.tensordot(mix, ring0, axes=1)) / 1.5
    ring = tf.Variable(ring0)
    out = fused_ring_step(tf.constant(z), ring.handle, tf.constant(mix), tf.constant(1.5, tf.float64),
                          tf.constant(1, tf.int32), False, tf.constant(3.0, tf.float64)).numpy() / 3.0
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-14)
    np.testing.assert_array_equal(ring.numpy()[[0, 2]], ring0[[0, 2]])
    np.testing.assert_allclose(ring.numpy()[1], expected, rtol=0, atol=1e-14)
    fir = tf.Variable(ring0)
    out = fused_ring_step(tf.constant(z), fir.handle, tf.constant(mix), tf.constant(1.5, tf.float64),
                          tf.constant(2, tf.int32), True, tf.constant(1.0, tf.float64)).numpy()
    np.testing.assert_allclose(out, 1.5 * z + np.tensordot(mix, ring0, axes=1), rtol=0, atol=1e-14)
    np.testing.assert_array_equal(fir.numpy()[2], z)


def test_fused_blt_step_updates_every_accumulator():
    rng = np.random.default_rng(4)
    s0, z = rng.normal(size=(2, 7)), rng.normal(size=(7,))
    omega, theta = np.array([0.3, 0.1]), np.array([0.9, 0.2])
    y = z - omega @ s0
    state = tf.Variable(s0)
    out = fused_blt_step(tf.constant(z), state.handle, tf.constant(omega), tf.constant(theta),
                         tf.constant(2.0, tf.float64)).numpy()
    np.testing.assert_allclose(out, 2.0 * y, rtol=0, atol=1e-14)
    np.testing.assert_allclose(state.numpy(), theta[:, None] * s0 + y, rtol=0, atol=1e-14)


def test_when_the_fused_form_is_used_and_refusals():
    mixing = _strategy("banded", 10)
    noise = StreamNoise.from_mixing(mixing)
    state = tf.Variable(tf.zeros(noise.state_shape((2,))))
    assert noise.fuses(state)
    assert not StreamNoise(mixing.stream(), fused=False).fuses(state)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        assert not noise.fuses(state)  # tf.distribute: the unfused reference
    with pytest.raises(ValueError, match="fused must be True or False, got 'yes'"):
        StreamNoise(mixing.stream(), fused="yes")

    class Redefined(StreamNoise):  # a subclass with its own recurrence is never bypassed
        def advance(self, z, step, state=None, coefficients=None):
            return super().advance(2.0 * z, step, state, coefficients)

    redefined = Redefined(mixing.stream())
    assert not redefined.fuses(state)
    z = tf.constant([1.0, -2.0])
    z_tilde = redefined.advance_in_place(z, tf.constant(0), state)
    np.testing.assert_allclose(z_tilde.numpy(), 2.0 * z.numpy() / mixing.band_values[0, 0], rtol=1e-6)
    stateless = StreamNoise.from_mixing(_strategy("identity", 10))
    assert not stateless.fuses(state)
    with pytest.raises(ValueError, match="needs a stream with state"):
        stateless.advance_in_place(tf.zeros((2,)), tf.constant(0), state)


def test_bench_step_noise_bandwidth_reports_both_noises_and_forms(capsys):
    """benchmarks/bench_step.py --noise-bandwidth on the small MLP, one round of one step:
    a line per noise with the fused, unfused and copy figures; the bytes are 4·b·n
    (banded) and 8·d·n (BLT)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
    try:
        import bench_step
    finally:
        sys.path.pop(0)
    median = bench_step.noise_bandwidth("mlp", repeats=1, steps=1)
    assert set(median) == {"banded16 fused", "banded16 unfused", "blt4 fused", "blt4 unfused",
                           "copy banded16", "copy blt4"}
    assert all(t > 0 for t in median.values())
    text = capsys.readouterr().out
    n = 784 * 128 + 128 + 128 * 10 + 10
    assert f"noise bandwidth banded16 ({4 * 16 * n / 1e6:.1f} MB/step)" in text
    assert f"noise bandwidth blt4 ({8 * 4 * n / 1e6:.1f} MB/step)" in text
    lines = [line for line in text.splitlines() if line.startswith("noise bandwidth ")]
    assert len(lines) == 2 and all(line.count("GB/s") == 3 for line in lines)  # copy, fused, unfused
