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
    elif kind == "einsum_bias":  # a bias along the position axis: not merged, the fallback
        inputs = keras.Input((4, 6))
        h = layers.EinsumDense("abc,cd->abd", output_shape=(4, 5), bias_axes="bd", activation="tanh")(inputs)
        out = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
        x = rng.normal(size=(p, 4, 6)).astype("float32")
    elif kind == "embedding":
        inputs = keras.Input((5,), dtype="int32")
        h = layers.Embedding(11, 4)(inputs)
        out = layers.Dense(3)(layers.GlobalAveragePooling1D()(h))
        x = rng.integers(0, 11, size=(p, 5)).astype("int32")
    else:
        raise ValueError(kind)
    return keras.Model(inputs, out), x, rng.normal(size=(p, 3)).astype("float32")


KINDS = ("dense", "attention", "conv", "lora", "embedding", "einsum_bias")


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
    return reference_units(grad_of, x, y, w, clip, K)


def check(got_sums, got_norms, ref_sums, ref_norms, rtol=2e-5):
    """The engine's per-row norms (each unit's on its K rows) and clipped sums match."""
    got_norms = np.asarray(got_norms, np.float64)
    np.testing.assert_allclose(got_norms, np.repeat(ref_norms, K), rtol=rtol, atol=1e-7)
    flat = np.concatenate([np.asarray(g, np.float64).ravel() for g in got_sums])
    ref = np.concatenate([r.ravel() for r in ref_sums])
    assert np.linalg.norm(flat - ref) <= rtol * 10 * np.linalg.norm(ref) + 1e-7


def one_fit_step_matches_reference(grad_of_model, adaptive=False):
    """One ``fit`` step of a user-level run (σ ≈ 0) moves the weights by exactly
    ``−η·Σ_u clip(G_u, ζ)/B`` of the reference on the step's own batch (the pipeline's rows and
    masks, the engine's per-user clip, the optimizer's division by B users)."""
    import warnings

    import keras_noisecurve as knc

    rng = np.random.default_rng(3)
    x = rng.normal(size=(120, 6)).astype("float32")
    y = rng.normal(size=(120, 3)).astype("float32")
    users = rng.integers(0, 20, size=120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed seeds, δ ≥ 1/n: a test
        run = knc.PrivateRun(privacy_unit="user", num_users=20, examples_per_user=4, batch_size=5, steps=3,
                             noise_multiplier=1e-7, delta=1e-2, seed=0, sampling="fixed_epochs",
                             adaptive_clip=knc.AdaptiveClip(initial=0.05, count_stddev=1e-9) if adaptive else None)
        model, _, _ = build("dense")
        private = knc.make_private(model)
        optimizer = knc.NoiseCurveOptimizer(run=run, learning_rate=0.1, seed=1,
                                            l2_norm_clip=None if adaptive else 0.05)
        private.compile(optimizer=optimizer, loss=mse)
        data = run.dataset(x, y, users=users)
        private.build((None, 6))
        optimizer.build(private.trainable_variables)
        xb, yb, mask, _ = next(iter(data.batches(optimizer)))
        xb, yb, mask = (np.asarray(t) for t in (xb, yb, mask))
        assert len(mask) == run.padded_rows and len(mask) % 4 == 0
        before = [np.asarray(keras.ops.convert_to_numpy(v.value), np.float64) for v in model.trainable_variables]
        sums, norms = reference_units(grad_of_model(model), xb, yb, mask, 0.05, 4)
        private.fit(data, epochs=1, steps_per_epoch=1, verbose=0)
    after = [np.asarray(keras.ops.convert_to_numpy(v.value), np.float64) for v in model.trainable_variables]
    for b, a, s in zip(before, after, sums):
        np.testing.assert_allclose(a, b - 0.1 * s / 5, atol=2e-6)
    return norms


def reference_units(grad_of, x, y, w, clip, k):
    """``(Σ_u clip(G_u, ζ), unit norms (U,))`` in float64 over units of ``k`` rows, ``G_u`` =
    ``grad_of(x_u, y_u, w_u)``, a Python loop over the units."""
    sums = None
    norms = []
    for u in range(len(w) // k):
        rows = slice(u * k, (u + 1) * k)
        grads = [np.asarray(g, np.float64) for g in grad_of(x[rows], y[rows], w[rows])]
        norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
        norms.append(norm)
        factor = min(1.0, clip / norm) if norm > 0 else 1.0
        sums = [factor * g for g in grads] if sums is None else [s + factor * g for s, g in zip(sums, grads)]
    return sums, np.array(norms)


def resume_matches_uninterrupted(tmp_path):
    """A user-level run with an adaptive clip and banded noise, saved after its first epoch
    (``model.save``), loaded and finished, ends with the weights and ζ of the same run
    uninterrupted: the loaded optimizer resumes the users' sampling, their rows, the noise and
    the clip estimate exactly. A resume on other user ids is refused."""
    import warnings

    import keras_noisecurve as knc

    rng = np.random.default_rng(5)
    x = rng.normal(size=(90, 6)).astype("float32")
    y = rng.normal(size=(90, 3)).astype("float32")
    users = rng.integers(0, 15, size=90)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fixed seeds, δ ≥ 1/n: a test
        run = knc.PrivateRun(privacy_unit="user", num_users=15, examples_per_user=3, batch_size=5, epochs=2,
                             noise_multiplier=0.3, delta=1e-2, seed=0, mixing=knc.solve_mixing_matrix(
                                 steps=6, bands=2, objective="bandmf"),
                             adaptive_clip=knc.AdaptiveClip(initial=0.2))

        def fresh():
            model, _, _ = build("dense", seed=4)
            private = knc.make_private(model)
            private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.2, seed=1), loss=mse)
            return private

        straight = fresh()
        straight.fit(run.dataset(x, y, users=users), epochs=2, steps_per_epoch=3, verbose=0)
        first = fresh()
        first.fit(run.dataset(x, y, users=users), epochs=1, steps_per_epoch=3, verbose=0)
        first.save(tmp_path / "user.keras")
        loaded = keras.models.load_model(tmp_path / "user.keras", custom_objects={"mse": mse})
        other = np.roll(users, 1)
        try:
            loaded.fit(run.dataset(x, y, users=other), epochs=1, steps_per_epoch=3, verbose=0)
        except ValueError as err:
            refused = str(err)
        else:
            refused = None
        loaded.fit(run.dataset(x, y, users=users), epochs=1, steps_per_epoch=3, verbose=0)
    assert int(keras.ops.convert_to_numpy(loaded.optimizer.iterations.value)) == 6
    for a, b in zip(loaded.get_weights(), straight.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(loaded.optimizer.current_clip()) == float(straight.optimizer.current_clip())
    assert float(straight.optimizer.current_clip()) != 0.2  # the clip moved
    return refused
