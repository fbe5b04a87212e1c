"""The per-example squared norms of the Dense and Embedding weight gradients, in ``keras.ops``:
the same math for both ghost-clipping engines (JAX's ``engine_forms`` re-exports these;
TensorFlow's ``sequence_sq_norms`` and ``token_sq_norms`` call them, choosing between the forms
themselves for an unknown sequence length). No framework import.

Shapes: P examples, L positions. A Dense-type weight's per-example gradient is a sum of outer
products over the positions, ``G_i = Σ_l a_il g_ilᵀ`` (``a`` (P, L, d_in) the layer's inputs,
``g`` (P, L, d_out) the gradients at its outputs), and its squared Frobenius norm is computed
without ``G_i`` when that is cheaper (Li et al. 2022, "ghost clipping"):

- L = 1: ``‖a_i‖²·‖g_i‖²``;
- the Gram form ``Σ_{l,l'} (a_il·a_il')(g_il·g_il')``, memory P·L², when L² < d_in·d_out
  (:func:`gram_is_cheaper`);
- else ``G_i`` itself, memory P·d_in·d_out.

An embedding table's per-example gradient has row v = ``Σ_{l: id_il = v} g_il``; its squared norm
is ``Σ_{l,l'} [id_il = id_il'] (g_il·g_il')`` (memory P·L²) when L² < vocabulary·d, else the
rows summed per example (a segment sum, memory P·vocabulary·d).

A per-example normalisation ``out = γ ⊙ x̂ + β`` (LayerNormalization, GroupNormalization) has the
per-example gradients ``Σ_positions x̂ ⊙ g`` (γ) and ``Σ_positions g`` (β)
(:func:`scale_offset_grads`), x̂ the normalised input (:func:`layer_norm_hat`,
:func:`group_norm_hat`); the TensorFlow engine computes x̂ in its recording forward, the JAX
engine from the recorded input.
"""

from __future__ import annotations

from keras import ops

__all__ = ["ExampleGrads", "arrange", "cat", "gram_is_cheaper", "gram_sq_norms", "group_norm_hat", "kept", "layer_norm_hat",
           "outer_sq_norms", "per_weight",
           "scale_offset_grads", "scaled", "sequence_sq_norms", "sum_dtype", "token_gram_sq_norms",
           "token_rows_sq_norms", "token_sq_norms", "weighted_outer", "weighted_sum"]


def sum_dtype(x) -> str:
    """The dtype the kernels compute norms and sums in for a recorded tensor ``x``: float64 stays
    float64 (a float64 model keeps all 53 bits), everything else is float32."""
    return "float64" if str(getattr(x.dtype, "name", x.dtype)) == "float64" else "float32"


def arrange(x, letters: str, target: str):
    """``einsum(f"{letters}->{target}", x)`` as a sum and a transpose: the axes of ``x`` (named by
    ``letters``) missing from ``target`` summed away, the rest put in ``target``'s order; ``x``
    itself when nothing moves (a one-operand einsum costs a kernel launch on TensorFlow)."""
    gone = [i for i, ch in enumerate(letters) if ch not in target]
    if gone:
        x = ops.sum(x, axis=gone)
        letters = "".join(ch for ch in letters if ch in target)
    if letters != target:
        x = ops.transpose(x, [letters.index(ch) for ch in target])
    return x


def cat(parts):
    """The calls of a shared layer, concatenated along the positions (axis 1)."""
    return parts[0] if len(parts) == 1 else ops.concatenate(parts, axis=1)


def _rows(c, x):
    """``c`` (P,) reshaped to broadcast against ``x`` (P, ...), in ``x``'s dtype."""
    return ops.reshape(ops.cast(c, x.dtype), (-1,) + (1,) * (len(x.shape) - 1))


def scaled(c, x):
    """``x`` (P, ...) with example i's rows multiplied by ``c[i]`` (``c`` (P,))."""
    return x * _rows(c, x)


def kept(x, keep):
    """``x`` (P, ...) with the rows of dropped examples (``keep`` (P,) bool false) set to 0, so that
    a non-finite example's 0 factor cannot give 0·inf = nan in a sum over the batch; ``keep=None``:
    ``x`` unchanged."""
    if keep is None:
        return x

    def masked():
        return ops.where(ops.reshape(keep, (-1,) + (1,) * (len(x.shape) - 1)), x, ops.zeros_like(x))

    # no example dropped (the usual step): no pass over x
    return ops.cond(ops.all(keep), lambda: x, masked)


def weighted_outer(a, g, c, keep=None):
    """``Σ_i c_i Σ_l a_il g_ilᵀ`` (d_in, d_out) from ``a`` (P, L, d_in), ``g`` (P, L, d_out): the
    factor with fewer entries per example carries ``c`` (one cheaper pass), and dropped examples'
    rows are 0 in both (:func:`kept`)."""
    a, g = kept(a, keep), kept(g, keep)
    if a.shape[-1] < g.shape[-1]:
        a = scaled(c, a)
    else:
        g = scaled(c, g)
    return ops.einsum("ni,nj->ij", ops.reshape(a, (-1, a.shape[-1])), ops.reshape(g, (-1, g.shape[-1])))


def weighted_sum(per_example, c, keep=None):
    """``Σ_i c_i·per_example_i`` for a (P, ...) tensor; dropped examples' rows count 0 (:func:`kept`)."""
    return ops.tensordot(ops.cast(c, per_example.dtype), kept(per_example, keep), axes=1)


class ExampleGrads:
    """Per-example gradients ``per`` (P, G, I, O) of a kernel, summed over the layer's calls: the
    interface a backend's ``example_grads`` returns (its own layout may differ behind it)."""

    def __init__(self, per):
        self.per = per

    def sq_norms(self):
        """(P,): ``Σ_γ ‖∂W_i[γ]‖²_F``."""
        return ops.sum(ops.reshape(self.per * self.per, (ops.shape(self.per)[0], -1)), axis=1)

    def weighted_sum(self, c, keep=None):
        """(G, I, O): ``Σ_i c_i ∂W_i``, dropped examples (``keep`` false) counting 0."""
        return weighted_sum(self.per, c, keep)


def per_weight(pairs):
    """``(sq, sums)`` of a kernel whose per-example gradients are formed: ``pairs`` a list of
    ``(variable, G)`` with ``G`` (P, ...) (any shape whose entries are the variable's); ``sq`` (P,)
    the sum of their squared norms, ``sums(c, keep)`` ``{id(variable): Σ_i c_i·G_i}`` in the
    variable's shape."""
    sq = sum(ops.sum(ops.reshape(g * g, (ops.shape(g)[0], -1)), axis=1) for _, g in pairs)

    def sums(c, keep=None):
        return {id(w): ops.reshape(weighted_sum(g, c, keep), tuple(w.shape)) for w, g in pairs}

    return sq, sums


def gram_is_cheaper(length: int, d_in: int, d_out: int) -> bool:
    """Whether the Gram form (P·L² numbers) is smaller than ``G_i`` (P·d_in·d_out numbers)."""
    return length * length < d_in * d_out


def gram_sq_norms(a, g):
    """``Σ_{l,l'} (a_il·a_il')(g_il·g_il')`` (P,): ``a`` (P, L, d_in), ``g`` (P, L, d_out)."""
    return ops.sum(ops.einsum("pli,pmi->plm", a, a) * ops.einsum("plj,pmj->plm", g, g), axis=(1, 2))


def outer_sq_norms(a, g):
    """``‖Σ_l a_il g_ilᵀ‖²_F`` (P,) with ``G_i`` formed (P, d_in, d_out)."""
    per_example = ops.einsum("pli,plj->pij", a, g)
    return ops.sum(per_example * per_example, axis=(1, 2))


def sequence_sq_norms(a, g):
    """Per-example ``‖Σ_l a_il g_ilᵀ‖²_F`` (P,) by the cheapest form for the shapes of ``a``
    (P, L, d_in) and ``g`` (P, L, d_out) (d_in and d_out known); for a length L known only when
    the step runs (a TensorFlow graph), ``ops.cond`` chooses then."""
    length, d_in, d_out = a.shape[1], a.shape[-1], g.shape[-1]
    if length == 1:
        return ops.sum(a * a, axis=(1, 2)) * ops.sum(g * g, axis=(1, 2))
    if length is None:
        dynamic = ops.shape(a)[1]
        return ops.cond(dynamic * dynamic < d_in * d_out, lambda: gram_sq_norms(a, g), lambda: outer_sq_norms(a, g))
    return gram_sq_norms(a, g) if gram_is_cheaper(length, d_in, d_out) else outer_sq_norms(a, g)


def token_gram_sq_norms(ids, g):
    """``Σ_{l,l'} [id_l = id_l'] (g_l·g_l')`` (P,): ``ids`` (P, L) integers, ``g`` (P, L, d)."""
    same = ops.cast(ops.equal(ids[:, :, None], ids[:, None, :]), g.dtype)
    return ops.sum(same * ops.einsum("pld,pmd->plm", g, g), axis=(1, 2))


def token_rows_sq_norms(ids, g, vocabulary: int):
    """The same as :func:`token_gram_sq_norms` with each example's table rows summed (a segment
    sum over example × vocabulary rows, memory P·vocabulary·d)."""
    p, d = ops.shape(ids)[0], g.shape[-1]
    segments = ids + ops.cast(ops.arange(p)[:, None] * vocabulary, ids.dtype)
    rows = ops.segment_sum(ops.reshape(g, (-1, d)), ops.reshape(segments, (-1,)), num_segments=p * vocabulary)
    return ops.sum(ops.reshape(rows * rows, (p, vocabulary * d)), axis=1)


def token_sq_norms(ids, g, vocabulary: int):
    """Per-example squared norm (P,) of an embedding table's gradient, ``ids`` (P, L) integer
    token ids, ``g`` (P, L, d): the Gram form when L² < vocabulary·d, else the segment sum
    (``ops.cond`` chooses when the step runs for a length unknown before)."""
    length, d = ids.shape[1], g.shape[-1]
    if length is None:
        dynamic = ops.shape(ids)[1]
        return ops.cond(dynamic * dynamic < vocabulary * d, lambda: token_gram_sq_norms(ids, g),
                        lambda: token_rows_sq_norms(ids, g, vocabulary))
    if gram_is_cheaper(length, vocabulary, d):
        return token_gram_sq_norms(ids, g)
    return token_rows_sq_norms(ids, g, vocabulary)


def layer_norm_hat(x, axes, epsilon, *, rms: bool = False):
    """LayerNormalization's x̂ over ``axes`` (positive, never 0): ``(x − mean)/√(var + ε)``, or
    ``x/√(var + ε)`` with ``rms`` (Keras's ``rms_scaling=True`` divides by the variance's root,
    not by the mean square's), in the dtype of ``x``. The variance is the mean of ``(x − mean)²``
    (not ``E[x²] − mean²``, which loses digits when the mean is large)."""
    axes = tuple(axes)
    mean = ops.mean(x, axis=axes, keepdims=True)
    inverse = ops.rsqrt(ops.mean(ops.square(x - mean), axis=axes, keepdims=True) + epsilon)
    return x * inverse if rms else (x - mean) * inverse


def group_norm_hat(x, groups: int, epsilon):
    """GroupNormalization's x̂ with the channels on the last axis: ``x`` (P, ..., C) in ``groups``
    groups of C/groups channels, mean and variance over the positions and each group's channels
    (as :func:`layer_norm_hat`); returns x̂ of the shape of ``x``. The positions must be known
    (static shapes)."""
    channels = x.shape[-1]
    grouped = ops.reshape(x, (x.shape[0] if x.shape[0] is not None else -1, -1, groups, channels // groups))
    return ops.reshape(layer_norm_hat(grouped, (1, 3), epsilon), ops.shape(x))


def scale_offset_grads(x_hat, g, keep_axes):
    """The per-example gradients of ``γ ⊙ x̂ + β``: ``(Σ x̂ ⊙ g, Σ g)``, each summed over every
    axis of ``g`` (P, ...) but 0 and ``keep_axes`` (positive: the axes γ and β are laid along), so
    of shape (P, *kept sizes)."""
    axes = tuple(k for k in range(1, len(g.shape)) if k not in keep_axes)
    if not axes:
        return x_hat * g, g
    return ops.sum(x_hat * g, axis=axes), ops.sum(g, axis=axes)
