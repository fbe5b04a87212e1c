"""The ``dp_accounting`` event that dominates a training run, and its ε.

numpy/scipy + ``dp_accounting`` only: this module never imports TensorFlow.

Privacy model (docs/privacy.md): example-level DP with **add-or-remove-one**
adjacency, the relation under which ``dp_accounting``'s Poisson-subsampled Gaussian
is analysed. The mechanism is the whole training run: every intermediate model is
released.

Two sampling schemes (docs/design.md#privacy-model):

``"cyclic_poisson"`` (BandMF amplification, Choquette-Choo et al. 2023, "Amplified
  banded matrix factorization"). The n examples are split into b fixed, balanced
  partitions; step t uses partition ``t mod b`` and includes each of its examples
  independently with probability ``q = B·b/n``. With a lower-triangular b-banded C
  the participations of one example are ≥ b steps apart, so the columns of C they
  touch have disjoint row supports and the run is dominated by

      ⌈T/b⌉ self-compositions of PoissonSampled(q, Gaussian(σ / s)),

  with s the largest column norm of C (1 for a valid artifact). ⌈T/b⌉ and not T/b:
  partition 0 is used at steps 0, b, 2b, …, i.e. ⌈T/b⌉ times when b does not divide
  T, and the guarantee must hold for its examples too. b = 1 is plain DP-SGD with
  ``q = B/n`` and T compositions.

``"fixed_epochs"`` (no amplification). One shuffled order, repeated every epoch, in
  ``⌈n/B⌉`` batches per epoch: every example participates exactly once per epoch
  and consecutive participations are ``steps_per_epoch ≥ b`` steps apart. Then
  ``X = CᵀC`` has zero entries between participations and the L2 sensitivity of
  the whole run is ``s·√k`` (k = epochs), i.e. a single Gaussian mechanism with
  noise multiplier ``σ / (s·√k)``. A C that is not banded (BLT, BISR:
  ``keras_noisecurve.mixing.strategies``) has overlapping columns; its sensitivity
  Δ_k = ‖Σ_{i<k} C[:, i·steps_per_epoch]‖ is computed from C (its coefficients are
  non-negative, so the first start is the worst) and the run is one Gaussian
  mechanism with noise multiplier ``σ / Δ_k``. Cyclic Poisson sampling is refused for
  them: its amplification argument needs a banded C.

Noise multipliers are relative to the clip norm ζ: the optimizer adds ``ζ·σ·z̃_t``
to the clipped gradient sum.

Calibration of σ from (ε, δ) is in :mod:`keras_noisecurve.privacy.calibration`, the
padded batch size and the overflow δ in :mod:`keras_noisecurve.privacy.overflow`;
:mod:`keras_noisecurve.privacy.accounting` gathers all three.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

from keras_noisecurve._validation import check_choice, check_float, check_int

__all__ = [
    "ACCOUNTANTS",
    "PLD_VALUE_DISCRETIZATION",
    "RDP_ORDERS",
    "SAMPLINGS",
    "AccountingSetup",
    "accounting_setup",
    "compute_epsilon",
    "dp_event",
    "epsilon_for_setup",
    "epsilon_of_event",
    "event_for_setup",
    "make_accountant",
    "sampling_probability",
    "steps_for_epochs",
]

SAMPLINGS = ("cyclic_poisson", "fixed_epochs")
ACCOUNTANTS = ("pld", "rdp")

#: Value discretisation interval of the PLD accountant (privacy-loss grid step).
#: ``dp_accounting`` rounds pessimistically, so the ε it reports is an upper bound.
PLD_VALUE_DISCRETIZATION = 1e-4

#: RDP orders: dp_accounting's standard list (1.1 … 10.9 by 0.1, 11 … 63, 128, 256,
#: 512, 1024), the same list ``RdpAccountant()`` and TensorFlow Privacy use.
RDP_ORDERS = tuple(_rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


@dataclasses.dataclass(frozen=True)
class AccountingSetup:
    """The validated description of a training run that the accountant needs.

    Attributes:
      sampling: ``"cyclic_poisson"`` or ``"fixed_epochs"``.
      num_examples: n, size of the private training set.
      batch_size: B, the expected (cyclic Poisson) or fixed batch size.
      steps: T, number of optimizer steps.
      bands: b, band width of C.
      epochs: k for ``fixed_epochs`` (= ⌈T / steps_per_epoch⌉), else None.
      steps_per_epoch: ⌈n/B⌉ for ``fixed_epochs``, else None.
      sampling_probability: q = B·b/n for ``cyclic_poisson``, else None.
      compositions: ⌈T/b⌉ for ``cyclic_poisson`` (Poisson-subsampled Gaussians);
        1 for ``fixed_epochs`` (one Gaussian mechanism of sensitivity s·√k).
      sensitivity: s, the largest column norm of C's leading T×T block (1.0 when no
        mixing matrix is given, i.e. a valid artifact is assumed only if none is given).
      strategy: the kind of C (``"banded"``, ``"toeplitz"``, ``"blt"``, ``"bisr"``).
      participation_sensitivities: for a C that is not banded (BLT, BISR; ``fixed_epochs``
        only), the L2 sensitivity of k = 1 … epochs participations ``steps_per_epoch``
        steps apart, computed from C (its columns overlap, so √k·s does not hold);
        ``None`` for banded kinds.
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

    def fixed_epoch_sensitivity(self, k: int) -> float:
        """L2 sensitivity of k ≥ 1 fixed-epoch participations: s·√k for a banded C (its
        participations touch disjoint rows), the computed value for BLT and BISR."""
        if self.participation_sensitivities is not None:
            return float(self.participation_sensitivities[k - 1])
        return self.sensitivity * math.sqrt(k)

    def participations(self, steps: Optional[int] = None) -> int:
        """Number of times one example can participate in the first ``steps`` steps."""
        steps = self.steps if steps is None else steps
        if self.sampling == "cyclic_poisson":
            return -(-steps // self.bands)
        return -(-steps // self.steps_per_epoch)


def steps_for_epochs(*, num_examples: int, batch_size: int, epochs: int) -> int:
    """T for ``epochs`` passes over the data: ``T = epochs · ⌈n/B⌉``.

    The one definition of epochs → steps of the package (``PrivateRun(epochs=)``,
    ``noisecurve calibrate --epochs``, ``compute_epsilon``/``calibrate_noise_multiplier``
    with ``epochs`` and no ``steps``): one pass is ⌈n/B⌉ steps, what ``fit`` calls an
    epoch, for cyclic Poisson and fixed-epoch sampling alike. ``epochs`` must be a
    positive integer.
    """
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    if isinstance(epochs, float) and epochs.is_integer():
        epochs = int(epochs)
    k = check_int("epochs", epochs, minimum=1)
    return k * -(-n // batch)


def sampling_probability(*, num_examples: int, batch_size: int, bands: int = 1) -> float:
    """Per-step inclusion probability ``q = B·b/n`` of cyclic Poisson sampling.

    Each partition holds about n/b examples and is visited every b steps; including
    each of them with probability q gives an expected batch of B examples.

    Raises:
      ValueError: if q ≥ 1 — the batch is too large for b partitions: a partition of
        n/b examples cannot yield B examples in expectation without including every
        example (no amplification). Use fewer bands or a smaller batch.
    """
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    b = check_int("bands", bands, minimum=1)
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


def accounting_setup(
    *,
    num_examples: int,
    batch_size: int,
    steps: Optional[int] = None,
    bands: Optional[int] = None,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
) -> AccountingSetup:
    """Validate a run description and derive q, compositions and sensitivity.

    Args:
      num_examples, batch_size, steps: positive ints n, B, T. ``steps=None`` with
        ``epochs``: T = epochs·⌈n/B⌉ (:func:`steps_for_epochs`).
      bands: positive int b ≤ T; None means 1, or the mixing matrix's bands when
        ``mixing`` is given.
      sampling: ``"cyclic_poisson"`` or ``"fixed_epochs"``.
      epochs: required iff ``sampling == "fixed_epochs"``; must equal
        ``⌈T / ⌈n/B⌉⌉``, the number of (possibly partial) epochs the T steps touch,
        which is the number of times the first example of the fixed order participates.
      mixing: optional ``MixingMatrix``; its bands (must equal ``bands`` if both are
        given) and the largest column norm of its leading T×T block set b and s.

    Raises:
      ValueError / TypeError with a message naming the argument.
    """
    sampling = check_choice("sampling", sampling, SAMPLINGS)
    n = check_int("num_examples", num_examples, minimum=1)
    batch = check_int("batch_size", batch_size, minimum=1)
    if steps is None:
        if epochs is None:
            raise ValueError("give steps (T) or epochs (T = epochs * ceil(num_examples/batch_size)); got neither.")
        steps = steps_for_epochs(num_examples=n, batch_size=batch, epochs=epochs)
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
        q = sampling_probability(num_examples=n, batch_size=batch, bands=bands)
        return AccountingSetup(
            sampling, n, batch, steps, bands, None, None, q, -(-steps // bands), sensitivity, strategy
        )

    if epochs is None:
        raise ValueError("sampling='fixed_epochs' requires epochs (the number of passes over the data).")
    epochs = check_int("epochs", epochs, minimum=1)
    per_epoch = -(-n // batch)
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
    return AccountingSetup(sampling, n, batch, steps, bands, epochs, per_epoch, None, 1, sensitivity, strategy,
                           multi)


def event_for_setup(setup: AccountingSetup, noise_multiplier: float, participations: Optional[int] = None):
    """The dominating DpEvent of ``setup`` at noise multiplier σ (σ ≥ 0)."""
    k = setup.participations() if participations is None else participations
    if setup.sampling == "cyclic_poisson":
        inner = dp_accounting.PoissonSampledDpEvent(
            setup.sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier / setup.sensitivity)
        )
        return dp_accounting.SelfComposedDpEvent(inner, k)
    return dp_accounting.GaussianDpEvent(noise_multiplier / setup.fixed_epoch_sensitivity(k))


def make_accountant(accountant: str):
    if accountant == "pld":
        return _pld.PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION)
    return _rdp.RdpAccountant(list(RDP_ORDERS))


def epsilon_of_event(event, delta: float, accountant: str) -> float:
    return float(make_accountant(accountant).compose(event).get_epsilon(delta))


def dp_event(
    *,
    num_examples: int,
    batch_size: int,
    steps: Optional[int] = None,
    bands: Optional[int] = None,
    noise_multiplier: float,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event that dominates a training run.

    - ``cyclic_poisson``: ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
      GaussianDpEvent(σ/s)), ⌈T/b⌉)`` with ``q = B·b/n`` (BandMF amplification).
    - ``fixed_epochs``: ``GaussianDpEvent(σ / (s·√k))``, k = epochs; for a C that is
      not banded (BLT, BISR) ``GaussianDpEvent(σ / Δ_k)`` with Δ_k the sensitivity of
      k participations ``steps_per_epoch`` apart computed from C.

    s is the largest column norm of ``mixing`` (1 without one). Neighbouring relation:
    add-or-remove-one example.

    Args:
      noise_multiplier: σ > 0, noise standard deviation divided by the clip norm.
      Others: see :func:`accounting_setup`.
    """
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    setup = accounting_setup(
        num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
        sampling=sampling, epochs=epochs, mixing=mixing,
    )
    return event_for_setup(setup, sigma)


def compute_epsilon(
    *,
    noise_multiplier: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    steps: Optional[int] = None,
    bands: Optional[int] = None,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
    accountant: str = "pld",
) -> float:
    """ε of a training run at accounting δ (add-or-remove-one adjacency).

    Accountants: ``"pld"`` — ``dp_accounting.pld.PLDAccountant`` with value
    discretisation interval ``PLD_VALUE_DISCRETIZATION = 1e-4`` (pessimistic
    rounding, so an upper bound; seconds per call for thousands of compositions);
    ``"rdp"`` — ``dp_accounting.rdp.RdpAccountant`` with ``RDP_ORDERS`` (looser,
    milliseconds).

    The batches of :func:`keras_noisecurve.privacy.sampler.banded_poisson_dataset`
    are padded to a fixed size and truncated in the (tiny-probability) event of
    overflow; the run is then (ε, δ + overflow_delta)-DP, see :func:`overflow_delta`.

    Returns:
      ε (float; ``inf`` is impossible for σ > 0).
    """
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    setup = accounting_setup(
        num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
        sampling=sampling, epochs=epochs, mixing=mixing,
    )
    return epsilon_of_event(event_for_setup(setup, sigma), delta, accountant)


def epsilon_for_setup(setup: AccountingSetup, *, noise_multiplier: float, delta: float,
                      accountant: str = "pld", participations: Optional[int] = None) -> float:
    """ε for an already validated ``setup``, optionally after fewer participations.

    ``participations`` = k counts the compositions actually run: ⌈t/b⌉ after t steps of
    cyclic Poisson sampling, ⌈t/steps_per_epoch⌉ for fixed epochs. 0 gives ε = 0.
    Used by the ``PrivacyBudget`` callback.
    """
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    k = setup.participations() if participations is None else check_int("participations", participations, minimum=0)
    if k == 0:
        return 0.0
    return epsilon_of_event(event_for_setup(setup, sigma, k), delta, accountant)
