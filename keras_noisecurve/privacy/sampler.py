"""The cyclic Poisson batch sampler that makes BandMF amplification true.

``sampling_plan`` (numpy only) draws the whole index sequence up front: a (T, P)
int array of example indices and a (T, P) float32 mask (1 = real example,
0 = padding). ``banded_poisson_dataset`` (TensorFlow, imported inside the function)
turns it into a ``tf.data.Dataset`` of fixed-shape batches ``(x, y, mask)`` by a
gather in ``map``, so shapes never change and nothing retraces.

Keras ``fit`` passes the third element as ``sample_weight``; the private model
applies it per example *before* clipping, so padding contributes nothing to the
clipped sum. The optimizer divides by the expected batch size B, never by the
mask sum. Padding slots hold copies of example 0: a private model
(``make_private``/``DPModel``) leaves rows of weight 0 out of every metric; a plain
Keras model applies ``sample_weight`` only to the loss and ``weighted_metrics``.

Secret randomness: with ``seed=None`` the partitions and batches come from OS
entropy (``np.random.SeedSequence()``). A fixed seed makes the batch selection
predictable to anyone who knows it, which weakens DP: use one only for tests and
reproducibility experiments.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

import numpy as np

from keras_noisecurve._validation import check_choice, check_float, check_int
from keras_noisecurve.privacy import accounting

#: A tf.data input is materialised into numpy once; larger inputs are refused.
MAX_MATERIALIZED_BYTES = 2 * 1024**3


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """The batches of a run, drawn up front.

    Attributes:
      indices: int64 array (T, P); row t lists the examples of step t, padding slots
        hold 0 (any valid index) and are masked out.
      mask: float32 array (T, P); 1 for a real example, 0 for padding.
        ``mask[t].sum()`` is the real batch size of step t.
      partitions: list of b int64 arrays, the fixed partitions (cyclic Poisson) or,
        for fixed epochs, the ⌈n/B⌉ batches of the one shuffled order.
      sampling: ``"cyclic_poisson"`` or ``"fixed_epochs"``.
      sampling_probability: q (None for fixed epochs).
      padded_size: P.
      overflow_probability: union bound on any step drawing > P (0 for fixed epochs).
      truncated_steps: steps whose draw exceeded P and was truncated to P.
      dropped_examples: total examples removed by truncation.
    """

    indices: np.ndarray
    mask: np.ndarray
    partitions: list
    sampling: str
    sampling_probability: Optional[float]
    padded_size: int
    overflow_probability: float
    truncated_steps: int
    dropped_examples: int

    @property
    def steps(self) -> int:
        return self.indices.shape[0]

    def batch(self, t: int) -> np.ndarray:
        """Indices of the real examples of step t (padding removed)."""
        return self.indices[t][self.mask[t] > 0]


def _rng(seed) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng(np.random.SeedSequence())  # OS entropy
    if isinstance(seed, np.random.SeedSequence):
        return np.random.default_rng(seed)
    return np.random.default_rng(check_int("seed", seed, minimum=0))


def sampling_plan(
    *,
    num_examples: int,
    batch_size: int,
    bands: int,
    steps: int,
    seed=None,
    sampling: str = "cyclic_poisson",
    max_batch_size: Optional[int] = None,
    overflow_probability: Optional[float] = None,
) -> SamplingPlan:
    """Draw the partitions and the (T, P) index/mask arrays of a run.

    ``cyclic_poisson``: the n examples are permuted (secret randomness) and split
    into b balanced partitions (sizes differ by ≤ 1, ``np.array_split``). Step t uses
    partition ``t mod b`` only and includes each of its m examples independently with
    probability ``q = B·b/n``: it draws k ~ Binomial(m, q), then a uniformly random
    k-subset — the same distribution as m independent coin flips. P is the smallest
    size whose union-bound overflow probability is ≤ ``overflow_probability``
    (default ``accounting.DEFAULT_OVERFLOW_PROBABILITY = 1e-12``), or
    ``max_batch_size`` if given (then its overflow probability is reported). A draw
    with k > P keeps a uniformly random P-subset; such truncations are counted and
    warned about, and the run's total δ is δ + ``accounting.overflow_delta``.

    ``fixed_epochs``: one permutation cut into ⌈n/B⌉ batches of B (the last one
    shorter, padded); the SAME order repeats every epoch, so an example's
    participations are exactly ``steps_per_epoch`` apart; ``steps_per_epoch ≥ b`` is
    required (consecutive participations must not share a band of C). P = B.

    Args:
      num_examples: n. batch_size: B (expected size for cyclic Poisson). bands: b.
      steps: T, number of batches. seed: None (OS entropy, the private default), an
        int or a ``np.random.SeedSequence`` (tests only: a known seed weakens DP).
      max_batch_size: P for cyclic Poisson (mutually exclusive with
        ``overflow_probability``).

    Returns:
      SamplingPlan.
    """
    sampling = check_choice("sampling", sampling, accounting.SAMPLINGS)
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    if bands > steps:
        raise ValueError(f"bands={bands} cannot exceed steps={steps}.")
    if batch > n:
        raise ValueError(f"batch_size={batch} cannot exceed num_examples={n}.")
    if max_batch_size is not None and overflow_probability is not None:
        raise ValueError("give max_batch_size or overflow_probability, not both.")
    rng = _rng(seed)
    perm = rng.permutation(n).astype(np.int64)

    if sampling == "fixed_epochs":
        if max_batch_size is not None or overflow_probability is not None:
            raise ValueError("max_batch_size / overflow_probability apply to cyclic_poisson only; fixed_epochs pads to batch_size.")
        per_epoch = -(-n // batch)
        if per_epoch < bands:
            raise ValueError(
                f"fixed_epochs needs steps_per_epoch = ceil({n}/{batch}) = {per_epoch} >= bands = {bands}: "
                "participations of an example are steps_per_epoch apart and must be at least b apart."
            )
        batches = [perm[i * batch:(i + 1) * batch] for i in range(per_epoch)]
        indices = np.zeros((steps, batch), dtype=np.int64)
        mask = np.zeros((steps, batch), dtype=np.float32)
        for t in range(steps):
            members = batches[t % per_epoch]
            indices[t, : members.size] = members
            mask[t, : members.size] = 1.0
        return SamplingPlan(indices, mask, batches, sampling, None, batch, 0.0, 0, 0)

    q = accounting.sampling_probability(num_examples=n, batch_size=batch, bands=bands)
    if max_batch_size is not None:
        padded = check_int("max_batch_size", max_batch_size, minimum=1)
    else:
        target = accounting.DEFAULT_OVERFLOW_PROBABILITY if overflow_probability is None else overflow_probability
        target = check_float("overflow_probability", target, open_unit=True)
        padded = accounting.padded_batch_size(
            num_examples=n, batch_size=batch, steps=steps, bands=bands, overflow_probability=target
        )
    p_over = accounting.overflow_probability(
        num_examples=n, batch_size=batch, steps=steps, bands=bands, padded_size=padded
    )
    partitions = np.array_split(perm, bands)
    sizes = np.array([p.size for p in partitions])
    counts = rng.binomial(sizes[np.arange(steps) % bands], q)
    indices = np.zeros((steps, padded), dtype=np.int64)
    mask = np.zeros((steps, padded), dtype=np.float32)
    truncated = dropped = 0
    for t in range(steps):
        part = partitions[t % bands]
        k = int(counts[t])
        if k > padded:
            truncated += 1
            dropped += k - padded
            k = padded
        chosen = part[rng.choice(part.size, size=k, replace=False)] if k else part[:0]
        indices[t, :k] = chosen
        mask[t, :k] = 1.0
    if truncated:
        warnings.warn(
            f"cyclic Poisson sampler: {truncated} of {steps} steps drew more than the padded size {padded} "
            f"and were truncated ({dropped} examples dropped). Truncation is accounted for only through "
            f"the overflow bound {p_over:.3g}: the run's total delta is delta + "
            "keras_noisecurve.privacy.overflow_delta(epsilon=..., overflow_probability="
            f"{p_over:.3g}). Increase max_batch_size or lower overflow_probability.",
            RuntimeWarning,
            stacklevel=2,
        )
    return SamplingPlan(indices, mask, partitions, sampling, q, padded, p_over, truncated, dropped)


# ------------------------------------------------------------------ tf.data
def _nbytes(structure) -> int:
    import tensorflow as tf

    return sum(int(np.asarray(a).nbytes) for a in tf.nest.flatten(structure))


def _materialize(dataset):
    """(x, y, sample_weight) numpy structures from a dataset of examples."""
    import tensorflow as tf

    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    if leaves and all(getattr(s, "shape", None) is not None and s.shape.rank and s.shape[0] is None for s in leaves):
        dataset = dataset.unbatch()  # a batched dataset: every component has an unknown leading dim
        spec = dataset.element_spec
    rows, total = [], 0
    for element in dataset.as_numpy_iterator():
        total += _nbytes(element)
        if total > MAX_MATERIALIZED_BYTES:
            raise ValueError(
                f"the tf.data input exceeds {MAX_MATERIALIZED_BYTES / 1024**3:g} GiB when materialised; "
                "banded_poisson_dataset keeps the private data in memory to gather its batches. Pass a "
                "smaller dataset, or numpy arrays of indices/features you can hold in memory."
            )
        rows.append(element)
    if not rows:
        raise ValueError("the tf.data input is empty.")
    stacked = tf.nest.map_structure(lambda *xs: np.stack(xs), *rows)
    if isinstance(spec, tuple):
        if len(spec) == 1:
            return stacked[0], None, None
        if len(spec) == 2:
            return stacked[0], stacked[1], None
        if len(spec) == 3:
            return stacked[0], stacked[1], stacked[2]
        raise ValueError(f"a tuple element must be (x,), (x, y) or (x, y, sample_weight); got {len(spec)} parts.")
    return stacked, None, None


def _leading_length(name, structure) -> int:
    import tensorflow as tf

    lengths = {int(np.shape(a)[0]) if np.ndim(a) else -1 for a in tf.nest.flatten(structure)}
    if len(lengths) != 1 or -1 in lengths:
        raise ValueError(f"every array in {name} must have the same leading (example) dimension; got lengths {sorted(lengths)}.")
    return lengths.pop()


def banded_poisson_dataset(
    x,
    y=None,
    *,
    batch_size: int,
    bands: int,
    steps: int,
    seed=None,
    sampling: str = "cyclic_poisson",
    sample_weight=None,
    max_batch_size: Optional[int] = None,
    overflow_probability: Optional[float] = None,
    return_plan: bool = False,
):
    """A ``tf.data.Dataset`` of exactly ``steps`` fixed-shape batches ``(x, y, mask)``.

    Args:
      x: numpy array (n, ...), or a dict/tuple of such arrays, or a
        ``tf.data.Dataset`` of examples ``x``, ``(x,)``, ``(x, y)`` or
        ``(x, y, sample_weight)`` (a batched dataset — every component with an
        unknown leading dimension — is unbatched). A dataset is materialised into
        numpy once; more than 2 GiB is refused.
      y: labels (n, ...) or a structure of them, or None (the dataset then yields
        ``(x, None, mask)``, which Keras reads as no targets plus per-example
        weights).
      batch_size, bands, steps, seed, sampling, max_batch_size,
        overflow_probability: see :func:`sampling_plan`.
      sample_weight: optional (n,) weights, multiplied into the mask.
      return_plan: also return the :class:`SamplingPlan` (for tests/inspection).

    Returns:
      ``tf.data.Dataset`` with element spec ``(x: (P, ...), y: (P, ...), mask: (P,)
      float32)``; P = ``plan.padded_size``. With ``return_plan``: ``(dataset, plan)``.
    """
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        if y is not None or sample_weight is not None:
            raise ValueError("with a tf.data.Dataset input, put y and sample_weight inside the dataset's elements.")
        x, y, sample_weight = _materialize(x)
    else:
        x = tf.nest.map_structure(np.asarray, x)
        if y is not None:
            y = tf.nest.map_structure(np.asarray, y)
    n = _leading_length("x", x)
    if y is not None and _leading_length("y", y) != n:
        raise ValueError(f"y has {_leading_length('y', y)} examples but x has {n}.")
    if sample_weight is not None:
        sample_weight = np.asarray(sample_weight, dtype=np.float32)
        if sample_weight.shape != (n,):
            raise ValueError(f"sample_weight must have shape ({n},), got {sample_weight.shape}.")

    plan = sampling_plan(
        num_examples=n, batch_size=batch_size, bands=bands, steps=steps, seed=seed, sampling=sampling,
        max_batch_size=max_batch_size, overflow_probability=overflow_probability,
    )
    mask = plan.mask
    if sample_weight is not None:
        mask = mask * sample_weight[plan.indices]
    x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
    y_t = None if y is None else tf.nest.map_structure(tf.convert_to_tensor, y)

    def gather(idx, m):
        xb = tf.nest.map_structure(lambda a: tf.gather(a, idx), x_t)
        if y_t is None:
            return xb, None, m
        return xb, tf.nest.map_structure(lambda a: tf.gather(a, idx), y_t), m

    ds = tf.data.Dataset.from_tensor_slices((plan.indices, mask.astype(np.float32)))
    ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    return (ds, plan) if return_plan else ds
