"""What a private ``fit`` checks before its first step, so that the ε it reports is the ε spent.

- :class:`PlanStart`, a callback the private model appends after the user's (so after any
  restore, e.g. ``BackupAndRestore``): refuses an optimizer state saved under another plan,
  on other examples or another order of them, or for another model, loss or update
  (:func:`check_plan`, ``NoiseCurveOptimizer.check_plan``); refuses a model whose examples
  reach one another in training mode or that writes state from the data, probed on a few
  examples (:mod:`~keras_noisecurve.backend.common.batch_probe`, :func:`probe_rows`); warns when the weights changed
  since this process's last private step, or when a resumed model has layers that draw
  random numbers; records the weights' digest at the end.
- :func:`budgets_apart`: ``PrivacyBudget`` callbacks run after the plan check, wherever the
  user listed them (they read the restored step).
- :func:`low_level_warning`: an optimizer without a run tracks no ε.

docs/privacy.md, "What can make ε wrong", lists every path and what happens on it. All of
this runs on the host, once per ``fit``: nothing per step.
"""

from __future__ import annotations

import hashlib
import warnings

import keras
import numpy as np

from keras_noisecurve import _compat
from keras_noisecurve.privacy import plan_state
from keras_noisecurve.backend.common.batch_probe import PROBE_SCAN, first_of
from keras_noisecurve.training.optimizer import NoiseCurveOptimizer

__all__ = ["PlanStart", "budgets_apart", "check_plan", "callback_list", "is_arrays", "low_level_warning", "probe_rows"]


def _step(optimizer) -> int:
    return int(keras.ops.convert_to_numpy(optimizer.iterations.value))


def check_plan(private, data=None) -> None:
    """``optimizer.check_plan`` of ``private``'s optimizer with the words of its wrapped model,
    compiled loss, update and class-weight table (``plan_state.model_word``) and ``data``'s."""
    optimizer = getattr(private, "optimizer", None)
    if isinstance(optimizer, NoiseCurveOptimizer):
        loaded = getattr(private, "_dp_loaded_steps", 0)
        if loaded and _step(optimizer) == 0:
            raise ValueError(
                f"the weights were loaded from a file written after {loaded} private steps, but the optimizer "
                "stands at step 0 (its state was not restored: load_model(..., compile=False), or a new "
                "optimizer): epsilon would count from 0 on weights that already spent it. Resume with the "
                "compiled file (keras.models.load_model(path)) or load_weights into the compiled model; to "
                "start a new run from these weights on purpose (both runs count), copy them into the wrapped "
                "model: new_private.inner.set_weights(loaded.inner.get_weights()).")
        object.__setattr__(private, "_dp_loaded_steps", 0)
        word = plan_state.model_word(private.inner, getattr(private, "loss", None), optimizer=optimizer,
                                     class_weight=getattr(private, "_dp_class_weight", None))
        optimizer.check_plan(data=data, model=word)


def probe_rows(x=None, y=None, *, source=None):
    """``() -> (x, y) or None``: the first examples (up to ``PROBE_SCAN``) the batch probe
    (:mod:`~keras_noisecurve.backend.common.batch_probe`) chooses its rows among, read when called.

    ``source``: an ``ExampleSource`` (a run's, a ``banded_poisson_dataset`` plan's); else
    ``x, y`` as ``fit`` got them: arrays (or dicts/lists of arrays), a ``tf.data.Dataset``
    of batches (its first), a ``keras.utils.PyDataset`` (its batch 0). Anything else (a
    Python generator, which cannot be read twice): ``None``; the private step then warns
    that the probe did not run (``PrivateModel.check_examples_apart`` runs it by hand)."""

    def read():
        if source is not None:
            return source.gather(np.arange(min(PROBE_SCAN, source.num_examples), dtype=np.int64))
        if is_arrays(x):
            return x, y
        if isinstance(x, keras.utils.PyDataset):
            return first_of(x[0])
        if hasattr(x, "element_spec") and hasattr(x, "take"):  # a tf.data.Dataset
            return first_of(next(iter(x.take(1)), None))
        return None

    return read


def is_arrays(x) -> bool:
    """Whether ``fit`` batches ``x`` itself (arrays, or a dict/list of them): Keras's
    ``batch_size`` (default 32) then sets the batches."""
    if isinstance(x, dict):
        x = next(iter(x.values()), None)
    elif isinstance(x, (list, tuple)):
        x = x[0] if x else None
    return hasattr(x, "shape") and hasattr(x, "dtype")


class PlanStart(keras.callbacks.Callback):
    """Before the first step of a private ``fit``, after the user's callbacks: the plan check
    (:func:`check_plan`), the batch probe on ``rows()`` (:func:`probe_rows`; once per
    ``compile``), then the warnings of :func:`_weights_changed` and :func:`_random_layers`;
    at the end, the weights' digest for the next ``fit``."""

    def __init__(self, data, rows=None):
        super().__init__()
        self._data = data
        self._rows = rows

    def on_train_begin(self, logs=None):
        private = self.model
        check_plan(private, self._data)
        batch = self._rows() if self._rows is not None else None
        if batch is not None:
            private._dp_probe(*batch)
        recorded = getattr(private, "_dp_weights_after", None)
        continued = recorded is not None and recorded[0] == _step(private.optimizer)  # no restore since
        _weights_changed(private)
        if not continued:
            _random_layers(private)

    def on_train_end(self, logs=None):
        object.__setattr__(self.model, "_dp_weights_after", _weights_digest(self.model))


def callback_list(callbacks) -> list:
    """``fit``'s ``callbacks`` as a list (``None``: empty; a ``keras.callbacks.CallbackList``:
    its callbacks)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    return list(callbacks or [])


def budgets_apart(callbacks):
    """``(others, budgets)``: the user's callbacks, the ``PrivacyBudget`` ones apart (each list
    in the user's order). A budget reads the step count in ``on_train_begin``, which must come
    after a restore (``BackupAndRestore``) whatever order the user listed them in."""
    from keras_noisecurve.privacy.budget import PrivacyBudget

    callbacks = callback_list(callbacks)
    return ([c for c in callbacks if not isinstance(c, PrivacyBudget)],
            [c for c in callbacks if isinstance(c, PrivacyBudget)])


def low_level_warning(optimizer, batch_size) -> str:
    """The warning of a private fit whose optimizer has no run: nothing tracks ε."""
    size = f" of {batch_size} examples" if batch_size is not None else ""
    expected = optimizer.expected_batch_size
    mismatch = (f" The batches{size} are not the expected_batch_size={expected} the noisy sum is divided by."
                if batch_size is not None and batch_size != expected else "")
    return (
        f"this optimizer has no PrivateRun: epsilon is not tracked, and nothing checks that the batches follow "
        f"the sampling your accounting assumes (fixed, shuffled batches are not Poisson sampling).{mismatch} "
        "Describe the run once, run = keras_noisecurve.PrivateRun(...), and train with "
        "NoiseCurveOptimizer(run=run, ...) on fit(run.dataset(x, y)) (docs/run.md)."
    )


def _weights_digest(model):
    """``(step, digest)``: the optimizer's step and a digest of the trainable weights of
    ``model`` (host values, in order; frozen weights, e.g. a LoRA model's base, are left out); ``None`` where a weight is not wholly on this process (JAX
    arrays split across processes: nothing is compared then)."""
    values = [variable.value for variable in model.trainable_variables]  # what a fit can train
    if not all(getattr(value, "is_fully_addressable", True) for value in values):
        return None
    digest = hashlib.blake2b(digest_size=16)
    for value in values:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(value)).tobytes())
    return _step(model.optimizer), digest.digest()


def _weights_changed(private) -> None:
    """Warn when the weights differ from those after this process's last private step while
    the step stood still (a restore brings its own step with its weights): something else
    trained or edited them, and the reported ε does not describe them."""
    recorded = getattr(private, "_dp_weights_after", None)
    now = _weights_digest(private) if recorded is not None else None
    if now is not None and now[0] == recorded[0] and now[1] != recorded[1]:
        warnings.warn(
            "the model's weights changed since its last private step (a non-private fit of the wrapped "
            "model, set_weights, load_weights of other weights, ...): the epsilon this run reports covers "
            "the private steps only, not what changed the weights in between. If private data changed "
            "them, the model is not private at the reported epsilon.",
            RuntimeWarning, stacklevel=2)
    object.__setattr__(private, "_dp_weights_after", None)


def _random_layers(private) -> None:
    """On a resume (step > 0 at the start of a private fit), warn when layers draw random
    numbers in training (Dropout, GaussianNoise, ...): their generators' state is not in
    checkpoints, so a step run again from a checkpoint does not reproduce its first release."""
    optimizer = getattr(private, "optimizer", None)
    if not isinstance(optimizer, NoiseCurveOptimizer) or _step(optimizer) == 0:
        return
    random = sorted({type(layer).__name__ for layer in _compat.flatten_layers(private.inner)
                     if _compat.seed_generators(layer)})
    if random:
        warnings.warn(
            f"resuming at step {_step(optimizer)} with layers that draw random numbers in training "
            f"({', '.join(random)}): their generators' state is not saved in checkpoints, so a step that "
            "already ran after this checkpoint (before a crash) runs again on other random numbers with the "
            "same noise. Harmless if nothing of those steps was released (their checkpoints, logs or "
            "weights); otherwise their difference is released without noise (docs/privacy.md §9).",
            RuntimeWarning, stacklevel=2)
