"""keras_noisecurve._compat: every private name of Keras, TensorFlow and dp-accounting the
library uses, pinned against the installed versions. Each test checks what the function
returns against a public way to get the same thing (or a closed form), so a release that
renames, removes or changes the meaning of a private name fails here, by name."""

from __future__ import annotations

import ast
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve import _compat

ROOT = Path(__file__).resolve().parents[1]


def _model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.5), name="hidden")(inputs)
    block = keras.Sequential([keras.layers.Dense(2, name="inner")], name="block")
    outputs = block(hidden)
    return keras.Model(inputs, outputs, name="m")


def _sgd_on(variables, **kwargs):
    optimizer = keras.optimizers.SGD(**kwargs)
    optimizer.build(variables)
    return optimizer


# ------------------------------------------------------------------ layers and models
def test_flatten_layers_is_the_layer_tree():
    model = _model()
    layers = _compat.flatten_layers(model)
    names = [layer.name for layer in layers if not isinstance(layer, keras.layers.InputLayer)]
    assert names == ["m", "hidden", "block", "inner"]  # depth first, the model itself first
    assert [layer.name for layer in _compat.flatten_layers(model, include_self=False, recursive=False)] == [
        layer.name for layer in model.layers
    ]
    # recursive: the nested Sequential's layer is reached, not only the model's own layers
    assert "inner" in names and "inner" not in [layer.name for layer in model.layers]


def test_own_trainable_variables_are_the_layer_s_weights_not_its_sublayers():
    dense = keras.layers.Dense(2)
    dense.build((None, 3))
    assert [v.path for v in _compat.own_trainable_variables(dense)] == [v.path for v in dense.trainable_weights]
    block = keras.Sequential([keras.layers.Dense(2)])
    block.build((None, 3))
    assert list(_compat.own_trainable_variables(block)) == [] and len(block.trainable_weights) == 2


def test_unautocast_variable_is_the_tf_variable_even_under_a_mixed_policy():
    import tensorflow as tf

    layer = keras.layers.Dense(2, dtype="mixed_bfloat16")
    layer.build((None, 3))
    raw = _compat.unautocast_variable(layer.kernel)
    assert isinstance(raw, tf.Variable) and raw.dtype == tf.float32
    seen = []

    class Probe(keras.layers.Layer):
        def call(self, x):  # inside the call the Keras variable autocasts to bfloat16
            seen.append((layer.kernel.value.dtype, _compat.unautocast_variable(layer.kernel).dtype))
            return x

    Probe(dtype="mixed_bfloat16")(tf.ones((1, 3)))
    assert seen == [(tf.bfloat16, tf.float32)]
    assert _compat.unautocast_variable(raw) is raw


def test_causal_padding_is_kernel_minus_one_times_dilation_on_the_left():
    layer = keras.layers.Conv1D(2, kernel_size=3, dilation_rate=2, padding="causal")
    widths = np.asarray(_compat.causal_padding(layer)).tolist()
    assert widths == [[0, 0], [(3 - 1) * 2, 0], [0, 0]]


def test_rnn_is_keras_s_loop_of_the_recurrent_layers():
    """A SimpleRNN's own output equals Keras's loop run with the cell's step, masked and backwards
    (``(last_output, outputs, new_states)``; a masked step keeps the previous output)."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.SimpleRNN(3, return_sequences=True, go_backwards=True)
    x = np.random.default_rng(0).normal(size=(2, 4, 2)).astype("float32")
    mask = np.array([[True, True, False, True], [False, True, True, True]])
    want = layer(x, mask=mask)
    cell = layer.cell

    def step(x_t, states):
        h = cell.activation(x_t @ cell.kernel + states[0] @ cell.recurrent_kernel + cell.bias)
        return h, [h]

    last, outputs, states = _compat.rnn(step, x, [np.zeros((2, 3), "float32")], go_backwards=True, mask=mask)
    np.testing.assert_allclose(outputs, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, want[:, -1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(states[0], want[:, -1], rtol=1e-5, atol=1e-6)


def test_copy_keras_mask_carries_the_mask_keras_attached():
    import tensorflow as tf

    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tf.constant([[1, 0]]))
    copy = _compat.copy_keras_mask(embedded, tf.identity(embedded))
    # the next layer sees the mask: a masked average over the one real position
    pooled = keras.layers.GlobalAveragePooling1D()(copy)
    np.testing.assert_allclose(np.asarray(pooled), np.asarray(embedded)[:, 0], rtol=1e-6)
    plain = tf.constant([1.0])
    assert _compat.copy_keras_mask(plain, tf.identity(plain)).shape == (1,)


def test_regularization_losses_are_the_weight_penalties():
    model = _model()
    penalties = _compat.regularization_losses(model)
    kernel = model.get_layer("hidden").kernel.numpy()
    assert len(penalties) == 1
    np.testing.assert_allclose(float(penalties[0]), 0.5 * np.sum(kernel**2), rtol=1e-6)


def test_compile_metrics_loss_tracker_and_symbolic_build():
    model = _model()
    assert _compat.compile_metrics(model) is None
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    metrics = _compat.compile_metrics(model)
    assert metrics is not None and metrics.built is False
    tracker = _compat.loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean)
    _compat.symbolic_build(model, data_batch=(tf.TensorSpec((None, 4)), tf.TensorSpec((None, 2))))
    assert model.optimizer.built and _compat.compile_metrics(model).built
    x, y = np.ones((4, 4), "float32"), np.zeros((4, 2), "float32")
    logs = model.fit(x, y, batch_size=4, epochs=1, verbose=0).history
    assert float(tracker.result()) == pytest.approx(logs["loss"][0], rel=1e-6)


def test_update_compile_metrics_gives_the_unweighted_metrics_the_row_weight():
    model = _model()
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"], weighted_metrics=["mae"])
    rng = np.random.default_rng(0)
    y, y_pred = rng.normal(size=(6, 2)).astype("float32"), rng.normal(size=(6, 2)).astype("float32")
    rows = np.array([1, 0, 1, 1, 0, 1], "float32")
    weights = np.array([2, 5, 1, 0.5, 3, 1], "float32") * rows
    _compat.update_compile_metrics(model, y, y_pred, sample_weight=weights, row_weight=rows)
    errors = np.mean(np.abs(y - y_pred), axis=1)  # per-row mean absolute error, in numpy
    logs = model.get_metrics_result()
    values = sorted(float(v) for k, v in logs.items() if "mae" in k)
    want = sorted([np.sum(errors * rows) / np.sum(rows), np.sum(errors * weights) / np.sum(weights)])
    np.testing.assert_allclose(values, want, rtol=1e-5)


# ------------------------------------------------------------------------- optimizers
def test_optimizer_internals_agree_with_public_views():
    variables = [keras.Variable(np.zeros((2, 3), "float32")), keras.Variable(np.zeros(3, "float32"))]
    optimizer = _sgd_on(variables, learning_rate=0.25, momentum=0.5)
    assert _compat.distribution_strategy(optimizer) is tf.distribute.get_strategy()
    assert float(_compat.current_learning_rate(optimizer)) == 0.25 == float(optimizer.learning_rate)
    assert [v is w for v, w in zip(_compat.trainable_variables(optimizer), variables)] == [True, True]
    assert [_compat.variable_index(optimizer, v) for v in variables] == [0, 1]
    keys = _compat.trainable_variable_keys(optimizer)
    assert {_compat.variable_key(optimizer, v) for v in variables} == set(keys) and len(keys) == 2
    own = _compat.optimizer_variables(optimizer)
    assert [v.path for v in own] == [v.path for v in optimizer.variables]  # iterations, lr, 2 momenta
    counter = _compat.iterations_variable(optimizer)
    counter.assign_add(3)
    assert int(optimizer.iterations.numpy()) == 3


def test_learning_rate_value_is_the_unevaluated_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    optimizer = _sgd_on([keras.Variable(np.zeros(2, "float32"))], learning_rate=schedule)
    assert _compat.learning_rate_value(optimizer) is schedule
    _compat.iterations_variable(optimizer).assign(2)
    assert float(_compat.current_learning_rate(optimizer)) == pytest.approx(0.1 * 0.5**2)


@pytest.mark.parametrize("ours, base, method, parameters, backend", _compat.PRIVATE_OVERRIDES,
                         ids=[entry[2] for entry in _compat.PRIVATE_OVERRIDES])
def test_private_overrides_still_match_keras(ours, base, method, parameters, backend):
    if backend is not None and backend != keras.backend.backend():
        pytest.skip(f"overridden on the {backend} backend only (tests/jax/test_jax_compat.py checks it there)")
    assert _compat.check_private_override(ours, base, method, parameters) is None


def test_every_private_override_in_the_package_is_listed():
    """Methods ``_name`` defined in the package whose name Keras also defines on Model,
    Layer or Optimizer are overrides of Keras privates: each must be in PRIVATE_OVERRIDES."""
    keras_privates = set()
    for cls in (keras.Model, keras.layers.Layer, keras.optimizers.Optimizer, keras.callbacks.Callback,
                keras.optimizers.schedules.LearningRateSchedule):
        keras_privates |= {name for name in dir(cls) if name.startswith("_") and not name.startswith("__")}
    listed = {entry[2] for entry in _compat.PRIVATE_OVERRIDES}
    found = set()
    for path in sorted((ROOT / "keras_noisecurve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name in keras_privates:
                        found.add(item.name)
    assert found == listed


def test_keras_mask_and_masks_kept_through_a_row_selection():
    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(tf.constant([[1, 0], [0, 3]]))
    np.testing.assert_array_equal(np.asarray(_compat.keras_mask(embedded)), [[True, False], [False, True]])
    assert _compat.keras_mask(tf.constant([1.0])) is None
    (first,) = _compat.map_keeping_masks(lambda t: t[:1], (embedded,))
    np.testing.assert_array_equal(np.asarray(_compat.keras_mask(first)), [[True, False]])


def test_without_compiled_loss_hides_and_restores_it():
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    compiled = model._compile_loss
    with _compat.without_compiled_loss(model):
        assert model._compile_loss is None
    assert model._compile_loss is compiled


def test_unmerged_kernel_of_a_lora_layer_is_the_frozen_kernel():
    layer = keras.layers.Dense(3)
    layer.build((None, 4))
    before = layer.kernel.numpy()
    layer.enable_lora(2)
    layer.lora_kernel_b.assign(np.ones((2, 3), np.float32))
    kernel = _compat.unmerged_kernel(layer)
    np.testing.assert_allclose(kernel.numpy(), before)
    assert not kernel.trainable
    merged = before + (layer.lora_alpha / layer.lora_rank) * layer.lora_kernel_a.numpy() @ np.ones((2, 3))
    np.testing.assert_allclose(layer.kernel.numpy(), merged, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ tf.distribute / XLA
def test_replica_value_specs_of_a_per_replica_spec():
    from tensorflow.python.distribute import values  # the private class, only to build one

    spec = values.PerReplicaSpec(tf.TensorSpec([2]), tf.TensorSpec([3]))
    assert [s.shape.as_list() for s in _compat.replica_value_specs(spec)] == [[2], [3]]
    assert _compat.replica_value_specs(tf.TensorSpec([2])) is None


def test_in_xla_context():
    from keras_noisecurve.backend.tensorflow import compat as tf_compat

    assert tf_compat.in_xla_context() is False  # eager
    seen = {}

    @tf.function(jit_compile=True)
    def compiled(x):
        seen["xla"] = tf_compat.in_xla_context()
        return x + 1

    @tf.function(jit_compile=False)
    def plain(x):
        seen["graph"] = tf_compat.in_xla_context()
        return x + 1

    compiled(tf.constant(1.0))
    plain(tf.constant(1.0))
    assert seen == {"xla": True, "graph": False}


def test_keras_moments_can_be_swapped_and_restored():
    module = _compat.keras_tf_nn_module()
    assert module is not None, f"keras {keras.__version__}: keras.ops.moments has no swappable _compute_moments"
    calls = []

    def recording(*args, **kwargs):
        calls.append(True)
        return previous(*args, **kwargs)

    previous = _compat.swap_compute_moments(module, recording)
    try:
        mean, var = keras.ops.moments(tf.constant([1.0, 2.0, 3.0, 6.0]), axes=[0])
    finally:
        assert _compat.swap_compute_moments(module, previous) is recording
    assert calls and float(mean) == 3.0 and float(var) == pytest.approx(3.5)


def test_float64_promotion_keeps_float64_and_restores_keras_s_promotion():
    # Keras promotes float64 to float32 on every backend but TensorFlow; the JAX side (where
    # the scope matters: a float64 GroupNormalization) is tests/jax/test_jax_depthwise.py
    before = keras.backend.result_type("float64", "float32")
    assert before == ("float64" if keras.backend.backend() == "tensorflow" else "float32")
    with _compat.float64_promotion():
        assert keras.backend.result_type("float64", "float32") == "float64"
        assert keras.backend.result_type("float64", "float16") == "float64"
    assert keras.backend.result_type("float64", "float32") == before


# ----------------------------------------------------------------------- dp-accounting
def test_pld_pmfs_and_dense_fields_give_dp_accounting_s_delta():
    from dp_accounting.pld import privacy_loss_distribution as pld_module

    pld = pld_module.from_gaussian_mechanism(1.0, value_discretization_interval=1e-3)
    pmfs = _compat.pld_pmfs(pld)
    assert len(pmfs) == 1  # the Gaussian PLD is symmetric
    disc, lower, probs, inf_mass = _compat.dense_pmf_fields(pmfs[0].to_dense_pmf())
    probs = np.asarray(probs, dtype=np.float64)
    assert disc == pytest.approx(1e-3) and probs.sum() + inf_mass == pytest.approx(1.0, abs=1e-9)
    losses = (int(lower) + np.arange(len(probs))) * disc
    for epsilon in (0.5, 1.0, 2.0):
        above = losses > epsilon
        delta = float(np.sum(probs[above] * (1.0 - np.exp(epsilon - losses[above])))) + float(inf_mass)
        assert delta == pytest.approx(pld.get_delta_for_epsilon(epsilon), rel=1e-9, abs=1e-15)
    # an asymmetric PLD (Laplace under add/remove, pessimistic) has two pmfs
    laplace = pld_module.from_laplace_mechanism(1.0, value_discretization_interval=1e-2, sampling_prob=0.5)
    assert len(_compat.pld_pmfs(laplace)) == 2


def test_compat_imports_no_tensorflow():
    import os
    import subprocess
    import sys

    code = ("import sys; import keras_noisecurve._compat; "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_private_third_party_import_outside_compat():
    """``keras.src`` / ``tensorflow.python`` are imported only by ``_compat`` and
    ``backend/tensorflow/compat.py`` (the full rule, private attributes included, is
    tests/layout_rules.py's ``private_names``)."""
    offenders = []
    for path in sorted((ROOT / "keras_noisecurve").rglob("*.py")):
        if path.relative_to(ROOT / "keras_noisecurve").as_posix() in ("_compat.py", "backend/tensorflow/compat.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            for name in names:
                if name.startswith(("keras.src", "tensorflow.python", "tensorflow.core")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, offenders
