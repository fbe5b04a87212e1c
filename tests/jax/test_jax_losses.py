"""Losses that are not one value per example, on JAX: per token, per pixel, per position.

Each private step (σ = 1e-9, SGD) is checked against an INDEPENDENT per-example loop
(``tests/jax/helpers.reference_clipped_sum``: one ``jax.grad`` per example of a
hand-written per-example loss, clipping in float64 numpy): the per-example loss is the
mean of the per-position values over the example's real positions (Keras mask,
``ignore_class``), per-position sample weights multiplied in (docs/training.md).
"""

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, make_private
from tests.jax.helpers import reference_clipped_sum, weights_of

CLIP, LR, B = 0.5, 0.5, 8
V, L = 12, 6


def _token_ce(logits, labels):
    """Cross-entropy per position, (1, L), by hand."""
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def _packed_lm_loss(yi, pred):
    """yi (1, L, 3): labels, weight, mask channels: Σ_t w·m·ce / Σ_t m."""
    labels, weight, mask = yi[..., 0].astype(jnp.int32), yi[..., 1], yi[..., 2]
    ce = _token_ce(pred.astype(jnp.float32), labels)
    return jnp.sum(ce * weight * mask, axis=-1) / jnp.maximum(jnp.sum(mask, axis=-1), 1.0)


def _lm(mask_zero=False, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((L,), dtype="int32"), keras.layers.Embedding(V, 5, mask_zero=mask_zero),
                             keras.layers.Dense(V)])


def _tokens(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, V, (B, L)).astype("int32")
    x[:, 4:] *= rng.integers(0, 2, (B, 1)).astype("int32")  # some sequences padded with 0 after 4 tokens
    y = rng.integers(0, V, (B, L)).astype("int32")
    return x, y


def _private(model, clipping, loss, **compile_kwargs):
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=1e-9,
                                                  expected_batch_size=B, seed=0), loss=loss, **compile_kwargs)
    return private


def _check_one_step(model, twin, private, x, y, sample_weight, packed_y, reference_loss):
    start = weights_of(twin)
    sums, norms = reference_clipped_sum(twin, x, packed_y, np.ones(B, np.float32), CLIP, loss=reference_loss)
    assert np.max(norms) > CLIP  # the clipping is exercised
    private.train_on_batch(x, y, sample_weight=sample_weight)
    for got, w0, s in zip(weights_of(model), start, sums):
        np.testing.assert_allclose(got, w0 - LR * s / B, rtol=1e-4, atol=1e-6)


CASES = ["next_token", "per_token_weights", "ignore_class", "mask_zero"]


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
@pytest.mark.parametrize("case", CASES)
def test_a_per_token_loss_is_one_mean_per_sequence(case, clipping):
    x, y = _tokens()
    mask_zero = case == "mask_zero"
    model, twin = _lm(mask_zero), _lm(mask_zero)
    weight = np.ones((B, L), np.float32)
    mask = np.ones((B, L), np.float32)
    sample_weight = None
    kwargs = {}
    if case == "per_token_weights":
        weight = np.random.default_rng(3).uniform(0, 2, (B, L)).astype(np.float32)
        sample_weight = weight
    elif case == "ignore_class":
        y[:, 3:] *= np.random.default_rng(4).integers(0, 2, (B, 1)).astype("int32")  # label 0: padding
        mask = (y != 0).astype(np.float32)
        kwargs["ignore_class"] = 0
    elif mask_zero:
        mask = (x != 0).astype(np.float32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, **kwargs)
    private = _private(model, clipping, loss)
    packed = np.stack([y.astype(np.float32), weight, mask], axis=-1)
    _check_one_step(model, twin, private, x, y, sample_weight, packed, _packed_lm_loss)


def _autoencoder(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(3, 3, strides=2, padding="same",
                                                                         activation="tanh"),
                             keras.layers.Conv2DTranspose(1, 3, strides=2, padding="same")])


@pytest.mark.parametrize("clipping", ["auto", "vectorized"])
def test_a_per_pixel_mse_autoencoder_trains_as_the_loop(clipping):
    x = np.random.default_rng(0).normal(size=(B, 8, 8, 1)).astype(np.float32)
    model, twin = _autoencoder(), _autoencoder()
    private = _private(model, clipping, "mse")
    _check_one_step(model, twin, private, x, x, None, x,
                    lambda yi, pred: jnp.mean((pred - yi) ** 2, axis=(1, 2, 3)))


def test_per_token_metrics_and_evaluate_use_the_real_tokens():
    """Compiled metrics on per-token outputs; ``evaluate``'s loss is the mean over the sequences
    of each sequence's masked mean (computed here by numpy), its accuracy Keras's masked one."""
    x, y = _tokens(1)
    model = _lm(mask_zero=True)
    private = _private(model, "auto", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       metrics=["accuracy"], weighted_metrics=["accuracy"])
    logs = private.fit(x, y, batch_size=B, epochs=1, verbose=0).history
    assert np.isfinite(logs["loss"][0]) and 0 <= logs["accuracy"][0] <= 1
    result = private.evaluate(x, y, batch_size=B, verbose=0, return_dict=True)
    logits = np.asarray(model.predict(x, verbose=0), np.float64)
    ce = np.asarray(_token_ce(jnp.asarray(logits), jnp.asarray(y)), np.float64)
    mask = (x != 0).astype(np.float64)
    np.testing.assert_allclose(result["loss"], np.mean(np.sum(ce * mask, 1) / np.sum(mask, 1)), rtol=1e-5)
    right = (np.argmax(logits, -1) == y) * mask
    np.testing.assert_allclose(result["accuracy"], np.sum(right) / np.sum(mask), rtol=1e-5)


def _two_heads(structure, seed=0):
    keras.utils.set_random_seed(seed)
    a, b = keras.Input((4,), name="a"), keras.Input((3,), name="b")
    h = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()([a, b]))
    cls, reg = keras.layers.Dense(2, name="cls")(h), keras.layers.Dense(2, name="reg")(h)
    return keras.Model({"a": a, "b": b}, {"cls": cls, "reg": reg} if structure == "dict" else [cls, reg])


@pytest.mark.parametrize("structure", ["dict", "list"])
def test_two_named_outputs_with_one_built_in_loss(structure):
    """One built-in loss for two outputs: the per-example loss is the sum of the two MSEs."""
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(B, 4)).astype("float32"), "b": rng.normal(size=(B, 3)).astype("float32")}
    y = {"cls": rng.normal(size=(B, 2)).astype("float32"), "reg": 3 * rng.normal(size=(B, 2)).astype("float32")}
    model, twin = _two_heads(structure), _two_heads(structure)
    if structure == "list":
        y = [y["cls"], y["reg"]]
    private = _private(model, "auto", "mse", metrics=["mae"] * 2 if structure == "list" else {"cls": ["mae"]})
    packed = np.concatenate([y["cls"], y["reg"]] if structure == "dict" else y, axis=1)

    def loss(yi, pred):
        outs = [pred["cls"], pred["reg"]] if structure == "dict" else list(pred)
        return jnp.mean((outs[0] - yi[:, :2]) ** 2, -1) + jnp.mean((outs[1] - yi[:, 2:]) ** 2, -1)

    _check_one_step(model, twin, private, x, y, None, packed, loss)
    logs = private.evaluate(x, y, verbose=0, return_dict=True)
    assert not any(k.endswith("_loss") for k in logs)  # no per-output loss trackers that would log 0


def test_train_on_batch_with_class_weight_traces_the_step_once_per_table(monkeypatch):
    """Counted on the class's ``_dp_train_step`` (what the jitted step calls at trace time): a
    trace per table, none for a table seen before; each table's step applies its own table."""
    from keras_noisecurve.training.dp_model import PrivateModel

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    private = _private(model, "auto", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traces = []
    step = PrivateModel._dp_train_step

    def counting(self, state, data, table):
        traces.append(1)
        return step(self, state, data, table)

    monkeypatch.setattr(PrivateModel, "_dp_train_step", counting)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(B, 4)).astype("float32"), rng.integers(0, 3, B).astype("int32")
    first, second = {0: 1.0, 1: 2.0, 2: 0.5}, {0: 3.0}
    for _ in range(3):
        private.train_on_batch(x, y, class_weight=first)
    assert len(traces) == 1
    private.train_on_batch(x, y)  # no table: its own step
    private.train_on_batch(x, y, class_weight=second)
    assert len(traces) == 3
    for table in (first, second, None, first):
        private.train_on_batch(x, y, class_weight=table)
    assert len(traces) == 3  # every table seen before reuses its step
    # each step applies its own table (w_i = cw[y_i] before clipping): all-zero weights move nothing
    zero = {0: 0.0, 1: 0.0, 2: 0.0}
    for table, moves in ((zero, False), (None, True), (zero, False), (first, True), (None, True)):
        before = weights_of(model)
        private.train_on_batch(x, y, class_weight=table)
        change = max(np.max(np.abs(a - b)) for a, b in zip(weights_of(model), before))
        assert (change > 1e-3) == moves, (table, change)
    assert len(traces) == 4
