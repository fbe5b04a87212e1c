"""The recurrent kernel (keras_noisecurve.backend.common.ghost_rnn) inside the JAX ghost engine, against
the INDEPENDENT per-example loop of tests/jax/helpers.reference_clipped_sum (one ``jax.grad`` of the
model's ``stateless_call`` per example, clipping in float64 numpy).

Every test also records which layers went through the engine's per-layer fallback (by wrapping
``ghost._fallback``): a ruled recurrent layer must not; an unruled configuration (unroll, a
subclassed cell, dropout) must, and stay exact.

Tolerance: float32 (the engine's norms are float32 by design). The kernel's forward runs the recurrence
and the kernel sums outer products over ≤ 12 steps in another order than the loop's backward pass: norms rtol
1e-4, sums atol 1e-4 × the largest reference entry. A wrong gate order, a missing recurrent term,
a mask applied to the wrong step or a reversed sequence changes them by far more than 1e-2.
"""

import functools

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest

from keras_noisecurve.backend.common import ghost_rnn
from keras_noisecurve.backend.jax import ghost
from keras_noisecurve.backend.jax.ghost import ghost_clipped_sum
from tests.jax.helpers import mse_per_example, reference_clipped_sum


@pytest.fixture
def fallbacks(monkeypatch):
    """The names of the layers the engine sent to its per-layer fallback (while tracing)."""
    seen = []
    original = ghost._fallback

    def recording(model, layer, *args, **kwargs):
        seen.append(layer.name)
        return original(model, layer, *args, **kwargs)

    monkeypatch.setattr(ghost, "_fallback", recording)
    return seen


@pytest.fixture
def ruled(monkeypatch):
    """The names of the layers the recurrent kernel accepted (while tracing)."""
    seen = []
    original = ghost_rnn.recurrent

    @functools.wraps(original)  # its reason and forward too: the engine runs the forward of this kernel
    def recording(layer, calls):
        result = original(layer, calls)
        if result is not None:
            seen.append(layer.name)
        return result

    from keras_noisecurve.backend.common import kernel_rules
    monkeypatch.setattr(kernel_rules, "RULES", tuple((kind, recording if r is original else r)
                                                    for kind, r in kernel_rules.RULES))
    return seen


def _vectorized(*args, **kwargs):
    from keras_noisecurve.backend.jax.clipping import clipped_sum
    return clipped_sum(*args, **kwargs)


def _compare(model, x, y, rtol=1e-4):
    weights = np.ones(len(y), np.float32)
    weights[1], weights[2] = 0.0, 0.5  # a padding row and a sample weight
    _, free = reference_clipped_sum(model, x, y, weights, 1e9)
    clip = float(np.median(free[free > 0]))  # both regimes: some examples clipped, some not
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    step = jax.jit(lambda tv, ntv, x, y, w: ghost_clipped_sum(
        model, mse_per_example, tv, ntv, x, y, w, l2_norm_clip=clip, clipping="ghost", vectorized=_vectorized)[:2])
    sums, norms = step(trainable, non_trainable, x, y, jnp.asarray(weights))
    ref_sums, ref_norms = reference_clipped_sum(model, x, y, weights, clip)
    np.testing.assert_allclose(np.asarray(norms), ref_norms, rtol=rtol, atol=1e-6)
    scale = max(np.max(np.abs(r)) for r in ref_sums)
    for s, r, v in zip(sums, ref_sums, model.trainable_variables):
        assert s.shape == v.shape and s.dtype == v.dtype
        np.testing.assert_allclose(np.asarray(s), r, rtol=rtol, atol=rtol * scale, err_msg=v.path)
    assert np.sum(ref_norms > clip) >= 1 and np.sum((ref_norms < clip) & (ref_norms > 0)) >= 1


def _branches(inputs, branches):
    """Every branch (a list of layers applied in turn) on ``inputs``, flattened and concatenated:
    every output of every branch reaches the loss (masked steps' outputs too)."""
    outs = []
    for branch in branches:
        h = inputs
        for layer in branch:
            h = layer(h)
        outs.append(keras.layers.Flatten()(h) if len(h.shape) == 3 else h)
    return outs[0] if len(outs) == 1 else keras.layers.Concatenate()(outs)


def _sequence_model(*branches, steps=6, features=3, outputs=2, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((steps, features))
    return keras.Model(inputs, keras.layers.Dense(outputs)(_branches(inputs, branches)))


def _data(model, n=7, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *model.input_shape[1:])).astype("float32")
    y = rng.normal(size=(n, model.output_shape[-1])).astype("float32")
    return x, y


#: parallel branches of one model per case (one compilation per case): (branches, ruled layers)
LAYERS = {
    "lstm": lambda: ([[keras.layers.LSTM(4)], [keras.layers.LSTM(3, return_sequences=True, go_backwards=True)],
                      [keras.layers.LSTM(4, use_bias=False, implementation=1)],
                      [keras.layers.RNN(keras.layers.LSTMCell(3), return_sequences=True)]], 4),
    "gru": lambda: ([[keras.layers.GRU(4, return_sequences=True)],
                     [keras.layers.GRU(4, reset_after=False, go_backwards=True)],
                     [keras.layers.GRU(3, use_bias=False, activation="relu")],
                     [keras.layers.GRU(3, reset_after=False, return_sequences=True, go_backwards=True)]], 4),
    "simple-rnn": lambda: ([[keras.layers.SimpleRNN(5)],
                            [keras.layers.SimpleRNN(3, return_sequences=True, go_backwards=True, use_bias=False)]], 2),
    "bidirectional": lambda: ([[keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))],
                               [keras.layers.Bidirectional(keras.layers.GRU(3), merge_mode="sum")]], 4),
}


@pytest.mark.parametrize("case", sorted(LAYERS))
def test_recurrent_rule_equals_the_per_example_loop(case, fallbacks, ruled):
    branches, count = LAYERS[case]()
    model = _sequence_model(*branches, seed=1)
    _compare(model, *_data(model, seed=1))
    assert fallbacks == []
    assert len(ruled) == count


def _masked_model(*branches, vocabulary=6, steps=7, outputs=2, seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((steps,), dtype="int32")
    h = keras.layers.Embedding(vocabulary, 3, mask_zero=True)(inputs)
    return keras.Model(inputs, keras.layers.Dense(outputs)(_branches(h, branches)))


def _ids(n=7, steps=7, seed=0):
    """Token ids with 0 (masked) at the end of some rows, in the middle and at the start of others."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 6, size=(n, steps)).astype("int32")
    ids[0, 4:] = 0
    ids[3, 2] = 0
    ids[4, :2] = 0
    ids[5, 1:6] = 0
    return ids


MASKED = {
    "lstm-gru": lambda: ([[keras.layers.LSTM(4)], [keras.layers.LSTM(3, return_sequences=True, go_backwards=True)],
                          [keras.layers.GRU(3, return_sequences=True)],
                          [keras.layers.GRU(4, reset_after=False, go_backwards=True)]], 4),
    "simple-zero-output-stacked": lambda: ([
        [keras.layers.SimpleRNN(4, return_sequences=True, zero_output_for_mask=True)],
        [keras.layers.SimpleRNN(3, zero_output_for_mask=True)],
        [keras.layers.LSTM(3, return_sequences=True), keras.layers.GRU(3, return_sequences=True)]], 4),
    "bidirectional": lambda: ([[keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True))],
                               [keras.layers.Bidirectional(keras.layers.GRU(3, reset_after=False),
                                                           merge_mode="ave")]], 4),
}


@pytest.mark.filterwarnings("ignore:Layer 'flatten.*does not support masking:UserWarning")  # on purpose
@pytest.mark.parametrize("case", sorted(MASKED))
def test_recurrent_rule_with_a_mask_equals_the_per_example_loop(case, fallbacks, ruled):
    branches, count = MASKED[case]()
    model = _masked_model(*branches, seed=2)
    x = _ids(seed=2)
    y = np.random.default_rng(3).normal(size=(len(x), 2)).astype("float32")
    _compare(model, x, y)
    assert fallbacks == []
    assert len(ruled) == count


def test_initial_state_from_another_input_and_a_shared_recurrent_layer(fallbacks, ruled):
    """An LSTM started from a state computed by a Dense of a second input (the gradient at that state
    reaches the Dense through the engine), and one GRU applied to two sequences (its per-example
    gradient is the sum over both calls)."""
    keras.utils.set_random_seed(4)
    seq = keras.Input((5, 3))
    other = keras.Input((5, 3))
    context = keras.Input((2,))
    h0 = keras.layers.Dense(4, activation="tanh")(context)
    c0 = keras.layers.Dense(4)(context)
    a = keras.layers.LSTM(4)(seq, initial_state=[h0, c0])
    shared = keras.layers.GRU(3)
    merged = keras.layers.Concatenate()([a, shared(seq), shared(other)])
    model = keras.Model([seq, other, context], keras.layers.Dense(2)(merged))
    rng = np.random.default_rng(4)
    x = [rng.normal(size=(7, 5, 3)).astype("float32"), rng.normal(size=(7, 5, 3)).astype("float32"),
         rng.normal(size=(7, 2)).astype("float32")]
    y = rng.normal(size=(7, 2)).astype("float32")
    _compare(model, x, y)
    assert fallbacks == []
    assert len(ruled) == 2


def test_mixed_bfloat16_norms_and_sums(fallbacks, ruled):
    """bfloat16 compute with float32 variables: the rule recomputes the recurrence in float32 from
    the recorded bfloat16 input and gradient. Both sides round the forward pass to bfloat16 in
    different orders: rtol 3e-2 (a wrong rule is off by > 0.1)."""
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = _sequence_model([keras.layers.LSTM(4, return_sequences=True), keras.layers.GRU(3)], seed=7)
        assert model.layers[1].compute_dtype == "bfloat16"
        _compare(model, *_data(model, seed=7), rtol=3e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert fallbacks == [] and len(ruled) == 2


class _PeepCell(keras.layers.SimpleRNNCell):
    """A subclassed cell (the rule takes exact Keras cells only)."""


def test_unruled_recurrent_configurations_take_the_fallback_and_stay_exact(fallbacks, ruled):
    """A subclassed cell takes the fallback; unroll=True and return_state=True (refused before the
    kernel ran its own forward) are taken."""
    keras.utils.set_random_seed(5)
    inputs = keras.Input((4, 3))
    unrolled = keras.layers.LSTM(3, return_sequences=True, unroll=True, name="unrolled")(inputs)
    custom = keras.layers.RNN(_PeepCell(3), return_sequences=True, name="custom_cell")(unrolled)
    with_state, state = keras.layers.GRU(3, return_state=True, name="with_state")(custom)
    ruled_gru = keras.layers.GRU(2, name="ruled")(custom)
    merged = keras.layers.Concatenate()([with_state, state, ruled_gru])
    model = keras.Model(inputs, keras.layers.Dense(2)(merged))
    _compare(model, *_data(model, seed=5))
    assert fallbacks == ["custom_cell"]
    assert ruled == ["unrolled", "with_state", "ruled"]


def test_the_kernel_declines_what_it_does_not_handle():
    """Direct checks of the refusals (no engine): a reason for each, so the engine falls back; and
    calls without what the kernel's forward saves (g at the output, not at m) give None."""
    keras.utils.set_random_seed(6)
    x = np.zeros((2, 3, 2), "float32")
    for layer, reason in ((keras.layers.LSTM(2, dropout=0.5), "dropout"),
                          (keras.layers.GRU(2, recurrent_dropout=0.2), "recurrent_dropout"),
                          (keras.layers.GRU(2, stateful=True), "stateful"),
                          (keras.layers.RNN(_PeepCell(2)), "_PeepCell"),
                          (keras.layers.RNN(keras.layers.StackedRNNCells([keras.layers.GRUCell(2), keras.layers.GRUCell(2)])),
                           "StackedRNNCells")):
        layer(x)
        assert reason in ghost_rnn.recurrent.reason(layer), layer.name
    layer = keras.layers.LSTM(2, unroll=True, return_state=True)
    out = layer(x)
    assert ghost_rnn.recurrent.reason(layer) is None
    call = {"a": jnp.asarray(x), "g": jnp.zeros_like(out[0]), "args": ((jnp.asarray(x),), {})}
    assert ghost_rnn.recurrent(layer, [call]) is None


def test_a_private_step_with_a_non_finite_example_equals_the_vectorized_engine(fallbacks, ruled):
    """``make_private(clipping="ghost")`` takes one step on an LSTM → GRU model whose update equals the
    exact vectorized engine's (``jax.vmap`` of the whole model's gradient); one example's input is
    NaN, so the rule's sums run with that example's rows zeroed (it contributes 0 on both engines)."""
    from keras_noisecurve import NoiseCurveOptimizer, make_private

    rng = np.random.default_rng(10)
    x = rng.normal(size=(8, 5, 3)).astype("float32")
    x[3, 2, 1] = np.nan
    y = rng.normal(size=(8, 2)).astype("float32")
    updates = {}
    for clipping in ("ghost", "vectorized"):
        keras.utils.set_random_seed(10)  # before the layers are made: the same initial weights twice
        model = _sequence_model([keras.layers.LSTM(4, return_sequences=True), keras.layers.GRU(3)], steps=5, seed=10)
        before = [np.asarray(v.value, np.float64) for v in model.trainable_variables]
        private = make_private(model, clipping=clipping)
        private.compile(optimizer=NoiseCurveOptimizer(learning_rate=1.0, l2_norm_clip=0.05, noise_multiplier=1e-9,
                                                      expected_batch_size=8, seed=0), loss="mse")
        private.train_on_batch(x, y)
        updates[clipping] = [np.asarray(v.value, np.float64) - b for v, b in zip(model.trainable_variables, before)]
    scale = max(np.max(np.abs(u)) for u in updates["vectorized"])
    assert scale > 1e-4 and all(np.all(np.isfinite(u)) for u in updates["ghost"])
    for a, b in zip(updates["ghost"], updates["vectorized"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * scale)
    assert fallbacks == [] and len(ruled) == 2


def test_a_function_rule_of_one_s_own_leaves_the_kernels_forward_in_place(fallbacks, ruled, monkeypatch):
    """A plain function rule registered before the built-in kernels (asked with the gradient at the
    layer's output) does not turn the recurrent kernel's forward off: the LSTM is still taken by the
    kernel, and the function saw the layer's output gradient, not the one at the projections."""
    from keras_noisecurve.backend.common import kernel_rules

    seen = []

    def looks(layer, calls):
        if isinstance(layer, keras.layers.LSTM):
            seen.append((calls[0]["g"].shape, calls[0]["saved"]))
        return None

    monkeypatch.setattr(kernel_rules, "_REGISTERED", [])
    kernel_rules.register_rule(looks)
    model = _sequence_model([keras.layers.LSTM(4)], seed=8)
    _compare(model, *_data(model, seed=8))
    assert fallbacks == [] and len(ruled) == 1
    assert seen and all(shape == (7, 4) and saved is None for shape, saved in seen)


def test_layers_given_their_inputs_by_keyword_stay_exact(fallbacks, ruled):
    """``layer(sequences=x)`` / ``layer(inputs=x)``: the engine records the call as it is (no forward,
    no first positional argument for a kernel), so both layers take the fallback, exactly."""
    keras.utils.set_random_seed(9)
    inputs = keras.Input((5, 3))
    h = keras.layers.LayerNormalization(name="norm")(inputs=inputs)
    h = keras.layers.LSTM(4, name="lstm")(sequences=h)
    model = keras.Model(inputs, keras.layers.Dense(2)(h))
    _compare(model, *_data(model, seed=9))
    assert sorted(fallbacks) == ["lstm", "norm"] and ruled == []
