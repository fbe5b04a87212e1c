"""The run spec: one validated value describing a private run (:class:`RunSpec`).

n, B, T (or epochs), b, the sampling and the mixing strategy's accounting facts
(its bands, sensitivity, per-epoch sensitivities), validated once where the user gives
them; calibration, ε, padding, the sampler and the budget callback take the spec.

numpy only (the mixing strategy is asked for its facts): this module never imports
TensorFlow or ``dp_accounting``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from keras_noisecurve._validation import check_choice, check_float, check_int

__all__ = ["RUN_ARGUMENTS", "SAMPLINGS", "RunSpec", "as_spec", "steps_for_epochs"]

SAMPLINGS = ("cyclic_poisson", "fixed_epochs")

#: The keyword arguments that describe a run: those of :class:`RunSpec`.
RUN_ARGUMENTS = ("num_examples", "batch_size", "steps", "epochs", "bands", "sampling", "mixing",
                 "count_noise_multiplier")


@dataclasses.dataclass(frozen=True, init=False)
class RunSpec:
    """The run description, validated once: everything calibration, ε, padding, the
    sampler and the ``PrivacyBudget`` callback need to know about a training run.

    Immutable; build it with the keyword arguments below (the one place where n, B, T,
    b, the sampling and the mixing's accounting facts are checked against each other).
    Every function that works on a run takes a ``RunSpec`` (``spec=``) or, for
    planning, these same keyword arguments (:func:`as_spec`).

    Args (keyword-only):
      num_examples: n, size of the private training set (int ≥ 1).
      batch_size: B ≤ n, the expected (cyclic Poisson) or fixed batch size.
      steps: T, the number of optimizer steps; ``None`` with ``epochs``: T = epochs·⌈n/B⌉
        (:func:`steps_for_epochs`).
      epochs: for ``fixed_epochs``, k = ⌈T / ⌈n/B⌉⌉ (the number of times the first example
        of the fixed order participates; derived from ``steps`` when not given, checked
        against it when both are); for ``cyclic_poisson`` only as an alternative to ``steps``.
      bands: b ≤ T; ``None``: 1, or the mixing's bands when ``mixing`` is given.
      sampling: ``"cyclic_poisson"`` (default) or ``"fixed_epochs"``.
      mixing: optional mixing strategy (``MixingMatrix`` or a strategy of
        ``keras_noisecurve.mixing.strategies``) of at least T steps: sets b (must equal
        ``bands`` if both are given) and the sensitivity s. Only its accounting facts are
        kept, not the matrix.
      count_noise_multiplier: σ_c > 0, the noise multiplier of an adaptive clip's count
        query (``AdaptiveClip.count_noise_multiplier(B)``: its noise over its sensitivity
        ½), which enters at every participation beside the gradient; ``None`` (default):
        a fixed clip, no count queries.

    Attributes (derived):
      sampling, num_examples, batch_size, steps, bands: as validated.
      epochs: k for ``fixed_epochs``, else None.
      steps_per_epoch: ⌈n/B⌉ for ``fixed_epochs``, else None.
      sampling_probability: q = B·b/n for ``cyclic_poisson`` (must be < 1), else None.
      compositions: ⌈T/b⌉ for ``cyclic_poisson`` (Poisson-subsampled Gaussians);
        1 for ``fixed_epochs`` (one Gaussian mechanism of sensitivity s·√k).
      sensitivity: s, the largest column norm of C's leading T×T block (1.0 without mixing).
      strategy: the kind of C (``"banded"``, ``"toeplitz"``, ``"blt"``, ``"bisr"``).
      participation_sensitivities: for a C that is not banded (BLT, BISR; ``fixed_epochs``
        only), the L2 sensitivity of k = 1 … epochs participations ``steps_per_epoch``
        steps apart, computed from C (its columns overlap, so √k·s does not hold);
        ``None`` for banded kinds.

    Raises:
      ValueError / TypeError with a one-line message naming the argument, what was
      received and what is allowed.
    """

    sampling: str
    num_examples: int
    batch_size: int
    steps: int
    bands: int
    epochs: Optional[int]
    steps_per_epoch: Optional[int]
    sampling_probability: Optional[float]
    compositions: int
    sensitivity: float
    strategy: str = "banded"
    participation_sensitivities: Optional[tuple] = None
    count_noise_multiplier: Optional[float] = None

    def __init__(self, *, num_examples: int, batch_size: int, steps: Optional[int] = None,
                 epochs: Optional[int] = None, bands: Optional[int] = None, sampling: str = "cyclic_poisson",
                 mixing=None, count_noise_multiplier: Optional[float] = None):
        values = _describe_run(num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
                               sampling=sampling, epochs=epochs, mixing=mixing)
        if count_noise_multiplier is not None:
            count_noise_multiplier = check_float("count_noise_multiplier", count_noise_multiplier, positive=True)
        values = values + (count_noise_multiplier,)
        for field, value in zip(dataclasses.fields(self), values):
            object.__setattr__(self, field.name, value)

    @property
    def separation(self) -> int:
        """Smallest number of steps between two participations of one example: b (cyclic
        Poisson) or ``steps_per_epoch`` (fixed epochs)."""
        return self.bands if self.sampling == "cyclic_poisson" else self.steps_per_epoch

    def fixed_epoch_sensitivity(self, k: int) -> float:
        """L2 sensitivity of k ≥ 1 fixed-epoch participations: s·√k for a banded C (its
        participations touch disjoint rows), the computed value for BLT and BISR."""
        if self.participation_sensitivities is not None:
            return float(self.participation_sensitivities[k - 1])
        return self.sensitivity * math.sqrt(k)

    def participations(self, steps: Optional[int] = None) -> int:
        """Number of times one example can participate in the first ``steps`` steps:
        ⌈steps / separation⌉ (default: all T steps)."""
        steps = self.steps if steps is None else steps
        return -(-steps // self.separation)


def as_spec(spec=None, run: Optional[dict] = None, *, caller: str) -> RunSpec:
    """The :class:`RunSpec` of a planning call: ``spec`` itself, or ``RunSpec(**run)``.

    ``caller`` names the function in the messages. Exactly one of ``spec`` and the run's
    keyword arguments (:data:`RUN_ARGUMENTS`) must be given.
    """
    run = {} if run is None else run
    if spec is not None:
        if not isinstance(spec, RunSpec):
            raise TypeError(f"{caller}: spec must be a keras_noisecurve.RunSpec, got {type(spec).__name__}.")
        if run:
            raise ValueError(
                f"{caller}: give spec= or the run's keyword arguments, not both; got spec and "
                f"{', '.join(sorted(run))}."
            )
        return spec
    unknown = sorted(set(run) - set(RUN_ARGUMENTS))
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword argument(s) {', '.join(unknown)}; the run is described by "
            f"{', '.join(RUN_ARGUMENTS)} (or spec=)."
        )
    if not run:
        raise TypeError(f"{caller}() needs the run: spec= or its keyword arguments ({', '.join(RUN_ARGUMENTS)}).")
    return RunSpec(**run)


def steps_for_epochs(*, num_examples: int, batch_size: int, epochs: int) -> int:
    """T for ``epochs`` passes over the data: ``T = epochs · ⌈n/B⌉``.

    The one definition of epochs → steps of the package (``RunSpec(epochs=)`` and so
    ``PrivateRun(epochs=)``, ``compute_epsilon``, ``calibrate_noise_multiplier``;
    ``noisecurve calibrate --epochs``): one pass is ⌈n/B⌉ steps, what ``fit`` calls an
    epoch, for cyclic Poisson and fixed-epoch sampling alike. ``epochs`` must be a
    positive integer.
    """
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    return _steps_for_epochs(n, batch, epochs)


def _steps_for_epochs(n: int, batch: int, epochs) -> int:
    """epochs · ⌈n/B⌉ for validated n, B; validates ``epochs`` (an integral float is accepted)."""
    if isinstance(epochs, float) and epochs.is_integer():
        epochs = int(epochs)
    return check_int("epochs", epochs, minimum=1) * -(-n // batch)


def _sampling_probability(n: int, batch: int, b: int) -> float:
    """Per-step inclusion probability ``q = B·b/n`` of cyclic Poisson sampling (validated ints).

    Each partition holds about n/b examples and is visited every b steps; including
    each of them with probability q gives an expected batch of B examples.

    Raises:
      ValueError: if q ≥ 1 — the batch is too large for b partitions: a partition of
        n/b examples cannot yield B examples in expectation without including every
        example (no amplification). Use fewer bands or a smaller batch.
    """
    q = batch * b / n
    if q >= 1.0:
        raise ValueError(
            f"sampling probability q = batch_size*bands/num_examples = {batch}*{b}/{n} = {q:g} must be < 1: "
            f"the batch is too large for {b} partitions of about {n / b:g} examples each. "
            "Use fewer bands or a smaller batch_size."
        )
    return q


def _mixing_sensitivity(mixing, steps: int, bands: Optional[int]) -> tuple[int, float]:
    """(b, s): the bands of cyclic Poisson sampling (``mixing.accounting_bands``: 1 for a C
    that is not banded) and the largest column norm of C[:steps, :steps]."""
    if not callable(getattr(mixing, "sensitivity", None)):
        raise TypeError(
            f"mixing must be a keras_noisecurve.MixingMatrix or a mixing strategy, got {type(mixing).__name__}."
        )
    if not mixing.banded and bands is not None and bands != 1:
        raise ValueError(
            f"bands={bands} does not apply to a {mixing.kind} mixing strategy: its C is not banded, so there are "
            "no partitions; leave bands unset."
        )
    if mixing.banded and bands is not None and bands != mixing.bands:
        raise ValueError(f"bands={bands} does not match the mixing matrix, which has {mixing.bands} bands.")
    if mixing.has_plan and steps > mixing.steps:
        raise ValueError(
            f"steps={steps} exceeds the mixing matrix's {mixing.steps} steps: C defines the noise of "
            f"{mixing.steps} steps only."
        )
    sensitivity = mixing.sensitivity(steps=steps)
    if not sensitivity > 0 or not math.isfinite(sensitivity):
        raise ValueError(f"the mixing matrix has an invalid column norm {sensitivity!r}.")
    return mixing.accounting_bands, sensitivity


def _describe_run(*, num_examples, batch_size, steps, bands, sampling, epochs, mixing) -> tuple:
    """:class:`RunSpec`'s validation: its field values, in field order (see its docstring)."""
    sampling = check_choice("sampling", sampling, SAMPLINGS)
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    if steps is None:
        if epochs is None:
            raise ValueError("give steps (T) or epochs (T = epochs * ceil(num_examples/batch_size)); got neither.")
        steps = _steps_for_epochs(n, batch, epochs)
        if sampling == "cyclic_poisson":
            epochs = None  # it only named T
    steps = check_int("steps", steps, minimum=1)
    if bands is not None:
        bands = check_int("bands", bands, minimum=1)
    strategy = "banded" if mixing is None else getattr(mixing, "kind", "banded")
    if mixing is not None:
        bands, sensitivity = _mixing_sensitivity(mixing, steps, bands)
    else:
        bands = 1 if bands is None else bands
        sensitivity = 1.0
    if bands > steps:
        raise ValueError(
            f"bands={bands} cannot exceed steps={steps}: C is T×T, so at most T bands exist."
        )
    if batch > n:
        raise ValueError(f"batch_size={batch} cannot exceed num_examples={n}.")

    if mixing is not None and not mixing.allows_sampling(sampling):
        raise ValueError(
            f"sampling={sampling!r} needs a banded C (its amplification assumes participations at least b "
            f"steps apart touch disjoint rows of C); a {strategy} C is not banded. Use sampling='fixed_epochs' "
            "(no amplification: one Gaussian mechanism with the sensitivity of all epochs), or a banded or "
            "toeplitz strategy."
        )
    if sampling == "cyclic_poisson":
        if epochs is not None:
            raise ValueError(
                f"epochs={epochs!r} is only meaningful for sampling='fixed_epochs'; for cyclic_poisson give steps only."
            )
        q = _sampling_probability(n, batch, bands)
        return (sampling, n, batch, steps, bands, None, None, q, -(-steps // bands), sensitivity, strategy, None)

    per_epoch = -(-n // batch)
    if epochs is None:  # the epochs the T steps touch
        epochs = -(-steps // per_epoch)
    epochs = check_int("epochs", epochs, minimum=1)
    if per_epoch < bands:
        raise ValueError(
            f"fixed_epochs needs steps_per_epoch = ceil(num_examples/batch_size) = {per_epoch} >= bands = {bands}: "
            "an example's participations are steps_per_epoch steps apart and must be at least b apart for the "
            "sensitivity sqrt(epochs) to hold. Use fewer bands or a smaller batch_size."
        )
    touched = -(-steps // per_epoch)
    if touched != epochs:
        raise ValueError(
            f"steps={steps} and epochs={epochs} are inconsistent: with {per_epoch} steps per epoch "
            f"(ceil({n}/{batch})), {steps} steps touch ceil({steps}/{per_epoch}) = {touched} epochs. "
            f"Require (epochs-1)*{per_epoch} < steps <= epochs*{per_epoch}; e.g. steps={epochs * per_epoch}."
        )
    multi = None
    if mixing is not None and not mixing.banded:
        multi = tuple(mixing.sensitivity(participations=k, separation=per_epoch) if k > 1 else sensitivity
                      for k in range(1, epochs + 1))
    return (sampling, n, batch, steps, bands, epochs, per_epoch, None, 1, sensitivity, strategy, multi)
