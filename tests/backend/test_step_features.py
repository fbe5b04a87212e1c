"""The training features of a traced private step written in Keras (``backend/common/step_features.py``,
JAX's), on the default backend against numpy: the non-finite count with padding rows, the counts
metric through a sequence of steps and resets, the refusal messages, and class weights for every
label layout."""

import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common import step_features as features


def _np(x):
    return keras.ops.convert_to_numpy(x)


def test_the_count_drops_only_real_examples_with_a_non_finite_loss_or_norm():
    losses = np.array([1.0, np.nan, 2.0, np.inf, np.nan, 0.5], "float32")
    norms = np.array([1.0, 1.0, np.inf, 1.0, 1.0, 1.0], "float32")
    weights = np.array([1.0, 2.0, 0.5, 1.0, 0.0, 0.0], "float32")  # the last two rows are padding
    mask = features.nonfinite_mask(losses, norms)
    np.testing.assert_array_equal(_np(mask), ~(np.isfinite(losses) & np.isfinite(norms)))
    dropped, real = features.count_dropped(mask, weights)
    assert (int(_np(dropped)), int(_np(real))) == (3, 4)
    assert str(_np(dropped).dtype) == str(_np(real).dtype) == "int32"


def test_the_metric_counts_an_epoch_a_fit_and_the_last_refused_step():
    metric = features.NonFiniteExamples()
    metric.update_state(0, 0, 0)
    metric.update_state(2, 1, 0)
    metric.update_state(1, 4, features.ALL_DROPPED)
    assert int(_np(metric.result())) == 3
    values = metric.values()
    assert values.dtype.kind == "i" and values.shape == (9,)
    # epoch, fit count, steps with drops, first, last, refused, refused step, why, its batch's step
    np.testing.assert_array_equal(values, [3, 3, 2, 1, 4, 1, 4, features.ALL_DROPPED, 4])
    metric.reset_state()  # a new epoch: only its count starts again
    np.testing.assert_array_equal(metric.values(), [0, 3, 2, 1, 4, 1, 4, features.ALL_DROPPED, 4])
    metric.update_state(0, 6, features.OUT_OF_STEP | features.ALL_DROPPED, batch_step=2)
    values = metric.values()
    np.testing.assert_array_equal(values[5:], [2, 6, 3, 2])
    assert features.refused_steps(values) == 2
    with pytest.raises(RuntimeError, match="refused step 6 .* holds rows of step 2 of the plan"):
        features.raise_if_refused(values, 1)
    assert features.raise_if_refused(values, 2) == 2  # nothing new since
    assert "refused step 4" in features.all_dropped_message(4, 1)
    metric.reset_fit()
    np.testing.assert_array_equal(metric.values(), np.zeros(9))


@pytest.mark.parametrize("layout", ["(P,)", "(P, 1)", "one-hot"])
def test_class_weights_give_each_example_its_class_weight_and_1_outside_the_table(layout):
    table = np.array([2.0, 0.5, 3.0], "float32")
    labels = np.array([0, 1, 2, 5, 1, -1])
    if layout == "(P,)":
        y = labels.astype("float32")
    elif layout == "(P, 1)":
        y = labels.reshape(-1, 1).astype("int32")
    else:
        y = np.eye(6, dtype="float32")[np.where(labels >= 0, labels, 4)]  # classes 5 and 4: outside the table
    want = np.array([2.0, 0.5, 3.0, 1.0, 0.5, 1.0], "float32")
    np.testing.assert_array_equal(_np(features.class_weights(table, y)), want)


def test_class_weights_refuse_several_outputs():
    with pytest.raises(ValueError, match="one output"):
        features.class_weights(np.ones(2, "float32"), [np.zeros(3), np.zeros(3)])
