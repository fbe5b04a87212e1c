"""Privacy units of several rows (user-level privacy), shared by the clipping engines of both
backends, in ``keras.ops``.

A user-level run (``PrivateRun(privacy_unit="user", examples_per_user=k)``) gives every step a
batch of ``P = U·k`` rows, user-major: rows ``[u·k, (u+1)·k)`` are user slot u (its examples,
then padding rows of weight 0). One clip bounds the sum of a unit's weighted gradients,
``G_u = Σ_{i ∈ u} w_i·∇loss_i``:

    S = Σ_u G_u·min(1, ζ/‖G_u‖)

The engines compute ``‖G_u‖`` in one of two exact ways:

- **merged positions** (ghost norms per unit): a layer whose per-example gradient is a sum over
  positions of terms that each depend on one position only (Dense, EinsumDense on a position
  axis, Embedding, LoRA, LayerNormalization over trailing axes) has a per-unit gradient that is
  the same sum over all the unit's positions. :func:`merge_rows` folds the k rows of a unit into
  its positions, ``(U·k, L, ...) → (U, k·L, ...)`` (``(U·k, d) → (U, k, d)``), and the layer's
  ordinary rule then returns per-unit norms and sums. :func:`merges` says which layers qualify;
- **the exact fallback** (every other layer): per-row gradients of the layer's own weights,
  summed over each unit's rows (:func:`unit_sum`), as the per-layer fallback and the vectorized
  engines compute them.

A unit is dropped (factor 0) when any of its rows has a non-finite loss or its norm is not
finite (:func:`unit_losses`). The engines return the unit's norm and dropped flag on each of its
rows (:func:`per_row`), so code that reads per-row results is unchanged; the adaptive clip's count
reads one entry per unit (:func:`unit_view`).
"""

from __future__ import annotations

from keras_noisecurve.backend.common.geometry import parse_einsum

__all__ = ["MERGED_KINDS", "check_rows", "merge_rows", "merges", "per_row", "unit_losses", "unit_sum", "unit_view"]

#: The rule kinds whose kernels read their rows only through position-flattening reshapes, so
#: that :func:`merge_rows` turns them into per-unit kernels (subject to :func:`merges`).
MERGED_KINDS = ("Dense", "EinsumDense", "Embedding", "LoRA", "LayerNormalization")


def _einsum_merges(equation: str, bias_axes) -> bool:
    """An explicit equation whose input axis 1 is a position: in the input and the output (axis 1
    of both), not in the kernel nor in the bias (a bias along it would have one entry per position
    of the merged rows); an input of rank ≥ 3, so the merge keeps the rank."""
    if "..." in equation:
        return False
    inp, ker, out = parse_einsum(equation, len(equation.split(",")[0]))
    return (len(inp) >= 3 and len(out) >= 2 and inp[1] == out[1] and inp[1] not in ker
            and inp[1] not in (bias_axes or ""))


def merges(kind: str, layer, *, builtin: bool = True) -> bool:
    """Whether ``layer``, clipped by the rule of ``kind``, gives per-unit norms and sums when its
    recorded rows are merged by :func:`merge_rows` (else the engine uses its exact fallback).
    ``builtin``: the rule is the library's own kernel of that kind (a rule registered by a user,
    whatever its kind's name, is never merged: its gradient need not be a sum over positions)."""
    import keras

    if kind not in MERGED_KINDS or not builtin:
        return False
    if kind in ("EinsumDense", "LoRA") and isinstance(layer, keras.layers.EinsumDense):
        return _einsum_merges(layer.equation, getattr(layer, "bias_axes", None) if layer.bias is not None else None)
    if kind == "LayerNormalization":
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
        return all(a == -1 or a >= 2 for a in axes)  # axis 1 of an input is the merged one
    return True


def check_rows(rows, unit_rows: int) -> int:
    """``U``, the number of units of a batch of ``rows`` rows (a Python int); ``ValueError`` when
    ``rows`` is not a multiple of ``unit_rows``."""
    if unit_rows < 1 or rows % unit_rows:
        raise ValueError(
            f"a user-level batch has examples_per_user={unit_rows} rows per user, so its rows must be a "
            f"multiple of {unit_rows}; got {rows} rows. Train on the run's batches (run.dataset(x, y, users=...)).")
    return rows // unit_rows


def merge_rows(t, unit_rows: int):
    """``t`` (U·k, d₁, d₂, …) as (U, k·d₁, d₂, …) (rank kept); (U·k, d) as (U, k, d); (U·k,) as
    (U, k). Row j of unit u lands at position block j: the unit's positions in row order."""
    from keras import ops

    k = int(unit_rows)
    shape = ops.shape(t)
    rest = tuple(shape[1:])
    if len(rest) >= 2:
        return ops.reshape(t, (-1, k * rest[0], *rest[1:]))
    return ops.reshape(t, (-1, k, *rest))


def unit_sum(t, unit_rows: int):
    """Per-row values ``t`` (U·k, ...) summed over each unit's rows: (U, ...)."""
    from keras import ops

    return ops.sum(ops.reshape(t, (-1, int(unit_rows), *tuple(ops.shape(t)[1:]))), axis=1)


def unit_losses(losses, unit_rows: int):
    """(U,) the sum of each unit's unweighted row losses: not finite exactly when one of its
    rows' losses is not (inf − inf is nan), what :func:`~keras_noisecurve.backend.common.clip.clip_factors`
    checks."""
    return unit_sum(losses, unit_rows)


def per_row(values, unit_rows: int):
    """Per-unit ``values`` (U,) on each of the unit's k rows: (U·k,)."""
    from keras import ops

    return ops.repeat(values, int(unit_rows), axis=0)


def unit_view(norms, weights, unit_rows: int):
    """``(norms (U,), weights (U,))`` of the units from per-row engine results: a unit's norm
    (every row of a unit carries it, :func:`per_row`) and ``1`` where some row of the unit weighs
    more than 0 (a real user), else 0 (a padding slot). ``weights`` ``None``: every unit real.
    ``unit_rows`` 1: ``(norms, weights)`` as they are."""
    from keras import ops

    k = int(unit_rows)
    if k == 1:  # example-level: the rows are the units
        return norms, weights
    unit_norms = ops.reshape(norms, (-1, k))[:, 0]
    if weights is None:
        return unit_norms, None
    real = ops.cast(ops.any(ops.reshape(weights, (-1, k)) > 0, axis=1), "float32")
    return unit_norms, real
