"""The cyclic Poisson batch sampler that makes BandMF amplification true.

:class:`BatchSampler` (numpy only) gives random access to the batch of any step t —
an int64 index vector (P,) and a float32 mask (P,) (1 = real example, 0 = padding) —
from a secret key and t alone, so a resumed run continues with exactly the batches an
uninterrupted one would have drawn. ``PrivateRun.dataset`` (the way to train) draws
step by step through it; ``sampling_plan`` draws a whole run's (T, P) arrays up front
(for inspection and tests), and ``banded_poisson_dataset`` (TensorFlow, imported inside
the function) turns such a plan into a ``tf.data.Dataset`` of ``(x, y, mask)``
for custom loops that do their own accounting; it starts at an optimizer's step.

Keras ``fit`` passes the mask as ``sample_weight``; the private model applies it per
example *before* clipping, so padding contributes nothing to the clipped sum. The
optimizer divides by the expected batch size B, never by the mask sum. Padding slots
hold copies of example 0: a private model (``make_private``) leaves rows of
weight 0 out of every metric; a plain Keras model applies ``sample_weight`` only to the
loss and ``weighted_metrics``.

Secret randomness: with ``seed=None`` the key comes from OS entropy
(``np.random.SeedSequence()``). A fixed seed makes the batch selection predictable to
anyone who knows it, which weakens DP: use one only for tests and reproducibility
experiments.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Optional

import numpy as np

from keras_noisecurve._validation import check_int
from keras_noisecurve.privacy.spec import RunSpec, as_spec
from keras_noisecurve.privacy.overflow import padding


#: The secret sampling key is two 64-bit words (stored as int64, e.g. in an optimizer
#: variable); every random choice of the sampler derives from it.
KEY_WORDS = 2

# stream tags: independent numpy streams derived from the key
_PERMUTATION, _STEP = 0, 1


def new_key() -> np.ndarray:
    """A fresh secret sampling key from OS entropy: int64 array (2,)."""
    return np.random.SeedSequence().generate_state(KEY_WORDS, np.uint64).view(np.int64)


def key_from_seed(seed=None) -> np.ndarray:
    """The sampling key (int64 (2,)) of ``seed``: ``None`` → :func:`new_key` (secret);
    an int or a ``np.random.SeedSequence`` → a reproducible key (tests only: a known
    seed makes the batches predictable, which weakens DP)."""
    if seed is None:
        return new_key()
    if isinstance(seed, np.random.SeedSequence):
        return seed.generate_state(KEY_WORDS, np.uint64).view(np.int64)
    seed = check_int("seed", seed, minimum=0, secret=True)
    return np.random.SeedSequence(seed).generate_state(KEY_WORDS, np.uint64).view(np.int64)


def check_key(key) -> np.ndarray:
    """``key`` as an int64 array (2,), or ``ValueError`` saying the type, shape and dtype
    received and what is allowed — never the key's values (the key is secret)."""
    try:
        arr = np.asarray(key)
    except Exception:  # noqa: BLE001 - a ragged or foreign object: its message could quote the values
        raise ValueError(f"a sampling key must be an integer array of shape ({KEY_WORDS},) (e.g. run.initial_key() "
                         f"or optimizer.sampling_key); got a {type(key).__name__} that is not an array.") from None
    if arr.shape != (KEY_WORDS,) or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"a sampling key must be an integer array of shape ({KEY_WORDS},) (e.g. run.initial_key() "
                         f"or optimizer.sampling_key); got a {type(key).__name__} of shape {arr.shape} and dtype "
                         f"{arr.dtype} (its values are secret and not shown).")
    return arr.astype(np.int64)


@dataclasses.dataclass(frozen=True)
class SamplingPlan:
    """The batches of a run, drawn up front (for inspection and tests; training draws
    them step by step through :class:`BatchSampler`).

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


class BatchSampler:
    """Random access to the batch of any step: ``sampler.batch(t)`` → (indices, mask).

    Every choice derives from the secret ``key`` (int64 (2,)) and the step index
    alone, so batch t is the same whether the run is drawn from step 0 or resumed at
    step t, in this process or another one with the same key.

    ``cyclic_poisson``: a permutation of the n examples (numpy stream ``(key, 0)``) is
    split into b balanced partitions (sizes differ by ≤ 1, ``np.array_split``). Step t
    uses partition ``t mod b`` only and includes each of its m examples independently
    with probability ``q = B·b/n``: from the stream ``(key, 1, t)`` it draws
    k ~ Binomial(m, q), then a uniformly random k-subset in random order — the same
    distribution as m independent coin flips. If k > P the first P of them (a uniformly
    random P-subset) are kept: such truncations are accounted for only through the
    overflow bound (the run's total δ adds ``overflow_delta``) and warned about.

    ``fixed_epochs``: one permutation cut into ⌈n/B⌉ batches of B (the last one shorter,
    padded); the SAME order repeats every epoch, so an example's participations are
    exactly ``steps_per_epoch`` apart. P = B.

    Args:
      spec: the run's :class:`~keras_noisecurve.privacy.spec.RunSpec` (n, B, b, T, the
        sampling and q). padded_size: P ≥ 1 (:func:`~keras_noisecurve.privacy.overflow.padding`).
      key: the secret sampling key, int64 (2,) (:func:`key_from_seed`).

    The permutation (O(n) memory) is computed on first use and kept; ``batch`` is
    thread-safe.
    """

    def __init__(self, *, spec: RunSpec, padded_size: int, key):
        if not isinstance(spec, RunSpec):
            raise TypeError(f"BatchSampler: spec must be a keras_noisecurve.RunSpec, got {type(spec).__name__}.")
        self.spec = spec
        self.sampling = spec.sampling
        self.num_examples = spec.num_examples
        self.batch_size = spec.batch_size
        self.bands = spec.bands
        self.steps = spec.steps
        self.sampling_probability = spec.sampling_probability
        self.padded_size = check_int("padded_size", padded_size, minimum=1)
        self._key = check_key(key)
        self._words = [int(w) for w in self._key.view(np.uint64)]
        self._partitions = None
        self._lock = threading.Lock()
        self.truncated_steps = 0
        self.dropped_examples = 0

    @property
    def partitions(self) -> list:
        """The b partitions (cyclic Poisson) or the ⌈n/B⌉ batches of the order (fixed epochs)."""
        with self._lock:
            if self._partitions is None:
                perm = np.random.default_rng(self._words + [_PERMUTATION]).permutation(self.num_examples)
                perm = perm.astype(np.int64)
                if self.sampling == "fixed_epochs":
                    per_epoch = -(-self.num_examples // self.batch_size)
                    self._partitions = [perm[i * self.batch_size:(i + 1) * self.batch_size] for i in range(per_epoch)]
                else:
                    self._partitions = np.array_split(perm, self.bands)
            return self._partitions

    def batch(self, t: int) -> tuple[np.ndarray, np.ndarray, int]:
        """The batch of step t: ``(indices, mask, dropped)``.

        indices: int64 (P,), real examples first, padding slots hold 0; mask: float32
        (P,), 1 for a real example; dropped: examples removed by truncation (0 unless
        the draw exceeded P).
        """
        t = int(t)
        if not 0 <= t < self.steps:
            raise ValueError(f"step {t} is outside the plan of {self.steps} steps (0 ... {self.steps - 1}).")
        parts = self.partitions
        indices = np.zeros(self.padded_size, dtype=np.int64)
        mask = np.zeros(self.padded_size, dtype=np.float32)
        if self.sampling == "fixed_epochs":
            members = parts[t % len(parts)]
            indices[: members.size] = members
            mask[: members.size] = 1.0
            return indices, mask, 0
        part = parts[t % self.bands]
        rng = np.random.default_rng(self._words + [_STEP, t])
        k = int(rng.binomial(part.size, self.sampling_probability))
        chosen = part[rng.choice(part.size, size=k, replace=False)] if k else part[:0]
        dropped = max(0, k - self.padded_size)
        chosen = chosen[: self.padded_size]
        indices[: chosen.size] = chosen
        mask[: chosen.size] = 1.0
        if dropped:
            with self._lock:
                self.truncated_steps += 1
                self.dropped_examples += dropped
        return indices, mask, dropped


def truncation_warning(*, truncated: int, steps: int, padded_size: int, dropped: int,
                       overflow_probability: float, unit: str = "example") -> str:
    """The message of the warning issued when a draw exceeded the padded size (``unit``: what the
    sampler draws, ``"example"`` or ``"user"``)."""
    return (
        f"cyclic Poisson sampler: {truncated} of {steps} steps drew more than the padded size {padded_size} "
        f"and were truncated ({dropped} {unit}s dropped). Truncation is accounted for only through "
        f"the overflow bound {overflow_probability:.3g}: the run's total delta is delta + "
        "keras_noisecurve.privacy.overflow_delta(epsilon=..., overflow_probability="
        f"{overflow_probability:.3g}). Increase max_batch_size or lower overflow_probability."
    )


def sampling_plan(*, spec: Optional[RunSpec] = None, seed=None, max_batch_size: Optional[int] = None,
                  overflow_probability: Optional[float] = None, **run) -> SamplingPlan:
    """Draw the partitions and the (T, P) index/mask arrays of a whole run at once.

    The batches are those of :class:`BatchSampler` (see it for the distribution) with
    the key of ``seed``; P from :func:`~keras_noisecurve.privacy.overflow.padding`.
    Truncations are counted and warned about (``RuntimeWarning``).

    Args:
      spec: the :class:`~keras_noisecurve.privacy.spec.RunSpec`, or instead its keyword
        arguments (``num_examples=``, ``batch_size=``, ``steps=``, ``bands=``,
        ``sampling=``, ``epochs=``, ``mixing=``).
      seed: None (OS entropy, the private default), an int or a
        ``np.random.SeedSequence`` (tests only: a known seed weakens DP).
      max_batch_size: P for cyclic Poisson (mutually exclusive with
        ``overflow_probability``).

    Returns:
      SamplingPlan.
    """
    spec = as_spec(spec, run, caller="sampling_plan")
    padded, p_over = padding(spec=spec, max_batch_size=max_batch_size, overflow_probability=overflow_probability)
    sampler = BatchSampler(spec=spec, padded_size=padded, key=key_from_seed(seed))
    rows = [sampler.batch(t) for t in range(sampler.steps)]
    indices = np.stack([r[0] for r in rows])
    mask = np.stack([r[1] for r in rows])
    if sampler.truncated_steps:
        warnings.warn(
            truncation_warning(truncated=sampler.truncated_steps, steps=sampler.steps, padded_size=padded,
                               dropped=sampler.dropped_examples, overflow_probability=p_over),
            RuntimeWarning,
            stacklevel=2,
        )
    return SamplingPlan(indices, mask, sampler.partitions, sampler.sampling, sampler.sampling_probability,
                        padded, p_over, sampler.truncated_steps, sampler.dropped_examples)


# ------------------------------------------------------------------ tf.data
def banded_poisson_dataset(x, y=None, *, spec: Optional[RunSpec] = None, seed=None, sample_weight=None,
                           max_batch_size: Optional[int] = None, overflow_probability: Optional[float] = None,
                           optimizer=None, return_plan: bool = False, **run):
    """A ``tf.data.Dataset`` of the fixed-shape batches ``(x, y, mask)`` of steps t … T − 1.

    LOW LEVEL, for custom loops that do their own accounting: the sampler without
    accounting, for an optimizer made without a ``PrivateRun`` (a model whose optimizer
    belongs to a run refuses it in ``fit``; ``PrivateRun.dataset`` is the way to train).

    Resuming: where the batches start is read when the dataset is ITERATED, from the
    optimizer's step counter t = ``optimizer.iterations`` (``optimizer=``, or, in
    ``PrivateModel.fit``, the model's optimizer, which also checks each batch's step), so
    a model restored at step t (``BackupAndRestore``, ``load_model``, a checkpoint)
    continues with batch t of the same plan. A plan drawn from OS entropy
    (``seed=None``) cannot be drawn again after a restart: iterating it from t > 0 for
    an optimizer that did not take steps 0 … t − 1 on this very dataset object is
    refused (``ValueError`` in ``fit``, ``InvalidArgumentError`` from the iterator)
    before the first batch. Without ``optimizer`` (and outside ``fit``) it starts at
    step 0 and nothing checks a restored position.

    Args:
      x: anything :func:`keras_noisecurve.privacy.sources.as_source` accepts: numpy
        arrays (n, ...) or a dict/tuple of them, a ``tf.data.Dataset`` of examples
        ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (materialised once;
        more than 2 GiB is refused), a memory-mapped array, a random-access sequence
        or a ``keras.utils.PyDataset`` (only each batch's examples are read).
      y: labels (n, ...) or a structure of them, or None (the dataset then yields
        ``(x, None, mask)``, which Keras reads as no targets plus per-example
        weights).
      spec: the :class:`~keras_noisecurve.privacy.spec.RunSpec`, or instead its keyword
        arguments (``batch_size=``, ``steps=``, ``bands=``, ``sampling=``, ...;
        ``num_examples`` defaults to the number of examples in ``x``). The data must hold
        exactly ``spec.num_examples`` examples.
      seed, max_batch_size, overflow_probability: see :func:`sampling_plan`.
      sample_weight: optional (n,) weights, multiplied into the mask.
      optimizer: optional ``NoiseCurveOptimizer`` (made without a run) whose
        ``iterations`` decide the first batch, for custom loops (see Resuming).
      return_plan: also return the :class:`SamplingPlan` (for tests/inspection).

    Returns:
      ``tf.data.Dataset`` with element spec ``(x: (P, ...), y: (P, ...), mask: (P,)
      float32)``; P = ``plan.padded_size``. With ``return_plan``: ``(dataset, plan)``.
    """
    from keras_noisecurve.privacy.sources import as_source

    source = as_source(x, y, sample_weight=sample_weight)
    if spec is None:
        run.setdefault("num_examples", source.num_examples)
    spec = as_spec(spec, run, caller="banded_poisson_dataset")
    if source.num_examples != spec.num_examples:
        raise ValueError(
            f"the data has {source.num_examples} examples but the spec was planned for num_examples="
            f"{spec.num_examples}: the sampling probability and the privacy guarantee assume n examples."
        )
    plan = sampling_plan(spec=spec, seed=seed, max_batch_size=max_batch_size,
                         overflow_probability=overflow_probability)
    mask = plan.mask
    if source.sample_weight is not None:
        mask = mask * source.sample_weight[plan.indices]

    if optimizer is not None and getattr(optimizer, "run", None) is not None:
        raise ValueError(f"optimizer belongs to a PrivateRun ({optimizer.run!r}): train on run.dataset(x, y) "
                         "(its batches(optimizer) in a custom loop), not banded_poisson_dataset.")
    low = _LowLevelPlan(source, plan.indices, mask.astype(np.float32), reseedable=seed is not None)
    ds = low.dataset(optimizer)
    ds._knc_low_level_plan = low  # PrivateModel.fit positions it at the model's optimizer
    return (ds, plan) if return_plan else ds


class _LowLevelPlan:
    """The batches of one ``banded_poisson_dataset`` plan, started at an optimizer's step.

    ``reseedable``: the plan was drawn from a given seed (the same code draws it again
    after a restart); otherwise only optimizers that took this plan's steps from step 0
    (recorded in ``started``) may continue it."""

    def __init__(self, source, indices, mask, *, reseedable):
        import weakref

        self.source, self.indices, self.mask = source, indices, mask
        self.steps, self.reseedable = int(indices.shape[0]), reseedable
        self.started = weakref.WeakSet()
        self._begun = weakref.WeakKeyDictionary()  # optimizer -> the step fit began at

    def begin(self, optimizer) -> int:
        """:meth:`position`, read when ``fit`` begins (after restores, before the first step) and
        kept for the dataset, which reads it when it is first iterated: on JAX that is after
        Keras moved the optimizer's variables into the training state, when they cannot be read."""
        self._begun[optimizer] = t = self.position(optimizer)
        return t

    def start(self, optimizer) -> int:
        """The step the dataset starts at: the one ``fit`` began at, else :meth:`position`."""
        begun = self._begun.get(optimizer)
        return self.position(optimizer) if begun is None else begun

    def position(self, optimizer) -> int:
        """The first step to take for ``optimizer`` (its ``iterations``); refuses what cannot continue."""
        value = getattr(optimizer.iterations, "value", optimizer.iterations)
        t = int(value.numpy()) if hasattr(value, "numpy") else int(value)
        if t > self.steps:
            raise ValueError(f"the optimizer stands at step {t}, past this plan's {self.steps} steps.")
        if t == 0:
            self.started.add(optimizer)
        elif not self.reseedable and optimizer not in self.started:
            raise ValueError(
                f"banded_poisson_dataset(seed=None): the optimizer stands at step {t} (restored), but this plan was "
                "drawn from OS entropy in this process, so it is not the plan steps 0 ... "
                f"{t - 1} were sampled from, and continuing on it would break the sampling the accounting assumed. "
                "Use a PrivateRun (its secret sampling key is saved with the optimizer: fit(run.dataset(x, y))), "
                "or draw the low-level plan from a seed you keep secret and pass the same seed again."
            )
        return t

    def dataset(self, optimizer=None, *, with_step=False):
        """Batches ``(x, y, mask)`` (``+ (step,)`` with ``with_step``) from ``optimizer``'s step (0 without)."""
        from keras_noisecurve import backend

        return backend.module("pipeline").plan_steps_dataset(self, optimizer, with_step=with_step)
