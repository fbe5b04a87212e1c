"""Two deep convolutional backbones on JAX: the ghost engine (``clipping="auto"`` under
``jax.jit``, as the training step traces it; each layer's norms as its rule reports them)
against an INDEPENDENT float64 per-example loop written here: one ``jax.grad`` of the float64
model's ``stateless_call`` per example (a batch of one, no ``vmap``), norms and clipping in
float64 numpy.

- MobileNetV2 (``keras.applications``, α = 0.35, 32×32, its BatchNormalization replaced by
  GroupNormalization with ``replace_batch_normalization``): 17 ``DepthwiseConv2D`` (stride 1
  ``"same"``, stride 2 ``"valid"`` after a ``ZeroPadding2D``), 1×1 ``Conv2D`` and 52 group norms
  of 1 to 40 channels per group. The model is built in float64 and the engine runs on it. In
  float32 this network is ill-conditioned (group norms of one or two channels on its 2×2 and
  1×1 maps, each with a gain up to 1/√ε ≈ 32; per-example gradient norms of 9·10² to 2·10⁴):
  float32 evaluations of its per-example gradients are up to 3e-3 to 6e-2 from float64 with no
  engine at all (5 examples: an independent float32 loop of batches of one 2.8e-3; a plain
  ``jax.grad`` of one example's loss through the batch of 5, 6.0e-2; TensorFlow's float32
  loop 5.3e-3), and the engines follow the float32 function they run (the ghost engine 3e-5
  from that ``jax.grad``, and from the whole-model ``vmap`` engine): a float32 model cannot
  show the engine's own error. On the float64 model the rules compute in float32 from float64
  activations and output gradients: measured ≤ 5e-7 per layer.
- DeepLabV3 (keras-hub, the catalogue's tiny config: a ResNet encoder with frozen batch norms,
  dilated spatial pyramid pooling), built in float32 and copied to a float64 build (the same
  weights); the engine runs on the float64 build, like MobileNetV2's: measured 1.2e-6 (Conv2D,
  the rules computing in float32 from float64 activations), 1.7e-7 (Dense). Run on the float32 model the
  engine measured 1.1e-7 (norms) here, but 4.9e-5 on one example of five on another CPU (CI's):
  that is the float32 forward pass's own rounding, which depends on the CPU's kernels, not the
  engine's error (the float32 model's engine is held to the catalogue's 1e-4 in the training
  tests).

The float64 loop runs inside the audit's ``float64_scope`` (JAX's x64, and Keras's dtype
promotion keeping float64: without it Keras normalises a float64 GroupNormalization in float32,
and the float64 "reference" of MobileNetV2 is itself 5e-3 from float64).

Tolerance 1e-5 relative on every layer's per-example norms (relative to max(‖g_iL‖, 10⁻⁴‖g_i‖)),
the per-example norms and the clipped sum (each layer's part relative to max(its own norm,
10⁻⁴ of the whole sum's): DeepLabV3's last ResNet stage is not used, its gradient is 0). A wrong
tap, padding or (channel, tap) order moves a layer by > 1e-2. Runtime (mostly building the
models and XLA compilation): 50 s (MobileNetV2) and 35 s (DeepLabV3) on 2 cores shared at a
load of 3.5, 85 CPU-seconds in all: both are marked slow.
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.backend.common import norm_observer
from keras_noisecurve.backend.jax.audit import float64_scope
from keras_noisecurve.backend.jax.clipping import clipped_sum
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum

RTOL = 1e-5
P = 4


def _float64_loop(model, loss_fn, x, y):
    """Per-example float64 gradients (a list over examples of lists of arrays): one jitted
    ``jax.grad`` of ``model.stateless_call`` on a batch of one, inside :func:`float64_scope`."""
    @jax.jit
    def one(tv, ntv, xi, yi):
        def loss(tv):
            pred, _ = model.stateless_call(tv, ntv, xi, training=False)
            return jnp.sum(loss_fn(yi, pred))

        return jax.grad(loss)(tv)

    with float64_scope():
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        out = []
        for i in range(len(y)):
            grads = one(trainable, non_trainable, jnp.asarray(x[i:i + 1], jnp.float64), jnp.asarray(y[i:i + 1]))
            assert all(g.dtype == jnp.float64 for g in grads)
            out.append([np.asarray(g, np.float64) for g in grads])
    return out


def _engine(model, loss_fn, x, y, clip):
    """The ghost engine (``clipping="auto"``) under ``jax.jit``, as the training step traces it, at
    ``training=False``: ``(clipped sums, norms (P,), [(layer, rule, variables)], [its squared
    norms (P,)])``, every array float64 numpy; the layers' norms as their rules computed them
    (``norm_observer``, read at trace time and returned by the jitted function)."""
    layers = []

    @jax.jit
    def run(tv, ntv, x, y, w):
        with norm_observer.observe_layer_norms() as seen:
            sums, norms, _, _, _ = ghost_clipped_sum(model, loss_fn, tv, ntv, x, y, w, l2_norm_clip=clip,
                                                     training=False, clipping="auto", vectorized=clipped_sum)
        layers[:] = [(layer, rule, owned) for layer, rule, owned, _ in seen]
        return sums, norms, [sq for _, _, _, sq in seen]

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    sums, norms, layer_sq = run(trainable, non_trainable, x, y, jnp.ones((len(y),), jnp.float32))
    as64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    return [as64(s) for s in sums], as64(norms), layers, [as64(sq) for sq in layer_sq]


def _check(model, loss_fn, x, y, reference):
    """The engine on ``model`` (float32 or float64) against ``reference`` (the float64 loop), ζ the
    median norm; returns ``{layer class: its layers' worst norm or clipped-sum error}``."""
    variables = model.trainable_variables
    sq = np.array([[np.sum(g[k] ** 2) for k in range(len(variables))] for g in reference])  # (P, V)
    norms = np.sqrt(sq.sum(axis=1))
    clip = float(np.median(norms))  # half the examples clipped
    factors = np.minimum(1.0, clip / norms)
    want = [sum(f * g[k] for f, g in zip(factors, reference)) for k in range(len(variables))]
    total = np.sqrt(sum(np.sum(w ** 2) for w in want))

    got_sums, got_norms, groups, layer_sq = _engine(model, loss_fn, x, y, clip)
    assert np.max(np.abs(got_norms - norms) / norms) < RTOL, (got_norms, norms)
    index = {id(v): k for k, v in enumerate(variables)}
    errors = {}
    assert sorted(index[id(v)] for _, _, owned in groups for v in owned) == list(range(len(variables)))
    for (layer, rule, owned), got_sq in zip(groups, layer_sq):
        assert rule != "generic", f"{layer.name} ({type(layer).__name__}) went to the per-layer fallback"
        ks = [index[id(v)] for v in owned]
        ref = np.sqrt(sq[:, ks].sum(axis=1))
        got = np.sqrt(np.maximum(got_sq, 0.0))
        norm_error = np.max(np.abs(got - ref) / np.maximum(ref, 1e-4 * norms))
        diff = np.sqrt(sum(np.sum((got_sums[k] - want[k]) ** 2) for k in ks))
        sum_error = diff / max(np.sqrt(sum(np.sum(want[k] ** 2) for k in ks)), 1e-4 * total)
        assert norm_error < RTOL and sum_error < RTOL, (layer.name, rule, norm_error, sum_error)
        kind = type(layer).__name__
        errors[kind] = max(errors.get(kind, 0.0), norm_error, sum_error)
    return errors


def test_the_float64_scope_normalises_in_float64():
    """Keras on JAX promotes float64 to float32 (``keras.backend.result_type``), so that a
    float64 GroupNormalization would normalise in float32 (7e-7 from numpy); in the scope it
    does not."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 6, 6, 8)) * 2 + 1
    mean, var = x.mean(axis=(1, 2), keepdims=True), x.var(axis=(1, 2), keepdims=True)
    want = (x - mean) / np.sqrt(var + 1e-3)
    with float64_scope():
        layer = keras.layers.GroupNormalization(groups=8, epsilon=1e-3, dtype="float64")
        got = np.asarray(layer(jnp.asarray(x)))
        assert keras.backend.result_type("float64", "float32") == "float64"
    assert got.dtype == np.float64 and np.max(np.abs(got - want)) < 1e-12
    assert keras.backend.result_type("float64", "float32") == "float32"  # restored on exit


@pytest.mark.slow
def test_mobilenet_v2_with_group_norms_matches_a_float64_loop():
    old = keras.config.floatx(), keras.config.dtype_policy().name
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(P, 32, 32, 3)), rng.integers(0, 4, size=P)
    loss_fn = per_example_loss_fn("sparse_categorical_crossentropy")
    try:
        with float64_scope():
            keras.config.set_floatx("float64")
            keras.config.set_dtype_policy("float64")
            keras.utils.set_random_seed(0)
            model = knc.replace_batch_normalization(
                keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=4, alpha=0.35))
            assert {v.dtype for v in model.trainable_variables} == {"float64"}
            reference = _float64_loop(model, loss_fn, x, y)
            errors = _check(model, loss_fn, x, y, reference)
    finally:
        keras.config.set_floatx(old[0])
        keras.config.set_dtype_policy(old[1])
        keras.backend.clear_session()
    assert {"DepthwiseConv2D", "Conv2D", "GroupNormalization", "Dense"} <= set(errors), errors


@pytest.mark.slow
def test_deeplab_v3_matches_a_float64_loop():
    pytest.importorskip("keras_hub")
    from tests.training import catalogue

    case = catalogue.make_case("DeepLabV3Backbone", dtype="float32")
    loss_fn = per_example_loss_fn(case.loss)
    try:
        with float64_scope():
            twin = catalogue.make_case("DeepLabV3Backbone", dtype="float64").model
            assert {v.dtype for v in twin.trainable_variables} == {"float64"}
            for target, source in zip(twin.weights, case.model.weights):
                assert tuple(target.shape) == tuple(source.shape)
                target.assign(np.asarray(source.value, np.float64))
            x = np.asarray(case.x, np.float64)
            reference = _float64_loop(twin, loss_fn, x, case.y)
            errors = _check(twin, loss_fn, x, case.y, reference)
    finally:
        keras.backend.clear_session()
    assert "Conv2D" in errors, errors
