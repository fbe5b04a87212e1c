"""Private training in Keras 3 (TensorFlow and JAX backends).

- :class:`NoiseCurveOptimizer`: the noisy SGD step from a clipped sum for every
  mixing strategy, C = I (DP-SGD) by default (``optimizer.py``; its argument checks in
  ``optimizer_args.py``, its update-rule warning in ``update_rule_check.py``), with the
  online noise of ``noise.py``.
- :func:`make_private` (a :class:`PrivateModel`, ``dp_model.py``): per-example clipping in
  ``train_step``, whose engines are the backend's (``keras_noisecurve.backend.<name>``:
  ``dp_model``, ``clipping``, ``ghost`` and its rules); examples with a non-finite loss or
  gradient are dropped, counted and reported.
- :func:`describe`, :func:`register_rule`, :class:`LayerRule`, :func:`layer_kernel` (``rules.py``):
  which rule clips each layer, and a rule of your own: one ``keras.ops`` kernel for every backend,
  or a kernel per backend.
- :func:`fit_distributed` (``distributed.py``): the training loop for
  ``MultiWorkerMirroredStrategy``, where Keras 3's ``fit`` does not run (TensorFlow).
- :func:`learning_rate_schedule`, :class:`LinearCooldown`, :class:`MultiplierSchedule`
  (``schedules.py``): the Keras learning rate of an ``UpdateRule``'s schedule, for an
  ``inner=keras.optimizers.SGD(...)`` that runs the update a mixing matrix was solved for.
"""

import importlib

# public name -> module that defines it; loaded on first access, so that importing this
# package imports no framework and the TensorFlow-only parts (the clipping engines, the
# ghost-norm rules, fit_distributed) load only where they are used
_EXPORTS = {
    "LayerRule": "keras_noisecurve.training.rules",
    "layer_kernel": "keras_noisecurve.training.rules",
    "LinearCooldown": "keras_noisecurve.training.schedules",
    "MultiplierSchedule": "keras_noisecurve.training.schedules",
    "NoiseCurveOptimizer": "keras_noisecurve.training.optimizer",
    "PrivateLogsWarning": "keras_noisecurve.training.log_guard",
    "PrivateModel": "keras_noisecurve.training.dp_model",
    "StreamNoise": "keras_noisecurve.training.noise",
    "describe": "keras_noisecurve.training.rules",
    "fit_distributed": "keras_noisecurve.training.distributed",
    "learning_rate_schedule": "keras_noisecurve.training.schedules",
    "make_private": "keras_noisecurve.training.dp_model",
    "register_rule": "keras_noisecurve.training.rules",
    "replace_batch_normalization": "keras_noisecurve.training.batchnorm",
}

#: public names that are objects of the backend's engines, from its ``clipping`` module
#: (``keras_noisecurve.backend.module("clipping")``); only TensorFlow has them
_FROM_CLIPPING = ("ClippedSum", "get_engine", "vectorized_clipped_sum")

__all__ = sorted({*_EXPORTS, *_FROM_CLIPPING})


def __getattr__(name: str):
    if name not in _EXPORTS and name not in _FROM_CLIPPING:
        raise AttributeError(f"module 'keras_noisecurve.training' has no attribute {name!r}")
    from keras_noisecurve import backend

    if backend.refuses(name):  # fit_distributed and the TensorFlow engines' objects on JAX
        raise AttributeError(
            f"keras_noisecurve.training.{name} is part of the TensorFlow backend (KERAS_BACKEND="
            f"tensorflow); under the backend in use ({backend.module('clipping').__name__}) make_private(model) "
            "clips per example itself."
        )
    owner = backend.module("clipping") if name in _FROM_CLIPPING else importlib.import_module(_EXPORTS[name])
    value = getattr(owner, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
