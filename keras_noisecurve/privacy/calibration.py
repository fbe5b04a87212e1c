"""Noise calibration: the smallest σ whose training run is (ε, δ)-DP.

numpy/scipy + ``dp_accounting`` only: this module never imports TensorFlow.

:func:`calibrate_noise_multiplier` searches σ on the dominating event of
:mod:`keras_noisecurve.privacy.events`; :func:`calibrate` also reports q, the number of
compositions, the re-checked ε, the sampler's padded batch size and the total δ
(:mod:`keras_noisecurve.privacy.overflow`), as ``noisecurve calibrate`` prints them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

from keras_noisecurve._validation import check_choice, check_float
from keras_noisecurve.privacy.events import (
    ACCOUNTANTS,
    PLD_VALUE_DISCRETIZATION,
    RDP_ORDERS,
    epsilon_of_event,
    event_of,
    make_accountant,
)
from keras_noisecurve.privacy.spec import RunSpec, as_spec
from keras_noisecurve.privacy.overflow import checked_padding, overflow_delta

__all__ = ["CALIBRATION_EPSILON_RTOL", "CALIBRATION_RTOL", "Calibration", "calibrate", "calibrate_noise_multiplier"]

#: Relative tolerance, in σ, of :func:`calibrate_noise_multiplier`'s root searches.
CALIBRATION_RTOL = 1e-6

#: A calibrated σ is returned only if (1 − this)·ε_target ≤ ε(σ) ≤ ε_target.
CALIBRATION_EPSILON_RTOL = 1e-4

_INTEGER_RDP_ORDERS = tuple(o for o in RDP_ORDERS if float(o).is_integer())

#: Calibration refuses a target ε above the RDP ε (standard orders, an upper bound on
#: PLD's) of a noise multiplier this small: such runs give no meaningful privacy, and PLD
#: accounting at smaller σ needs minutes and tens of GiB (its grid grows like 1/σ²).
_MIN_SIGMA = 0.25

#: What ``calibrate_dp_mechanism`` raises when a bracket misses the root, in every
#: dp-accounting version the project allows: ``ValueError`` (all versions) and
#: ``NoOptimumFoundError`` (0.4.3 only; 0.4.4 removed it and bisects instead).
#: Looked up by name, so a version without one of them cannot turn the fallback into
#: an ``AttributeError``.
_BRACKET_ERRORS = tuple(
    error for error in (
        ValueError,
        getattr(dp_accounting.mechanism_calibration, "NoOptimumFoundError", None),
        getattr(dp_accounting.mechanism_calibration, "NoBracketIntervalFoundError", None),
    ) if isinstance(error, type) and issubclass(error, Exception)
)


def _too_small_sigma(epsilon: float, delta: float, floor: float, largest: float, num_examples: int) -> str:
    """Why calibration refuses a run that a σ below ``floor`` would make (ε, δ)-DP; ``largest``
    is ε at σ = ``floor``. A δ of 1/n or more is named as the cause: it is what makes ε cheap."""
    if delta >= 1.0 / num_examples:
        return (f"delta={delta:g} is too large: at this delta a sigma below {floor:g} already meets "
                f"epsilon={epsilon:g} (sigma = {floor:g} gives {largest:.4g}), which means no meaningful privacy. "
                f"delta must lie in (0, 1) and should be much smaller than 1/n = {1.0 / num_examples:.3g} "
                f"(n = {num_examples} examples): a delta of 1/n or more allows releasing an example outright.")
    return (f"epsilon={epsilon:g} is so large that sigma < {floor:g} would suffice, which gives no meaningful "
            f"privacy. Possible: epsilon <= {largest:.4g} (sigma = {floor:g}) for this run at delta={delta:g}.")


def calibrate_noise_multiplier(*, epsilon: float, delta: float, accountant: str = "pld",
                               spec: Optional[RunSpec] = None, **run) -> float:
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

    Args:
      epsilon: target ε > 0. delta: accounting δ in (0, 1).
      accountant: ``"pld"`` (default) or ``"rdp"``.
      spec: the :class:`~keras_noisecurve.privacy.spec.RunSpec`, or instead its keyword
        arguments (``num_examples=``, ``batch_size=``, ``steps=``/``epochs=``, ``bands=``,
        ``sampling=``, ``mixing=``, ``count_noise_multiplier=``). With an adaptive clip's
        ``count_noise_multiplier=`` σ_c (``AdaptiveClip.count_noise_multiplier(B)``), σ is the
        one whose run, count queries included, is (ε, δ)-DP; σ_c itself is not calibrated.

    Returns:
      σ > 0 (float).
    """
    epsilon = check_float("epsilon", epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    spec = as_spec(spec, run, caller="calibrate_noise_multiplier")
    return noise_multiplier_for(spec, epsilon, delta, accountant)


def noise_multiplier_for(spec: RunSpec, epsilon: float, delta: float, accountant: str) -> float:
    """σ for ``spec`` at (ε, δ), arguments already validated (``PrivateRun`` calls it);
    see :func:`calibrate_noise_multiplier` for the stages."""
    mc = dp_accounting.mechanism_calibration

    def make_event(sigma):
        return event_of(spec, max(float(sigma), 1e-12))

    def gap(make_accountant, sigma):
        return make_accountant().compose(make_event(sigma)).get_epsilon(delta) - epsilon

    def bracket_around(make_accountant, guess, factor=1.25, floor=0.5 * _MIN_SIGMA):
        """Geometric search from ``guess`` for [lo, hi] with ε(lo) > target ≥ ε(hi)."""
        lo = hi = guess
        g = gap(make_accountant, hi)
        for _ in range(60):
            if g <= 0:
                break
            lo, hi = hi, factor * hi
            g = gap(make_accountant, hi)
        else:
            raise ValueError(
                f"epsilon={epsilon:g} at delta={delta:g} is out of reach: even sigma={hi:.4g} gives epsilon="
                f"{g + epsilon:.4g} for this run. Possible: a larger epsilon or delta, fewer steps or a smaller "
                "batch_size." + ("" if spec.count_noise_multiplier is None else
                                 f" The adaptive clip's count queries alone (noise multiplier "
                                 f"{spec.count_noise_multiplier:g} = 2 x count_stddev) spend that much: give "
                                 "AdaptiveClip(count_stddev=...) a larger value (the default B/20 suits B in the "
                                 "hundreds), or use a fixed clip.")
            )
        if lo == hi:
            for _ in range(200):
                lo = lo / factor
                if lo < floor:
                    largest = gap(make_accountant, floor) + epsilon
                    raise ValueError(_too_small_sigma(epsilon, delta, floor, largest, spec.num_examples))
                if gap(make_accountant, lo) > 0:
                    break
                hi = lo
        return mc.ExplicitBracketInterval(lo, hi)

    def solve(make_accountant, bracket, tol, fallback_guess):
        try:
            return float(mc.calibrate_dp_mechanism(make_accountant, make_event, epsilon, delta, bracket, tol=tol))
        except _BRACKET_ERRORS:  # the guessed bracket missed the root
            return float(mc.calibrate_dp_mechanism(
                make_accountant, make_event, epsilon, delta, bracket_around(make_accountant, fallback_guess), tol=tol
            ))

    # Stage 1: RDP on integer orders only — fast, and an upper bound on the ε of the
    # standard-order RDP and of PLD, so its σ is an upper end for the next bracket.
    def int_rdp():
        return _rdp.RdpAccountant(list(_INTEGER_RDP_ORDERS))

    absl = logging.getLogger("absl")  # RDP warns that it drops orders at such a small sigma
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        largest = gap(lambda: make_accountant("rdp"), _MIN_SIGMA) + epsilon
    finally:
        absl.setLevel(level)
    if epsilon > largest:
        raise ValueError(_too_small_sigma(epsilon, delta, _MIN_SIGMA, largest, spec.num_examples))
    bracket1 = bracket_around(int_rdp, 1.0, factor=2.0)
    sigma1 = float(mc.calibrate_dp_mechanism(
        int_rdp, make_event, epsilon, delta, bracket1, tol=1e-5 * bracket1.endpoint_2,
    ))
    if accountant == "rdp":
        return solve(lambda: make_accountant("rdp"), mc.ExplicitBracketInterval(0.8 * sigma1, sigma1 + 1e-3),
                     CALIBRATION_RTOL * sigma1, sigma1)

    # Stage 2: PLD on a 10x coarser grid (about 10x faster, ε within ~1e-5 relative).
    sigma2 = solve(
        lambda: _pld.PLDAccountant(value_discretization_interval=10 * PLD_VALUE_DISCRETIZATION),
        mc.ExplicitBracketInterval(0.75 * sigma1, sigma1 + 1e-3), CALIBRATION_RTOL * sigma1, sigma1,
    )
    # Stage 3: the PLD accountant of compute_epsilon. Accept σ₂ if it already meets the
    # budget within CALIBRATION_EPSILON_RTOL; otherwise Brent's method near σ₂.
    eps2 = epsilon_of_event(make_event(sigma2), delta, "pld")
    if (1.0 - CALIBRATION_EPSILON_RTOL) * epsilon <= eps2 <= epsilon:
        return sigma2
    return solve(lambda: make_accountant("pld"), mc.ExplicitBracketInterval(0.98 * sigma2, 1.02 * sigma2),
                 CALIBRATION_RTOL * sigma2, sigma2)


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
      count_noise_multiplier: σ_c of an adaptive clip's count queries, included in σ
        (``RunSpec(count_noise_multiplier=)``); ``None``: a fixed clip, no counts.
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
    count_noise_multiplier: Optional[float] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(*, epsilon: float, delta: float, accountant: str = "pld",
              overflow_probability_target: Optional[float] = None,
              spec: Optional[RunSpec] = None, **run) -> Calibration:
    """Calibrate σ and report q, compositions, re-checked ε, padding and overflow.

    Same arguments as :func:`calibrate_noise_multiplier`, plus the overflow target
    of the sampler's padded batch size (cyclic Poisson; fixed epochs pad to B):
    ``None`` (default) gives the padded size ``PrivateRun`` uses by default
    (``DEFAULT_OVERFLOW_PROBABILITY``, smaller where the overflow rule needs it); a target
    whose padded size breaks the overflow rule (``(1 + e^ε)·p ≤ δ/10``,
    :func:`~keras_noisecurve.privacy.overflow.checked_padding`) is refused, as ``PrivateRun``
    refuses it.
    """
    epsilon = check_float("epsilon", epsilon, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    spec = as_spec(spec, run, caller="calibrate")
    sigma = noise_multiplier_for(spec, epsilon, delta, accountant)
    eps = epsilon_of_event(event_of(spec, sigma), delta, accountant)
    if spec.sampling == "cyclic_poisson":
        padded, p_over = checked_padding(spec=spec, delta=delta, epsilon=lambda: eps, epsilon_bound=eps,
                                         overflow_probability=overflow_probability_target)
    else:
        padded, p_over = spec.batch_size, 0.0
    return Calibration(
        noise_multiplier=sigma, epsilon=eps, target_epsilon=epsilon, delta=delta,
        sampling_probability=spec.sampling_probability, compositions=spec.compositions,
        steps=spec.steps, bands=spec.bands, epochs=spec.epochs, steps_per_epoch=spec.steps_per_epoch,
        sampling=spec.sampling, accountant=accountant, sensitivity=spec.sensitivity,
        padded_batch_size=padded, overflow_probability=p_over,
        total_delta=delta + overflow_delta(epsilon=eps, overflow_probability=p_over),
        count_noise_multiplier=spec.count_noise_multiplier,
    )
