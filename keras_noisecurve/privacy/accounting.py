"""Privacy accounting for banded matrix factorization with cyclic Poisson sampling.

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
  noise multiplier ``σ / (s·√k)``.

Noise multipliers are relative to the clip norm ζ: the optimizer adds ``ζ·σ·z̃_t``
to the clipped gradient sum.

Total δ: the sampler pads batches to a fixed size P; a step that samples more than
P examples is truncated. The δ returned here is the accounting δ of the ideal
(untruncated) mechanism; the run's total δ is ``delta + overflow_delta(...)``
(see :func:`overflow_delta`). With the sampler's default (overflow probability
≤ 1e-12) this addition is below 1e-12·(1 + e^ε).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import dp_accounting
import numpy as np
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp
from scipy import stats

from keras_noisecurve._validation import check_choice, check_float, check_int

SAMPLINGS = ("cyclic_poisson", "fixed_epochs")
ACCOUNTANTS = ("pld", "rdp")

#: Value discretisation interval of the PLD accountant (privacy-loss grid step).
#: ``dp_accounting`` rounds pessimistically, so the ε it reports is an upper bound.
PLD_VALUE_DISCRETIZATION = 1e-4

#: RDP orders: dp_accounting's standard list (1.1 … 10.9 by 0.1, 11 … 63, 128, 256,
#: 512, 1024), the same list ``RdpAccountant()`` and TensorFlow Privacy use.
RDP_ORDERS = tuple(_rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)

#: Default bound on the probability that any step of the cyclic Poisson sampler
#: draws more examples than its padded batch size (see :func:`padded_batch_size`).
DEFAULT_OVERFLOW_PROBABILITY = 1e-12

#: Relative tolerance, in σ, of :func:`calibrate_noise_multiplier`'s root searches.
CALIBRATION_RTOL = 1e-6

#: A calibrated σ is returned only if (1 − this)·ε_target ≤ ε(σ) ≤ ε_target.
CALIBRATION_EPSILON_RTOL = 1e-4

_INTEGER_RDP_ORDERS = tuple(o for o in RDP_ORDERS if float(o).is_integer())

#: Calibration refuses targets that would need a noise multiplier below this.
_MIN_SIGMA = 1e-3


# --------------------------------------------------------------------------- setup
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

    def participations(self, steps: Optional[int] = None) -> int:
        """Number of times one example can participate in the first ``steps`` steps."""
        steps = self.steps if steps is None else steps
        if self.sampling == "cyclic_poisson":
            return -(-steps // self.bands)
        return -(-steps // self.steps_per_epoch)


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
    """(bands, max column norm of C[:steps, :steps]) from a MixingMatrix."""
    from keras_noisecurve.mixing.matrix import MixingMatrix

    if not isinstance(mixing, MixingMatrix):
        raise TypeError(f"mixing must be a keras_noisecurve.MixingMatrix, got {type(mixing).__name__}.")
    if bands is not None and bands != mixing.bands:
        raise ValueError(f"bands={bands} does not match the mixing matrix, which has {mixing.bands} bands.")
    if steps > mixing.steps:
        raise ValueError(
            f"steps={steps} exceeds the mixing matrix's {mixing.steps} steps: C defines the noise of "
            f"{mixing.steps} steps only."
        )
    values = np.asarray(mixing.band_values)[:steps]
    sq = np.zeros(steps)
    for j in range(values.shape[1]):
        # C[t, t-j] = values[t, j] lies in column t-j; keep rows t < steps.
        sq[: max(steps - j, 0)] += values[j:steps, j] ** 2
    sensitivity = float(np.sqrt(sq.max()))
    if not sensitivity > 0 or not math.isfinite(sensitivity):
        raise ValueError(f"the mixing matrix has an invalid column norm {sensitivity!r}.")
    return mixing.bands, sensitivity


def accounting_setup(
    *,
    num_examples: int,
    batch_size: int,
    steps: int,
    bands: Optional[int] = None,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
) -> AccountingSetup:
    """Validate a run description and derive q, compositions and sensitivity.

    Args:
      num_examples, batch_size, steps: positive ints n, B, T.
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
    steps = check_int("steps", steps, minimum=1)
    if bands is not None:
        bands = check_int("bands", bands, minimum=1)
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

    if sampling == "cyclic_poisson":
        if epochs is not None:
            raise ValueError(
                f"epochs={epochs!r} is only meaningful for sampling='fixed_epochs'; for cyclic_poisson give steps only."
            )
        q = sampling_probability(num_examples=n, batch_size=batch, bands=bands)
        return AccountingSetup(
            sampling, n, batch, steps, bands, None, None, q, -(-steps // bands), sensitivity
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
    return AccountingSetup(sampling, n, batch, steps, bands, epochs, per_epoch, None, 1, sensitivity)


def _event_for(setup: AccountingSetup, noise_multiplier: float, participations: Optional[int] = None):
    """The dominating DpEvent of ``setup`` at noise multiplier σ (σ ≥ 0)."""
    k = setup.participations() if participations is None else participations
    if setup.sampling == "cyclic_poisson":
        inner = dp_accounting.PoissonSampledDpEvent(
            setup.sampling_probability, dp_accounting.GaussianDpEvent(noise_multiplier / setup.sensitivity)
        )
        return dp_accounting.SelfComposedDpEvent(inner, k)
    return dp_accounting.GaussianDpEvent(noise_multiplier / (setup.sensitivity * math.sqrt(k)))


def _make_accountant(accountant: str):
    if accountant == "pld":
        return _pld.PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION)
    return _rdp.RdpAccountant(list(RDP_ORDERS))


def _epsilon_of_event(event, delta: float, accountant: str) -> float:
    return float(_make_accountant(accountant).compose(event).get_epsilon(delta))


def coarse_epsilon_for_setup(setup: AccountingSetup, *, noise_multiplier: float, delta: float,
                             accountant: str = "pld", participations: Optional[int] = None) -> float:
    """Like :func:`epsilon_for_setup` but PLD on a 10× coarser grid (1e-3): ~10× faster.

    For searches only (e.g. the callback's budget bisection); every reported ε uses
    :func:`epsilon_for_setup`.
    """
    k = setup.participations() if participations is None else participations
    if k == 0:
        return 0.0
    event = _event_for(setup, noise_multiplier, k)
    if accountant == "pld":
        a = _pld.PLDAccountant(value_discretization_interval=10 * PLD_VALUE_DISCRETIZATION)
        return float(a.compose(event).get_epsilon(delta))
    return _epsilon_of_event(event, delta, accountant)


# ------------------------------------------------------------------ public API
def dp_event(
    *,
    num_examples: int,
    batch_size: int,
    steps: int,
    bands: Optional[int] = None,
    noise_multiplier: float,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event that dominates a training run.

    - ``cyclic_poisson``: ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
      GaussianDpEvent(σ/s)), ⌈T/b⌉)`` with ``q = B·b/n`` (BandMF amplification).
    - ``fixed_epochs``: ``GaussianDpEvent(σ / (s·√k))``, k = epochs.

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
    return _event_for(setup, sigma)


def compute_epsilon(
    *,
    noise_multiplier: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    steps: int,
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
    return _epsilon_of_event(_event_for(setup, sigma), delta, accountant)


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
    return _epsilon_of_event(_event_for(setup, sigma, k), delta, accountant)


def calibrate_noise_multiplier(
    *,
    epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    steps: int,
    bands: Optional[int] = None,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
    accountant: str = "pld",
) -> float:
    """Smallest noise multiplier σ whose run is (ε, δ)-DP, by root search.

    Uses ``dp_accounting.calibrate_dp_mechanism`` (Brent's method on the event of
    :func:`dp_event`), which guarantees ε(σ) ≤ ε for the σ it returns, in stages
    so that few slow PLD evaluations are needed:

    1. RDP restricted to integer orders (milliseconds; its ε upper-bounds both the
       standard-order RDP and PLD, so its σ₁ is an upper end of the next bracket);
    2. ``"rdp"``: Brent in [0.8σ₁, σ₁] with the standard orders, tolerance
       ``CALIBRATION_RTOL·σ₁`` — done. ``"pld"``: Brent with a PLD accountant on a
       10× coarser grid (1e-3), giving σ₂;
    3. ``"pld"``: one evaluation with the 1e-4 PLD accountant of
       :func:`compute_epsilon`; σ₂ is returned if ``(1 − 1e-4)·ε ≤ ε(σ₂) ≤ ε``,
       else Brent with that accountant in [0.98σ₂, 1.02σ₂].

    Each stage falls back to an open bracket search if its bracket misses the
    root. The result re-checks to ε within 1e-3 relative (tested; in practice
    1e-4 or better) and never above ε.

    Returns:
      σ > 0 (float).
    """
    epsilon = check_float("epsilon", epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    setup = accounting_setup(
        num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
        sampling=sampling, epochs=epochs, mixing=mixing,
    )
    return _calibrate(setup, epsilon, delta, accountant)


def _calibrate(setup: AccountingSetup, epsilon: float, delta: float, accountant: str) -> float:
    """σ for ``setup`` at (ε, δ); see :func:`calibrate_noise_multiplier` for the stages."""
    mc = dp_accounting.mechanism_calibration

    def make_event(sigma):
        return _event_for(setup, max(float(sigma), 1e-12))

    def gap(make_accountant, sigma):
        return make_accountant().compose(make_event(sigma)).get_epsilon(delta) - epsilon

    def bracket_around(make_accountant, guess, factor=1.25):
        """Geometric search from ``guess`` for [lo, hi] with ε(lo) > target ≥ ε(hi)."""
        lo = hi = guess
        g = gap(make_accountant, hi)
        for _ in range(60):
            if g <= 0:
                break
            lo, hi = hi, factor * hi
            g = gap(make_accountant, hi)
        else:
            raise ValueError(f"no noise multiplier up to {hi:g} reaches epsilon={epsilon:g} at delta={delta:g}.")
        if lo == hi:
            for _ in range(200):
                lo = lo / factor
                if lo < _MIN_SIGMA:
                    raise ValueError(
                        f"epsilon={epsilon:g} is so large that sigma < {_MIN_SIGMA:g} would suffice; "
                        "such a run gives no meaningful privacy. Ask for a smaller epsilon."
                    )
                if gap(make_accountant, lo) > 0:
                    break
                hi = lo
        return mc.ExplicitBracketInterval(lo, hi)

    def solve(make_accountant, bracket, tol, fallback_guess):
        try:
            return float(mc.calibrate_dp_mechanism(make_accountant, make_event, epsilon, delta, bracket, tol=tol))
        except (ValueError, mc.NoOptimumFoundError):  # the guessed bracket missed the root
            return float(mc.calibrate_dp_mechanism(
                make_accountant, make_event, epsilon, delta, bracket_around(make_accountant, fallback_guess), tol=tol
            ))

    # Stage 1: RDP on integer orders only — fast, and an upper bound on the ε of the
    # standard-order RDP and of PLD, so its σ is an upper end for the next bracket.
    def int_rdp():
        return _rdp.RdpAccountant(list(_INTEGER_RDP_ORDERS))

    bracket1 = bracket_around(int_rdp, 1.0, factor=2.0)
    sigma1 = float(mc.calibrate_dp_mechanism(
        int_rdp, make_event, epsilon, delta, bracket1, tol=1e-5 * bracket1.endpoint_2,
    ))
    if accountant == "rdp":
        return solve(lambda: _make_accountant("rdp"), mc.ExplicitBracketInterval(0.8 * sigma1, sigma1 + 1e-3),
                     CALIBRATION_RTOL * sigma1, sigma1)

    # Stage 2: PLD on a 10x coarser grid (about 10x faster, ε within ~1e-5 relative).
    sigma2 = solve(
        lambda: _pld.PLDAccountant(value_discretization_interval=10 * PLD_VALUE_DISCRETIZATION),
        mc.ExplicitBracketInterval(0.75 * sigma1, sigma1 + 1e-3), CALIBRATION_RTOL * sigma1, sigma1,
    )
    # Stage 3: the PLD accountant of compute_epsilon. Accept σ₂ if it already meets the
    # budget within CALIBRATION_EPSILON_RTOL; otherwise Brent's method near σ₂.
    eps2 = _epsilon_of_event(make_event(sigma2), delta, "pld")
    if (1.0 - CALIBRATION_EPSILON_RTOL) * epsilon <= eps2 <= epsilon:
        return sigma2
    return solve(lambda: _make_accountant("pld"), mc.ExplicitBracketInterval(0.98 * sigma2, 1.02 * sigma2),
                 CALIBRATION_RTOL * sigma2, sigma2)


# ------------------------------------------------------------- padding/overflow
def _largest_partition(num_examples: int, bands: int) -> int:
    return -(-num_examples // bands)


def overflow_probability(*, num_examples: int, batch_size: int, steps: int, bands: int = 1,
                         padded_size: int) -> float:
    """Union bound on P(some step of cyclic Poisson sampling draws > P examples).

    Step t draws Binomial(m_t, q) examples, m_t ≤ ⌈n/b⌉ the size of partition
    ``t mod b``. To cover a neighbouring dataset (one more example) the bound uses
    m = ⌈n/b⌉ + 1 for every step: ``min(1, T · P[Binomial(m, q) > P])``.
    """
    n = check_int("num_examples", num_examples, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    padded = check_int("padded_size", padded_size, minimum=0)
    q = sampling_probability(num_examples=n, batch_size=batch_size, bands=bands)
    m = _largest_partition(n, bands) + 1
    return float(min(1.0, steps * stats.binom.sf(padded, m, q)))


def padded_batch_size(*, num_examples: int, batch_size: int, steps: int, bands: int = 1,
                      overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY) -> int:
    """Smallest padded batch size P whose :func:`overflow_probability` is ≤ the target.

    Computed exactly from the Binomial tail (scipy ``binom.logsf``), never above the
    largest partition size ⌈n/b⌉ (a real partition can never overflow that).
    """
    n = check_int("num_examples", num_examples, minimum=1)
    steps = check_int("steps", steps, minimum=1)
    bands = check_int("bands", bands, minimum=1)
    target = check_float("overflow_probability", overflow_probability, open_unit=True)
    q = sampling_probability(num_examples=n, batch_size=batch_size, bands=bands)
    m_real = _largest_partition(n, bands)
    m = m_real + 1
    candidates = np.arange(0, m_real + 1)
    log_tail = math.log(steps) + stats.binom.logsf(candidates, m, q)
    ok = np.flatnonzero(log_tail <= math.log(target))
    return int(candidates[ok[0]]) if ok.size else int(m_real)


def overflow_delta(*, epsilon: float, overflow_probability: float) -> float:
    """Extra δ caused by truncating overflowing batches: ``(1 + e^ε) · p``.

    Let M be the ideal (untruncated) mechanism and M' the truncated one; on every
    dataset they differ only on the overflow event, so their outputs are within
    total variation p (the union bound :func:`overflow_probability`, which already
    covers the neighbour's extra example). If M is (ε, δ)-DP then for neighbours D, D'
    ``P[M'(D)∈S] ≤ P[M(D)∈S] + p ≤ e^ε P[M(D')∈S] + δ + p ≤ e^ε P[M'(D')∈S] + δ + (1+e^ε)p``.
    The total δ of a run is ``delta + overflow_delta(epsilon=ε, overflow_probability=p)``.
    """
    epsilon = check_float("epsilon", epsilon, nonnegative=True)
    p = check_float("overflow_probability", overflow_probability, nonnegative=True)
    if p > 1:
        raise ValueError(f"overflow_probability must be <= 1, got {p}.")
    return float(min(1.0, (1.0 + math.exp(min(epsilon, 700.0))) * p))


# ------------------------------------------------------------------- summary
@dataclasses.dataclass(frozen=True)
class Calibration:
    """Result of :func:`calibrate`: everything the ``noisecurve calibrate`` CLI prints.

    Attributes:
      noise_multiplier: σ.
      epsilon: ε re-computed at σ (≤ target_epsilon).
      target_epsilon, delta: the requested budget (accounting δ).
      sampling_probability: q (None for fixed_epochs).
      compositions: number of dominating mechanisms composed.
      steps, bands, epochs, steps_per_epoch, sampling, accountant: the setup.
      padded_batch_size: P the sampler uses by default.
      overflow_probability: union bound on any step overflowing P.
      total_delta: delta + overflow_delta(ε, overflow_probability).
    """

    noise_multiplier: float
    epsilon: float
    target_epsilon: float
    delta: float
    sampling_probability: Optional[float]
    compositions: int
    steps: int
    bands: int
    epochs: Optional[int]
    steps_per_epoch: Optional[int]
    sampling: str
    accountant: str
    sensitivity: float
    padded_batch_size: int
    overflow_probability: float
    total_delta: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(
    *,
    epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    steps: int,
    bands: Optional[int] = None,
    sampling: str = "cyclic_poisson",
    epochs: Optional[int] = None,
    mixing=None,
    accountant: str = "pld",
    overflow_probability_target: float = DEFAULT_OVERFLOW_PROBABILITY,
) -> Calibration:
    """Calibrate σ and report q, compositions, re-checked ε, padding and overflow.

    Same arguments as :func:`calibrate_noise_multiplier`, plus the overflow target
    of the sampler's padded batch size.
    """
    epsilon = check_float("epsilon", epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    setup = accounting_setup(
        num_examples=num_examples, batch_size=batch_size, steps=steps, bands=bands,
        sampling=sampling, epochs=epochs, mixing=mixing,
    )
    sigma = _calibrate(setup, epsilon, delta, accountant)
    eps = _epsilon_of_event(_event_for(setup, sigma), delta, accountant)
    if setup.sampling == "cyclic_poisson":
        padded = padded_batch_size(
            num_examples=setup.num_examples, batch_size=setup.batch_size, steps=setup.steps,
            bands=setup.bands, overflow_probability=overflow_probability_target,
        )
        p_over = overflow_probability(
            num_examples=setup.num_examples, batch_size=setup.batch_size, steps=setup.steps,
            bands=setup.bands, padded_size=padded,
        )
    else:
        padded, p_over = setup.batch_size, 0.0
    return Calibration(
        noise_multiplier=sigma, epsilon=eps, target_epsilon=epsilon, delta=delta,
        sampling_probability=setup.sampling_probability, compositions=setup.compositions,
        steps=setup.steps, bands=setup.bands, epochs=setup.epochs, steps_per_epoch=setup.steps_per_epoch,
        sampling=setup.sampling, accountant=accountant, sensitivity=setup.sensitivity,
        padded_batch_size=padded, overflow_probability=p_over,
        total_delta=delta + overflow_delta(epsilon=eps, overflow_probability=p_over),
    )
