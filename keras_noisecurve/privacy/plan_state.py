"""The plan words: what ε depends on, saved in the optimizer's state beside its step.

ε is computed from the plan — n, B, T, σ, the mixing matrix C, δ, the sampling, the
accountant, the padded batch size P, the clip norm ζ — and assumes that the batches of
every step come from ONE dataset in ONE order, run through one model and loss. A
checkpoint restored into a script whose plan was edited would continue under the new
plan and report the new plan's ε, although its first steps spent the old one's. So the
optimizer saves the plan with its step counter: an int32 variable ``plan`` of
:data:`FIELDS` words, each a 32-bit hash of one field (0: not part of this optimizer's
plan). Every route that restores the optimizer (``BackupAndRestore``, ``load_weights``,
``load_model``, ``tf.train.Checkpoint``, Orbax) restores the words with the step; the
next private ``fit`` or custom loop compares them with the script's own plan
(:func:`differences`) and refuses to continue under another.

``data`` and ``model`` are bound at the first private ``fit`` (or custom loop) on a
run's examples: the fingerprint of the examples in their order
(:meth:`~keras_noisecurve.privacy.source_base.ExampleSource.fingerprint`) and of the
model's trainable variables and loss (:func:`model_word`). Resuming on other examples,
the same examples in another order, or another model or loss is refused, so a step that
runs again from a checkpoint takes the same inputs and draws the same noise: it
reproduces its first output instead of releasing a second one (docs/privacy.md, "What
can make ε wrong").

Neutral code (numpy and hashlib): no framework is imported here.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

__all__ = ["FIELDS", "BOUND_AT_FIT", "words", "word", "differences", "refusal", "model_word"]

#: the fields of the plan, in the order of the ``plan`` variable's words
FIELDS = ("num_examples", "batch_size", "steps", "mixing", "noise_multiplier", "delta", "sampling",
          "accountant", "padded_batch_size", "l2_norm_clip", "data", "model")

#: the fields bound at the first private fit (0 until then), not when the optimizer is built
BOUND_AT_FIT = ("data", "model")

#: what each field is, for messages
_WHAT = {
    "num_examples": "n, the number of examples",
    "batch_size": "B, the (expected) batch size",
    "steps": "T, the number of steps",
    "mixing": "the mixing matrix C",
    "noise_multiplier": "σ, the noise multiplier (calibrated from epsilon when epsilon is given)",
    "delta": "δ",
    "sampling": "the sampling",
    "accountant": "the accountant",
    "padded_batch_size": "P, the padded batch size",
    "l2_norm_clip": "ζ, the clip norm",
    "data": "the training examples or their order",
    "model": "the model's trainable variables or its loss",
}


def word(value) -> int:
    """A nonzero 31-bit hash of a JSON-able ``value`` (``None`` → 0: not in the plan)."""
    if value is None:
        return 0
    digest = hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1) + 1


def words(facts: dict) -> np.ndarray:
    """The int32 (len(FIELDS),) words of ``facts`` ({field: JSON-able value or None});
    fields left out are 0."""
    unknown = set(facts) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown plan fields {sorted(unknown)}; the fields are {list(FIELDS)}.")
    return np.array([word(facts.get(name)) for name in FIELDS], dtype=np.int32)


def differences(saved, expected) -> list:
    """The fields whose saved word differs from the expected one. A field that is 0 on
    either side is not compared (not part of that plan, or not bound yet)."""
    saved = np.asarray(saved, dtype=np.int64).reshape(-1)
    expected = np.asarray(expected, dtype=np.int64).reshape(-1)
    if saved.shape != expected.shape:
        return list(FIELDS)
    return [name for name, a, b in zip(FIELDS, saved, expected) if a and b and a != b]


def refusal(fields, *, step: int, plan: str) -> str:
    """The message refusing to continue a state saved under another plan."""
    listed = "; ".join(_WHAT[name] for name in fields)
    return (
        f"the optimizer's state (step {step}) was saved under another plan than this script's ({plan}); "
        f"what differs: {listed}. epsilon is computed from the plan, so continuing would report an epsilon the "
        "run did not spend, and a step run again on other inputs would reuse its noise. Resume with the "
        "plan, data (same order), model and loss the checkpoint was written with, or start a new run from a "
        "fresh optimizer and account for both runs (their epsilons compose)."
    )


def model_word(model, loss, *, optimizer=None, class_weight=None) -> int:
    """The hash of what one step computes besides the data and the restored state: the
    trainable variables' shapes and dtypes in order, each layer's class and config (an
    activation, a dropout rate), the compiled loss's config, the update's configuration
    (the optimizer's and its inner optimizer's, a learning-rate schedule) and the
    class-weight table. Names are left out (a fresh process numbers Keras's automatic names
    anew), and so is a constant learning rate (a variable: restored with the state)."""
    from keras_noisecurve import _compat

    variables = [[list(map(int, v.shape)), str(v.dtype)] for v in model.trainable_variables]
    layers = [_facts(layer) for layer in _compat.flatten_layers(model)
              if not hasattr(layer, "layers")]  # leaf layers
    update = None
    if optimizer is not None:
        inner = getattr(optimizer, "inner", None)
        update = [_facts(optimizer), None if inner is None else _facts(inner),
                  _schedule(_compat.learning_rate_value(inner if inner is not None else optimizer))]
    weights = None if class_weight is None else np.asarray(class_weight, np.float64).tolist()
    return word({"variables": variables, "layers": layers, "loss": _loss_description(loss), "update": update,
                 "class_weight": weights})


#: attributes that are names, bookkeeping or restored with the state, not what a step computes
_SKIPPED = {"name", "built", "trainable", "dtype", "path", "seed", "run", "learning_rate", "iterations"}


def _facts(obj) -> list:
    """``obj``'s class and its public attributes of plain types (an activation by its name,
    a dropout rate, momentum); read from the object itself, not ``get_config`` (which, on
    the JAX backend, imports TensorFlow where it is installed)."""
    facts = {}
    for key, value in sorted(vars(obj).items()):
        if key.startswith(("_", "is_")) or key in _SKIPPED:  # is_*: state flags (is_gptq_calibrated)
            continue
        if isinstance(value, (bool, int, float, str)) or value is None:
            facts[key] = _plain(value)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            facts[key] = [_plain(v) for v in value]
        elif callable(value) and hasattr(value, "__name__") and not hasattr(value, "weights"):
            facts[key] = getattr(value, "__qualname__", value.__name__)
    return [type(obj).__name__, facts]


def _plain(value):
    """Numbers as floats (a config read back from a file turns 4 into 4.0), the rest as is."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return value


def _schedule(learning_rate):
    """A learning-rate schedule's class and config (a constant rate: ``None``, restored)."""
    get_config = getattr(learning_rate, "get_config", None)
    if get_config is None or not callable(learning_rate):
        return None
    try:
        return [type(learning_rate).__name__, json.loads(json.dumps(get_config(), sort_keys=True, default=str))]
    except (TypeError, ValueError, NotImplementedError):
        return type(learning_rate).__name__


def _loss_description(loss):
    """A loss by name, or its class, its public facts and its function's keyword arguments
    (``from_logits``, ``label_smoothing``, ...)."""
    if loss is None or isinstance(loss, str):
        return loss
    if not hasattr(loss, "__dict__"):
        return getattr(loss, "__qualname__", type(loss).__name__)
    from keras_noisecurve import _compat

    kwargs = {k: v for k, v in sorted(_compat.loss_kwargs(loss).items())
              if isinstance(v, (bool, int, float, str)) or v is None}
    return [*_facts(loss), kwargs]
