"""``EpsilonLedger``: ε after every step of a planned run, each participation count once.

numpy/scipy + ``dp_accounting`` only: this module never imports TensorFlow or Keras.

After t optimizer steps an example has participated at most k = ⌈t/b⌉ times (cyclic
Poisson) or ⌈t/steps_per_epoch⌉ times (fixed epochs); ε(t) is the ε of the dominating
event with k participations (:func:`keras_noisecurve.privacy.events.event_of`),
at the accounting δ. The ledger answers ε(t) for every t = 0 … T of the plan and
computes ε_k for each k = 0 … K (K = ``spec.participations()``) at most once, on the
first query that needs it (``epsilons()`` computes the whole table).

How ε_k is computed (sampling × accountant):

``cyclic_poisson``, ``"pld"``
  k self-compositions of one Poisson-subsampled Gaussian. The mechanism's privacy loss
  distribution is built ONCE (``dp_accounting``'s ``from_gaussian_mechanism`` with value
  discretisation ``PLD_VALUE_DISCRETIZATION``: the pmfs the PLD accountant builds, and
  most of the time of a from-scratch ε); so are its Chernoff moments and, per FFT length,
  its real FFT. ε_k is then one power of that spectrum, one inverse FFT and a vectorised
  ε(δ) read-out: ``dp_accounting``'s ``self_compose(k)`` (same truncation window, tail mass
  1e-15 moved to infinity) without its per-element Python loops. Agrees with
  :func:`~keras_noisecurve.privacy.events.compute_epsilon` to ``PLD_RTOL`` (FFT round-off;
  measured ≤ 3e-10 absolute for ε ≤ 3, either side).
``cyclic_poisson``, ``"rdp"``
  RDP is additive: the per-composition RDP curve once, ε_k for all k at once with
  ``dp_accounting``'s RDP-to-(ε, δ) conversion, vectorised (equal to the reference to
  round-off).
``fixed_epochs``, ``"pld"``
  one Gaussian mechanism of noise multiplier σ/(s·√k): its exact ε in closed form (analytic
  Gaussian mechanism, Balle & Wang 2018), microseconds per k. The PLD accountant's answer
  is a discretised upper bound on this value (measured 1e-9 … 1e-7 above it, never below).
``fixed_epochs``, ``"rdp"``
  ``dp_accounting``'s RDP accountant per k (closed form for a Gaussian, sub-millisecond).

Cost (cyclic Poisson, PLD): building the mechanism's PLD ≈ the time of one
from-scratch ε; each further ε_k is one inverse FFT of the k-fold window, so no query
blocks long; the whole table costs K of those (timings: docs/performance.md,
"Measurements behind design choices").
"""

from __future__ import annotations

import math
from typing import Optional

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld_dist
from dp_accounting.rdp import rdp_privacy_accountant as _rdp_acc
from scipy import fft as _fft
from scipy import optimize, special

from keras_noisecurve import _compat
from keras_noisecurve.privacy import events
from keras_noisecurve.privacy.spec import RunSpec

__all__ = ["EpsilonLedger", "PLD_RTOL", "TAIL_MASS_TRUNCATION"]

#: Probability mass the k-fold self-convolution may drop from its tails (moved to the
#: infinite loss, so ε stays an upper bound): ``dp_accounting``'s default for ``self_compose``.
TAIL_MASS_TRUNCATION = 1e-15

#: Relative tolerance between the ledger's PLD ε and dp_accounting's PLD accountant (tested).
PLD_RTOL = 1e-8

#: Growth factor between the FFT lengths the ledger uses (one cached spectrum per length).
_FFT_GROWTH = 1.25

#: The table is computed with a progress bar (tqdm, stderr) shown only after this many seconds.
_PROGRESS_DELAY_S = 3.0


class EpsilonLedger:
    """ε after each of the T optimizer steps of one planned run.

    Internal to :class:`~keras_noisecurve.privacy.run.PrivateRun`, which validates every
    argument and builds one per run (``run.epsilon(step)`` reads it; the ``PrivacyBudget``
    callback shares it).

    Args (keyword-only, already validated):
      spec: the run's :class:`~keras_noisecurve.privacy.spec.RunSpec` (n, B, T, b,
        sampling, q and the sensitivity s).
      noise_multiplier: σ > 0 (noise std / clip norm).
      delta: accounting δ in (0, 1).
      accountant: ``"pld"`` or ``"rdp"``.

    Nothing is computed in the constructor; the first query builds what every ε_k shares
    (for PLD, the mechanism's privacy loss distribution) and each ε_k is computed once.

    Attributes:
      spec, noise_multiplier, delta, accountant: as given.
      steps: T. num_participations: K = ``spec.participations()``.
      evaluations: how many ε_k (k ≥ 1) have been computed so far (each k at most once).
      mechanism_builds: how many times the shared per-mechanism state was built (0 or 1).
    """

    def __init__(self, *, spec: RunSpec, noise_multiplier: float, delta: float, accountant: str):
        self.spec = spec
        self.noise_multiplier = noise_multiplier
        self.delta = delta
        self.accountant = accountant
        self.steps = spec.steps
        self.num_participations = spec.participations()
        self._eps = np.full(self.num_participations + 1, np.nan)  # ε_k, NaN = not computed yet
        self._eps[0] = 0.0
        self._core = None
        self.evaluations = 0
        self.mechanism_builds = 0

    def __repr__(self) -> str:
        s = self.spec
        return (f"EpsilonLedger(sampling={s.sampling!r}, n={s.num_examples}, B={s.batch_size}, T={s.steps}, "
                f"b={s.bands}, K={self.num_participations}, noise_multiplier={self.noise_multiplier:g}, "
                f"delta={self.delta:g}, accountant={self.accountant!r})")

    # ---------------------------------------------------------------- queries
    def participations(self, steps_done: int) -> int:
        """k: participations of one example after ``steps_done`` ∈ [0, T] steps (0 → 0)."""
        return self.spec.participations(steps_done) if steps_done > 0 else 0

    def epsilon(self, steps_done: Optional[int] = None) -> float:
        """ε spent after ``steps_done`` ∈ [0, T] optimizer steps (default T; 0 → 0.0)."""
        steps_done = self.steps if steps_done is None else steps_done
        return self.epsilon_of_participations(self.participations(steps_done))

    def epsilon_of_participations(self, k: int) -> float:
        """ε_k: ε of the dominating event with k ∈ [0, K] participations (computed once)."""
        if np.isnan(self._eps[k]):
            self._eps[k] = self._compute(k)
        return float(self._eps[k])

    def epsilons(self, *, progress: bool = True) -> np.ndarray:
        """The whole table: array of shape (K + 1,), entry k = ε_k (entry 0 = 0.0).

        Step t reads entry ``participations(t)``. Computes every missing ε_k (a tqdm bar on
        stderr appears if this takes more than a few seconds and ``progress`` is true).
        """
        missing = np.flatnonzero(np.isnan(self._eps))
        if missing.size:
            core = self._get_core()
            if isinstance(core, _RdpTable):
                self._eps[missing] = core.table[missing]
                self.evaluations += int(missing.size)
            else:
                it = missing
                if progress and missing.size > 1:
                    from tqdm.auto import tqdm

                    it = tqdm(missing, desc="epsilon ledger", unit="k", delay=_PROGRESS_DELAY_S, leave=False)
                for k in it:
                    self._eps[k] = self._compute(int(k))
        return self._eps.copy()

    # -------------------------------------------------------------- internals
    def _get_core(self):
        if self._core is None:
            s = self.spec
            sigma = events.gaussian_noise_multiplier(s, self.noise_multiplier, 1)  # as events.event_of
            if s.sampling == "cyclic_poisson" and self.accountant == "pld":
                self._core = _PoissonPld(sigma, s.sampling_probability, self.delta, self.num_participations)
            elif s.sampling == "cyclic_poisson":
                self._core = _RdpTable(sigma, s.sampling_probability, self.delta, self.num_participations)
            else:
                self._core = _FixedEpochs(self.noise_multiplier, s, self.delta, self.accountant)
            self.mechanism_builds += 1
        return self._core

    def _compute(self, k: int) -> float:
        if k == 0:
            return 0.0
        core = self._get_core()
        self.evaluations += 1
        if isinstance(core, _RdpTable):
            return float(core.table[k])
        return core.epsilon(k)


# ------------------------------------------------------- cyclic Poisson, PLD
class _PoissonPld:
    """k self-compositions of PoissonSampled(q, Gaussian(σ)) from one PLD, k = 1, 2, …"""

    def __init__(self, sigma: float, q: float, delta: float, num_participations: int):
        pld = _pld_dist.from_gaussian_mechanism(
            standard_deviation=sigma, value_discretization_interval=events.PLD_VALUE_DISCRETIZATION,
            sampling_prob=q,
        )
        self.delta = delta
        self.pmfs = [_DensePmf(pmf) for pmf in _dense_pmfs(pld)]
        # ε of each pmf after k compositions (NaN: not computed): ε after fewer compositions is
        # where the read-out of the next k starts looking.
        self.pmf_eps = np.full((num_participations + 1, len(self.pmfs)), np.nan)
        self.pmf_eps[0] = 0.0

    def epsilon(self, k: int) -> float:
        for j, pmf in enumerate(self.pmfs):
            at_least = float(np.nanmax(self.pmf_eps[:k, j]))  # ε after fewer compositions
            self.pmf_eps[k, j] = pmf.epsilon_after(k, self.delta, at_least)
        # ε of a PLD = max over its remove / add pmfs (PrivacyLossDistribution.get_epsilon_for_delta).
        return float(self.pmf_eps[k].max())


def _dense_pmfs(pld) -> list:
    """The remove (and, if different, add) pmf of a dp_accounting PLD as DensePLDPmf.

    dp_accounting 0.4 has no public accessor (``_compat.pld_pmfs``, pinned by
    tests/test_compat.py; tests/privacy/test_ledger.py checks the ledger's ε against dp_accounting's own).
    """
    return [p.to_dense_pmf() for p in _compat.pld_pmfs(pld)]


class _DensePmf:
    """One dense privacy-loss pmf (losses (lower + i)·Δ, i < L) and its k-fold self-convolutions."""

    def __init__(self, pmf):
        disc, lower, probs, inf_mass = _compat.dense_pmf_fields(pmf)
        self.disc = float(disc)
        self.lower = int(lower)
        self.probs = np.asarray(probs, dtype=np.float64)
        self.inf_mass = float(inf_mass)
        size = len(self.probs)
        # Chernoff bounds on the k-fold sum's support, as dp_accounting's compute_self_convolve_bounds.
        self.orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size
        idx = np.arange(size)
        self.log_mgfs = np.array([special.logsumexp(idx * o, b=self.probs) for o in self.orders])
        self._spectrum = (0, None)  # (FFT length N, rfft of probs at N)
        self._last = (0, 0, None)  # (k, N, spectrum ** k): the next k multiplies once

    def window(self, k: int) -> tuple[int, int]:
        """[lo, hi]: indices of the k-fold sum holding all but ≤ TAIL_MASS_TRUNCATION of its mass."""
        size = len(self.probs)
        bound = (k * self.log_mgfs + math.log(2 / TAIL_MASS_TRUNCATION)) / self.orders
        hi = min((size - 1) * k, int(np.ceil(bound[self.orders > 0]).min()))
        lo = max(0, int(np.floor(bound[self.orders < 0]).max()))
        return lo, hi

    def _fft_length(self, width: int) -> int:
        size = len(self.probs)
        target = size
        while target < width:
            target = math.ceil(target * _FFT_GROWTH)
        return _fft.next_fast_len(target, real=True)

    def epsilon_after(self, k: int, delta: float, at_least: float) -> float:
        """ε of the k-fold self-convolution at δ; ``at_least``: a value it is known to reach."""
        lo, hi = self.window(k)
        width = hi - lo + 1
        n = self._fft_length(width)
        if self._spectrum[0] != n:
            self._spectrum = (n, _fft.rfft(self.probs, n))
        spectrum = self._spectrum[1]
        last_k, last_n, last_power = self._last
        power = last_power * spectrum if (last_n == n and last_k == k - 1) else spectrum ** k
        self._last = (k, n, power)
        circular = _fft.irfft(power, n)  # the k-fold sum modulo n
        start, end = lo % n, lo % n + width
        if end <= n:
            probs = circular[start:end]
            outside = float(circular[:start].sum() + circular[end:].sum())
        else:  # the window wraps around the buffer's end
            probs = np.concatenate((circular[start:], circular[: end - n]))
            outside = float(circular[end - n : start].sum())
        # Mass outside [lo, hi] (≤ TAIL_MASS_TRUNCATION by the Chernoff bound) goes to the infinite loss, as
        # dp_accounting's self_compose does; so does what the length-n buffer holds outside the window.
        outside = max(0.0, outside)
        inf_mass = TAIL_MASS_TRUNCATION - math.expm1(k * math.log1p(-self.inf_mass)) + outside
        return _epsilon_for_delta(probs, lower=self.lower * k + lo, infinity_mass=inf_mass, delta=delta,
                                 discretization=self.disc, at_least=at_least)


def _epsilon_for_delta(probs: np.ndarray, *, lower: int, infinity_mass: float, delta: float,
                      discretization: float, at_least: float = 0.0) -> float:
    """Smallest ε ≥ 0 with hockey-stick divergence ≤ δ for a dense privacy-loss pmf.

    ``dp_accounting``'s ``pld_pmf._get_epsilon_for_delta``, vectorised: scan the losses from
    the top, ``probs[i]`` at loss ``(lower + i)·discretization``; stop at the first loss ℓ
    with log((mass above − δ) / Σ e^(−loss)·p above) ≥ ℓ. ``at_least`` (a value ε is known to
    reach, e.g. ε of fewer compositions) limits the first scan to losses ≥ at_least − 2Δ;
    if the answer is not there everything is scanned, so the result never depends on it.

    Args:
      probs: shape (L,), probabilities (float64). lower: integer index of probs[0]'s loss.
      infinity_mass: probability of an infinite loss. delta: target δ.
      discretization: Δ, the loss grid step (nats).
    """
    if infinity_mass > delta:
        return math.inf
    size = len(probs)
    top = lower + size - 1
    first = top - math.floor(max(at_least, 0.0) / discretization) + 2  # entries scanned first
    for count in (first, size) if 0 < first < size else (size,):
        rev = probs[size - count:][::-1]
        losses = (top - np.arange(count)) * discretization
        # masses BEFORE adding entry i (the loop's state when it tests entry i)
        upper = np.empty(count + 1)
        upper[0] = 0.0
        np.cumsum(rev, out=upper[1:])
        upper += infinity_mass
        with np.errstate(over="ignore", invalid="ignore"):
            weight = np.exp(-losses)
            lower_mass = np.empty(count + 1)
            lower_mass[0] = 0.0
            np.cumsum(weight * rev, out=lower_mass[1:])
            # log((U - δ) / L) >= loss  <=>  (U - δ)·e^(-loss) >= L   (U > δ, L > 0)
            stop = (upper[:-1] - delta) * weight >= lower_mass[:-1]
        stop &= upper[:-1] > delta
        stop &= lower_mass[:-1] > 0
        i_stop = int(np.argmax(stop)) if stop.any() else None
        # after adding entry i, a huge loss may leave e^(-loss)·p = 0: the loop returns that loss
        huge = (upper[1:] >= delta) & (lower_mass[1:] == 0)
        if huge.any():
            i_huge = int(np.argmax(huge))
            if i_stop is None or i_huge < i_stop:
                return max(0.0, float(losses[i_huge]))
        if i_stop is None and count < size:
            continue  # not found in the top part: scan everything
        i = count if i_stop is None else i_stop
        mass_upper, mass_lower = float(upper[i]), float(lower_mass[i])
        if mass_upper <= mass_lower + delta:
            return 0.0
        return math.log((mass_upper - delta) / mass_lower)
    raise AssertionError("unreachable")


# ------------------------------------------------------- cyclic Poisson, RDP
class _RdpTable:
    """ε_k for all k ≤ K at once: RDP of k compositions = k × RDP of one."""

    def __init__(self, sigma: float, q: float, delta: float, num_participations: int):
        acc = _rdp_acc.RdpAccountant(list(events.RDP_ORDERS))
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)))
        orders, rdp_one = acc.orders, acc.rdp
        table = np.zeros(num_participations + 1)
        chunk = max(1, 2**20 // len(orders))
        for start in range(1, num_participations + 1, chunk):
            ks = np.arange(start, min(num_participations + 1, start + chunk))
            table[ks] = _rdp_epsilon(orders, ks[:, None] * rdp_one[None, :], delta)
        self.table = table


def _rdp_epsilon(orders: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """dp_accounting's ``rdp_privacy_accountant.compute_epsilon`` for many RDP curves.

    orders: shape (A,); rdp: shape (K, A), one curve per row; returns ε, shape (K,).
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = rdp + np.log1p(-1 / orders) - np.log(delta * orders) / (orders - 1)
    eps = np.where(orders > 1.01, eps, np.inf)
    eps = np.where(delta**2 + np.expm1(-rdp) > 0, 0.0, eps)
    return np.maximum(0.0, eps.min(axis=1))


# ------------------------------------------------------------ fixed epochs
class _FixedEpochs:
    """One Gaussian mechanism of noise multiplier σ/Δ_k after k epochs (Δ_k = s·√k for a banded C)."""

    def __init__(self, noise_multiplier: float, spec, delta: float, accountant: str):
        self.sigma, self.spec, self.delta, self.accountant = noise_multiplier, spec, delta, accountant

    def epsilon(self, k: int) -> float:
        sigma_k = events.gaussian_noise_multiplier(self.spec, self.sigma, k)  # as events.event_of
        if self.accountant == "rdp":
            return events.epsilon_of_event(dp_accounting.GaussianDpEvent(sigma_k), self.delta, "rdp")
        return _gaussian_epsilon(1.0 / sigma_k, self.delta)


def _gaussian_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of the Gaussian mechanism N(μ, 1) vs N(0, 1) (Balle & Wang 2018, Thm. 8)."""
    return float(special.ndtr(mu / 2 - epsilon / mu) - math.exp(epsilon + special.log_ndtr(-mu / 2 - epsilon / mu)))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact ε of the Gaussian mechanism with sensitivity / noise std = μ > 0 at δ (never below the truth)."""
    if _gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, mu) > delta:
        hi *= 2.0
    eps = optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-13, rtol=1e-14)
    while _gaussian_delta(eps, mu) > delta:  # brentq may stop just below the root: step to its upper side
        eps += 1e-13 + 1e-14 * eps
    return eps
