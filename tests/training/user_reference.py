"""Shared pieces of the user-level clipping tests on both backends: five small models (Dense,
attention, Conv, LoRA, Embedding), a user-level batch (units of k rows, padding rows of weight 0,
each user's rows weighted 1/m) and an INDEPENDENT per-user reference: a Python loop over users,
each user's gradient the ordinary batch gradient of ``Σ_j w_j·loss_j`` over its k rows
(``grad_of``, the backend's plain autodiff, no clipping engine), norms and clipping in float64
numpy."""

import keras
import numpy as np

K, USERS = 3, 4  # rows per user, users in the batch


def build(kind, seed=0):
    """``(model, x, y)``: a small model of ``kind`` and a batch of ``USERS·K`` rows."""
    keras.utils.set_random_seed(seed)
    rng = np.random.default_rng(seed)
    p = USERS * K
    layers = keras.layers
    if kind == "dense":
        inputs = keras.Input((6,))
        out = layers.Dense(3)(layers.Dense(5, activation="tanh")(inputs))
        x = rng.normal(size=(p, 6)).astype("float32")
    elif kind == "attention":
        inputs = keras.Input((4, 8))
        h = layers.MultiHeadAttention(num_heads=2, key_dim=4)(inputs, inputs)
        h = layers.LayerNormalization()(h + inputs)
        out = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
        x = rng.normal(size=(p, 4, 8)).astype("float32")
    elif kind == "conv":
        inputs = keras.Input((6, 6, 2))
        h = layers.Conv2D(3, 3, activation="tanh")(inputs)
        out = layers.Dense(3)(layers.Flatten()(h))
        x = rng.normal(size=(p, 6, 6, 2)).astype("float32")
    elif kind == "lora":
        inputs = keras.Input((6,))
        first, second = layers.Dense(5, activation="tanh"), layers.Dense(3)
        out = second(first(inputs))
        model = keras.Model(inputs, out)
        first.enable_lora(2)
        second.enable_lora(2)
        for layer in (first, second):  # B = 0 at init: give the factors values
            layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32") * 0.3)
        x = rng.normal(size=(p, 6)).astype("float32")
        return model, x, rng.normal(size=(p, 3)).astype("float32")
    elif kind == "embedding":
        inputs = keras.Input((5,), dtype="int32")
        h = layers.Embedding(11, 4)(inputs)
        out = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
        x = rng.integers(0, 11, size=(p, 5)).astype("int32")
    else:
        raise ValueError(kind)
    return keras.Model(inputs, out), x, rng.normal(size=(p, 3)).astype("float32")


KINDS = ("dense", "attention", "conv", "lora", "embedding")


def user_weights():
    """(P,) float32: user 0 has all K rows, user 1 one row, user 2 two, user 3 none (a padding
    slot); a real row of a user with m rows weighs 1/m."""
    counts = [K, 1, 2, 0]
    w = np.zeros(USERS * K, np.float32)
    for u, m in enumerate(counts):
        w[u * K : u * K + m] = 1.0 / m if m else 0.0
    return w


def mse(y_true, y_pred):
    return keras.ops.mean((y_pred - y_true) ** 2, axis=-1)


def reference(grad_of, x, y, w, clip):
    """``(Σ_u clip(G_u, ζ), unit norms (U,))`` in float64, ``G_u`` = ``grad_of(x_u, y_u, w_u)``
    (a list of arrays: the gradient of ``Σ_j w_j·loss_j`` over the user's K rows)."""
    sums, norms = None, []
    for u in range(len(w) // K):
        rows = slice(u * K, (u + 1) * K)
        grads = [np.asarray(g, np.float64) for g in grad_of(x[rows], y[rows], w[rows])]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        sums = [factor * g for g in grads] if sums is None else [s + factor * g for s, g in zip(sums, grads)]
    return sums, np.array(norms)


def check(got_sums, got_norms, ref_sums, ref_norms, rtol=2e-5):
    """The engine's per-row norms (each unit's on its K rows) and clipped sums match."""
    got_norms = np.asarray(got_norms, np.float64)
    np.testing.assert_allclose(got_norms, np.repeat(ref_norms, K), rtol=rtol, atol=1e-7)
    flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in got_sums])
    ref = np.concatenate([r.ravel() for r in ref_sums])
    assert np.linalg.norm(flat - ref) <= rtol * 10 * np.linalg.norm(ref) + 1e-7
