"""Before the first private step: does one example's output or loss depend on another
example's input, or does the training-mode call write state from the data?

Per-example clipping bounds one example's influence on a step only if nothing else
carries it out of the step:

- a layer that mixes the examples of a batch in training mode (``MixUp``, ``CutMix``,
  batch statistics, a custom layer that centres the batch) or a loss that does: example j
  moves example i's gradient, which is clipped as i's;
- a variable that the training-mode call writes from the batch (a running statistic, a
  stateful RNN's state, a float8 scale history): the released model keeps it, without
  noise.

:func:`probe_examples` looks for both on k ≤ :data:`PROBE_ROWS` examples, outside any
compiled step, with the model's own forward pass and per-example loss:

1. the model in training mode on the k rows, its outputs and per-example losses; every
   non-trainable variable (random-generator states included, so ``Dropout`` draws the same
   masks each time) is restored before each call and at the end;
2. the same call again: the two must agree to :data:`TOLERANCE` (otherwise the model draws
   random numbers outside its seed generators, e.g. ``tf.random`` ops, and nothing can be
   concluded about mixing: :func:`check_examples_apart` warns);
3. for each row j, the batch with row j's input replaced by row j+1's (mod k): no other
   row's outputs or loss may move by more than :data:`TOLERANCE` (relative to the largest
   value of that output);
4. a non-trainable variable written by the calls (other than random-generator states) with
   a value that differs between two of those batches is state updated from the data.

A model with one mixing layer that draws a random pairing (``MixUp``) escapes step 3 only if
its pairing fixes every row, probability 1/k! (1/40,320 for k = 8). k + 2 forward passes
on k rows, once per ``compile``: nothing per step. A model that mixes examples only in its
gradient (a custom gradient across the batch) is not seen here; the audit's clipping check
(``keras_noisecurve.audit.check_mechanism``) compares per-example gradients.
"""

from __future__ import annotations

import dataclasses
import warnings

import keras
import numpy as np

from keras_noisecurve import _compat

__all__ = ["PROBE_ROWS", "TOLERANCE", "ProbeResult", "check_examples_apart", "probe_examples"]

#: the examples the probe uses (the first of the batch or the data)
PROBE_ROWS = 8
#: a row moves when its outputs or loss change by more than this fraction of the output's largest value
TOLERANCE = 1e-5
#: layer classes known to mix the examples of a batch in training mode (named in the message)
KNOWN_MIXERS = ("MixUp", "CutMix", "BatchNormalization")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_examples` found.

    Attributes:
      rows: k, the examples probed (fewer than 2: nothing could be checked).
      reproducible: two identical training-mode calls agreed (False: the mixing check is void).
      mixing: ``(i, j, change)`` of the largest move: row i's outputs or loss moved by
        ``change`` (relative) when row j's input was replaced; ``None`` below :data:`TOLERANCE`.
      written: paths of the non-trainable variables written from the data.
      suspects: ``"name (Class)"`` of the layers of :data:`KNOWN_MIXERS` the model holds.
    """

    rows: int
    reproducible: bool
    mixing: tuple | None
    written: tuple
    suspects: tuple

    @property
    def passed(self) -> bool:
        return self.rows >= 2 and self.reproducible and self.mixing is None and not self.written

    def problems(self) -> list:
        """The refusal messages (empty when nothing was found)."""
        out = []
        if self.mixing is not None:
            i, j, change = self.mixing
            named = f" The model holds {', '.join(self.suspects)}." if self.suspects else ""
            out.append(
                f"in training mode, example {i}'s output or loss moved by {change:.3g} (relative) when example {j}'s "
                "input was replaced: a layer or the loss mixes the examples of a batch (MixUp, CutMix, batch "
                f"statistics, a layer that centres the batch), so per-example clipping cannot bound one example's "
                f"influence (no DP guarantee).{named} Remove it from the model: augment each example alone (in the "
                "data, e.g. run.dataset(x, y, example_fn=...)), normalise each example alone (GroupNormalization, "
                "LayerNormalization), and compute the loss of each example from its own prediction only.")
        if self.written:
            out.append(
                f"in training mode the model writes {', '.join(self.written)} from the batch (a running statistic, "
                "a stateful RNN's state, a scale history): the released model would carry these values without "
                "noise. Freeze the layer (layer.trainable = False runs it in inference mode), make it stateless "
                "(stateful=False), or remove it.")
        return out


def _rows(tree, k):
    """The first ``k`` rows of every leaf of ``tree`` (numpy)."""
    return keras.tree.map_structure(lambda a: np.asarray(keras.ops.convert_to_numpy(a))[:k], tree)


def _replace_row(tree, j, source):
    def one(a):
        a = a.copy()
        a[j] = a[source]
        return a

    return keras.tree.map_structure(one, tree)


def _per_row(outputs, losses, k):
    """The leaves of ``outputs`` with k rows, and the losses (k,), as float64 (k, d) blocks."""
    blocks = []
    for leaf in keras.tree.flatten(outputs) + ([] if losses is None else [losses]):
        value = np.asarray(keras.ops.convert_to_numpy(leaf))
        if value.ndim and value.shape[0] == k and np.issubdtype(value.dtype, np.number):
            blocks.append(value.reshape(k, -1).astype(np.float64))
    return blocks


def _moved(base, other, k):
    """(k,) the largest relative change of each row between two lists of (k, d) blocks
    (zeros when the model has no output with k rows to compare)."""
    change = np.zeros(k)
    for a, b in zip(base, other):
        scale = max(float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0)), 1e-30)
        with np.errstate(invalid="ignore"):
            diff = np.where((a == b) | (np.isnan(a) & np.isnan(b)), 0.0, np.abs(a - b))
        diff = np.where(np.isnan(diff), np.inf, diff)
        change = np.maximum(change, np.max(diff, axis=1, initial=0.0) / scale)
    return change


def probe_examples(model, x, y=None, *, loss_fn=None, rows=PROBE_ROWS) -> ProbeResult:
    """Probe ``model`` for examples that reach one another in training mode (module docstring).

    Args:
      model: a built ``keras.Model`` (the wrapped model of a private model).
      x: a batch of inputs (nested structures allowed), leading dimension ≥ 1.
      y: its labels, or ``None`` (then only the outputs are compared).
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example loss (the private model's), or ``None``.
      rows: the examples to use, k = min(rows, P).

    Returns:
      a :class:`ProbeResult`. The model's non-trainable variables hold their values from
      before the call again.
    """
    k = min(int(rows), int(np.asarray(keras.tree.flatten(x)[0]).shape[0]))
    suspects = tuple(f"'{layer.name}' ({type(layer).__name__})" for layer in _compat.flatten_layers(model)
                     if type(layer).__name__ in KNOWN_MIXERS and getattr(layer, "trainable", True))
    if k < 2:
        return ProbeResult(rows=k, reproducible=True, mixing=None, written=(), suspects=suspects)
    x = _rows(x, k)
    y = None if y is None else _rows(y, k)
    variables = list(model.non_trainable_variables)
    generator = _compat.global_seed_generator()
    randomness = {id(g.state) for layer in _compat.flatten_layers(model) for g in _compat.seed_generators(layer)}
    if generator is not None:
        variables.append(generator.state)
        randomness.add(id(generator.state))
    saved = [np.array(keras.ops.convert_to_numpy(v.value)) for v in variables]
    watched = [n for n, v in enumerate(variables) if id(v) not in randomness]

    def restore():
        for variable, value in zip(variables, saved):
            variable.assign(value)

    def call(xb):
        restore()
        outputs = model(xb, training=True)
        losses = None if (y is None or loss_fn is None) else loss_fn(y, outputs)
        state = [np.array(keras.ops.convert_to_numpy(variables[n].value)) for n in watched]
        return _per_row(outputs, losses, k), state

    try:
        base, base_state = call(x)
        again, again_state = call(x)
        reproducible = bool(np.all(_moved(base, again, k) <= TOLERANCE))
        worst, written = None, set()
        for j in range(k):
            blocks, state = call(_replace_row(x, j, (j + 1) % k))
            moved = _moved(base, blocks, k)
            moved[j] = 0.0
            i = int(np.argmax(moved))
            if moved[i] > TOLERANCE and (worst is None or moved[i] > worst[2]):
                worst = (i, j, float(moved[i]))
            for n, before, stable, now in zip(watched, base_state, again_state, state):
                if np.array_equal(before, stable, equal_nan=True) and not np.array_equal(before, now, equal_nan=True):
                    written.add(variables[n].path)
    finally:
        restore()
    return ProbeResult(rows=k, reproducible=reproducible, mixing=worst if reproducible else None,
                       written=tuple(sorted(written)), suspects=suspects)


def check_examples_apart(model, x, y=None, *, loss_fn=None) -> ProbeResult:
    """:func:`probe_examples`, refusing what it finds.

    Raises:
      ValueError: when one example's output or loss depends on another's input in training
        mode, or the call writes non-trainable state from the data (the messages of
        :meth:`ProbeResult.problems`).

    Warns ``RuntimeWarning`` when two identical calls disagree (randomness outside the
    model's seed generators: mixing cannot be checked).
    """
    result = probe_examples(model, x, y, loss_fn=loss_fn)
    problems = result.problems()
    if problems:
        raise ValueError(" ".join(problems))
    if not result.reproducible:
        warnings.warn(
            "two identical training-mode calls of the model gave different outputs (random numbers drawn outside "
            "its keras.random.SeedGenerator states, e.g. tf.random ops): whether a layer mixes the examples of a "
            "batch could not be checked. Draw random numbers with a SeedGenerator the layer tracks.",
            RuntimeWarning, stacklevel=2)
    return result
