"""What the JAX package leaves to ``backend/common/defaults``: ``devices`` lists JAX's devices
and holds nothing back; ``ghost_conv`` is Keras's convolutions; ``pipeline`` is JAX's own (the
default's, with its processes' agreement); ``distributed`` and ``tf_privacy`` refuse, naming the backend and what
to call instead; ``backend.module`` refuses a name that is no seam module."""

import pytest

import keras_noisecurve as knc
from keras_noisecurve import backend


def test_the_modules_jax_leaves_out_come_from_the_defaults():
    for name in backend.OPTIONAL:
        owner = "jax" if name == "pipeline" else "common.defaults"
        assert backend.module(name).__name__ == f"keras_noisecurve.backend.{owner}.{name}"
    assert backend.module("noise").__name__ == "keras_noisecurve.backend.jax.noise"
    devices = backend.module("devices")
    assert devices.probe() is None and devices.quiet_python_logs() is None
    assert devices.before_first_variable() is None


def test_tf_privacy_and_fit_distributed_are_refused_with_the_backend_named():
    with pytest.raises(ImportError, match="KERAS_BACKEND=tensorflow \\(the backend is 'jax'\\)"):
        import keras_noisecurve.integrations.tf_privacy  # noqa: F401
    assert backend.refuses("BandedMatrixFactorizationQuery") and backend.refuses("fit_distributed")
    with pytest.raises(AttributeError, match="fit_distributed is part of the TensorFlow backend"):
        knc.training.fit_distributed  # noqa: B018
    from keras_noisecurve.training import distributed

    with pytest.raises(RuntimeError, match="under 'jax' call model.fit"):
        distributed.fit_distributed(None, data=None)  # refused before its arguments are read
    with pytest.raises(AttributeError, match="helper of tf.distribute strategies .* the backend is 'jax'"):
        distributed.is_chief  # noqa: B018


def test_the_default_probe_does_nothing_where_keras_lists_no_devices(monkeypatch):
    import keras

    def unlisted(device_type=None):
        raise NotImplementedError("no device list for this backend")

    monkeypatch.setattr(keras.distribution, "list_devices", unlisted)
    assert backend.module("devices").probe() is None


def test_a_name_outside_the_seam_is_refused():
    with pytest.raises(ValueError, match="module_name must be one of .* got 'ghost_rnn'"):
        backend.module("ghost_rnn")
