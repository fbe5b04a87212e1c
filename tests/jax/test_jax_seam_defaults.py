"""What the JAX package leaves to ``backend/common/defaults``: ``devices`` lists JAX's devices
and holds nothing back; ``distributed`` and ``tf_privacy`` refuse, naming the backend and what
to call instead; ``backend.module`` refuses a name that is no seam module."""

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve import backend


def test_the_modules_jax_leaves_out_come_from_the_defaults():
    for name in backend.OPTIONAL:
        assert backend.module(name).__name__ == f"keras_noisecurve.backend.common.defaults.{name}"
    assert backend.module("noise").__name__ == "keras_noisecurve.backend.jax.noise"
    devices = backend.module("devices")
    assert devices.probe() is None and devices.quiet_python_logs() is None
    assert devices.before_first_variable() is None


def test_tf_privacy_and_fit_distributed_are_refused_with_the_backend_named():
    with pytest.raises(ImportError, match="KERAS_BACKEND=tensorflow \\(the backend is 'jax'\\)"):
        import keras_noisecurve.integrations.tf_privacy  # noqa: F401
    assert backend.refuses("BandedMatrixFactorizationQuery") and backend.refuses("fit_distributed")
    import keras

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    run = knc.PrivateRun(num_examples=8, batch_size=4, steps=2, mixing=knc.MixingMatrix.identity(2),
                         noise_multiplier=1.0, delta=1e-5, seed=0)
    data = (np.zeros((8, 2), "float32"), np.zeros((8, 1), "float32"))
    with pytest.raises(AttributeError, match="fit_distributed is part of the TensorFlow backend"):
        knc.training.fit_distributed  # noqa: B018
    from keras_noisecurve.training import distributed

    with pytest.raises(RuntimeError, match="under 'jax' call model.fit"):
        distributed.fit_distributed(model, run=run, data=data, strategy=None)
    with pytest.raises(AttributeError, match="helper of tf.distribute strategies .* the backend is 'jax'"):
        distributed.is_chief  # noqa: B018


def test_a_name_outside_the_seam_is_refused():
    with pytest.raises(ValueError, match="module_name must be one of .* got 'ghost_conv'"):
        backend.module("ghost_conv")
