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

:func:`probe_examples` looks for both on k ≤ :data:`PROBE_ROWS` examples with pairwise
different inputs (among the first :data:`PROBE_SCAN`), outside any compiled step, with the
model's own forward pass and per-example loss (an unbuilt model is built first, by a call
in inference mode, so that every variable is in the snapshot):

1. the model in training mode on the k rows, its outputs and per-example losses; every
   non-trainable variable (random-generator states included, so ``Dropout`` draws the same
   masks each time) is restored before each call and at the end;
2. the same call again: the two must agree to :data:`TOLERANCE` (otherwise the model draws
   random numbers outside its seed generators, e.g. ``tf.random`` ops: nothing can be
   concluded, and :func:`check_examples_apart` refuses);
3. for each row j, the batch with row j's input and label replaced by row j+1's (mod k): no
   other row's outputs or loss may move by more than :data:`TOLERANCE` (relative to the
   largest finite value of that output; compared where the model computed them, only k
   numbers reach the host);
4. a non-trainable variable written by the calls (other than random-generator states) with
   a value that differs between two of those batches is state updated from the data.

A model with one mixing layer that draws a random pairing (``MixUp``) escapes step 3 only if
its pairing fixes every row, probability 1/k! (1/40,320 for k = 8). k + 2 forward passes
on k rows, once per ``compile``: nothing per step. A model that mixes examples only in its
gradient (a custom gradient across the batch), or only in batches larger than k, is not
seen here; the audit's clipping check (``keras_noisecurve.audit.check_mechanism``)
compares per-example gradients on larger batches.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np

from keras_noisecurve import _compat

__all__ = ["PROBE_ROWS", "PROBE_SCAN", "TOLERANCE", "ProbeResult", "check_examples_apart", "first_of",
           "probe_examples"]

#: the examples the probe uses (with pairwise different inputs, the first of the batch or the data)
PROBE_ROWS = 8
#: the examples among which it looks for them
PROBE_SCAN = 64
#: a row moves when its outputs or loss change by more than this fraction of the output's largest value
TOLERANCE = 1e-5
#: layer classes known to mix the examples of a batch in training mode (named in the message)
KNOWN_MIXERS = ("MixUp", "CutMix", "BatchNormalization")


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe_examples` found.

    Attributes:
      rows: k, the examples probed, with pairwise different inputs (fewer than 2: nothing
        could be checked).
      reproducible: two identical training-mode calls agreed (False: the mixing check is void).
      mixing: ``(i, j, change)`` of the largest move: row i's outputs or loss moved by
        ``change`` (relative) when row j's input and label were replaced; ``None`` below
        :data:`TOLERANCE` (or when not reproducible: then nothing could be compared).
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
        if not self.reproducible:
            out.append(
                "two identical training-mode calls of the model gave different outputs (random numbers drawn "
                "outside its keras.random.SeedGenerator states, e.g. tf.random or numpy calls in a layer): whether "
                "a layer mixes the examples of a batch cannot be checked, and a step run again from a checkpoint "
                "would not reproduce its release. Draw random numbers with a keras.random.SeedGenerator the layer "
                "tracks (self.seed_generator = keras.random.SeedGenerator(); keras.random.normal(..., "
                "seed=self.seed_generator)).")
        if self.mixing is not None:
            i, j, change = self.mixing
            named = f" The model holds {', '.join(self.suspects)}." if self.suspects else ""
            out.append(
                f"in training mode, example {i}'s output or loss moved by {change:.3g} (relative) when example {j}'s "
                "input and label were replaced: a layer or the loss mixes the examples of a batch (MixUp, CutMix, batch "
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


def first_of(element):
    """``(x, y)`` of a batch as datasets yield it: ``x``, ``(x,)``, ``(x, y)``, ``(x, y, w)`` or
    a run's ``(x, y, mask, step)``; ``None`` stays ``None``."""
    if element is None:
        return None
    if isinstance(element, tuple) and not hasattr(element, "_fields"):
        return element[0], (element[1] if len(element) > 1 else None)
    return element, None


def _take(tree, index):
    """The rows ``index`` (a slice or an int array) of every leaf of ``tree``, as numpy; a
    slice is taken before the conversion, so a large input is never copied whole."""
    def one(a):
        if isinstance(index, slice):
            a = a[index]
        a = np.asarray(keras.ops.convert_to_numpy(a))
        return a if isinstance(index, slice) else a[index]

    return keras.tree.map_structure(one, tree)


def _distinct(x, y, rows):
    """``(x, y)`` of up to ``rows`` examples with pairwise different inputs, chosen in order
    among the first :data:`PROBE_SCAN` (replacing a row by an identical one would show
    nothing)."""
    size = int(keras.tree.flatten(x)[0].shape[0])
    x = _take(x, slice(0, min(size, PROBE_SCAN)))
    y = None if y is None else _take(y, slice(0, min(size, PROBE_SCAN)))
    leaves = keras.tree.flatten(x)
    seen, chosen = set(), []
    for i in range(int(leaves[0].shape[0])):
        key = b"".join(np.ascontiguousarray(leaf[i]).tobytes() if leaf.dtype != object else repr(leaf[i]).encode()
                       for leaf in leaves)
        if key not in seen:
            seen.add(key)
            chosen.append(i)
        if len(chosen) == rows:
            break
    index = np.asarray(chosen, np.int64)
    return _take(x, index), (None if y is None else _take(y, index))


def _replace_row(tree, j, source):
    def one(a):
        a = a.copy()
        a[j] = a[source]
        return a

    return None if tree is None else keras.tree.map_structure(one, tree)


def _per_row(outputs, losses, k):
    """The numeric leaves of ``outputs`` with k rows, and the losses (k,), as float32 (k, d)
    tensors, left where the model computed them."""
    blocks = []
    for leaf in keras.tree.flatten(outputs) + ([] if losses is None else [losses]):
        shape = getattr(leaf, "shape", ())
        dtype = keras.backend.standardize_dtype(getattr(leaf, "dtype", "string"))
        if len(shape) and shape[0] == k and dtype not in ("bool", "string"):
            blocks.append(keras.ops.reshape(keras.ops.cast(leaf, "float32"), (k, -1)))
    return blocks


def _moved(base, other, k):
    """(k,) numpy: the largest change of each row between two lists of (k, d) blocks, relative
    to the largest finite value of the block (zeros when nothing has k rows). Computed where
    the blocks are: only (k,) values reach the host."""
    ops = keras.ops
    change = np.zeros(k)
    for a, b in zip(base, other):
        scale = max(float(ops.convert_to_numpy(ops.max(ops.where(ops.isfinite(a), ops.abs(a), 0.0)))), 1e-30)
        same = ops.logical_or(ops.equal(a, b), ops.logical_and(ops.isnan(a), ops.isnan(b)))
        diff = ops.where(same, 0.0, ops.abs(a - b))
        diff = ops.where(ops.isnan(diff), np.inf, diff)
        change = np.maximum(change, np.asarray(ops.convert_to_numpy(ops.max(diff, axis=1)), np.float64) / scale)
    return change


def probe_examples(model, x, y=None, *, loss_fn=None, rows=PROBE_ROWS) -> ProbeResult:
    """Probe ``model`` for examples that reach one another in training mode (module docstring).

    Args:
      model: a ``keras.Model`` (a private model or the model it wraps); built here (by a call
        in inference mode) if it is not.
      x: a batch of inputs (nested structures allowed), leading dimension ≥ 1.
      y: its labels, or ``None`` (then only the outputs are compared).
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example loss (the private model's), or ``None``.
      rows: the examples to use: k ≤ ``rows`` with pairwise different inputs, among the
        first :data:`PROBE_SCAN`; each is replaced, input and label, by the next.

    Returns:
      a :class:`ProbeResult`. The model's non-trainable variables hold their values from
      before the call again.
    """
    suspects = tuple(f"'{layer.name}' ({type(layer).__name__})" for layer in _compat.flatten_layers(model)
                     if type(layer).__name__ in KNOWN_MIXERS and getattr(layer, "trainable", True))
    x, y = _distinct(x, y, int(rows))
    k = int(keras.tree.flatten(x)[0].shape[0])
    if k < 2:
        return ProbeResult(rows=k, reproducible=True, mixing=None, written=(), suspects=suspects)
    if not all(layer.built for layer in _compat.flatten_layers(model)):
        model(x, training=False)  # create the variables first: the snapshot must hold every one
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

    def call(xb, yb):
        restore()
        outputs = model(xb, training=True)
        losses = None if (yb is None or loss_fn is None) else loss_fn(yb, outputs)
        state = [np.array(keras.ops.convert_to_numpy(variables[n].value)) for n in watched]
        return _per_row(outputs, losses, k), state

    try:
        base, base_state = call(x, y)
        again, again_state = call(x, y)
        reproducible = bool(np.all(_moved(base, again, k) <= TOLERANCE))
        del again
        worst, written = None, set()
        for j in range(k):
            blocks, state = call(_replace_row(x, j, (j + 1) % k), _replace_row(y, j, (j + 1) % k))
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
      ValueError: when one example's output or loss depends on another's input or label in
        training mode, when the call writes non-trainable state from the data, or when two
        identical calls disagree (randomness outside the model's seed generators: nothing
        could be checked); the messages of :meth:`ProbeResult.problems`.
    """
    result = probe_examples(model, x, y, loss_fn=loss_fn)
    problems = result.problems()
    if problems:
        raise ValueError(" ".join(problems))
    return result
