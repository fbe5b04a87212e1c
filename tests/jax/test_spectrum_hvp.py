"""The spectrum on the JAX backend (KERAS_BACKEND=jax): Hessian-vector products against
the exact Hessian from ``jax.hessian`` of the loss as a function of the flattened
parameters (an independent computation), GroupNormalization's second derivatives,
per-example gradient norms against a loop of single-example gradients, the pre-training
step against hand-written SGD, and the refusal of a ``tf.distribute`` strategy."""

import keras
import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

SCCE = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _mlp(seed=0, inputs=5, hidden=(7,), outputs=3):
    inp = keras.Input((inputs,))
    h = inp
    for i, width in enumerate(hidden):
        h = keras.layers.Dense(width, activation="tanh", kernel_initializer=keras.initializers.GlorotNormal(seed + i))(h)
    out = keras.layers.Dense(outputs, kernel_initializer=keras.initializers.GlorotNormal(seed + 99),
                             bias_initializer=keras.initializers.RandomNormal(seed=seed + 7))(h)
    return keras.Model(inp, out)


def _groupnorm_cnn(seed=0):
    inp = keras.Input((6, 6, 2))
    h = keras.layers.Conv2D(4, 3, padding="same", kernel_initializer=keras.initializers.GlorotNormal(seed))(inp)
    h = keras.layers.GroupNormalization(groups=2, gamma_initializer=keras.initializers.RandomUniform(0.5, 1.5, seed=seed + 1),
                                        beta_initializer=keras.initializers.RandomNormal(stddev=0.3, seed=seed + 2))(h)
    h = keras.layers.Activation("tanh")(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    out = keras.layers.Dense(3, kernel_initializer=keras.initializers.GlorotNormal(seed + 3))(h)
    return keras.Model(inp, out)


def _exact_hessian(model, x, y):
    """∇² of (1/n) Σ_i ℓ_i as a (p, p) matrix: ``jax.hessian`` of the loss of the FLAT
    parameter vector, with the log-softmax cross-entropy written out in jnp."""
    shapes = [tuple(v.shape) for v in model.trainable_variables]
    sizes = [int(np.prod(s)) for s in shapes]
    flat0 = jnp.concatenate([jnp.ravel(v.value) for v in model.trainable_variables])
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(flat):
        parts, offset = [], 0
        for shape, size in zip(shapes, sizes):
            parts.append(flat[offset : offset + size].reshape(shape))
            offset += size
        logits, _ = model.stateless_call(parts, non_trainable, jnp.asarray(x), training=False)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(y)[:, None], axis=1))

    return np.asarray(jax.hessian(loss)(flat0), dtype=np.float64)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("build", [_mlp, _groupnorm_cnn], ids=["mlp", "groupnorm_cnn"])
def test_hvp_equals_exact_hessian_times_v(build):
    from keras_noisecurve.spectrum.dense import dense_hessian
    from keras_noisecurve.spectrum.hvp import HessianOperator

    model = build()
    rng = np.random.default_rng(0)
    shape = (29,) + tuple(model.input_shape[1:])
    x = rng.normal(size=shape).astype(np.float32)
    y = rng.integers(0, 3, size=29)
    op = HessianOperator(model, x, y, loss=SCCE, batch_size=8)  # 8, 8, 8, 5: unequal last batch
    H = _exact_hessian(model, x, y)
    assert H.shape == (op.dimension, op.dimension)
    V = rng.normal(size=(op.dimension, 3))
    for j in range(3):
        assert _rel(op.matvec(V[:, j]), H @ V[:, j]) < 2e-5  # float32 round-off; a wrong product is O(1) off
    assert _rel(op.matmat(V), H @ V) < 2e-5
    assert op.num_hvps == 6
    np.testing.assert_allclose(dense_hessian(op, chunk_size=16), 0.5 * (H + H.T), rtol=0, atol=2e-5 * np.abs(H).max())


def test_gradient_and_loss_against_a_plain_mean():
    from keras_noisecurve.spectrum.hvp import HessianOperator

    model = _mlp()
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(13, 5)).astype(np.float32), rng.integers(0, 3, size=13)
    op = HessianOperator(model, x, y, loss=SCCE, batch_size=4)
    logits = np.asarray(model(x), dtype=np.float64)
    logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    assert op.loss() == pytest.approx(-logp[np.arange(13), y].mean(), rel=1e-5)
    w0 = op.flat_weights()
    v = rng.normal(size=op.dimension)
    op.assign(w0 + 1e-2 * v)  # weights are read at every call: no stale trace
    moved = op.gradient()
    op.assign(w0)
    np.testing.assert_allclose(op.flat_weights(), w0)
    assert _rel(moved - op.gradient(), 1e-2 * op.matvec(v)) < 5e-2  # g(w + hv) − g(w) ≈ h·Hv


def test_per_example_norms_and_clipping_scale_match_a_loop():
    from keras_noisecurve.spectrum.clip_scale import clipping_scale, per_example_gradient_norms

    model = _mlp(hidden=(6,))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(11, 5)).astype(np.float32), rng.integers(0, 3, size=11)
    trainable = [v.value for v in model.trainable_variables]

    def one(w, i):
        logits, _ = model.stateless_call(w, [], jnp.asarray(x[i : i + 1]))
        return -jax.nn.log_softmax(logits)[0, y[i]]

    loop = np.array([np.sqrt(sum(float(jnp.sum(g * g)) for g in jax.grad(one)(trainable, i))) for i in range(11)])
    norms = per_example_gradient_norms(model, x, y, loss_fn=SCCE.call, batch_size=4)
    np.testing.assert_allclose(norms, loop, rtol=1e-5)
    zeta = float(np.median(loop))
    assert clipping_scale(model, x, y, l2_norm_clip=zeta, loss=SCCE, batch_size=4) == pytest.approx(
        np.mean(np.minimum(1.0, zeta / loop)), rel=1e-5)


def test_pretraining_is_plain_sgd():
    from keras_noisecurve.spectrum.pretrain import pretrain

    model = _mlp()
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(10, 5)).astype(np.float32), rng.integers(0, 3, size=10)
    w = [np.asarray(v.value) for v in model.trainable_variables]
    order = np.random.default_rng(5).permutation(10)

    def mean_loss(ws, idx):
        h = jnp.tanh(jnp.asarray(x[idx]) @ ws[0] + ws[1])
        logits = h @ ws[2] + ws[3]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(y[idx])[:, None], axis=1))

    for start in (0, 4, 8):  # one epoch, batches of 4, 4, 2
        idx = order[start : start + 4]
        grads = jax.grad(mean_loss)([jnp.asarray(a) for a in w], idx)
        w = [a - 0.1 * np.asarray(g) for a, g in zip(w, grads)]
    history = pretrain(model, x, y, loss_fn=SCCE.call, epochs=1, learning_rate=0.1, batch_size=4, seed=5)
    assert len(history) == 1 and np.isfinite(history[0])
    for variable, expected in zip(model.trainable_variables, w):
        np.testing.assert_allclose(np.asarray(variable.value), expected, rtol=1e-4, atol=1e-5)


def test_a_tf_distribute_strategy_is_refused():
    from keras_noisecurve.spectrum.hvp import HessianOperator

    model = _mlp()
    x, y = np.zeros((4, 5), np.float32), np.zeros(4, np.int32)
    with pytest.raises(ValueError, match="strategy=object.*KERAS_BACKEND=tensorflow"):
        HessianOperator(model, x, y, loss=SCCE, strategy=object())
