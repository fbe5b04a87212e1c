"""make_private: model kinds, sample weights, metrics, refusals, save/load."""

import keras
import numpy as np
import pytest

from tests.training.helpers import noiseless
from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.training import NoiseCurveOptimizer, PrivateModel, make_private

B = 8


def _opt(**over):
    kw = dict(learning_rate=0.2, l2_norm_clip=1.0, noise_multiplier=1.0, expected_batch_size=B, seed=0)
    kw.update(over)
    return noiseless(NoiseCurveOptimizer(**kw)) if "noise_multiplier" not in over else NoiseCurveOptimizer(**kw)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    return x, y


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(4, activation="relu")
        self.d2 = keras.layers.Dense(2)

    def call(self, x):
        return self.d2(self.d1(x))


def _sequential():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])


def _functional_dp():
    inp = keras.Input((4,))
    out = keras.layers.Dense(2)(keras.layers.Dense(4, activation="relu")(inp))
    return make_private(keras.Model(inp, out), clipping="vectorized")


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_fit_without_noise_matches_clipped_mean_gd(kind, data):
    """σ = 0: one step equals w − η·Σ clip(g_i)/B (checked against the engine-free loop)."""
    x, y = data
    keras.utils.set_random_seed(3)
    if kind == "sequential":
        model = make_private(_sequential(), clipping="vectorized")
    elif kind == "functional":
        model = _functional_dp()
    else:
        model = make_private(Subclassed(), clipping="vectorized")
        model(x[:1])
    import tensorflow as tf

    w0 = [v.numpy() for v in model.trainable_variables]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    total = [np.zeros_like(w) for w in w0]
    for i in range(B):
        with tf.GradientTape() as tape:
            li = loss(y[i : i + 1], model(x[i : i + 1]))
        g = [t.numpy() for t in tape.gradient(li, model.trainable_variables)]
        n = np.sqrt(sum(np.sum(a**2) for a in g))
        total = [s + a * min(1.0, 1.0 / n) for s, a in zip(total, g)]
    model.compile(optimizer=_opt(), loss=loss, metrics=["accuracy"])
    hist = model.fit(x[:B], y[:B], batch_size=B, epochs=1, verbose=0)
    for v, w, s in zip(model.trainable_variables, w0, total):
        np.testing.assert_allclose(v.numpy(), w - 0.2 * s / B, rtol=1e-5, atol=1e-6)
    assert set(hist.history) == {"loss", "accuracy", "nonfinite_examples"}  # the count of dropped examples
    assert model.evaluate(x, y, verbose=0)[0] > 0
    assert model.predict(x, verbose=0).shape == (16, 2)


def test_sample_weight_is_a_mask_and_loss_is_masked_mean(data):
    x, y = data
    keras.utils.set_random_seed(4)
    base = _sequential()
    model = make_private(base, clipping="vectorized")
    model.compile(optimizer=_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    mask = np.array([1, 0, 1, 1, 0, 1, 1, 0], np.float32)
    w0 = base.get_weights()
    expected_loss = float(
        np.sum(mask * keras.losses.sparse_categorical_crossentropy(y[:B], base(x[:B]), from_logits=True).numpy())
        / mask.sum()
    )
    logs = model.train_on_batch(x[:B], y[:B], sample_weight=mask, return_dict=True)
    assert logs["loss"] == pytest.approx(expected_loss, rel=1e-5)
    after_mask = base.get_weights()
    # same step with only the unmasked rows
    base.set_weights(w0)
    model2 = make_private(base, clipping="vectorized")
    model2.compile(optimizer=_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keep = mask > 0
    model2.train_on_batch(x[:B][keep], y[:B][keep])
    for a, b in zip(after_mask, base.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_metrics_ignore_padding_rows(data):
    """Unweighted `metrics=[...]` count only rows with weight > 0 (padding of the sampler)."""
    x, y = data
    keras.utils.set_random_seed(5)
    base = _sequential()
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=_opt(learning_rate=1e-9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    pred = np.argmax(base(x[:B]).numpy(), axis=1)
    # Real rows: all correctly labelled; padding rows (weight 0): all wrong.
    labels = pred.copy()
    mask = np.array([1, 0, 1, 1, 0, 1, 1, 0], np.float32)
    labels[mask == 0] = 1 - pred[mask == 0]
    logs = model.train_on_batch(x[:B], labels, sample_weight=mask, return_dict=True)
    assert logs["accuracy"] == pytest.approx(1.0)


def test_refusals():
    model = make_private(_sequential(), clipping="vectorized")
    with pytest.raises(ValueError, match="compiled with a keras_noisecurve.NoiseCurveOptimizer"):
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="compiled with a keras_noisecurve.NoiseCurveOptimizer"):
        model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    bn = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="BatchNormalization.*mixes"):
        make_private(bn)
    bn.layers[0].trainable = False  # inference mode: no mixing
    make_private(bn)
    act = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activity_regularizer="l2")])
    with pytest.raises(ValueError, match="activity_regularizer"):
        make_private(act)
    with pytest.raises(ValueError, match="clipping must be one of"):
        make_private(_sequential(), clipping="exact")
    with pytest.raises(ValueError, match="microbatch_size must be >= 1"):
        make_private(_sequential(), microbatch_size=0)
    with pytest.raises(ValueError, match="single loss"):
        model.compile(optimizer=_opt(), loss=["mse", "mse"])


def test_fit_past_plan_fails_with_clear_message(data):
    x, y = data
    model = make_private(_sequential(), clipping="vectorized")
    opt = NoiseCurveOptimizer(learning_rate=0.1, mixing=MixingMatrix.identity(3), l2_norm_clip=1.0,
                              noise_multiplier=1.0, expected_batch_size=B, seed=1)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(Exception, match="privacy plan is spent"):
        model.fit(x, y, batch_size=B, epochs=2, verbose=0)  # 4 steps > T = 3
    assert int(opt.iterations.numpy()) == 3


@pytest.mark.parametrize("factory", ["make_private", "functional"])
def test_save_and_load_keras_file(tmp_path, data, factory):
    x, y = data
    keras.utils.set_random_seed(5)
    model = make_private(_sequential(), clipping="vectorized") if factory == "make_private" else _functional_dp()
    c = MixingMatrix.from_dense(np.array([[0.8, 0, 0], [0.6, 0.8, 0], [0, 0.6, 1.0]]), metadata={"objective": "t"})
    model.compile(
        optimizer=NoiseCurveOptimizer(learning_rate=0.1, mixing=c, l2_norm_clip=1.0, noise_multiplier=1.0,
                                      expected_batch_size=B),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x[:B], y[:B], batch_size=B, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded) is type(model)
    assert isinstance(loaded.optimizer, NoiseCurveOptimizer) and loaded.optimizer.mixing == c
    assert loaded.clipping == "vectorized"
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables) == 4 + 4  # iter, lr, key, plan, 4 rings
    for a, b in zip(loaded.optimizer.variables, model.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # iterations, secret key, plan words, ring buffers
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    if factory == "make_private":
        assert isinstance(loaded, PrivateModel)


def test_unbuilt_subclassed_model_builds_on_first_step(data):
    x, y = data
    model = make_private(Subclassed(), clipping="vectorized")
    model.compile(optimizer=_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x[:B], y[:B], batch_size=B, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert len(model.trainable_variables) == 4


@pytest.mark.filterwarnings("ignore:the mixing matrix")  # C is for SGD, the inner optimizer Adam
@pytest.mark.parametrize("built", [True, False])
def test_fit_traces_the_private_step_once_where_the_model_is_built(built, data):
    # A tf.function whose first trace creates variables (here the optimizer's noise key, its
    # banded noise state and Adam's slots) is traced a second time: a built model's optimizer
    # is built before fit traces the step. An unbuilt one is built by that trace (twice).
    x, y = data
    c = MixingMatrix.from_dense(np.array([[0.8, 0, 0], [0.6, 0.8, 0], [0, 0.6, 1.0]]), metadata={"objective": "t"})
    model = make_private(_sequential() if built else Subclassed())
    model.compile(optimizer=_opt(mixing=c, learning_rate=None, inner=keras.optimizers.Adam(0.01)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    traces = []
    step = model.train_step
    model.train_step = lambda data: traces.append(1) or step(data)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert len(traces) == (1 if built else 2)
    assert int(model.optimizer.iterations.numpy()) == 2
    names = sorted(v.path for v in model.optimizer.variables)
    assert any("noise_key" in n for n in names) and sum("adam" in n for n in names) >= 4, names


@pytest.mark.parametrize("clipping", ["ghost", "vectorized"])
def test_a_model_trained_privately_is_freed_once_the_user_drops_it(clipping, data):
    # A cache that held the model strongly (the ghost engine's per-model probe once did,
    # through its chains of enclosing layers) kept every model, its variables and its
    # traced steps alive for the life of the process.
    import gc
    import weakref

    x, y = data
    model = _sequential()
    private = make_private(model, clipping=clipping)
    private.compile(optimizer=_opt(), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    private.fit(x, y, batch_size=B, epochs=1, verbose=0)
    refs = [weakref.ref(model), weakref.ref(private)]
    del model, private
    gc.collect()
    assert [r() for r in refs] == [None, None]
