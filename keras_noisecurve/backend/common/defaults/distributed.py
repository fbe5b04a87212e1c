"""``fit_distributed`` on a backend without ``tf.distribute``: refused. It is the training loop
of TensorFlow's distribution strategies; on another Keras backend ``model.fit`` itself runs over
several devices and processes (``keras.distribution``, docs/distributed.md). The helpers of a
multi-worker TensorFlow run (``is_chief``, ``worker_checkpoint_dir``,
``assert_same_on_all_workers``) are refused by name, with the reason.
"""

from __future__ import annotations

__all__ = ["check_supported", "train"]

#: the helpers of a tf.distribute run, which this backend has not
_STRATEGY_HELPERS = ("assert_same_on_all_workers", "is_chief", "worker_checkpoint_dir")


def _backend() -> str:
    import keras

    return keras.backend.backend()


def check_supported() -> None:
    """Refuse ``fit_distributed`` (``RuntimeError``, saying what to call instead)."""
    raise RuntimeError(
        f"fit_distributed is the training loop of tf.distribute strategies (KERAS_BACKEND=tensorflow); under "
        f"{_backend()!r} call model.fit, which runs over several devices and processes itself "
        "(keras.distribution, docs/distributed.md)."
    )


def train(model, dataset_fn, *, run_steps, plan_steps, steps, strategy, callbacks, verbose, skip_done_steps,
          fingerprint, data_fingerprint=None, probe_rows=None):
    """Refused, as :func:`check_supported`."""
    check_supported()


def __getattr__(name):
    if name in _STRATEGY_HELPERS:
        raise AttributeError(
            f"keras_noisecurve.training.distributed.{name} is a helper of tf.distribute strategies "
            f"(KERAS_BACKEND=tensorflow); the backend is {_backend()!r}."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
