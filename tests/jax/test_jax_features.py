"""The TensorFlow step's training features on the JAX private step: non-finite examples
dropped and counted, ``fit(class_weight=...)``, ``add_loss`` penalties, padding rows in
no metric. Each expectation is computed independently: the per-example ``jax.grad`` loop
of ``tests/jax/helpers.py`` (float64 numpy clipping), a hand-written gradient of the
penalty, numpy accuracy.

σ = 1e-9 makes the noise ~1e-9 (negligible against the tolerances), so one step is
w₁ = w₀ − η/B·(Σ clip(w_i g_i, ζ) + B·∇penalty). Tolerances as in test_jax_clipping.py.
"""

import warnings

import keras
import numpy as np
import pytest

from keras_noisecurve import NoiseCurveOptimizer, PrivateRun, make_private
from tests.jax.helpers import mlp, reference_clipped_sum, weights_of

RTOL, ATOL = 2e-5, 2e-6
CLIP, LR, BATCH = 0.5, 0.3, 12


def _data(n=12, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype("float32"), rng.normal(size=(n, 3)).astype("float32")


def _private(model):
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=1e-9,
                                                  expected_batch_size=BATCH, seed=0), loss="mse")
    return private


def _assert_sgd_step(before, after, sums, extra=None):
    for k, (w0, w1, s) in enumerate(zip(before, after, sums)):
        add = 0.0 if extra is None else extra[k]
        np.testing.assert_allclose(w1, w0 - LR / BATCH * (s + add), rtol=RTOL, atol=ATOL)


# ------------------------------------------------------------------ non-finite examples
def test_a_nan_row_is_dropped_and_counted_and_a_nan_padding_row_is_not_counted():
    model = mlp()
    x, y = _data()
    weights = np.ones(12, np.float32)
    weights[7] = 0.0  # a padding row
    x[2, 1] = np.nan  # a real example with a NaN feature: dropped, counted
    x[7, 0] = np.inf  # the padding row is not finite either: dropped, not counted
    keep = weights.copy()
    keep[2] = 0.0
    clean = np.where(np.isfinite(x), x, 0.0).astype("float32")
    ref_sums, _ = reference_clipped_sum(model, clean, y, keep, CLIP)  # the batch without rows 2 and 7
    before = weights_of(model)
    private = _private(model)
    logs = private.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    _assert_sgd_step(before, weights_of(model), ref_sums)
    assert int(logs["nonfinite_examples"]) == 1
    assert np.isfinite(logs["loss"])


def test_fit_logs_the_epoch_count_and_warns_once_naming_the_steps():
    model = mlp()
    x, y = _data(24)
    x[[3, 15]] = np.nan  # one per batch of 12
    private = _private(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = private.fit(x, y, batch_size=12, epochs=2, shuffle=False, verbose=0)
    assert [int(v) for v in history.history["nonfinite_examples"]] == [2, 2]
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
                and "epsilon is not tracked" not in str(w.message)]  # the low-level path's own warning
    assert len(messages) == 1
    assert "dropped 4 example(s)" in messages[0] and "4 steps (the first at step 0, the last at step 3)" in messages[0]
    assert all(np.isfinite(w).all() for w in weights_of(model))


def test_a_step_whose_every_real_example_is_non_finite_is_refused_and_applies_noise_only():
    model = mlp()
    x, y = _data(4)
    x[:] = np.nan
    private = _private(model)
    before = weights_of(model)
    with pytest.raises(RuntimeError, match="refused step 0 .*every real example"):
        private.train_on_batch(x, y)
    for w0, w1 in zip(before, weights_of(model)):  # σ = 1e-9: the noise only moves ~1e-10
        np.testing.assert_allclose(w1, w0, rtol=0, atol=1e-7)
    with pytest.raises(RuntimeError, match="refused step 1 .*every real example"):  # fit: at the epoch's end
        private.fit(x, y, batch_size=4, epochs=1, verbose=0)
    for w0, w1 in zip(before, weights_of(model)):
        np.testing.assert_allclose(w1, w0, rtol=0, atol=1e-7)


# ------------------------------------------------------------------------- class_weight
def test_fit_class_weight_equals_the_same_sample_weights():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(12, 6)).astype("float32")
    y = rng.integers(0, 3, size=(12,)).astype("int32")
    table = {0: 2.0, 2: 0.25}  # class 1 not named: weight 1
    sample_weight = np.array([table.get(int(c), 1.0) for c in y], np.float32)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trained = []
    for kwargs in ({"class_weight": table}, {"sample_weight": sample_weight}):
        model = mlp(seed=3)
        private = make_private(model)
        private.compile(optimizer=NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=0.5,
                                                      expected_batch_size=BATCH, seed=2), loss=loss)
        private.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0, **kwargs)
        trained.append(weights_of(model))
    start = weights_of(mlp(seed=3))
    for a, b, w0 in zip(*trained, start):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)
        assert not np.allclose(a, w0)
    with pytest.raises(ValueError, match="class_weight keys must be class indices"):
        private.fit(x, y, batch_size=12, class_weight={"a": 1.0}, verbose=0)


def test_class_weight_multiplies_the_run_s_padding_mask():
    n, steps = 16, 2
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = rng.integers(0, 3, size=(n,)).astype("int32")
    table = {0: 0.0, 1: 3.0}
    sample_weight = np.array([table.get(int(c), 1.0) for c in y], np.float32)
    trained = []
    for use_table in (True, False):
        run = PrivateRun(num_examples=n, batch_size=8, steps=steps, noise_multiplier=1.0, delta=1e-5, seed=9)
        private = make_private(mlp(seed=6))
        private.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.1, l2_norm_clip=CLIP, seed=1),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if use_table:
            private.fit(run.dataset(x, y), class_weight=table, verbose=0)
        else:
            private.fit(run.dataset(x, y, sample_weight=sample_weight), verbose=0)
        trained.append(weights_of(private.inner))
    for a, b in zip(*trained):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# ----------------------------------------------------------------------------- add_loss
class _WeightPenalty(keras.layers.Layer):
    """Dense(3) that adds c·Σ kernel² (weights only) with add_loss."""

    def __init__(self, c=0.01, **kwargs):
        super().__init__(**kwargs)
        self.c = c
        self.dense = keras.layers.Dense(3)

    def call(self, inputs):
        out = self.dense(inputs)
        self.add_loss(self.c * keras.ops.sum(self.dense.kernel ** 2))
        return out


class _ActivityPenalty(keras.layers.Layer):
    def __init__(self, c=0.01, **kwargs):
        super().__init__(**kwargs)
        self.c = c

    def call(self, inputs):
        self.add_loss(self.c * keras.ops.mean(inputs ** 2))
        return inputs


def _penalised(layer, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(4, activation="tanh"), layer,
                             keras.layers.Dense(3)])


def test_a_weight_penalty_is_added_like_a_regulariser():
    model = _penalised(_WeightPenalty(0.01))
    x, y = _data()
    ref_sums, _ = reference_clipped_sum(model, x, y, np.ones(12, np.float32), CLIP)
    before = weights_of(model)
    private = _private(model)
    private.train_on_batch(x, y)
    kernel = [id(v) for v in model.trainable_variables].index(id(model.layers[1].dense.kernel))
    extra = [0.0] * len(before)
    extra[kernel] = BATCH * 2 * 0.01 * before[kernel]  # B·∇(c·Σ w²)
    _assert_sgd_step(before, weights_of(model), ref_sums, extra)


def test_a_penalty_on_the_batch_is_refused_and_a_zero_times_it_is_ignored():
    x, y = _data()
    private = _private(_penalised(_ActivityPenalty(0.01)))
    with pytest.raises(ValueError, match="depends on the batch"):
        private.train_on_batch(x, y)
    model = _penalised(_ActivityPenalty(0.0))  # router_aux_loss_coef=0: 0·penalty adds nothing
    ref_sums, _ = reference_clipped_sum(model, x, y, np.ones(12, np.float32), CLIP)
    before = weights_of(model)
    _private(model).train_on_batch(x, y)
    _assert_sgd_step(before, weights_of(model), ref_sums)


# ------------------------------------------------------------------------------ metrics
def test_padding_rows_count_in_no_metric():
    rng = np.random.default_rng(7)
    x = rng.normal(size=(12, 6)).astype("float32")
    y = rng.integers(0, 3, size=(12,)).astype("int32")
    weights = np.ones(12, np.float32)
    weights[[1, 4, 5, 9]] = 0.0
    model = mlp(seed=8)
    pred = np.argmax(np.asarray(model(x)), axis=-1)  # before the step: the step's y_pred
    real = weights > 0
    want = np.mean(pred[real] == y[real])
    assert want != np.mean(pred == y)  # the padding rows would change it
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(learning_rate=LR, l2_norm_clip=CLIP, noise_multiplier=1e-9,
                                                  expected_batch_size=BATCH, seed=0),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"], weighted_metrics=["accuracy"])
    logs = private.train_on_batch(x, y, sample_weight=weights, return_dict=True)
    accuracies = [v for k, v in logs.items() if "accuracy" in k]
    assert len(accuracies) == 2
    for value in accuracies:
        assert value == pytest.approx(want, abs=1e-6)


def test_a_run_batch_of_another_step_is_refused_and_applies_noise_only(monkeypatch):
    """The rows of step t + 1 fed at the optimizer's step t (what one JAX process feeding
    another step's rows looks like inside the step): every step is refused, the weights move
    by the noise only, and fit raises naming both steps."""
    from keras_noisecurve.privacy import step_batches

    shifted = step_batches.StepBatches.__getitem__
    monkeypatch.setattr(step_batches.StepBatches, "__getitem__", lambda self, i: (*shifted(self, i)[:3],
                                                                                   shifted(self, i)[3] + 1))
    model = mlp()
    x, y = _data(24)
    run = PrivateRun(num_examples=24, batch_size=12, steps=2, noise_multiplier=1e-9, delta=1e-5, seed=0)
    private = make_private(model)
    private.compile(optimizer=NoiseCurveOptimizer(run=run, learning_rate=LR, l2_norm_clip=CLIP, seed=0), loss="mse")
    before = weights_of(model)
    with pytest.raises(RuntimeError, match=r"refused step 1 \(2 refused step\(s\).*rows of step 2 of the plan, not "
                                           r"of the optimizer's step 1.*out of step"):
        private.fit(run.dataset(x, y), verbose=0)
    for w0, w1 in zip(before, weights_of(model)):  # σ = 1e-9: the noise only moves ~1e-10
        np.testing.assert_allclose(w1, w0, rtol=0, atol=1e-7)
