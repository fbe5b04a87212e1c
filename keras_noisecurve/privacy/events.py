"""The ``dp_accounting`` event that dominates a run (its :class:`~keras_noisecurve.privacy.spec.RunSpec`) and its ε.

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

import math
from typing import Optional

import dp_accounting
from dp_accounting import pld as _pld
from dp_accounting import rdp as _rdp

from keras_noisecurve._validation import check_choice, check_float
from keras_noisecurve.privacy.adaptive_clip import combined_noise_multiplier
from keras_noisecurve.privacy.spec import RunSpec, as_spec

__all__ = [
    "ACCOUNTANTS",
    "gaussian_noise_multiplier",
    "PLD_VALUE_DISCRETIZATION",
    "RDP_ORDERS",
    "compute_epsilon",
    "dp_event",
    "epsilon_of_event",
    "event_of",
    "make_accountant",
]

ACCOUNTANTS = ("pld", "rdp")

#: Value discretisation interval of the PLD accountant (privacy-loss grid step).
#: ``dp_accounting`` rounds pessimistically, so the ε it reports is an upper bound.
PLD_VALUE_DISCRETIZATION = 1e-4

#: RDP orders: dp_accounting's standard list (1.1 … 10.9 by 0.1, 11 … 63, 128, 256,
#: 512, 1024), the same list ``RdpAccountant()`` and TensorFlow Privacy use.
RDP_ORDERS = tuple(_rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)


def event_of(spec: RunSpec, noise_multiplier: float, participations: Optional[int] = None):
    """The dominating DpEvent of ``spec`` at noise multiplier σ, after ``participations``
    participations (default: all of the run's). Internal: arguments already validated."""
    k = spec.participations() if participations is None else participations
    sigma = gaussian_noise_multiplier(spec, noise_multiplier, k)
    if spec.sampling == "cyclic_poisson":
        inner = dp_accounting.PoissonSampledDpEvent(spec.sampling_probability, dp_accounting.GaussianDpEvent(sigma))
        return dp_accounting.SelfComposedDpEvent(inner, k)
    return dp_accounting.GaussianDpEvent(sigma)


def gaussian_noise_multiplier(spec: RunSpec, noise_multiplier: float, participations: int) -> float:
    """The noise multiplier of the Gaussian mechanism in ``spec``'s dominating event (the
    ledger's too).

    - ``cyclic_poisson``: one participation, ``σ/s``; with an adaptive clip's count query
      beside it (``spec.count_noise_multiplier`` = σ_c), ``(s²/σ² + 1/σ_c²)^(−1/2)``.
    - ``fixed_epochs``: all ``participations`` = k at once, ``σ/Δ_k``; with count queries
      ``(Δ_k²/σ² + k/σ_c²)^(−1/2)``.
    """
    counts = spec.count_noise_multiplier
    if spec.sampling == "cyclic_poisson":
        return combined_noise_multiplier(noise_multiplier, spec.sensitivity, counts)
    sensitivity = spec.fixed_epoch_sensitivity(participations)
    if counts is None:
        return noise_multiplier / sensitivity
    return 1.0 / math.sqrt((sensitivity / noise_multiplier) ** 2 + participations / counts**2)


def make_accountant(accountant: str):
    if accountant == "pld":
        return _pld.PLDAccountant(value_discretization_interval=PLD_VALUE_DISCRETIZATION)
    return _rdp.RdpAccountant(list(RDP_ORDERS))


def epsilon_of_event(event, delta: float, accountant: str) -> float:
    return float(make_accountant(accountant).compose(event).get_epsilon(delta))


def dp_event(*, noise_multiplier: float, spec: Optional[RunSpec] = None, **run) -> dp_accounting.DpEvent:
    """The ``dp_accounting`` event that dominates a training run.

    - ``cyclic_poisson``: ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
      GaussianDpEvent(σ/s)), ⌈T/b⌉)`` with ``q = B·b/n`` (BandMF amplification).
    - ``fixed_epochs``: ``GaussianDpEvent(σ / (s·√k))``, k = epochs; for a C that is
      not banded (BLT, BISR) ``GaussianDpEvent(σ / Δ_k)`` with Δ_k the sensitivity of
      k participations ``steps_per_epoch`` apart computed from C.

    s is the largest column norm of the mixing (1 without one). Neighbouring relation:
    add-or-remove-one example. With an adaptive clip's count queries
    (``count_noise_multiplier=`` σ_c) each Gaussian is that of the pair (gradient, count):
    noise multiplier ``(s²/σ² + 1/σ_c²)^(−1/2)`` per participation (cyclic Poisson),
    ``(Δ_k²/σ² + k/σ_c²)^(−1/2)`` for fixed epochs.

    Args:
      noise_multiplier: σ > 0, noise standard deviation divided by the clip norm.
      spec: the :class:`RunSpec`, or instead its keyword arguments (``num_examples=``,
        ``batch_size=``, ``steps=``/``epochs=``, ``bands=``, ``sampling=``, ``mixing=``,
        ``count_noise_multiplier=``).
    """
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    spec = as_spec(spec, run, caller="dp_event")
    return event_of(spec, sigma)


def compute_epsilon(*, noise_multiplier: float, delta: float, accountant: str = "pld",
                    spec: Optional[RunSpec] = None, **run) -> float:
    """ε of a planned training run at accounting δ (add-or-remove-one adjacency).

    The planning entry point (no ``PrivateRun`` needed); for a run, ``run.epsilon(step)``.

    Args:
      noise_multiplier: σ > 0, noise standard deviation divided by the clip norm.
      delta: accounting δ in (0, 1).
      accountant: ``"pld"`` — ``dp_accounting.pld.PLDAccountant`` with value
        discretisation interval ``PLD_VALUE_DISCRETIZATION = 1e-4`` (pessimistic
        rounding, so an upper bound; seconds per call for thousands of compositions);
        ``"rdp"`` — ``dp_accounting.rdp.RdpAccountant`` with ``RDP_ORDERS`` (looser,
        milliseconds).
      spec: the :class:`RunSpec`, or instead its keyword arguments (``num_examples=``,
        ``batch_size=``, ``steps=``/``epochs=``, ``bands=``, ``sampling=``, ``mixing=``,
        ``count_noise_multiplier=``: σ_c of an adaptive clip's count queries,
        ``AdaptiveClip.count_noise_multiplier(B)``, composed with the gradient at every
        participation).

    The batches of the sampler are padded to a fixed size and truncated in the
    (tiny-probability) event of overflow; the run is then (ε, δ + overflow_delta)-DP,
    see :func:`keras_noisecurve.privacy.overflow.overflow_delta`.

    Returns:
      ε (float; ``inf`` is impossible for σ > 0).
    """
    sigma = check_float("noise_multiplier", noise_multiplier, positive=True)
    delta = check_float("delta", delta, open_unit=True)
    accountant = check_choice("accountant", accountant, ACCOUNTANTS)
    spec = as_spec(spec, run, caller="compute_epsilon")
    return epsilon_of_event(event_of(spec, sigma), delta, accountant)
