"""Per-layer ghost-norm clipping on the JAX backend (``make_private(model, clipping="auto")``
or ``"ghost"``): ``Σ_i clip(w_i·∇loss_i, ζ)`` and the norms ``‖w_i·∇loss_i‖`` without
the per-example gradients of the whole model, all inside the jitted train step.

1. Recording. Every layer that owns trainable weights has its instance's ``call``
   replaced, while the step is traced, by a wrapper (restored in ``finally``): it keeps
   the call's arguments and adds a zero perturbation ``e_k`` (an argument of the
   differentiated function, shaped like that call's output, learnt by ``jax.eval_shape``
   of the same recorded call) to every floating output. For Dense and EinsumDense the
   perturbation goes before the fused activation (the rule needs the linear output); a
   kernel with a ``forward`` (norms, recurrent layers, ...) has it run in place of the call,
   and its ``z`` is perturbed too (``layer_rules.layer_kernel``).
2. One ``jax.value_and_grad`` of ``Σ_i w_i·loss_i`` with respect to the perturbations
   gives ``g_k = ∂(Σ_i w_i·loss_i)/∂z_k`` for every recorded output ``z_k`` (from outside the
   layer only); the weights are constants of that function, so no weight gradient is formed.
3. Per layer, the per-example squared norms of ITS weights' gradient: a rule of
   :mod:`keras_noisecurve.backend.common.kernel_rules` (a kernel of ``backend/common/ghost_*``: Dense,
   EinsumDense, Embedding, norms, convolutions, LoRA, RMS norms, KerasHub's embeddings, LSTM, GRU,
   SimpleRNN) from the recorded ``(a, g)`` (the rule runs under a
   stateless scope of the step's weight values), else the exact per-layer fallback:
   ``jax.vmap`` over examples of ``∂⟨layer(W; a_i), g_i⟩/∂W`` (the VJP of that one
   layer's call, every model weight mapped to its traced value, W its own weights).
   Summed over layers: ``‖w_i·∇loss_i‖²``; ``c_i = min(1, ζ/‖w_i·∇loss_i‖)``.
4. The clipped sum per layer from the same quantities ("book-keeping"), e.g.
   ``Σ_{i,l} a_il (c_i g_il)ᵀ`` for a kernel, ``Σ_i c_i G_i`` for a fallback layer.

Rows that are not examples (:mod:`keras_noisecurve.backend.common.row_probe`): a recorded call
whose floating outputs or first array argument do not have the batch size P as their leading
dimension (ViT's broadcast position ids (1, L), Mixtral's P·L router rows), a weighted layer
called inside a JAX control-flow body of a custom layer (``keras.ops.fori_loop``, ``scan``), and a
weight read outside its own layer's ``call`` (every variable read of the shape pass goes through a
reporting stateless scope) cannot be attributed to examples by that layer's rule. The shape pass
(``jax.eval_shape`` of the recorded forward pass) finds them and routes each to its innermost
enclosing CALLER: a layer whose every call takes P rows in its first array argument and returns P
or k·P rows (example-major) in each floating output, enclosing every call of the problem layer
(and the read), and tracking its weights. That caller becomes ONE target clipped whole by the
fallback (its ``vmap`` VJP covers every weight under it; a k·P-row output is split into P groups
of k rows), the layers under it are no longer recorded, and the shape pass runs again until
nothing is left (:func:`_plan`). Only when no layer but the model itself encloses the problem does
``clipping="auto"`` use the exact vectorized engine (``jax.vmap`` of the whole model's gradient)
and ``clipping="ghost"`` refuse with a ValueError naming the layer or weight, when the step is
first traced. Keras's recurrent layers are targets whole from the start (:func:`targets`).
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import keras

from keras_noisecurve import _compat
from keras_noisecurve._losses import float32_outputs
from keras_noisecurve.backend.common import kernel_rules, layer_rules, norm_forms, norm_observer, row_probe, units
from keras_noisecurve.backend.common.calls import training_kwargs, wrapped_calls
from keras_noisecurve.backend.common.clip import clip_factors
from keras_noisecurve.backend.common.kernel_rules import (
    find_rule, forward_of, is_registered, register_rule, uses_pre_activation)
from keras_noisecurve.backend.common.model_checks import input_batch

__all__ = ["describe", "ghost_clipped_sum", "ghost_norms", "probe_affine_scale", "register_rule", "targets"]

_F32 = jnp.float32

#: Full float32 precision for the rules' products. On a GPU, JAX's default precision lets a
#: float32 matmul run in TensorFloat-32 (about 3 decimal digits): a rule's norm
#: ``Σ (a·a')(g·g')`` and its book-keeping sum ``Σ a (c g)ᵀ`` would then round differently,
#: and an example's clipped contribution could exceed ζ by ~1e-3 relative, more than the
#: sensitivity the accounting assumes. The model's own forward and backward pass keep the
#: user's precision; the per-layer fallback computes norms and sums from the same arrays.
_EXACT = jax.default_matmul_precision("highest")

#: ``probe_affine_scale(layer) -> bool`` (``kernel_rules``): the layer's call runs at compile time, concrete in a trace
probe_affine_scale = kernel_rules.affine_scale_probe(scope=jax.ensure_compile_time_eval)


def targets(model, groups=()):
    """The layers of ``model`` that own trainable weights, with those weights:
    a list of ``(layer, [variable, ...])`` in Keras's depth-first order.

    A recurrent layer (``keras.layers.RNN`` and its subclasses) is one target with every
    trainable weight under it: its cell runs inside ``jax.lax.scan``, whose body cannot be
    recorded per call, so the whole layer is clipped at once, by the recurrent kernel
    (``backend/common/ghost_rnn``, whose forward records the input projections and the states)
    or else by the per-layer fallback. So is each
    layer of ``groups`` (callers of layers whose rows are not examples,
    :mod:`~keras_noisecurve.backend.common.row_probe`): the layers under it are not targets."""
    trainable_ids = {id(v) for v in model.trainable_variables}
    whole = {id(layer) for layer in groups}
    found, covered = [], set()
    for layer in _compat.flatten_layers(model, include_self=True, recursive=True):
        if id(layer) in covered:
            continue
        if isinstance(layer, keras.layers.RNN) or id(layer) in whole:
            covered.update(id(sub) for sub in _compat.flatten_layers(layer, include_self=False, recursive=True))
            owned = [v for v in layer.trainable_variables if id(v) in trainable_ids]
        else:
            owned = [v for v in _compat.own_trainable_variables(layer) if id(v) in trainable_ids]
        if owned:
            found.append((layer, owned))
    return found


def _is_array(x):
    return isinstance(x, (jax.Array, jax.core.Tracer)) or hasattr(x, "shape") and hasattr(x, "dtype")


def _floating(x):
    return _is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)


class _Recorder:
    """Trace-time state of one recorded forward pass (no Python state survives the trace)."""

    def __init__(self, layers, perturbations=None):
        self.layers = layers
        self.forwards = [forward_of(layer) for layer in layers]  # a kernel's forward, run in place of call
        self.perturbations = perturbations  # None: learn the shapes (jax.eval_shape)
        self.calls = []  # per call: layer index, args treedef, static leaves, array positions
        self.arrays = []  # per call: the array leaves of (args, kwargs)
        self.saved = []  # per call: what its kernel's forward saved, or None
        self.shapes = []  # per perturbation: jax.ShapeDtypeStruct
        self.bare = None  # layer index whose call runs bare (fallback re-run); others pass through
        self.active = []  # indices of the recorded layers whose call is running (innermost last)
        self.owner = {}  # id(trainable variable) -> index of the layer that owns it (the shape pass)
        self.outside = []  # (variable path, reading layers, owner index, enclosing chain) of outside reads
        self.probe = None  # the shape pass's row_probe.Probe (its stack: the layer calls running now)

    def read(self, variable):
        """Called for every variable read of the shape pass (:class:`_ReadScope`)."""
        owner = self.owner.get(id(variable))
        if owner is not None and owner not in self.active:
            chain = tuple(self.probe.stack) if self.probe is not None else ()
            self.outside.append((variable.path, [self.layers[i].name for i in self.active], owner, chain))

    def call(self, index, original, args, kwargs):
        self.active.append(index)
        try:
            return self._call(index, original, args, kwargs)
        finally:
            self.active.pop()

    def _perturbed(self, leaf):
        """``leaf`` plus its perturbation, and the perturbation's index."""
        k = len(self.shapes)
        self.shapes.append(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        return (leaf if self.perturbations is None else leaf + self.perturbations[k]), k

    def _call(self, index, original, args, kwargs):
        layer = self.layers[index]
        forward = self.forwards[index] if args else None  # inputs given by keyword: the call as it is
        pre = forward is None and uses_pre_activation(layer)
        if self.bare is not None or self.perturbations is False:
            if self.bare == index and pre:
                return _without_activation(layer, original, args, kwargs)
            return original(*args, **kwargs)
        activation = pre and layer.activation is not None
        z_slot, saved, z = None, None, None
        if forward is not None:  # the kernel's z (its gradient is the kernel's "g") and what it saves
            inner, got = getattr(original, "unprobed", original), {}  # under the shape pass's probe: it sees the call

            def run():
                z, after = forward(layer, inner, *args, **kwargs)
                got["z"], got["slot"] = self._perturbed(z)
                out, got["saved"] = after(got["z"])
                return out

            out = run() if inner is original else self.probe.around(layer, run, args, kwargs)
            z, z_slot, saved = got["z"], got["slot"], got["saved"]
        else:
            out = _without_activation(layer, original, args, kwargs) if activation else original(*args, **kwargs)
        leaves, tree = jax.tree_util.tree_flatten(out)
        slots = []  # the outputs' perturbations (the fallback's seeds); an output that is z shares z's
        for j, leaf in enumerate(leaves):
            if leaf is z:
                slots.append(z_slot)
            elif _floating(leaf):
                leaves[j], k = self._perturbed(leaf)
                slots.append(k)
        out = jax.tree_util.tree_unflatten(tree, leaves)
        flat, arg_tree = jax.tree_util.tree_flatten((args, kwargs))
        positions = [j for j, leaf in enumerate(flat) if _is_array(leaf)]
        static = [None if _is_array(leaf) else leaf for leaf in flat]
        self.calls.append({"layer": index, "tree": arg_tree, "static": static, "positions": positions, "slots": slots,
                           "z": z_slot, "single": z_slot is not None or len(leaves) == 1 and len(slots) == 1})
        self.arrays.append([flat[j] for j in positions])
        self.saved.append(None if saved is None else {key: jax.lax.stop_gradient(v) for key, v in saved.items()})
        if activation:
            out = layer.activation(out)
        return out


class _ReadScope(keras.StatelessScope):
    """Keras's stateless scope (the variables' values from ``state_mapping``) that reports every
    variable read to ``on_read``: the shape pass finds weights read outside their own layer's call."""

    def __init__(self, on_read, **kwargs):
        super().__init__(**kwargs)
        self._on_read = on_read

    def get_current_value(self, variable):
        self._on_read(variable)
        return super().get_current_value(variable)


def _tracking_call(model, trainable, non_trainable, x, training, recorder):
    """``model.stateless_call`` (outputs only) under a :class:`_ReadScope` reporting to ``recorder``."""
    recorder.owner = {id(v): index for index, (_, owned) in enumerate(recorder.targets) for v in owned}
    mapping = list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))
    with _ReadScope(recorder.read, state_mapping=mapping):
        return model.call(x, **training_kwargs(model, training))


def _without_activation(layer, original, args, kwargs):
    saved = layer.activation
    object.__setattr__(layer, "activation", None)
    try:
        return original(*args, **kwargs)
    finally:
        object.__setattr__(layer, "activation", saved)


@contextlib.contextmanager
def _recording(recorder):
    """Replace the ``call`` of every recorded layer instance (trace time only)."""
    positions = itertools.count()  # wrap is called once per layer, in order: its index in recorder.layers

    def wrap(layer, original):
        index = next(positions)

        def wrapped(*args, **kwargs):
            return recorder.call(index, original, args, kwargs)

        return wrapped

    with wrapped_calls(recorder.layers, wrap=wrap):
        yield recorder


def _rebuild(call, arrays):
    flat = list(call["static"])
    for j, value in zip(call["positions"], arrays):
        flat[j] = value
    return jax.tree_util.tree_unflatten(call["tree"], flat)


def _rows_problem(layer, call, arrays, shapes, size, grouped=False):
    """Why the call's rows are not the P examples (``None`` when they are; a caller clipped whole,
    ``grouped``, may return k·P rows, example-major)."""
    outs = [shapes[k].shape[0] if len(shapes[k].shape) else None for k in call["slots"]]
    first = next((a for a in arrays if len(a.shape) >= 1), None)
    rows_in = size if first is None else first.shape[0]
    if row_probe.rows_ok(rows_in, outs, size, grouped=grouped):
        return None
    return (f"layer {layer.name!r} ({type(layer).__name__}) is called on rows that are not the batch's "
            f"{size} examples (leading dimensions {outs + ([] if first is None else [rows_in])})")


_ADVICE = ("Use clipping='auto' (which then clips this model with the exact vectorized engine) or "
           "clipping='vectorized', or put the code that broadcasts, reshapes or loops and the layers it feeds in "
           "one layer whose call takes and returns one row per example (it is then clipped whole).")


def _problems(recorder, probe, found, size, groups, leaked):
    """What the shape pass found that the recorded layers cannot attribute to examples: a list
    of ``(chains, variables, message)``, ``chains`` the enclosing call chains a caller must be
    common to (:meth:`row_probe.Probe.caller`), ``variables`` the weights it must track."""
    if leaked is not None:  # the pass stopped there: the rest is seen in the next pass
        return [([probe.leak] if probe.leak else [], [], (
            "clipping='ghost' on JAX: a layer with trainable weights is called inside a JAX control-flow body "
            "(keras.ops.scan/fori_loop/while_loop in a custom layer's call), where its calls cannot be recorded "
            "one by one, and no layer enclosing that loop takes one row per example. " + _ADVICE))]
    layers = [layer for layer, _ in found]
    out, seen = [], set()
    for path, readers, owner, chain in recorder.outside:
        if path in seen:
            continue
        seen.add(path)
        where = f"inside the call of {', '.join(repr(r) for r in readers)}" if readers else "outside any layer"
        out.append(([chain] + probe.chains(layers[owner]), found[owner][1], (
            f"clipping='ghost' on JAX: the weight {path!r} is read {where}, not by the layer that owns it "
            "(e.g. a tied output projection reading an embedding table), and no layer enclosing both the read "
            "and its owner takes one row per example; the ghost engine would miss that part of its per-example "
            "gradient. " + _ADVICE)))
    bad = set()
    for call, arrays in zip(recorder.calls, recorder.arrays):
        index = call["layer"]
        layer = layers[index]
        problem = _rows_problem(layer, call, arrays, recorder.shapes, size, grouped=id(layer) in groups)
        if problem is not None and index not in bad:
            bad.add(index)
            out.append((probe.chains(layer), found[index][1], (
                f"clipping='ghost' on JAX: {problem}, and no layer calling it takes one row per example; the "
                "ghost engine attributes each row of a layer's input and output to one example. " + _ADVICE)))
    return out


def _is_leak(err) -> bool:  # JAX's report of a tracer leaked out of a control-flow body
    return "Leaked trace" in str(err) or isinstance(err, jax.errors.UnexpectedTracerError)

def _plan(model, forward, size, strict):
    """The targets of one step: ``(found, shapes, grouped)``, ``found`` as :func:`targets` gives them
    once every layer whose rows are not examples (or called in a control-flow body, or whose weight
    is read outside its call) is clipped through its caller (``common/row_probe.py``), ``shapes``
    the perturbations' shapes, ``grouped`` the callers' ids. Each shape pass (``jax.eval_shape``)
    that finds a problem adds its callers and runs again. ``None`` (``strict`` false) or ValueError
    (``strict``) when a problem has no caller but the model itself."""
    groups = []
    for _ in range(len(list(_compat.flatten_layers(model))) + 1):
        found = targets(model, groups)
        recorder = _Recorder([layer for layer, _ in found])
        probe = row_probe.Probe(model, is_leak=_is_leak, flatten=jax.tree_util.tree_leaves, floating=_floating)
        recorder.targets, recorder.probe = found, probe
        leaked = None
        try:
            with probe.installed(), jax.checking_leaks():  # a recorded call in a control-flow body leaks
                jax.eval_shape(lambda: forward(None, recorder))
        except Exception as err:  # noqa: BLE001 - jax.checking_leaks raises a plain Exception("Leaked trace ...")
            if not _is_leak(err):
                raise
            leaked = err
        problems = _problems(recorder, probe, found, size, {id(g) for g in groups}, leaked)
        if not problems:
            return found, recorder.shapes, {id(g) for g in groups}
        added = []
        for chains, variables, message in problems:
            caller = probe.caller(chains, variables, size, exclude=groups)
            if caller is None:
                if not strict:
                    return None
                raise ValueError(message) from leaked
            if not any(caller is g for g in added):
                added.append(caller)
        groups.extend(added)
    raise AssertionError("the ghost engine's plan did not settle")  # each pass adds a new caller: unreachable


def _fallback(model, layer, owned, calls, grads, trainable, non_trainable, recorder, size, unit_rows=1):
    """Per-example gradients (P, *shape) of ``layer``'s own weights (every weight under a caller
    clipped whole), summed over its calls: ``jax.vmap`` over examples of the VJP of the layer's call
    at its recorded arguments, seeded with example i's rows of the gradient at each output (rows
    i·k … i·k + k − 1 of an output with k·P rows). With ``unit_rows`` u > 1, per unit (P/u, *shape):
    the vmap runs over units, each the layer's call on its u rows."""
    u = int(unit_rows)
    units_of = size // u
    owned_ids = [id(v) for v in owned]
    index = {id(v): j for j, v in enumerate(model.trainable_variables)}
    mapping_rest = list(zip(model.non_trainable_variables, non_trainable))
    index_of_layer = recorder.layers.index(layer)
    total = None
    for call, arrays in calls:
        batched = [a.ndim >= 1 and a.shape[0] == size for a in arrays]
        # example (unit) i's rows of each output: P rows, or k·P rows of a caller, example-major
        seeds = [jnp.reshape(grads[k], (units_of, grads[k].shape[0] // units_of) + grads[k].shape[1:])
                 for k in call["slots"]]
        rows = [jnp.reshape(a, (units_of, u) + a.shape[1:]) if b and u > 1 else a for a, b in zip(arrays, batched)]

        def inner(weights, example_arrays, example_seeds, call=call, arrays=arrays, batched=batched):
            values = list(trainable)
            for vid, w in zip(owned_ids, weights):
                values[index[vid]] = w
            full = [(e if u > 1 else e[None]) if b else a for e, a, b in zip(example_arrays, arrays, batched)]
            args, kwargs = _rebuild(call, full)
            mapping = list(zip(model.trainable_variables, values)) + mapping_rest
            recorder.bare = index_of_layer  # this layer as recorded (pre-activation), the others plain
            try:
                with _recording(recorder), keras.StatelessScope(state_mapping=mapping):
                    out = layer(*args, **kwargs)
            finally:
                recorder.bare = None
            leaves = [leaf for leaf in jax.tree_util.tree_leaves(out) if _floating(leaf)]
            return sum(jnp.vdot(leaf.astype(_F32), s.astype(_F32)) for leaf, s in zip(leaves, example_seeds))

        owned_values = [trainable[index[vid]] for vid in owned_ids]
        in_axes = (None, [0 if b else None for b in batched], [0] * len(seeds))
        per = jax.vmap(jax.grad(inner), in_axes=in_axes)(owned_values, rows, seeds)
        total = per if total is None else [t + p for t, p in zip(total, per)]
    return [t.astype(_F32) for t in total]


def ghost_norms(model, loss_fn, trainable, non_trainable, x, y, weights, *, training=True, strict=True,
                unit_rows=1):
    """Per-layer ghost analysis of one batch (see the module docstring).

    Args:
      model: the Keras model whose ``stateless_call`` is differentiated.
      loss_fn: ``(y_true, y_pred) -> (P,)`` per-example losses.
      trainable, non_trainable: the values of the model's variables.
      x, y: the batch (P examples); weights: (P,) float32 (sample weight × mask).
      strict: raise ValueError on rows that are not examples and have no caller but the model
        (else return ``None``).
      unit_rows: k, the rows of one privacy unit (user-level; 1: every row is a unit). With
        k > 1 ``sq`` and ``c`` are per unit (U = P/k): a layer that :func:`units.merges` gets its
        rule on rows merged per unit (:func:`units.merge_rows`), any other the fallback's
        per-row gradients summed per unit.

    Returns:
      ``(sq, sums_fn, losses, y_pred, non_trainable)``: ``sq`` (P,) float32 squared norms
      ``‖w_i·∇loss_i‖²``; ``sums_fn(c, keep=None)`` the list, in ``model.trainable_variables`` order, of
      ``Σ_i c_i·w_i·∇loss_i`` for factors ``c`` (P,); the unweighted losses (P,), the
      predictions and the non-trainable values after the call. ``None`` when ``strict``
      is false and a layer's rows are not the examples, with no caller but the model.
    """
    size = int(weights.shape[0])
    k = int(unit_rows)
    count = units.check_rows(size, k)

    def forward(perturbations, recorder):
        with _recording(recorder):
            if perturbations is None:  # the shape pass also checks where each weight is read
                y_pred, new_ntv = _tracking_call(model, trainable, non_trainable, x, training, recorder), None
            else:
                kwargs = training_kwargs(model, training)
                y_pred, new_ntv = model.stateless_call(trainable, non_trainable, x, **kwargs)
        y32 = float32_outputs(y_pred)  # as Keras's Loss.__call__, each output keeping its Keras mask
        losses = jnp.reshape(loss_fn(y, y32), (-1,))
        total = jnp.sum(losses * weights.astype(losses.dtype))
        if perturbations is None:  # the shape pass keeps shapes only (no tracer outlives its trace)
            recorder.arrays = [[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays] for arrays in recorder.arrays]
            recorder.saved = []
            return total, (losses, y_pred, new_ntv, None)
        return total, (losses, y_pred, new_ntv, (recorder.arrays, recorder.saved))

    plan = _plan(model, forward, size, strict)
    if plan is None:
        return None
    found, shapes, grouped = plan
    layers = [layer for layer, _ in found]
    zeros = [jnp.zeros(s.shape, s.dtype) for s in shapes]
    recorder = _Recorder(layers, zeros)
    grad_fn = jax.grad(lambda e: forward(e, _reset(recorder, e)), has_aux=True)
    grads, (losses, y_pred, new_ntv, (recorded, saved)) = grad_fn(zeros)
    recorder.perturbations = False  # any later call of a wrapped layer (none expected) passes through

    by_layer = {}
    for call, arrays, kept_by_forward in zip(recorder.calls, recorded, saved):
        by_layer.setdefault(call["layer"], []).append((call, arrays))
        call["saved"] = kept_by_forward
    sq = jnp.zeros((count,), _F32)
    parts = []  # (owned variables, sums_fn)
    values = list(zip(model.trainable_variables, trainable)) + list(zip(model.non_trainable_variables, non_trainable))
    for index, (layer, owned) in enumerate(found):
        calls = by_layer.get(index, [])
        if not calls:
            continue  # not called: its weights' gradient is zero
        rule = None
        if id(layer) not in grouped and all(call["single"] for call, _ in calls):
            ruled = [{"a": _first_argument(call, arrays), "g": grads[call["slots"][0] if call["z"] is None else call["z"]],
                      "g_out": grads[call["slots"][0]] if len(call["slots"]) == 1 else None,
                      "args": _rebuild(call, arrays), "saved": call["saved"]} for call, arrays in calls]
            # a rule reads the step's weight values; its norms and its sums are two different
            # products of (a, g), so they run at full float32 precision (_EXACT)
            with keras.StatelessScope(state_mapping=values), _EXACT:
                rule = find_rule(layer, ruled)
                if rule is not None and k > 1:  # per unit: the same rule on merged rows, or the fallback
                    merged = [{"a": units.merge_rows(c["a"], k), "g": units.merge_rows(c["g"], k), "args": None}
                              for c in ruled]
                    builtin = not is_registered(rule[0])  # a user's kernel of that kind is never merged
                    again = find_rule(layer, merged) if units.merges(rule[0], layer, builtin=builtin) else None
                    rule = again if again is not None and again[0] == rule[0] else None
        observer = norm_observer.observer()
        if rule is not None:
            layer_sq, sums_fn = rule[1]
            if _keys(owned, sums_fn, count):
                sq = sq + layer_sq
                parts.append((owned, sums_fn))
                if observer is not None:
                    observer.append((layer, rule[0], list(owned), layer_sq))
                continue
        per = _fallback(model, layer, owned, calls, grads, trainable, non_trainable, recorder, size, k)
        layer_sq = sum(jnp.sum(jnp.reshape(p * p, (count, -1)), axis=1) for p in per)
        sq = sq + layer_sq
        if observer is not None:
            observer.append((layer, "caller" if id(layer) in grouped else layer_rules.GENERIC, list(owned), layer_sq))
        parts.append((owned, lambda c, keep=None, per=per, owned=owned: {
            id(v): jnp.tensordot(c, norm_forms.kept(p, keep), axes=1) for v, p in zip(owned, per)}))

    def sums_fn(c, keep=None):
        c = c.astype(_F32)
        got = {}
        with _EXACT:
            for _, fn in parts:
                got.update(fn(c, keep))
        return [got[id(v)].astype(t.dtype) if id(v) in got else jnp.zeros_like(t)
                for v, t in zip(model.trainable_variables, trainable)]

    new_ntv = list(new_ntv)
    return sq, sums_fn, losses, y_pred, new_ntv


def _first_argument(call, arrays):
    args, _ = _rebuild(call, arrays)
    return args[0] if args else None


def _keys(owned, sums_fn, size):
    """Whether a rule's sums cover exactly the layer's own weights (else: fallback)."""
    got = jax.eval_shape(sums_fn, jax.ShapeDtypeStruct((size,), _F32))
    return set(got) == {id(v) for v in owned}


def _reset(recorder, perturbations):
    recorder.perturbations = perturbations
    recorder.calls, recorder.arrays, recorder.shapes, recorder.saved = [], [], [], []
    return recorder


def ghost_clipped_sum(model, loss_fn, trainable, non_trainable, x, y, weights, *, l2_norm_clip,
                      microbatch_size=None, training=True, clipping="ghost", vectorized=None, unit_rows=1):
    """``Σ_i clip(w_i·∇loss_i, ζ)`` by ghost norms (see the module docstring); the same contract
    as ``keras_noisecurve.backend.jax.clipping.clipped_sum``.

    Returns ``(sums, norms, losses, y_pred, non_trainable)``: one array per trainable
    variable, the norms ‖w_i·∇loss_i‖ (P,) before clipping, the unweighted per-example
    losses (P,), the predictions and the non-trainable values after the call.
    ``clipping="auto"`` hands a model with a layer whose rows are not examples and that has no
    caller but the model (see the module docstring), or a ``microbatch_size`` below the batch
    size, to ``vectorized`` (same arguments); ``"ghost"`` refuses both. An example whose loss or norm is not finite contributes 0 to ``sums`` (its
    rows of every recorded (a, g) are zeroed before the sums, only in a step that has one).
    """
    size = int(weights.shape[0])
    clip = jnp.asarray(l2_norm_clip, _F32)
    if microbatch_size is not None and microbatch_size < size and clipping == "auto" and vectorized is not None:
        return vectorized(model, loss_fn, trainable, non_trainable, x, y, weights, l2_norm_clip=l2_norm_clip,
                          microbatch_size=microbatch_size, training=training, unit_rows=unit_rows)
    if microbatch_size is not None and microbatch_size < size:
        raise ValueError(
            f"microbatch_size={microbatch_size} with the ghost engine on JAX: the ghost engine needs no "
            "microbatches (it never forms per-example gradients of the whole model); use microbatch_size=None, "
            "or clipping='vectorized' to bound the memory of per-example gradients."
        )
    result = ghost_norms(model, loss_fn, trainable, non_trainable, x, y, weights, training=training,
                         strict=clipping != "auto" or vectorized is None, unit_rows=unit_rows)
    if result is None:
        return vectorized(model, loss_fn, trainable, non_trainable, x, y, weights, l2_norm_clip=l2_norm_clip,
                          microbatch_size=microbatch_size, training=training, unit_rows=unit_rows)
    sq, sums_fn, losses, y_pred, ntv = result
    norms = jnp.sqrt(sq)
    k = int(unit_rows)
    unit_loss = losses if k == 1 else units.unit_losses(losses, k)
    factor, keep = clip_factors(norms, unit_loss, clip)  # min(1, ζ/‖g_u‖); a non-finite unit: 0, dropped
    sums = jax.lax.cond(jnp.all(keep), sums_fn, lambda f: sums_fn(f, keep), factor)  # masking only if needed
    return sums, (norms if k == 1 else units.per_row(norms, k)), losses, y_pred, ntv


def describe(model, x=None, *, inside: bool = False) -> list:
    """``[(layer name, class, how)]`` for every layer with trainable weights, as the ghost engine
    clips it in a step on a batch shaped like ``x``: ``how`` is the rule's kind (``"Dense"``,
    ``"Conv"``, …: ``layer_rules.BUILTIN``, as on TensorFlow), ``"generic"`` for the exact per-layer
    VJP (the fallback), ``"caller"`` for a layer
    clipped whole with the layers under it (rows that are not examples, a weight read outside its
    call), or ``"vectorized"`` for every layer when no layer but the model encloses such a problem
    (``clipping="auto"`` then clips the model with the vectorized engine). ``inside=True`` lists
    the layers under a caller too, right after it, with ``how`` = ``"through '<caller name>'"``.

    The step is traced on abstract values (``jax.eval_shape``: nothing is computed); ``x`` is a
    batch of inputs (any number of examples ≥ 1), or a structure of ``jax.ShapeDtypeStruct``;
    ``None``: two examples of zeros shaped like a functional model's inputs (``ValueError`` for a
    model without inputs of known shape).
    """
    if x is None:
        x = input_batch(model)
        if x is None:
            raise ValueError(
                "describe(model) on jax traces one step: pass a batch of the model's inputs, "
                f"describe(model, x[:2]) (model {getattr(model, 'name', model)!r} has no inputs of known shape)."
            )
    if not isinstance(inside, bool):
        raise TypeError(f"inside must be True or False, got {inside!r}.")
    leaves = jax.tree_util.tree_leaves(x)
    if not leaves or any(getattr(a, "ndim", 0) < 1 for a in leaves):
        raise ValueError(f"x must be a batch of the model's inputs (arrays with the examples first), got {x!r}.")
    size = int(leaves[0].shape[0])

    def loss_fn(_, y_pred):  # any per-example loss: the rules do not depend on it
        return sum(jnp.sum(jnp.reshape(leaf.astype(_F32), (size, -1)), axis=1)
                   for leaf in jax.tree_util.tree_leaves(y_pred))

    def step(trainable, non_trainable, x):
        result = ghost_norms(model, loss_fn, trainable, non_trainable, x, None, jnp.ones((size,), _F32),
                             training=True, strict=False)
        return None if result is None else result[0]

    specs = lambda values: [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in values]  # noqa: E731
    with norm_observer.observe_layer_norms() as seen:
        clipped = jax.eval_shape(step, specs(model.trainable_variables), specs(model.non_trainable_variables), x)
    if clipped is None:
        return [(layer.name, type(layer).__name__, "vectorized") for layer, _ in targets(model)]
    trainable = {id(v) for v in model.trainable_variables}
    out = []
    for layer, how, _, _ in seen:
        out.append((layer.name, type(layer).__name__, how))
        if inside and (how == "caller" or isinstance(layer, keras.layers.RNN)):
            out += [(sub.name, type(sub).__name__, f"through '{layer.name}'")
                    for sub in _compat.flatten_layers(layer, include_self=False)
                    if any(id(v) in trainable for v in _compat.own_trainable_variables(sub))]
    return out

