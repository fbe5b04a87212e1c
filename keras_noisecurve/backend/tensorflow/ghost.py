"""Fast per-example clipping with ghost norms (no per-example gradients).

DP training needs ``Σ_i clip(w_i·∇loss_i, ζ)``: the sum over the P examples of a
batch of each example's (weighted) gradient scaled by ``c_i = min(1, ζ/‖w_i·∇loss_i‖)``
(the clipped sum of docs/design.md#update-rule; paper App. C). The vectorized
engine (:mod:`keras_noisecurve.backend.tensorflow.clipping`) forms all P per-example gradients;
this engine never does:

1. one forward pass records, for every layer with trainable weights, its input
   activation ``a`` and its output ``z`` (the *pre-activation* output for layers
   with a fused ``activation=``: the layer's linear part is run here, then the
   activation applied to it, so ``z`` is the tensor that flows on);
2. one backward pass gives ``g = ∂(Σ_i w_i·loss_i)/∂z`` for every recorded ``z``
   (it stops at the layer outputs: no weight gradients are formed);
3. each layer's per-example squared gradient norm follows from ``(a, g)`` alone
   (``‖a_i‖²‖g_i‖²`` for a dense layer on vectors, Gram forms for sequences,
   grouped per-example kernel gradients or patches for convolutions, ... see
   :mod:`keras_noisecurve.backend.tensorflow.engine_rules`);
   their sum over layers is ``‖w_i·∇loss_i‖²``, giving ``c_i = min(1, ζ/‖·‖)``;
4. the clipped sum ``Σ_i c_i·w_i·∇loss_i`` is the gradient of ``Σ_i c_i·w_i·loss_i``
   with ``c`` held constant. Rather than a second backward pass through the whole
   network, each layer assembles its part from the same ``(a, c ⊙ g)``
   ("book-keeping", Bu et al. 2022): e.g. ``Σ_{i,l} a_il (c_i g_il)ᵀ`` for a kernel,
   exactly the weight-gradient step of an ordinary backward pass; a convolution whose
   per-example kernel gradients step 3 formed sums them, ``Σ_i c_i ∂K_i``, instead.
   Total cost: one forward, one backward without weight gradients, the norms, one
   weight-gradient step.

Recording works by temporarily replacing the ``call`` of each supported layer
instance with a wrapper for the duration of the forward pass
(``keras_noisecurve.backend.common.calls.wrapped_calls`` in its shared mode: under a lock, with a
reference count, so concurrent replicas of ``tf.distribute`` share it safely); the
wrapper records into a thread-local recorder and calls the original ``call`` when no
recording is active in its thread. Inside ``tf.function`` this happens only while
tracing: no Python state survives between steps.

Coverage (:func:`plan`): every layer that owns trainable weights is clipped exactly —
by its ghost-norm rule where one exists (Dense, EinsumDense, Embedding,
Conv1D/Conv2D with groups = 1, LayerNormalization, GroupNormalization, ... see
``engine_rules.RULES``), and otherwise by the per-layer fallback of
:mod:`keras_noisecurve.backend.tensorflow.engine_fallback` (a vector–Jacobian product of that
one layer's call per example: custom layers, KerasHub embeddings, TimeDistributed,
configurations a rule does not handle). Layers without weights of their own
(activations, pooling, reshapes, dropout, containers, attention wrappers) need
nothing, provided they do not mix examples. A layer that sees rows that are not
examples (a broadcast row, token rows) is clipped through its innermost caller that
takes one row per example (:mod:`keras_noisecurve.backend.tensorflow.engine_rows`, found before
any step); so is a layer whose weight other code reads outside its call, through the
innermost per-example caller enclosing that read and the layer's calls
(:mod:`keras_noisecurve.backend.tensorflow.engine_reads`, the same probe). Refused: BatchNormalization
in training mode (it mixes examples), a layer on other rows or a read with no such caller,
and a read the probe did not see that falls outside the plan (checked when the step is traced).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref

import keras
import tensorflow as tf

from keras_noisecurve import _compat
from keras_noisecurve._validation import check_int
from keras_noisecurve.backend.common import norm_observer, units
from keras_noisecurve.backend.common.calls import wrapped_calls
from keras_noisecurve.backend.common.clip import clip_factors
from keras_noisecurve.backend.common.norm_observer import observe_layer_norms  # noqa: F401 - dp_model reads it here
from keras_noisecurve.backend.tensorflow.clipped_sum import ClippedSum, chunked_clipped_sum
from keras_noisecurve.backend.tensorflow import engine_rows
from keras_noisecurve.backend.tensorflow.engine_fallback import CallerRule, GenericRule, RNNFallbackRule, owned_trainable
from keras_noisecurve.backend.tensorflow.engine_rules import RULES, find_rule, probe_affine_scale, register_rule
from keras_noisecurve.backend.tensorflow.engine_reads import callers as callers_of_reads, check_reads

_GENERIC = GenericRule()
_CALLER = CallerRule()

__all__ = ["describe", "ghost_clipped_sum", "plan", "probe_affine_scale", "register_rule", "supports"]


# ------------------------------------------------------------------ the plan


def _is_batch_norm(layer) -> bool:
    import keras

    return isinstance(layer, keras.layers.BatchNormalization)


def _layer_label(layer) -> str:
    return f"{type(layer).__name__} layer '{layer.name}'"


def _children(layer):
    return _compat.flatten_layers(layer, include_self=False, recursive=False)


def plan(model, like=None):
    """How each layer's weights are clipped: ``[(layer, rule, variables)]``.

    Walks the layer tree from ``model``. A layer that owns trainable weights gets its
    ghost-norm rule (:func:`~keras_noisecurve.backend.tensorflow.engine_rules.find_rule`) when it
    has one in a supported configuration, else :class:`GenericRule`, the per-layer
    vector–Jacobian fallback; a rule with ``covers_sublayers`` also takes its
    sublayers' weights (they are not visited). ``variables`` are the layer's
    trainable variables among ``model.trainable_variables``. ``like``: a batch of inputs
    at whose lengths to look for rows that are not examples when the model's input specs
    cannot be traced (:func:`~keras_noisecurve.backend.tensorflow.engine_rows.probe`).

    Raises:
      ValueError: a trainable BatchNormalization (it mixes the examples of a batch) or a
        stateful layer (its state carries examples across batches), naming the layer.
    """
    trainable = {id(v) for v in model.trainable_variables}
    out, seen = [], set()

    def visit(layer):
        if id(layer) in seen:
            return
        seen.add(id(layer))
        if not layer.built and not layer.variables:
            # created but never called (EfficientNet's unused squeeze-and-excite convolutions):
            # no weights to clip, and its rules could not even read its kernel. A frozen layer is
            # still visited: KerasHub's LoRA freezes a layer whose sublayers' biases still train.
            return
        if _is_batch_norm(layer) and layer.trainable and layer.trainable_variables:
            raise ValueError(
                f"{_layer_label(layer)} normalises with batch statistics in training mode, "
                "which mixes examples: per-example clipping is not defined for it "
                "(use GroupNormalization or LayerNormalization — "
                "keras_noisecurve.replace_batch_normalization(model) rebuilds a functional model so — "
                "or freeze it)"
            )
        if getattr(layer, "stateful", False) and layer.trainable_variables:
            raise ValueError(
                f"{_layer_label(layer)} is stateful: its state carries examples of one batch into the "
                "next, so one example's influence is not confined to its own gradient (use stateful=False)"
            )
        rule = find_rule(layer)  # None: no rule takes this layer's configuration, the fallback does
        if rule is not None and rule.covers_sublayers:
            variables = rule.variables(layer, trainable)
            if variables:
                out.append((layer, rule, variables))
            return
        own = owned_trainable(layer, trainable)
        if own:
            out.append((layer, rule or _GENERIC, own))
        for child in _children(layer):
            visit(child)

    visit(model)
    return check_partition(_through_callers(model, out, trainable, like))


def check_partition(entries):
    """``entries`` (``[(layer, rule, variables)]``) unchanged if no variable is in two of
    them. A variable clipped by two rules would have its per-example gradient counted twice
    in every norm and one rule's sum silently replaced by the other's: an internal error,
    raised as one (naming the variable and both layers) rather than trained through."""
    owner = {}
    for layer, _, variables in entries:
        for variable in variables:
            first = owner.setdefault(id(variable), layer)
            if first is not layer:
                raise RuntimeError(
                    f"internal error: the weight '{variable.path}' is clipped by two rules, those of "
                    f"{_layer_label(first)} and {_layer_label(layer)}; please report this model. "
                    "clipping='vectorized' clips it exactly meanwhile."
                )
    return entries


def _through_callers(model, entries, trainable, like=None):
    """``entries`` with every layer that sees rows that are not examples (a broadcast row,
    token rows: :mod:`keras_noisecurve.backend.tensorflow.engine_rows`) or whose weight is read outside
    its own call (:mod:`keras_noisecurve.backend.tensorflow.engine_reads`) clipped through its
    innermost caller whose call takes one row per example: the outermost of nested callers,
    with all its sublayers' weights, replaces the entries inside it."""
    found = list(engine_rows.callers(model, [layer for layer, _, _ in entries], like).values())
    found += list(callers_of_reads(model, entries, like).values())
    if not found:
        return entries
    callers = list({id(c): c for c in found}.values())
    subtree = {id(c): {id(layer) for layer in _compat.flatten_layers(c)} for c in callers}
    callers = [c for c in callers if not any(d is not c and id(c) in subtree[id(d)] for d in callers)]
    covered = set().union(*(subtree[id(c)] for c in callers))
    out = [entry for entry in entries if id(entry[0]) not in covered]
    for caller in callers:
        variables = [v for v in caller.trainable_variables if id(v) in trainable]
        if variables:
            out.append((caller, _CALLER, variables))
    return out


def supports(model):
    """Whether :func:`ghost_clipped_sum` can clip ``model``.

    Every layer that owns trainable weights is covered, by its ghost-norm rule or by
    the per-layer fallback (:mod:`keras_noisecurve.backend.tensorflow.engine_fallback`); what
    remains unsupported is a layer that mixes the examples of a batch (a trainable
    BatchNormalization), a layer on rows that are not examples or a weight read outside
    its own layer's call with no per-example caller (found by the probe of
    :mod:`~keras_noisecurve.backend.tensorflow.engine_rows`; a model it cannot probe is checked when
    the step is traced), and an unbuilt model.

    Returns:
        ``(True, "")`` or ``(False, reason)``, ``reason`` naming the layer and why.
    """
    import keras

    if not isinstance(model, keras.layers.Layer):
        return False, f"expected a Keras model or layer, got {type(model).__name__}"
    if not model.built:
        return False, f"model '{model.name}' is not built (call it once or build it first)"
    try:
        plan(model)
    except ValueError as error:
        return False, str(error)
    return True, ""


def describe(model, x=None, *, inside: bool = False) -> list:
    """``[(layer name, class, how)]`` for every layer with trainable weights: ``how`` is
    the rule's kind (e.g. ``"Dense"``) or ``"generic"`` for the per-layer fallback; a caller
    that clips the layers under it (rows that are not examples, weights read outside their
    layer's call; also a TimeDistributed or recurrent layer with its sublayers) is listed
    in their place. ``inside=True`` lists those layers too, each right after its caller,
    with ``how`` = ``"through '<caller name>'"``. ``x`` (a batch of inputs) is not needed:
    this engine plans from the layers."""
    if not isinstance(inside, bool):
        raise TypeError(f"inside must be True or False, got {inside!r}.")
    trainable = {id(v) for v in model.trainable_variables}
    out = []
    for layer, rule, _ in plan(model):
        out.append((layer.name, type(layer).__name__, rule.kind))
        if inside and rule.covers_sublayers:
            out += [(sub.name, type(sub).__name__, f"through '{layer.name}'")
                    for sub in _compat.flatten_layers(layer, include_self=False) if owned_trainable(sub, trainable)]
    return out


# ---------------------------------------------------------------------- recording

_LOCAL = threading.local()


class _Recorder:
    """Per-call store of the tensors recorded by the wrapped layers (one thread)."""

    def __init__(self):
        self.calls: dict[int, list[dict]] = {}
        self.layers: dict[int, object] = {}
        self.spans: dict[int, list[tuple]] = {}  # id(layer) -> graph versions around each call

    def record_for(self, layer):
        def record(**tensors):
            self.layers[id(layer)] = layer
            self.calls.setdefault(id(layer), []).append(tensors)

        return record


def _first_argument(original_call):
    """The name of the first parameter of a layer's ``call`` (its inputs), or ``None``."""
    try:
        params = list(inspect.signature(original_call).parameters.values())
    except (TypeError, ValueError):
        return None
    first = params[0] if params else None
    return first.name if first is not None and first.kind in (first.POSITIONAL_OR_KEYWORD, first.KEYWORD_ONLY) else None


def _make_wrapper(layer, rule, original_call):
    first = _first_argument(original_call)

    def call(*args, **kwargs):
        # a caller may pass the inputs by keyword (``layer(hidden_states=x)``, Keras's own
        # ``call(inputs=...)``): the rules take them as the first positional argument
        if not args and first in kwargs:
            args = (kwargs.pop(first),)
        if not args:
            raise TypeError(f"{_layer_label(layer)} was called without inputs (positional or {first!r}=...)")
        inputs, args = args[0], args[1:]
        recorder = getattr(_LOCAL, "recorder", None)
        if recorder is None:
            return original_call(inputs, *args, **kwargs)
        graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
        before = graph.version if graph is not None else None
        out = rule.forward(layer, original_call, recorder.record_for(layer), inputs, *args, **kwargs)
        if graph is not None:
            recorder.spans.setdefault(id(layer), []).append((graph, before, graph.version))
        return out

    return call


@contextlib.contextmanager
def _recording(layers_and_rules):
    """Wrap the supported layers (shared with other threads' recordings of the same layers)
    and record in this thread; yields the :class:`_Recorder`."""
    if getattr(_LOCAL, "recorder", None) is not None:
        raise RuntimeError("ghost_clipped_sum cannot be nested inside another ghost_clipped_sum call.")
    rules = {id(layer): rule for layer, rule in layers_and_rules}
    recorder = _Recorder()
    with wrapped_calls([layer for layer, _ in layers_and_rules], shared=True,
                       wrap=lambda layer, original: _make_wrapper(layer, rules[id(layer)], original)):
        _LOCAL.recorder = recorder
        try:
            yield recorder
        finally:
            _LOCAL.recorder = None


# ------------------------------------------------------------------------ engine


def _check_clip(l2_norm_clip):
    if isinstance(l2_norm_clip, (tf.Tensor, tf.Variable)):
        return l2_norm_clip
    if isinstance(l2_norm_clip, bool) or not isinstance(l2_norm_clip, (int, float)):
        try:
            l2_norm_clip = float(l2_norm_clip)
        except (TypeError, ValueError):
            raise TypeError(
                f"l2_norm_clip must be a positive number, got {l2_norm_clip!r} "
                f"({type(l2_norm_clip).__name__})."
            ) from None
    if not l2_norm_clip > 0 or l2_norm_clip == float("inf"):
        raise ValueError(f"l2_norm_clip must be a finite number > 0, got {l2_norm_clip}.")
    return float(l2_norm_clip)


def _check_rows(layer, g, per_example_loss, groups=False):
    """A recorded layer must see one row per example (not, e.g., examples × time), or, for
    a caller of layers on other rows (``groups``: its input rows were probed to be the
    examples), k rows per example in example-major order."""
    rows, examples = g.shape[0], per_example_loss.shape[0]
    message = (
        f"{_layer_label(layer)} was called on a tensor whose first axis is not the batch "
        "of examples (a broadcast row, or examples reshaped into rows); ghost clipping "
        "cannot attribute its gradient to examples. Put the code that broadcasts or reshapes "
        "the batch, and the layers it feeds, in one layer whose call takes and returns one "
        "row per example: its weights are then clipped through that layer; or use clipping='vectorized' "
        "(the reference engine: an exact per-example loop, about P times a single gradient's cost)."
    )
    if rows is not None and examples is not None:
        if rows != examples and not (groups and rows >= examples and examples and rows % examples == 0):
            raise ValueError(message + f" ({rows} rows for {examples} examples)")
    elif groups:
        tf.debugging.assert_equal(tf.shape(g)[0] % tf.shape(per_example_loss)[0], 0, message=message)
    else:
        tf.debugging.assert_equal(tf.shape(g)[0], tf.shape(per_example_loss)[0], message=message)


def _differentiable(t) -> bool:
    return isinstance(t, (tf.Tensor, tf.Variable)) and (t.dtype.is_floating or t.dtype.is_complex)


def _per_unit(entries, unit_rows):
    """The plan of a user-level step (``unit_rows`` k > 1): a rule that gives per-unit norms on merged
    rows (:func:`units.merges`) is kept, and so is every per-layer fallback (its per-example gradients
    are summed per unit); any other layer is clipped by the fallback, through its own call (with its
    sublayers' weights where its rule covered them)."""
    if unit_rows == 1:
        return entries
    out = []
    for layer, rule, variables in entries:
        builtin = any(rule is r for r in RULES)  # not a user's rule
        if not isinstance(rule, GenericRule) and not units.merges(rule.kind, layer, builtin=builtin):
            if rule.covers_sublayers:
                rule = RNNFallbackRule() if isinstance(layer, keras.layers.RNN) else CallerRule()
            else:
                rule = _GENERIC
        out.append((layer, rule, variables))
    return out


_MERGED = ("a", "g", "ids", "saved")  # what the rules of units.MERGED_KINDS read of a call


def _merged(key, value, unit_rows):
    """A recorded entry of a call with a unit's rows made its positions (what a kernel saved in its
    forward too: a norm's x̂ has the input's rows)."""
    if key not in _MERGED or value is None:
        return value
    if isinstance(value, dict):
        return {k: units.merge_rows(v, unit_rows) for k, v in value.items()}
    return units.merge_rows(value, unit_rows)


def _ghost_step(model, loss_fn, x, y, sample_weight, clip, training, entries, unit_rows=1):
    variables = model.trainable_variables
    layers_and_rules = [(layer, rule) for layer, rule, _ in entries]
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    first_op = graph.version if graph is not None else None
    with _recording(layers_and_rules) as recorder:
        with tf.GradientTape() as tape:
            y_pred = model(x, training=training)
            per_example_loss = loss_fn(y, y_pred)
    if graph is not None:
        check_reads(entries, recorder.spans, graph, first_op, graph.version)
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    if per_example_loss.shape.rank != 1:
        raise ValueError(
            "loss_fn must return the per-example loss of shape (P,), got shape "
            f"{per_example_loss.shape}."
        )
    dtype = per_example_loss.dtype
    if sample_weight is None:
        weights = tf.ones_like(per_example_loss)
    else:
        weights = tf.reshape(tf.cast(sample_weight, dtype), tf.shape(per_example_loss))

    # every recorded call's differentiable outputs, flattened: one backward pass for all
    calls = [(entry, c) for entry in entries for c in recorder.calls.get(id(entry[0]), [])]
    flat = [tf.nest.flatten(c["out"]) for _, c in calls]
    targets = [t for outs in flat for t in outs if _differentiable(t)]
    if graph is not None:
        for ((layer, _, _), c), outs in zip(calls, flat):
            if any(_differentiable(t) and t.graph is not per_example_loss.graph for t in outs):
                raise ValueError(
                    f"{_layer_label(layer)} is called inside a loop (tf.while_loop / scan) of an enclosing "
                    "layer's call, where its output has no per-example gradient of its own. Give the "
                    "enclosing layer the weights, or use clipping='vectorized' (the reference engine: an exact per-example "
                    "loop, about P times a single gradient's cost)"
                )
    gs = tape.gradient(
        per_example_loss, targets, output_gradients=weights, unconnected_gradients=tf.UnconnectedGradients.ZERO
    ) if targets else []
    del tape
    gs = iter(gs)
    by_layer = {}
    for ((layer, rule, own), c), outs in zip(calls, flat):
        g = [next(gs) if _differentiable(t) else None for t in outs]
        for gk in g:
            if gk is not None:
                _check_rows(layer, gk, per_example_loss, groups=isinstance(rule, CallerRule))
        c = {**c, "g": g if isinstance(rule, GenericRule) else g[0]}
        if unit_rows > 1 and not isinstance(rule, GenericRule):  # a unit's rows become its positions
            c = {key: _merged(key, v, unit_rows) for key, v in c.items()}
        by_layer.setdefault(id(layer), (layer, rule, own, []))[3].append(c)

    norm_dtype = tf.float64 if dtype == tf.float64 else tf.float32
    unit_loss = per_example_loss if unit_rows == 1 else units.unit_losses(per_example_loss, unit_rows)
    sq = tf.zeros_like(unit_loss, dtype=norm_dtype)
    grad_fns = []
    observer = norm_observer.observer()
    for layer, rule, own, layer_calls in by_layer.values():
        if isinstance(rule, GenericRule):
            layer_sq, grad_fn = rule.analyse(layer, layer_calls, own, unit_rows=unit_rows)
        else:
            layer_sq, grad_fn = rule.analyse(layer, layer_calls)
        sq += tf.cast(layer_sq, norm_dtype)
        grad_fns.append(grad_fn)
        if observer is not None:
            observer.append((layer, rule, own, layer_sq))
    norms = tf.sqrt(sq)
    # a Python ζ goes straight to the norms' dtype (a float64 model keeps all 53 bits)
    clip = tf.cast(clip, norm_dtype) if isinstance(clip, (tf.Tensor, tf.Variable)) else tf.constant(clip, norm_dtype)
    # An example whose loss or gradient norm is not finite is dropped: c_i = 0 exactly, and
    # every rule's sum over the batch replaces the rows with c_i = 0 by zeros (tf.where in
    # engine_forms.keep_rows), so its inf/nan rows of (a, g) reach no other example's sum.
    factors, keep = clip_factors(norms, tf.cast(unit_loss, norm_dtype), clip)
    nonfinite = tf.logical_not(keep)
    if unit_rows > 1:  # a unit's norm and drop on each of its rows
        norms, nonfinite = units.per_row(norms, unit_rows), units.per_row(nonfinite, unit_rows)
    factors = tf.stop_gradient(factors)
    # g already carries w_i, so scaling by c_i gives Σ_i c_i·w_i·∇loss_i per variable.
    by_variable = {}
    for grad_fn in grad_fns:
        for variable, grad in grad_fn(factors):
            by_variable[id(variable)] = grad
    grads = [
        tf.cast(by_variable[id(v)], v.dtype) if id(v) in by_variable else tf.zeros(v.shape, v.dtype)
        for v in variables
    ]
    return ClippedSum(
        grads=grads,
        norms=tf.cast(norms, dtype),
        per_example_loss=per_example_loss,
        y_pred=y_pred,
        nonfinite=nonfinite,
    )


_READS_CHECKED = weakref.WeakKeyDictionary()  # model -> True once its traced forward was checked


def _check_reads_once(model, x, training, entries):
    """In eager mode, trace the forward pass once (never run it) to check where weights are read."""
    if _READS_CHECKED.get(model):
        return
    layers_and_rules = [(layer, rule) for layer, rule, _ in entries]

    def forward(x):
        graph = tf.compat.v1.get_default_graph()
        start = graph.version
        with _recording(layers_and_rules) as recorder:
            out = model(x, training=training)
        check_reads(entries, recorder.spans, graph, start, graph.version)
        return tf.nest.flatten(out)[0]

    spec = tf.nest.map_structure(lambda t: tf.TensorSpec.from_tensor(tf.convert_to_tensor(t)), x)
    tf.function(forward).get_concrete_function(spec)
    _READS_CHECKED[model] = True


def ghost_clipped_sum(
    model,
    loss_fn,
    x,
    y,
    sample_weight,
    *,
    l2_norm_clip,
    microbatch_size=None,
    training=True,
    unit_rows=1,
):
    """Clipped sum of per-example gradients via ghost norms (no per-example gradients).

    Computes ``Σ_i clip(w_i·∇loss_i, ζ)`` with ``clip(v, ζ) = v·min(1, ζ/‖v‖)`` (the
    clipped sum of docs/design.md#update-rule, paper App. C; noise is added by
    the optimizer), with two backward passes and per-layer norm identities instead of
    P per-example gradients. Same engine contract
    (:mod:`keras_noisecurve.backend.tensorflow.clipped_sum`) as
    :func:`keras_noisecurve.backend.tensorflow.clipping.vectorized_clipped_sum`.

    Args:
        model: a built Keras 3 model for which :func:`supports` is true.
        loss_fn: ``loss_fn(y_true, y_pred) -> (P,)`` unreduced per-example loss.
        x, y: a batch of P examples (any structure the model / loss accept).
        sample_weight: (P,) weights ``w_i`` multiplying each example's loss before
            clipping (0 for the padding of the batch sampler), or ``None`` (all 1).
        l2_norm_clip: ζ > 0, the clipping norm (same units as the gradient).
        microbatch_size: ``None`` (whole batch at once) or a positive integer m: the
            batch is processed in consecutive chunks of m examples (``tf.while_loop``;
            the last chunk may be shorter) to bound peak memory; the result is the
            same (per-example clipping does not depend on the chunking).
        training: passed to the model call (dropout etc.).
        unit_rows: k, the rows of one privacy unit (a user-level run's examples per user; 1:
            every row is a unit): ``Σ_u clip(Σ_{i ∈ u} w_i·∇loss_i, ζ)`` over units of k
            consecutive rows (:mod:`keras_noisecurve.backend.common.units`); a ``microbatch_size`` is
            rounded down to whole units.

    Returns:
        ``ClippedSum(grads, norms, per_example_loss, y_pred, nonfinite)``: ``grads``
        aligned with ``model.trainable_variables``; ``norms`` (P,) the norms
        ``‖w_i·∇loss_i‖`` before clipping; ``per_example_loss`` (P,) unweighted;
        ``y_pred`` the outputs; ``nonfinite`` (P,) bool, the examples whose loss or
        gradient norm is not finite, which contribute exactly 0 to ``grads``.

    Raises:
        ValueError: the model is not supported (see :func:`supports`), e.g. it has a
            custom layer with its own weights or a BatchNormalization in training mode.
    """
    ok, reason = supports(model)
    if not ok:
        raise ValueError(f"ghost_clipped_sum cannot clip this model exactly: {reason}.")
    clip = _check_clip(l2_norm_clip)
    if microbatch_size is not None:
        microbatch_size = check_int("microbatch_size", microbatch_size, minimum=1)
    if training is not None and not isinstance(training, bool):
        raise TypeError(f"training must be True, False or None, got {training!r}.")
    unit_rows = check_int("unit_rows", unit_rows, minimum=1)
    if unit_rows > 1:
        rows = tf.nest.flatten(x)[0].shape[0]
        if rows is not None:
            units.check_rows(int(rows), unit_rows)
    entries = plan(model, like=x)
    if tf.executing_eagerly():
        _check_reads_once(model, x, training, entries)
    entries = _per_unit(entries, unit_rows)

    def step(x_chunk, y_chunk, w_chunk):
        return _ghost_step(model, loss_fn, x_chunk, y_chunk, w_chunk, clip, training, entries, unit_rows)

    if microbatch_size is None:
        return step(x, y, sample_weight)
    return chunked_clipped_sum(step, x, y, sample_weight, max(1, microbatch_size // unit_rows) * unit_rows)
