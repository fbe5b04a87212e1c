"""The clipping check: the library's clipped sum on the user's model against an independent
per-example computation (both backends).

The library side is the engine as training runs it: ``make_private(model)``'s clipping
engine, called outside any compiled step on a batch of the user's data with the user's
loss and ζ, while every layer's rule reports its per-example squared norms (the private
model's ``_dp_engine_run``). The reference shares no code with any engine: a
loop over the examples of plain gradients of ONE example's weighted loss w_i·loss_i (a
``tf.GradientTape`` on TensorFlow, a ``jax.grad`` of ``stateless_call`` on JAX), on a
float64 clone of the model when one can be built (its config with every float32 dtype
replaced by float64, the weights copied; on JAX inside ``jax.enable_x64``), else on the
model itself in float32. From the reference gradients g_i:

- n_i = ‖g_i‖ and, per layer L (the engine's plan, ``ghost.plan``), n_iL = ‖g_iL‖;
- the clipped sum S = Σ_i g_i·min(1, ζ/n_i), per layer.

The check fails when, beyond ``tolerance`` (relative),

1. a layer's per-example norm from its rule differs from n_iL (``layer norms``; relative
   to max(n_iL, 10⁻⁴·n_i), so a layer whose share is dropped shows an error of 1);
2. the engine's per-example norm differs from n_i (``norms``);
3. a layer's part of the engine's clipped sum differs from S_L (``clipped sum``; relative
   to max(‖S_L‖, 10⁻⁴·‖S‖));
4. an example's contribution exceeds ζ(1 + tolerance): measured DIRECTLY, as the norm of
   the engine's clipped sum of a batch holding that example alone (for the examples with
   the largest n_i), and as min(1, ζ/engine norm)·n_i for every example.

The layer the check names (``worst_layer``) is the one whose OWN output is furthest off:
its rule's per-example norms (1.), or its part of the clipped sum given the clipping
factors the engine used, c'_i = min(1, ζ/n'_i) with n'_i the engine's norm, against
Σ_i c'_i·g_iL (the rule's gradient function alone). The error of 3., against the true
factors, is no attribution: one layer's wrong norm changes every example's factor and so
every layer's part of the sum, and the part of another layer can be further off than the
faulty layer's own (a SimpleRNN whose rule drops its share, followed by a Dense head: the
head's part of the sum off by 1.5, the SimpleRNN's by 1.0).

**The user unit** (``unit_rows`` k > 1, a user-level run's ``examples_per_user``): the batch
is user-major, rows ``[u·k, (u+1)·k)`` user u's (real rows weighted 1/m, padding rows 0), the
engine clips each user's SUM of weighted row gradients as one, and everything above is per
user: the reference's per-example gradients g_i summed over the user's k rows,
G_u = Σ_{i ∈ u} g_i, give n_u = ‖G_u‖, the per-layer n_uL and S = Σ_u G_u·min(1, ζ/n_u); the
direct contribution is the engine's clipped sum of a batch holding that user's k rows alone.

Dropout and other training-only randomness are off (``training=False``) on both sides,
so that both differentiate the same function.
"""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["ClippingCheck", "check_clipping", "float64_clone", "with_probe"]

#: a layer's (or an example's) share below this fraction of the example's norm is
#: compared in absolute terms (relative to this fraction of the total)
SHARE_FLOOR = 1e-4


@dataclasses.dataclass(frozen=True)
class ClippingCheck:
    """The outcome of :func:`check_clipping`.

    Attributes:
      passed: every measured error within ``tolerance`` and no contribution above ζ(1 + tolerance).
      tolerance: the relative tolerance used.
      reference_dtype: ``"float64"`` (a float64 clone), ``"float64 (k float32 variables)"`` (a
        clone whose layers kept k weights in float32) or ``"float32"`` (the model itself).
      examples: number of privacy units compared: examples, or users (``unit``).
      worst_layer: ``(name, class, rule)`` of the layer with the largest error of its own
        (``own_error``).
      worst_error: that error (relative): the largest of its layer-norm error and the error
        of its part of the clipped sum given the engine's clipping factors.
      norm_error: largest relative error of the engine's per-example norms.
      sum_error: largest relative error of a layer's part of the clipped sum (against the
        true clipped sum S_L).
      max_contribution: largest per-example contribution / ζ (1 = exactly ζ).
      layers: ``[{"layer", "class", "rule", "norm_error", "sum_error", "own_sum_error"}]`` for
        every layer: ``norm_error`` of its rule's norms (``None``: the engine reports none),
        ``sum_error`` of its part of the clipped sum against S_L, ``own_sum_error`` against
        the reference gradients scaled by the engine's factors.
      line: one line for a report.
      training_mode: the batch probe's verdict in training mode
        (:func:`keras_noisecurve.backend.common.batch_probe.probe_examples`): ``"PASS"``, or the
        reasons it fails (examples that reach one another, state written from the data);
        ``""`` where it did not run.
      unit: the privacy unit compared, ``"example"`` or ``"user"``.
      unit_rows: k, the rows of one unit (a user's slot; 1 for examples).
    """

    passed: bool
    tolerance: float
    reference_dtype: str
    examples: int
    worst_layer: tuple
    worst_error: float
    norm_error: float
    sum_error: float
    max_contribution: float
    layers: list
    line: str
    training_mode: str = ""
    unit: str = "example"
    unit_rows: int = 1


def _retype(config):
    """``config`` with every float32 dtype (policy or plain name) replaced by float64."""
    if isinstance(config, dict):
        if config.get("class_name") in ("DTypePolicy", "FloatDTypePolicy") and isinstance(config.get("config"), dict):
            if config["config"].get("name") == "float32":
                return {**config, "config": {**config["config"], "name": "float64"}}
        return {k: ("float64" if k == "dtype" and v == "float32" else _retype(v)) for k, v in config.items()}
    if isinstance(config, list):
        return [_retype(v) for v in config]
    return config


def float64_clone(model, sample_x):
    """A float64 copy of ``model`` (same architecture, weights cast), or ``None`` if it cannot
    be built (a model without a config, a layer that refuses float64, a weight mismatch).
    On JAX, build and use it inside the backend's ``audit.float64_scope()``."""
    import keras

    try:
        clone = keras.saving.deserialize_keras_object(_retype(keras.saving.serialize_keras_object(model)))
        clone(_cast(sample_x, "float64"), training=False)
        if len(clone.weights) != len(model.weights) or len(clone.trainable_variables) != len(
                model.trainable_variables):
            return None
        for target, source in zip(clone.weights, model.weights):
            if tuple(target.shape) != tuple(source.shape):
                return None
            target.assign(keras.ops.convert_to_numpy(source.value).astype(target.dtype))
        if not any(v.dtype == "float64" for v in clone.trainable_variables):
            return None
        return clone
    except Exception:  # noqa: BLE001 - any failure means: no float64 reference, use float32
        return None


def _layer_path(layer, variables):
    """Where a layer sits in the model: its variables' common path (``block_0/attention/query``),
    which tells apart sublayers of the same name in different blocks; else its name."""
    parts = [str(getattr(v, "path", "")).split("/")[:-1] for v in variables]
    common = []
    for level in zip(*parts) if parts else ():
        if len(set(level)) != 1:
            break
        common.append(level[0])
    if layer.name in common:  # a cell's weights sit below their layer: stop at the layer
        common = common[: len(common) - common[::-1].index(layer.name)]
    return "/".join(common) or layer.name


def _cast(tree, dtype):
    import keras

    def cast(a):
        a = np.asarray(a)
        return a.astype(dtype) if np.issubdtype(a.dtype, np.floating) else a

    return keras.tree.map_structure(cast, tree)


def _take(tree, index):
    import keras

    return keras.tree.map_structure(lambda a: np.asarray(a)[index], tree)


def check_clipping(*, private, loss_fn, l2_norm_clip, x, y, sample_weight=None, tolerance=1e-3, direct=4,
                   unit_rows=1):
    """Compare the engine's clipped sum and per-unit norms with an independent per-example gradient loop.

    Args:
      private: a ``PrivateModel`` (``make_private(model)``), built.
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example loss (``per_example_loss_fn(loss)``).
      l2_norm_clip: ζ > 0.
      x, y: one batch of P examples (numpy, nested structures allowed).
      sample_weight: (P,) weights w_i (default 1).
      tolerance: relative tolerance of every comparison.
      direct: how many units (those of largest norm) are also clipped ALONE by the engine
        to measure their contribution directly.
      unit_rows: k, the rows of one privacy unit: 1 (every row an example), or a user-level
        run's ``examples_per_user``, the batch user-major (rows ``[u·k, (u+1)·k)`` user u's, P a
        multiple of k); the engine runs with ``unit_rows=k`` and the reference sums each
        user's k per-example gradients before every comparison.

    Returns:
      a :class:`ClippingCheck` (fields for this one batch).
    """
    import keras

    from keras_noisecurve import backend

    audit = backend.module("audit")
    inner = private.inner
    rows = int(np.asarray(keras.tree.flatten(x)[0]).shape[0])
    per = int(unit_rows)  # rows of one unit
    if per < 1 or rows % per:
        raise ValueError(f"unit_rows must be >= 1 and divide the batch's {rows} rows (whole users of k rows each), "
                         f"got unit_rows={unit_rows!r}.")
    size = rows // per  # the units: examples, or users
    w = np.ones(rows, np.float32) if sample_weight is None else np.asarray(sample_weight, np.float32).reshape(-1)
    variables = private.trainable_variables
    groups, engine_norms, engine_sum, engine_layer_sq = private._dp_engine_run(
        loss_fn, x, y, w, l2_norm_clip=l2_norm_clip, unit_rows=per)
    engine_norms = np.asarray(engine_norms, np.float64).reshape(-1)
    if engine_norms.shape != (size,):
        raise RuntimeError(f"the engine returned {engine_norms.size} norms for {size} units.")
    paths = [_layer_path(layer, [variables[k] for k in ks]) for layer, _, ks in groups]
    covered = {k for _, _, ks in groups for k in ks}
    loose = [k for k in range(len(variables)) if k not in covered]
    if loose:
        groups.append((None, "unclipped", loose))
    # the factors the engine clipped with (0 for a unit it dropped as non-finite)
    engine_factors = np.where(np.isfinite(engine_norms),
                              np.minimum(1.0, l2_norm_clip / np.maximum(np.nan_to_num(engine_norms), 1e-300)), 0.0)

    with audit.float64_scope():
        clone = float64_clone(inner, _take(x, slice(0, 1)))
        if clone is None:
            reference_dtype = "float32"
        else:  # a layer may create some weights in float32 whatever its policy (Keras's LoRA weights)
            kept = sum(v.dtype != "float64" for v in clone.trainable_variables)
            reference_dtype = "float64" if not kept else f"float64 ({kept} float32 variables)"
        ref_model = inner if clone is None else clone
        grads = audit.reference_grads(ref_model, loss_fn, x, y, w, float64=clone is not None)
    if len(ref_model.trainable_variables) != len(variables):
        raise RuntimeError("the reference model's trainable variables do not match the private model's.")
    if per > 1:  # a user's gradient: the sum of its rows' weighted per-example gradients
        grads = [[sum(grads[u * per + j][v] for j in range(per)) for v in range(len(variables))] for u in range(size)]

    sq = np.array([[float(np.sum(g[k] ** 2)) for k in range(len(variables))] for g in grads])  # (U, V), U units
    norms = np.sqrt(sq.sum(axis=1))
    factors = np.minimum(1.0, l2_norm_clip / np.maximum(norms, 1e-300))
    reference_sum = [sum(factors[i] * grads[i][k] for i in range(size)) for k in range(len(variables))]
    own_sum = [sum(engine_factors[i] * grads[i][k] for i in range(size)) for k in range(len(variables))]
    total_own = np.sqrt(sum(float(np.sum(s ** 2)) for s in own_sum))
    total_sum = np.sqrt(sum(float(np.sum(s ** 2)) for s in reference_sum))

    layers, worst = [], None
    for (layer, kind, ks), path in zip(groups, paths + ["(not clipped by any rule)"]):
        ref_layer = np.sqrt(sq[:, ks].sum(axis=1))
        floor = np.maximum(ref_layer, SHARE_FLOOR * norms)
        norm_error = None
        if layer is not None and id(layer) in engine_layer_sq:
            eng_layer = np.sqrt(np.maximum(np.asarray(engine_layer_sq[id(layer)], np.float64).reshape(-1), 0.0))
            norm_error = (float(np.max(np.abs(eng_layer - ref_layer) / np.maximum(floor, 1e-300)))
                          if eng_layer.shape == ref_layer.shape else float("inf"))  # e.g. per row, not per user
        diff = np.sqrt(sum(float(np.sum((engine_sum[k] - reference_sum[k]) ** 2)) for k in ks))
        scale = np.sqrt(sum(float(np.sum(reference_sum[k] ** 2)) for k in ks))
        sum_error = float(diff / max(scale, SHARE_FLOOR * total_sum, 1e-300))
        own_diff = np.sqrt(sum(float(np.sum((engine_sum[k] - own_sum[k]) ** 2)) for k in ks))
        own_scale = np.sqrt(sum(float(np.sum(own_sum[k] ** 2)) for k in ks))
        own_sum_error = float(own_diff / max(own_scale, SHARE_FLOOR * total_own, 1e-300))
        name = (path, type(layer).__name__ if layer is not None else "-", kind)
        layers.append({"layer": name[0], "class": name[1], "rule": name[2], "norm_error": norm_error,
                       "sum_error": sum_error, "own_sum_error": own_sum_error})
        error = max(own_sum_error, norm_error or 0.0)  # this layer's own error (see the module's docstring)
        if worst is None or error > worst[1]:  # a tie: the first layer of the plan
            worst = (name, error)
    worst = worst or (("-", "-", "-"), 0.0)
    norm_error = float(np.max(np.abs(engine_norms - norms) / np.maximum(norms, SHARE_FLOOR * l2_norm_clip)))
    sum_error = max(entry["sum_error"] for entry in layers)
    contribution = np.minimum(1.0, l2_norm_clip / np.maximum(engine_norms, 1e-300)) * norms / l2_norm_clip
    max_contribution = float(np.max(contribution))
    for i in np.argsort(-norms)[:direct]:  # the engine's clipped sum of one unit (its k rows), alone
        span = slice(i * per, (i + 1) * per)
        _, _, single, _ = private._dp_engine_run(loss_fn, _take(x, span), _take(y, span), w[span],
                                                 l2_norm_clip=l2_norm_clip, plan=False, unit_rows=per)
        alone = np.sqrt(sum(float(np.sum(g ** 2)) for g in single))
        max_contribution = max(max_contribution, alone / l2_norm_clip)
    passed = (worst[1] <= tolerance and norm_error <= tolerance and sum_error <= tolerance
              and max_contribution <= 1.0 + tolerance)
    return ClippingCheck(passed=bool(passed), tolerance=float(tolerance), reference_dtype=reference_dtype,
                         examples=size, worst_layer=worst[0], worst_error=float(worst[1]),
                         norm_error=norm_error, sum_error=float(sum_error), max_contribution=max_contribution,
                         layers=layers, line="", unit="example" if per == 1 else "user", unit_rows=per)


def merge(checks, *, tolerance):
    """One :class:`ClippingCheck` of several batches (worst of each measure), with its line."""
    worst = max(checks, key=lambda c: c.worst_error)
    by_layer = {}
    for check in checks:
        for position, entry in enumerate(check.layers):  # every batch lists the plan's layers in order
            old = by_layer.get(position)
            if old is None:
                by_layer[position] = dict(entry)
            else:
                for key in ("norm_error", "sum_error", "own_sum_error"):
                    if entry[key] is not None:
                        old[key] = max(old[key] or 0.0, entry[key])
    merged = dataclasses.replace(
        worst, passed=all(c.passed for c in checks), examples=sum(c.examples for c in checks),
        norm_error=max(c.norm_error for c in checks), sum_error=max(c.sum_error for c in checks),
        max_contribution=max(c.max_contribution for c in checks), layers=list(by_layer.values()))
    name, cls, rule = merged.worst_layer
    verdict = "PASS" if merged.passed else "FAIL"
    if merged.unit == "user":
        against = (f"{merged.examples} users (k = {merged.unit_rows} rows each), {len(merged.layers)} layers against "
                   f"per-user gradients (sums of per-example gradients, {merged.reference_dtype})")
    else:
        against = (f"{merged.examples} examples, {len(merged.layers)} layers against per-example gradients "
                   f"({merged.reference_dtype})")
    line = (f"clipping: {verdict} - {against}: worst layer '{name}' ({cls}, rule {rule}) relative error "
            f"{merged.worst_error:.2e}; norms {merged.norm_error:.2e}; clipped sum {merged.sum_error:.2e}; "
            f"largest contribution "
            f"{merged.max_contribution:.6f} x zeta (tolerance {tolerance:g})")
    return dataclasses.replace(merged, line=line)


def with_probe(check, probe):
    """``check`` (a merged :class:`ClippingCheck`) with the batch probe's result ``probe``
    (a ``batch_probe.ProbeResult``, training mode): failed, its line extended, when the
    examples reach one another or the model writes state from the data. The comparison
    above runs with ``training=False``; a MixUp layer or batch statistics act in training
    only, so this is where they show."""
    problems = probe.problems()
    if problems:
        verdict = "FAIL - " + " ".join(problems)
    elif probe.rows < 2:
        verdict = "not checked (fewer than 2 examples with different inputs)"
    else:
        verdict = f"PASS ({probe.rows} examples: no example reaches another, no state written from the data)"
    line = f"{check.line}; training mode: {verdict}"
    return dataclasses.replace(check, passed=check.passed and not problems, line=line,
                               training_mode="PASS" if verdict.startswith("PASS") else verdict)
