"""The JAX noise generator (keras_noisecurve.backend.jax.noise) draws what the TensorFlow
backend draws for the same key, step and variable index (seed words and uniform words
exactly, normals to float32 rounding), also under ``jax.jit`` with a traced step; the
numpy run of the neutral Philox agrees with both; the draws are N(0, 1); and every
registered strategy's recurrence run with ``JaxOps`` equals the float64 numpy reference
``stream_apply``.

These run in the default (TensorFlow) test process: JAX is imported as a library."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX noise needs jax (pip install jax)")
jnp = jax.numpy

from keras_noisecurve.backend.common import philox  # noqa: E402
from keras_noisecurve.backend.jax import noise as jax_noise  # noqa: E402
from keras_noisecurve.mixing import STRATEGY_CLASSES  # noqa: E402
from keras_noisecurve.mixing.stream import stream_apply  # noqa: E402
from keras_noisecurve.training.noise import StreamNoise, key_from_seed  # noqa: E402
from tests.mixing.test_strategy_registry import EXAMPLES  # noqa: E402

#: |JAX − TensorFlow| allowed (absolute and relative); measured on CPU over 24M draws: at most
#: 9.5e-7 absolute (two float32 ulps at |z| ≈ 5) and 3.5e-7 relative
FLOAT_TOLERANCE = 2e-6
KEYS = [key_from_seed(0), key_from_seed(7), key_from_seed(2**63 - 1),
        np.array([2**63 - 1, -(2**63)], np.int64), np.array([-1, 123456789012345], np.int64)]
STEPS = [0, 1, 17, 2**31 - 1]
SHAPES = [(), (1,), (5,), (7, 3), (4, 3, 2), (1001,), (0,)]


def _tf():
    return pytest.importorskip("tensorflow", reason="the comparison with the TensorFlow backend needs TensorFlow")


def _words(seed):
    return np.asarray(seed, dtype="<i8").view("<u4").astype(np.uint32)


def test_key_words_are_the_int64_keys_words():
    for key in KEYS:
        words = jax_noise.key_words(key)
        assert words.dtype == np.uint32 and words.shape == (4,)
        np.testing.assert_array_equal(words, _words(key))
    with pytest.raises(ValueError, match=r"shape \(2,\).*got dtype float64 and shape \(2,\)"):
        jax_noise.key_words(np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"got dtype int64 and shape \(3,\)"):
        jax_noise.key_words(np.array([1, 2, 3]))


def test_the_looped_block_is_the_unrolled_block():
    """``philox_block_looped`` under JAX (its rounds one ``fori_loop``, jitted) gives the
    Random123 known answers of Philox-4×32-10 and, over a grid of lanes with a key per row,
    the unrolled block's words; a step seed's two derivation blocks are two loops."""
    mask = 2**32 - 1
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((mask,) * 4, (mask,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD))]
    looped = jax.jit(lambda c, k: philox.philox_block_looped(jax_noise._xp, tuple(c), tuple(k)))
    for counter, key, expected in cases:
        words = looped(jnp.asarray(counter, jnp.uint32), jnp.asarray(key, jnp.uint32))
        np.testing.assert_array_equal([int(w) for w in words], expected)
    rng = np.random.default_rng(3)
    lanes = rng.integers(0, 2**32, size=(5, 3), dtype=np.uint64).astype(np.uint32)
    row_keys = rng.integers(0, 2**32, size=(2, 5, 1), dtype=np.uint64).astype(np.uint32)
    high = rng.integers(0, 2**32, size=2, dtype=np.uint64).astype(np.uint32)
    counter, key = (lanes, np.uint32(0), high[0], high[1]), (row_keys[0], row_keys[1])
    got = jax.jit(lambda: philox.philox_block_looped(jax_noise._xp, counter, key))()
    for a, b in zip(got, philox.philox_block(np, counter, key)):
        assert a.shape == (5, 3)
        np.testing.assert_array_equal(np.asarray(a), b)
    text = str(jax.make_jaxpr(lambda s: jax_noise.step_seed(s, 5))(jnp.zeros(4, jnp.uint32)))
    assert text.count("= scan[") == 2  # fold_in: the key/counter block and block 0, a loop each


def test_seeds_equal_tensorflows_fold_in():
    """step_seed and variable_seed give the words of TensorFlow's stateless_fold_in chain,
    for int64 keys, uint32 words and int32 words (the same bits), traced int32 steps under
    jit, and Python steps beyond 2³¹ (split on the host)."""
    tf = _tf()
    indices = jnp.asarray([0, 2, 41], jnp.int32)
    traced = jax.jit(lambda key, step: jax.vmap(lambda k: jax_noise.variable_seed(jax_noise.step_seed(key, step), k))(
        indices))
    for key in KEYS:
        words = jax_noise.key_words(key)
        for step in STEPS:
            reference = tf.random.experimental.stateless_fold_in(tf.constant(key), tf.constant(step, tf.int64))
            expected = [_words(tf.random.experimental.stateless_fold_in(reference, tf.constant(int(k), tf.int64)))
                        for k in indices]
            np.testing.assert_array_equal(np.asarray(traced(jnp.asarray(words.view(np.int32)), jnp.int32(step))),
                                          expected)
    key = KEYS[2]
    for step in (2**31, 2**40 + 1):
        reference = tf.random.experimental.stateless_fold_in(tf.constant(key), tf.constant(step, tf.int64))
        np.testing.assert_array_equal(np.asarray(jax_noise.step_seed(key, step)), _words(reference.numpy()))
        np.testing.assert_array_equal(np.asarray(jax_noise.step_seed(key, np.array(step, np.int64))),
                                      _words(reference.numpy()))
        got = jax_noise.variable_seed(jax_noise.step_seed(jax_noise.key_words(key).view(np.int32), step), 7)
        assert got.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(got), _words(
            tf.random.experimental.stateless_fold_in(reference, tf.constant(7, tf.int64)).numpy()))


def test_uniform_words_equal_tensorflows_under_jit():
    """The JAX run of the neutral Philox gives TensorFlow's stateless_uniform uint32 words."""
    tf = _tf()
    for n in (1, 7, 1001):
        jitted = jax.jit(lambda s, n=n: philox.uniform_words(jax_noise._xp, s, n))
        for key in KEYS:
            seed = tf.random.experimental.stateless_fold_in(tf.constant(key), tf.constant(3, tf.int64))
            reference = tf.random.stateless_uniform([n], seed=seed, minval=None, maxval=None, dtype=tf.uint32,
                                                    alg="philox").numpy()
            np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(_words(seed.numpy())))), reference)


def test_jax_normals_equal_tensorflows():
    """Same key, step, index and shape: JAX's z_t equals the TensorFlow backend's (eager)
    to float32 rounding: all variables of a step at once (``variable_normals``) and one
    variable (``standard_normal``) under jit with traced step and index, and eagerly; the
    numpy run of the neutral generator agrees to the same rounding."""
    from keras_noisecurve.backend.tensorflow import noise as tf_noise

    _tf()
    every = jax.jit(lambda k, t: jax_noise.variable_normals(jax_noise.step_seed(k, t), SHAPES))
    one = jax.jit(lambda k, t, i: jax_noise.standard_normal(k, t, i, (7, 3)))
    worst = 0.0
    for key in KEYS:
        words = jax_noise.key_words(key)
        for step in STEPS:
            draws = every(jnp.asarray(words.view(np.int32)), jnp.int32(step))
            for index, (shape, got) in enumerate(zip(SHAPES, draws)):
                reference = tf_noise.standard_normal(key, step, index, shape).numpy()
                assert got.shape == shape and got.dtype == jnp.float32
                np.testing.assert_allclose(np.asarray(got), reference, rtol=FLOAT_TOLERANCE, atol=FLOAT_TOLERANCE)
                worst = max(worst, float(np.max(np.abs(np.asarray(got) - reference), initial=0.0)))
            reference = tf_noise.standard_normal(key, step, 3, (7, 3)).numpy()
            np.testing.assert_allclose(np.asarray(one(jnp.asarray(words), jnp.int32(step), jnp.int32(3))), reference,
                                       rtol=FLOAT_TOLERANCE, atol=FLOAT_TOLERANCE)
            seed = philox.fold_in(np, philox.fold_in(np, words, *philox.int64_words(step)), 3, 0)
            flat = philox.box_muller(np, seed, philox.fold_in(np, seed, 1, 0), 21, np.float32)
            np.testing.assert_allclose(flat.reshape(7, 3), reference, rtol=FLOAT_TOLERANCE, atol=FLOAT_TOLERANCE)
    assert 0.0 < worst < FLOAT_TOLERANCE  # the backends' log/cos/sin differ in the last bits only
    key = KEYS[1]
    eager = jax_noise.standard_normal(key, 2**31 + 5, 2, (4, 3))
    np.testing.assert_allclose(np.asarray(eager), tf_noise.standard_normal(key, 2**31 + 5, 2, (4, 3)).numpy(),
                               rtol=FLOAT_TOLERANCE, atol=FLOAT_TOLERANCE)


def test_variable_normals_are_the_per_variable_draws():
    """All variables at once equal one variable at a time (the same words: equal floats),
    with scales, custom indices, empty and scalar shapes, and mixed dtypes; numpy too."""
    seed = jax_noise.step_seed(jax_noise.key_words(key_from_seed(9)), 4)
    shapes, indices = [(3,), (), (0,), (7, 5), (1001,)], [0, 1, 2, 30, 2**40]
    scales, dtypes = [None, 2.0, None, 1.5, None], [jnp.float32, jnp.float32, jnp.float32, jnp.bfloat16, jnp.float32]
    together = jax_noise.variable_normals(seed, shapes, dtypes, scales=scales, indices=indices)
    for shape, index, scale, dtype, got in zip(shapes, indices, scales, dtypes, together):
        alone = jax_noise.normal_from_seed(jax_noise.variable_seed(seed, index), shape, dtype, scale=scale)
        assert got.shape == shape and got.dtype == dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(alone, np.float32))
    flat = philox.variable_normals(np, np.asarray(seed), indices, [3, 1, 0, 35, 1001], np.float32)
    for k in (0, 2, 4):  # the unscaled float32 entries
        np.testing.assert_allclose(flat[k], np.asarray(together[k]).reshape(-1), rtol=2e-6, atol=2e-6)
    assert jax_noise.variable_normals(seed, []) == []
    with pytest.raises(ValueError, match=r"one entry per shape \(2\), got 1, 2 and -"):
        jax_noise.variable_normals(seed, [(2,), (3,)], dtypes=[jnp.float32])


def test_normal_from_seed_scale_dtypes_and_refusals():
    seed = jax_noise.variable_seed(jax_noise.step_seed(jax_noise.key_words(key_from_seed(3)), 4), 1)
    z = jax_noise.normal_from_seed(seed, (7, 3, 5))
    assert z.shape == (7, 3, 5) and z.dtype == jnp.float32
    np.testing.assert_allclose(jax_noise.normal_from_seed(seed, (7, 3, 5), scale=2.5), 2.5 * z, rtol=1e-6)
    np.testing.assert_array_equal(z, jax_noise.standard_normal(key_from_seed(3), 4, 1, (7, 3, 5)))
    for dtype in (jnp.bfloat16, jnp.float16):
        low = jax_noise.normal_from_seed(seed, (7, 3, 5), dtype=dtype)
        assert low.dtype == dtype
        np.testing.assert_allclose(np.asarray(low, np.float32), z, rtol=1e-2, atol=1e-2)
    assert jax_noise.normal_from_seed(seed, (0,)).shape == (0,)
    with pytest.raises(ValueError, match="floating dtype, got int32"):
        jax_noise.normal_from_seed(seed, (3,), dtype=jnp.int32)
    with pytest.raises(ValueError, match="fully defined shape"):
        jax_noise.normal_from_seed(seed, (None, 3))
    with pytest.raises(ValueError, match=r"\(4,\) uint32 or int32 words.*got dtype float32 and shape \(4,\)"):
        jax_noise.normal_from_seed(jnp.zeros(4), (3,))
    with pytest.raises(ValueError, match="step must be an integer scalar, got dtype float32"):
        jax_noise.step_seed(seed, jnp.float32(1.0))


def test_float64_under_x64_is_computed_in_float64():
    """With JAX's x64 on, float64 draws are computed in float64 as TensorFlow's are, and an
    int64 traced step is split into both words."""
    from keras_noisecurve.backend.tensorflow import noise as tf_noise

    _tf()
    key = key_from_seed(5)
    reference = tf_noise.standard_normal(key, 2**33 + 1, 2, (9,), dtype="float64").numpy()
    with jax.enable_x64(True):
        got = jax_noise.standard_normal(jnp.asarray(jax_noise.key_words(key)), jnp.int64(2**33 + 1), 2, (9,),
                                        jnp.float64)
        assert got.dtype == jnp.float64
        np.testing.assert_allclose(np.asarray(got), reference, rtol=1e-12, atol=1e-12)


def test_jax_draws_have_the_standard_normal_law():
    """KS test, mean, variance, 3σ tail mass, and no dependence between Box–Muller partners
    (entries i and i + n/2), steps or variables, for an odd number of entries."""
    from scipy import stats

    n = 200_001
    key = jax_noise.key_words(key_from_seed(11))
    z = np.asarray(jax_noise.standard_normal(key, 5, 2, (n,)), np.float64)
    assert np.all(np.isfinite(z)) and np.abs(z).max() > 4.0
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert abs(z.mean()) < 5 / np.sqrt(n) and abs(z.var() - 1.0) < 5 * np.sqrt(2 / n)
    assert abs(np.mean(np.abs(z) > 3.0) - 0.0027) < 6e-4
    half = n // 2
    tol = 5 / np.sqrt(half)
    assert abs(np.corrcoef(z[:half], z[half:2 * half])[0, 1]) < tol
    assert abs(np.corrcoef(z[:half] ** 2, z[half:2 * half] ** 2)[0, 1]) < tol
    for other in (jax_noise.standard_normal(key, 6, 2, (n,)), jax_noise.standard_normal(key, 5, 3, (n,))):
        assert abs(np.corrcoef(z, np.asarray(other))[0, 1]) < 5 / np.sqrt(n)


SHAPE = (3, 2)
STREAM_STEPS = 9


def _run_jax(noise, z, dtype):
    """z̃ for every step by the functional JAX step under jit (traced step, state in and out)."""

    @jax.jit
    def step(z_t, t, state):
        coefficients = noise.step_coefficients(t, dtype)
        if state is None:
            return z_t * noise.folded_scale(jnp.asarray(1.0, dtype), coefficients), None
        z_tilde, write = noise.advance(z_t, t, state, coefficients)
        return z_tilde, noise.apply_write(state, write)

    state_shape = noise.state_shape(SHAPE)
    state = None if state_shape is None else jnp.zeros(state_shape, dtype)
    out = []
    for t in range(z.shape[0]):
        z_tilde, state = step(jnp.asarray(z[t], dtype), jnp.int32(t), state)
        assert z_tilde.dtype == dtype and z_tilde.shape == SHAPE
        out.append(np.asarray(z_tilde, np.float64))
    return np.array(out), state


@pytest.mark.parametrize("kind", sorted(STRATEGY_CLASSES))
def test_jax_recurrence_equals_numpy_reference(kind):
    """Every registered strategy: the recurrence run by StreamNoise with JaxOps under jit
    equals stream_apply (float64 numpy): to 1e-12 in float64 (x64 on), to float32
    rounding in float32; the final state is the stream's (ring slots / accumulators)."""
    strategy = EXAMPLES[kind](STREAM_STEPS)
    z = np.random.default_rng(4).standard_normal((STREAM_STEPS,) + SHAPE)
    reference = stream_apply(strategy.stream(), z)
    noise = StreamNoise.from_mixing(strategy, ops=jax_noise.JaxOps)
    assert noise.ops is jax_noise.JaxOps and noise.buffers == strategy.buffers and noise.steps == strategy.steps
    assert noise.assert_in_plan(jnp.int32(STREAM_STEPS)) is None  # no run-time check under JAX
    out32, _ = _run_jax(noise, z.astype(np.float32), jnp.float32)
    np.testing.assert_allclose(out32, reference, rtol=1e-5, atol=1e-5)
    with jax.enable_x64(True):
        out64, _ = _run_jax(noise, z, jnp.float64)
    np.testing.assert_allclose(out64, reference, rtol=0, atol=1e-12)


def test_jax_ops_write_and_coefficients_are_functional():
    """JaxOps against hand-written values: the slot layout (entry (t − j) mod m holds
    tail[j − 1]), the functional write, and NaN rows past the end of a table."""
    ops = jax_noise.JaxOps
    tail = jnp.asarray([10.0, 20.0, 30.0])
    np.testing.assert_array_equal(ops.slot_coefficients(tail, jnp.int32(4), 3), [10.0, 30.0, 20.0])  # t = 4, m = 3
    state = jnp.zeros((3, 2))
    new = ops.write_slot(state, ops.slot(jnp.int32(5), 3), jnp.ones(2))
    np.testing.assert_array_equal(new, [[0, 0], [0, 0], [1, 1]])
    np.testing.assert_array_equal(state, np.zeros((3, 2)))
    table = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(ops.gather(table, jnp.int32(2)), [4.0, 5.0])
    assert np.all(np.isnan(np.asarray(ops.gather(table, jnp.int32(3)))))


def test_stream_noise_under_jax_refuses_in_place_steps():
    strategy = EXAMPLES["banded"](STREAM_STEPS)
    noise = StreamNoise.from_mixing(strategy, ops=jax_noise.JaxOps)
    assert not noise.fuses(jnp.zeros(noise.state_shape(SHAPE)))
    with pytest.raises(ValueError, match="jax array namespace has immutable arrays: use advance"):
        noise.advance_in_place(jnp.zeros(SHAPE), 0, jnp.zeros(noise.state_shape(SHAPE)))
    with pytest.raises(ValueError, match="lacks .*write_slot"):
        StreamNoise(None, ops=object)
    z_tilde, state = noise.sample(jax_noise.key_words(key_from_seed(1)), 0, 0, SHAPE, state=jnp.zeros((2,) + SHAPE))
    expected = jax_noise.standard_normal(key_from_seed(1), 0, 0, SHAPE) / strategy.band_values[0, 0]
    np.testing.assert_allclose(z_tilde, expected, rtol=1e-6)
    np.testing.assert_allclose(state[0], z_tilde, rtol=0)


def test_training_noise_imports_no_framework():
    """training/noise.py (loaded on its own, without the training package) imports neither
    TensorFlow nor JAX; under KERAS_BACKEND=jax its StreamNoise runs with JaxOps and its
    generator names are the JAX ones, and TensorFlow is never imported."""
    code = textwrap.dedent("""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("noise_alone", "keras_noisecurve/training/noise.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert "tensorflow" not in sys.modules and "jax" not in sys.modules, sorted(sys.modules)
        from keras_noisecurve.backend.jax import noise as jax_noise
        noise = module.StreamNoise.from_mixing("dpsgd")
        assert noise.ops is jax_noise.JaxOps and module.normal_from_seed is jax_noise.normal_from_seed
        try:
            module.fused_ring_step
        except AttributeError as error:
            assert "not part of the backend's noise generator (keras_noisecurve.backend.jax.noise)" in str(error), error
        assert "tensorflow" not in sys.modules
        print("ok")
    """)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, KERAS_BACKEND="jax")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=root, env=env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_training_noise_lends_the_tensorflow_generator_under_tensorflow():
    """Under the default (TensorFlow) test backend, training.noise's generator names are
    the TensorFlow backend's, and a JAX-only name is refused by name."""
    from keras_noisecurve import backend
    from keras_noisecurve.training import noise

    if backend.name() != "tensorflow":
        pytest.skip("this process runs Keras on another backend")
    from keras_noisecurve.backend.tensorflow import noise as tf_noise

    assert noise.normal_from_seed is tf_noise.normal_from_seed and noise.TensorFlowOps is tf_noise.TensorFlowOps
    assert StreamNoise(None).ops is tf_noise.TensorFlowOps
    with pytest.raises(AttributeError, match=r"'JaxOps' is not part of the backend's noise generator \(keras_noisecurve.backend.tensorflow.noise\)"):
        noise.JaxOps
    with pytest.raises(AttributeError, match="has no attribute 'nothing_here'"):
        noise.nothing_here
