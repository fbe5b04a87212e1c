"""The optimizer overrides a private hook of Keras's TensorFlow optimizer,
``_distributed_tf_update_step`` (backend/tensorflow/optimizer.py says why no public hook does the
job). These tests fail loudly when a Keras release removes or renames it, changes its
signature, or stops calling it once per step around the per-variable updates."""

import inspect

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.training import NoiseCurveOptimizer
from keras_noisecurve.backend.tensorflow import optimizer as optimizer_module
from tests.training.helpers import random_banded_c

HOOK = "_distributed_tf_update_step"
SIGNATURE = ["self", "distribution", "grads_and_vars", "learning_rate"]


def test_keras_still_has_the_hook_with_the_signature_we_override():
    keras_hook = getattr(keras.optimizers.Optimizer, HOOK, None)
    assert keras_hook is not None, (
        f"keras {keras.__version__} has no Optimizer.{HOOK}: NoiseCurveOptimizer's once-per-step "
        "noise setup is never called (see backend/tensorflow/optimizer.py)."
    )
    assert list(inspect.signature(keras_hook).parameters) == SIGNATURE, (
        f"keras {keras.__version__} changed the signature of Optimizer.{HOOK}: "
        f"{inspect.signature(keras_hook)}"
    )
    ours = optimizer_module.OptimizerBackend.__dict__[HOOK]
    assert list(inspect.signature(ours).parameters) == SIGNATURE
    # Keras's TensorFlow backend reaches the hook from its per-step update.
    assert HOOK in inspect.getsource(keras.optimizers.Optimizer._backend_update_step)


@pytest.mark.parametrize("replicas", [1, 2])
def test_hook_builds_the_step_noise_once_per_step_before_every_variable_update(monkeypatch, replicas):
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < replicas:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    built, fallback = [], []

    class CountingStepNoise(optimizer_module._StepNoise):
        def __init__(self, optimizer):
            built.append(tf.distribute.in_cross_replica_context())
            super().__init__(optimizer)

    update_step = optimizer_module.OptimizerBackend.update_step

    def recording_update_step(self, gradient, variable, learning_rate):
        fallback.append(self._step_noise is None)  # None: the hook did not run first
        return update_step(self, gradient, variable, learning_rate)

    monkeypatch.setattr(optimizer_module, "_StepNoise", CountingStepNoise)
    monkeypatch.setattr(optimizer_module.OptimizerBackend, "update_step", recording_update_step)

    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:replicas]])
    shapes = [(3, 2), (2,), (4,)]
    with strategy.scope():
        variables = [keras.Variable(np.zeros(s, np.float32)) for s in shapes]
        opt = NoiseCurveOptimizer(
            learning_rate=0.1, mixing=random_banded_c(4, 2, rng=np.random.default_rng(0)), l2_norm_clip=1.0,
            noise_multiplier=1.0, expected_batch_size=2, seed=0,
        )
        opt.build(variables)

    @tf.function
    def step():
        strategy.run(lambda: opt.apply_clipped_sum([tf.zeros(s) for s in shapes], variables))

    step()
    step()
    assert int(opt.iterations.numpy()) == 2
    assert built == [True], f"step noise built {len(built)} times while tracing one step (want once, in the hook)"
    assert len(fallback) == len(shapes) * replicas and not any(fallback)
    for v in variables:  # every replica's copy received the same noise
        copies = [c.numpy() for c in getattr(v.value, "values", [v.value])]
        assert all(np.array_equal(copies[0], c) for c in copies[1:])
        assert np.any(copies[0] != 0)


def test_keras_still_builds_through_symbolic_build_with_the_signature_we_override():
    """The private model strips a PrivateRun batch's step index in ``_symbolic_build``
    (Keras builds a model under a strategy from one (x, y, sample_weight) batch there),
    and ``fit_distributed`` calls it to build before its loop."""
    from keras_noisecurve.training import dp_model

    keras_hook = getattr(keras.Model, "_symbolic_build", None)
    assert keras_hook is not None, f"keras {keras.__version__} has no Model._symbolic_build"
    expected = ["self", "iterator", "data_batch"]
    assert list(inspect.signature(keras_hook).parameters) == expected
    assert list(inspect.signature(dp_model.PrivateModel._symbolic_build).parameters) == expected
