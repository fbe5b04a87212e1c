"""The noise of a SHARDED variable (``keras.distribution.ModelParallel`` on JAX): its state
laid out like the variable, its draw made shard by shard.

Under ``ModelParallel`` a weight ``w`` of shape ``(n₀, …)`` carries a ``TensorLayout``
(e.g. ``(None, "model")``: columns split over the mesh axis ``model``). Its noise state,
shape ``(buffers, n₀, …)``, takes the layout ``(None, *w's axes)`` (:func:`state_layout`:
the buffer axis whole, the rest split as the weight), so each device holds the state of
its own slice of ``w`` and nothing else.

The draw z_t of such a weight (:func:`sharded_normal`) is the unsharded
``normal_from_seed(seed, shape)`` of ``keras_noisecurve.backend.jax.noise``, bit for bit,
written as an ELEMENTWISE function of the element's flat (row-major) index i:

    half = ⌈n/2⌉, j = i mod half, b₀ = word (j mod 4) of Philox block ⌊j/4⌋ of ``seed``,
    b₁ = the same word of ``fold_in(seed, 1)``; z_i = r(b₀)·cos θ(b₁) for i < half,
    r(b₀)·sin θ(b₁) otherwise

(the Box–Muller of ``keras_noisecurve.backend.common.philox.box_muller``, whose flat output puts
the cosines first). The index is built from ``iota`` in the weight's own shape and the
result is constrained to the weight's sharding (``jax.lax.with_sharding_constraint``), so
XLA's SPMD partitioner gives each device the iota of its own slice: every op after it is
elementwise, and no device computes a word of another device's slice (the compiled HLO
holds no array larger than a shard; tests/jax/test_jax_sharding.py checks it). The price:
one Philox block per element instead of one per four elements, paid only by sharded
weights; replicated weights keep the blocked draw.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from keras_noisecurve import _compat
from keras_noisecurve.backend.common import philox

__all__ = ["is_sharded", "jax_sharding", "sharded_normal", "state_layout", "variable_layout"]

_WORDS_LIMIT = 2**32


def variable_layout(variable):
    """A Keras variable's layout: the one it carries (``variable._layout``, set when it is
    initialised under a distribution), else the one the active ``keras.distribution``
    gives its path (a variable created in a ``StatelessScope`` is initialised later), else
    ``None``."""
    layout = _compat.variable_layout(variable)
    if layout is not None:
        return layout
    from keras.distribution import distribution

    active = distribution()
    return None if active is None else active.get_variable_layout(variable)


def jax_sharding(layout):
    """The ``jax.sharding.NamedSharding`` of a variable's layout (a Keras ``TensorLayout``
    or a ``NamedSharding``), or ``None`` (no layout, or another kind of sharding)."""
    if layout is None:
        return None
    backend = getattr(layout, "backend_layout", layout)
    return backend if isinstance(backend, NamedSharding) else None


def is_sharded(layout) -> bool:
    """Whether the layout splits at least one axis over a mesh axis of more than one device."""
    sharding = jax_sharding(layout)
    if sharding is None:
        return False
    sizes = dict(zip(sharding.mesh.axis_names, sharding.mesh.devices.shape))
    for entry in sharding.spec:
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(name is not None and sizes.get(name, 1) > 1 for name in names):
            return True
    return False


def state_layout(layout, rank: int):
    """The layout of a noise state ``(buffers, *shape)`` of a variable of rank ``rank``
    laid out as ``layout``: the buffer axis unsharded, the others as the variable's.

    Args:
      layout: the variable's ``keras.distribution.TensorLayout`` or ``NamedSharding``
        (``None``: ``None``, the default placement).
      rank: the variable's rank (a ``NamedSharding``'s spec may be shorter: the missing
        trailing axes are unsharded).

    Returns:
      a ``TensorLayout`` (for a ``TensorLayout``) or a ``NamedSharding``, or ``None``.
    """
    if layout is None:
        return None
    axes = getattr(layout, "axes", None)
    if axes is not None and hasattr(layout, "device_mesh"):  # keras.distribution.TensorLayout
        from keras.distribution import TensorLayout

        return TensorLayout((None,) + tuple(axes), layout.device_mesh)
    if isinstance(layout, NamedSharding):
        spec = tuple(layout.spec) + (None,) * (rank - len(layout.spec))
        return NamedSharding(layout.mesh, PartitionSpec(None, *spec))
    raise ValueError(f"a sharded variable's layout must be a keras.distribution.TensorLayout or a "
                     f"jax.sharding.NamedSharding, got {type(layout).__name__}: {layout!r}.")


def _flat_index(shape):
    """uint32 array of ``shape``: each element's row-major flat index, from per-axis iotas."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in range(len(shape) - 1, -1, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    return index


def _words_at(seed, j):
    """Word j of the seed's uniform Philox stream (``philox.uniform_words``), for an array
    of indices j (uint32): word ``j mod 4`` of the block of counter ``(⌊j/4⌋, 0, m₂, m₃)``."""
    key, (c2, c3) = philox.key_counter(jnp, seed)
    block = philox.philox_block(jnp, (jnp.right_shift(j, jnp.uint32(2)), jnp.uint32(0), c2, c3), key)
    word = jnp.bitwise_and(j, jnp.uint32(3))
    return jnp.where(word == 0, block[0], jnp.where(word == 1, block[1], jnp.where(word == 2, block[2], block[3])))


def sharded_normal(seed, shape, dtype, sharding, scale=None):
    """``normal_from_seed(seed, shape, dtype, scale)`` drawn shard by shard (module docstring).

    Args:
      seed: the variable's seed, (4,) uint32 words (``variable_seed(step_seed(key, t), k)``).
      shape: the variable's shape (fully defined, fewer than 2³² elements).
      dtype: floating dtype of the result (float32 arithmetic; float64 only with x64).
      sharding: the variable's ``NamedSharding`` (the result has it).
      scale: optional scalar multiplying the draw (folded into the radius, as
        ``normal_from_seed`` does).

    Returns:
      a jax array of ``shape`` and ``dtype`` with ``sharding``, equal bit for bit to the
      unsharded ``normal_from_seed`` (tests/jax/test_jax_sharding.py).
    """
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if n >= _WORDS_LIMIT:
        raise ValueError(f"a sharded draw indexes elements with 32-bit words: the variable has {n} elements "
                         f"(shape {shape}), at most {_WORDS_LIMIT - 1} are allowed.")
    dtype = jnp.dtype(dtype)
    compute = jnp.dtype(jnp.float64) if jax.dtypes.canonicalize_dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)
    seed = jnp.asarray(seed)
    if seed.dtype == jnp.int32:
        seed = jax.lax.bitcast_convert_type(seed, jnp.uint32)
    angle_seed = philox.fold_in(jnp, seed, jnp.uint32(1), jnp.uint32(0))
    half = (n + 1) // 2
    index = jax.lax.with_sharding_constraint(_flat_index(shape), sharding)
    first = index < jnp.uint32(half)
    j = jnp.where(first, index, index - jnp.uint32(half))
    # the arithmetic of philox.box_muller_words, element by element
    u = (_words_at(seed, j).astype(compute) + 0.5) * (2.0**-32)
    radius = jnp.sqrt(-2.0 * jnp.log(u))
    if scale is not None:
        radius = radius * jnp.asarray(scale).astype(compute)
    theta = _words_at(angle_seed, j).astype(compute) * (2.0 * math.pi * 2.0**-32)
    z = jnp.where(first, radius * jnp.cos(theta), radius * jnp.sin(theta))
    return jax.lax.with_sharding_constraint(z.astype(dtype), sharding)
