"""A layer of one's own and its ghost-norm kernel written once, in ``keras.ops``, for every
backend (the "Adding a layer family" recipe of docs/design.md): the TensorFlow and JAX rule tests
register it and compare its clipping with an independent per-example loop."""

import keras
from keras import ops

from keras_noisecurve.backend.common.norm_forms import cat, sum_dtype, weighted_sum
from keras_noisecurve.training import layer_kernel


class Gate(keras.layers.Layer):
    """y = x ⊙ sigmoid(v) along the last axis: not affine in its weight v, so no built-in rule
    takes it (the RMS-type rule probes for affinity and refuses)."""

    def build(self, shape):
        self.v = self.add_weight(shape=(shape[-1],), initializer="random_normal", name="v")

    def call(self, x):
        return x * ops.sigmoid(self.v)


@layer_kernel(Gate, weights=("v",))
def gate_kernel(layer, calls):
    """Gate: ∂y/∂v = x ⊙ σ'(v), so example i's gradient is Σ_positions g_i ⊙ x_i ⊙ σ'(v)."""
    d = layer.v.shape[0]
    dtype = sum_dtype(calls[0]["g"])
    p = ops.shape(calls[0]["g"])[0]
    s = ops.sigmoid(ops.cast(layer.v.value, dtype))
    a = cat([ops.reshape(ops.cast(c["a"], dtype), (p, -1, d)) for c in calls])
    g = cat([ops.reshape(ops.cast(c["g"], dtype), (p, -1, d)) for c in calls])
    per = ops.sum(g * a, axis=1) * (s * (1 - s))  # (P, d)

    def sums(c, keep=None):
        return {id(layer.v): weighted_sum(per, c, keep)}

    return ops.sum(per * per, axis=1), sums


def gate_model():
    inp = keras.Input((5, 4))
    h = keras.layers.Dense(6, name="first")(inp)
    h = Gate(name="gate")(h)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inp, keras.layers.Dense(3, name="head")(h))
