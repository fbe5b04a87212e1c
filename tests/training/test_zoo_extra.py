"""KerasHub models whose layers return tensors they also used (T5) or see rows that are
not examples (ViT, DeBERTa-v3, Mixtral): the default engine against an independent
per-example float64 loop, ``describe``/``supports`` before compile, and a private ``fit``.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_noisecurve as knc
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.backend.tensorflow.clipping import get_engine
from keras_noisecurve.backend.tensorflow.ghost import describe, supports
from tests.training import zoo, zoo_extra
from tests.training.helpers import loop_reference, set_precision

pytest.importorskip("keras_hub")

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


def _compare(case):
    model, loss_fn = case.model, per_example_loss_fn(case.loss)
    engine = get_engine("auto", model)
    rng = np.random.default_rng(4)
    w = rng.uniform(0.5, 2.0, size=zoo.P)
    w[1] = 0.0
    norms, _ = loop_reference(model, loss_fn, case.x, case.y, w, np.inf)
    clip = float(np.median(norms[norms > 0]))
    norms_ref, sum_ref = loop_reference(model, loss_fn, case.x, case.y, w, clip)
    step = tf.function(lambda x, y, w: engine(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False))
    got = step(case.x, case.y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-12)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)


@pytest.mark.parametrize("name", sorted(zoo_extra.EXTRA))
def test_clipped_sum_equals_a_per_example_float64_loop(name):
    _compare(zoo_extra.EXTRA[name](np.random.default_rng(1), dtype="float64"))


def test_t5_relative_bias_under_a_float64_policy():
    # the relative-attention bias is returned as position_bias AND used inside its layer;
    # a float64 policy once crashed the per-layer fallback (int64/int32 aranges)
    old = keras.config.floatx()
    set_precision("float64")
    try:
        _compare(zoo_extra.t5_seq2seq(np.random.default_rng(2)))
    finally:
        set_precision(old)


def test_rows_that_are_not_examples_are_clipped_through_their_caller_before_compile():
    # known before any step: the layers on a broadcast row / token rows are covered by the
    # layer that calls them (ViT's patching layer, DeBERTa's relative embedding, the MoE block)
    expected = {"vit": "ViTPatchingAndEmbedding", "deberta-v3": "RelativeEmbedding", "mixtral": "MixtralSparseMoeBlock"}
    for name, caller in expected.items():
        case = zoo_extra.EXTRA[name](np.random.default_rng(0))
        assert supports(case.model) == (True, "")
        how = describe(case.model)
        assert (caller, "generic") in {(cls, kind) for _, cls, kind in how}, how
        private = knc.make_private(case.model)
        assert supports(private) == (True, "")
    names = {layer for layer, _, _ in describe(zoo_extra.vit_classifier(np.random.default_rng(0)).model)}
    assert "position_embedding" not in names  # covered by its caller, not planned alone


@pytest.mark.parametrize("name", ["vit", "mixtral"])
def test_fit_through_a_private_run(name):
    case = zoo_extra.EXTRA[name](np.random.default_rng(2))
    run = knc.PrivateRun(num_examples=zoo.P, batch_size=4, steps=2, noise_multiplier=1.0, delta=1e-5,
                         sampling="fixed_epochs", seed=3)
    private = knc.make_private(case.model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.05, l2_norm_clip=1.0), loss=case.loss)
    before = [v.numpy().copy() for v in case.model.trainable_variables]
    history = private.fit(run.dataset(case.x, case.y), verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, case.model.trainable_variables))
