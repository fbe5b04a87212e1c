"""Private training of models the library did not write (``tests/training/zoo.py``).

For every model of the zoo — KerasHub BERT, GPT-2, Llama and Gemma (with and without
LoRA), LSTM and GRU classifiers, a GroupNorm ResNet, an embedding-heavy recommender,
attention next to a custom layer with its own weights — the default engine
(``clipping="auto"``) is compared in float64 against an independent loop over single
examples with ``tf.GradientTape`` (norms and clipped sum within 1e-5 relative), traced
as ``fit`` traces it. A short float32 ``fit`` through ``PrivateRun`` and a save/load
round trip follow for each. CI runs this file with oneDNN on and off.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import keras

import keras_noisecurve as knc
from keras_noisecurve._losses import per_example_loss_fn
from keras_noisecurve.backend.tensorflow.clipping import get_engine
from keras_noisecurve.backend.tensorflow.ghost import describe
from tests.training import zoo
from tests.training.helpers import loop_reference

pytest.importorskip("keras_hub")

RTOL = 1e-5


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(0)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_clipped_sum_equals_a_per_example_float64_loop(name):
    rng = np.random.default_rng(1)
    case = zoo.ZOO[name](rng, dtype="float64")
    model, loss_fn = case.model, per_example_loss_fn(case.loss)
    engine = get_engine("auto", model)
    w = rng.uniform(0.5, 2.0, size=zoo.P)
    w[1] = 0.0  # a padded example
    norms, _ = loop_reference(model, loss_fn, case.x, case.y, w, np.inf)
    clip = float(np.median(norms[norms > 0]))
    norms_ref, sum_ref = loop_reference(model, loss_fn, case.x, case.y, w, clip)
    step = tf.function(lambda x, y, w: engine(model, loss_fn, x, y, w, l2_norm_clip=clip, training=False))
    got = step(case.x, case.y, w)
    np.testing.assert_allclose(got.norms.numpy(), norms_ref, rtol=RTOL, atol=1e-12)
    scale = max(np.max(np.abs(g)) for g in sum_ref)
    for v, g, r in zip(model.trainable_variables, got.grads, sum_ref):
        np.testing.assert_allclose(np.asarray(g), r, rtol=RTOL, atol=RTOL * scale, err_msg=v.path)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_fit_through_a_private_run_and_save_load(name, tmp_path):
    rng = np.random.default_rng(2)
    case = zoo.ZOO[name](rng)
    n, batch = zoo.P, 4
    run = knc.PrivateRun(num_examples=n, batch_size=batch, steps=2, noise_multiplier=1.0, delta=1e-5,
                         sampling="fixed_epochs", seed=3)
    private = knc.make_private(case.model)
    private.compile(optimizer=knc.NoiseCurveOptimizer(run=run, learning_rate=0.05, l2_norm_clip=1.0),
                    loss=case.loss)
    before = [v.numpy().copy() for v in case.model.trainable_variables]
    history = private.fit(run.dataset(case.x, case.y), verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert int(private.optimizer.iterations.numpy()) == 2
    assert any(not np.array_equal(b, v.numpy()) for b, v in zip(before, case.model.trainable_variables))
    path = tmp_path / f"{name}.keras"
    private.save(path)
    loaded = keras.models.load_model(path)
    if "lora" not in name:  # (Keras saves a LoRA layer's kernel merged with its factors)
        assert len(loaded.weights) == len(private.weights)
        for a, b in zip(private.weights, loaded.weights):
            np.testing.assert_array_equal(b.numpy(), a.numpy(), err_msg=a.path)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(loaded(case.x)), keras.ops.convert_to_numpy(private(case.x)), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("name", ["bert", "bert-lora", "gpt2-lm", "gpt2-lm-lora", "llama-lm", "llama-lm-lora", "gemma-lm",
                                  "gemma-lm-lora"])
def test_kerashub_layers_have_fast_rules(name):
    # every weighted layer of these backbones (LoRA factors too) has a ghost rule: no per-layer fallback
    case = zoo.ZOO[name](np.random.default_rng(0))
    assert [(layer, cls) for layer, cls, how in describe(case.model) if how == "generic"] == []


def test_describe_names_how_each_layer_is_clipped():
    case = zoo.attention_with_custom_layer(np.random.default_rng(0))
    how = {cls: kind for _, cls, kind in describe(case.model)}
    assert how["Gate"] == "generic" and how["EinsumDense"] == "EinsumDense" and how["Dense"] == "Dense"
