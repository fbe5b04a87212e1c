r"""The mixing-matrix objectives ``Tr(W X⁻¹)`` as objects, looked up by name.

One small class per objective (the math of each W is in ``keras_noisecurve.mixing.workloads``
and ``rule_workloads``); each instance knows

* ``name`` and ``loss_scale``, what the value ``Tr(W X⁻¹)`` measures (``rule_loss_scale``
  where an update rule other than plain SGD changes that);
* what it needs: ``curvature`` (a Hessian spectrum and a learning rate: a curvature
  objective), ``blend`` (a blend weight λ), ``plain_sgd_only`` (no momentum or schedule);
  ``check_unused``, ``check_rule`` and ``check_bands`` refuse what it cannot use;
* ``workload(...)``: its dense (T, T) W for (T, curvature inputs, λ, update rule);
* how the banded solver evaluates it: ``surrogate_terms(...)``, the split
  ``W = s·RRᵀ + α·A_ruleᵀA_rule + ε·I`` that ``surrogate.Problem`` turns into a
  ``Surrogate`` (``lowrank`` is factored by pivoted Cholesky), and ``exact_loss`` /
  ``identity_loss`` (C given in band storage).

``toeplitz_workload`` gives the workload in the form the Toeplitz-family solvers take
(``toeplitz_loss.ToeplitzWorkload``: ``α·AᵀA + β·Σ a_i u_i u_iᵀ``); bandmf, noisecurve and
the blend have one (``TOEPLITZ_OBJECTIVES``), the others refuse. ``get_objective(name)`` returns the registered instance;
``workloads.OBJECTIVES``, ``CURVATURE_OBJECTIVES``, ``LOSS_SCALES`` and
``rule_workloads.PLAIN_ONLY_OBJECTIVES`` are read off ``REGISTRY``.

Imports go one way: this module builds on ``kernels`` (power sums, prefix and blend
workloads), ``rule_workloads`` (update rules) and ``banded``; ``workloads`` reads its name
tables off ``REGISTRY``. numpy only.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import numpy as np

from keras_noisecurve._validation import check_choice
from keras_noisecurve.mixing import kernels, rule_workloads
from keras_noisecurve.mixing.banded import inverse_frobenius_term, prefix_factor, trace_w_xinv

__all__ = ["REGISTRY", "Objective", "SurrogateTerms", "get_objective"]

_LOSS_GAP = "E[loss gap] = (eta^2 sigma^2 / 2) * loss for a quadratic model (blend: of the normalised mix)"


def _kernels():
    """``(kernels, rule_workloads)``: the modules the workloads are built from."""
    return kernels, rule_workloads


class SurrogateTerms(NamedTuple):
    """``W = lowrank_scale·lowrank + prefix_weight·A_ruleᵀA_rule + identity_weight·I`` and the
    dense W for exact reporting (None: evaluated from the band of C alone). ``lowrank`` is a
    dense PSD matrix that ``surrogate.Problem`` factors (None: no such term; a scale of None
    is 1)."""

    workload: np.ndarray | None = None
    lowrank: np.ndarray | None = None
    lowrank_scale: float | None = None
    prefix_weight: float = 0.0
    identity_weight: float = 0.0


class Objective:
    """Base class: a dense-workload objective; subclasses set the flags and the workload.

    ``rule`` arguments of the underscore and ``kernel`` methods are None for plain SGD
    (or a rule equal to it, ``rule_workloads.is_identity_rule``) and an ``UpdateRule``
    otherwise; ``prefix_map`` is that rule's ``PrefixMap`` (None for plain SGD).
    """

    name = ""
    loss_scale = ""
    rule_loss_scale: str | None = None  # what the value measures under another rule (None: loss_scale)
    curvature = False  # needs a spectrum and a learning rate
    toeplitz = False  # the Toeplitz-family solvers take it (``toeplitz_workload``)
    blend = False  # needs a blend weight λ
    plain_sgd_only = False  # derived for plain constant-rate SGD only
    any_update_rule = False  # its C is optimal whatever update rule the optimizer runs

    def __repr__(self):
        return f"<objective {self.name!r}>"

    # ---------------------------------------------------------------- validation
    def check_unused(self, *, spectrum, learning_rate, blend_weight) -> None:
        """Refuse inputs this objective does not use (they would be silently ignored)."""
        if not self.curvature and (spectrum is not None or learning_rate is not None):
            raise ValueError(
                f"objective={self.name!r} does not use a spectrum or a learning rate; got "
                f"spectrum={'given' if spectrum is not None else None}, learning_rate={learning_rate!r}."
            )
        if not self.blend and blend_weight is not None:
            users = " or ".join(f"objective={n!r}" for n, o in REGISTRY.items() if o.blend)
            raise ValueError(
                f"blend_weight is only used by {users}; got blend_weight={blend_weight!r} "
                f"with objective={self.name!r}."
            )

    def check_rule(self, rule) -> None:
        """Refuse an ``UpdateRule`` the workload is not derived for."""
        rule_workloads.check_rule_objective(self.name, rule)

    def check_bands(self, bands: int) -> None:
        """Refuse a band count the objective cannot use (every b by default)."""

    # ------------------------------------------------------------------ workload
    def workload(self, *, steps, inputs=None, blend_weight=None, update_rule=None) -> np.ndarray:
        """Dense (T, T) W from validated inputs (``workloads.dense_workload``)."""
        _, rw = _kernels()
        if update_rule is not None and rw.is_identity_rule(update_rule, steps):
            update_rule = None
        return self._workload(steps, inputs, blend_weight, update_rule)

    def _workload(self, steps, inputs, blend_weight, rule) -> np.ndarray:
        if rule is None:
            return self.kernel(steps, inputs)
        return self.rule_kernel(steps, inputs, rule)

    def kernel(self, steps, inputs, rows=None) -> np.ndarray:
        """The plain-SGD W of a spectrum alone (rows ``rows`` only; ``workloads.curvature_workload``)."""
        names = tuple(n for n, o in REGISTRY.items() if type(o).kernel is not Objective.kernel)
        raise ValueError(f"{self.name!r} has no workload of a spectrum alone; choose one of {names}.")

    def rule_kernel(self, steps, inputs, rule) -> np.ndarray:
        """``kernel`` for an update rule (``workloads.rule_curvature_workload``)."""
        return self.kernel(steps, inputs)  # refuses, as kernel does, unless overridden

    def exact_workload(self, steps, inputs, blend_weight, rule) -> np.ndarray | None:
        """The dense W that ``exact_loss`` needs (None: it needs only the band of C)."""
        return self._workload(steps, inputs, blend_weight, rule)

    def toeplitz_workload(self, workload_cls, *, steps, inputs=None, blend_weight=None):
        """The workload in the form the Toeplitz-family solvers take.

        Args:
          workload_cls: ``keras_noisecurve.mixing.toeplitz_loss.ToeplitzWorkload`` (passed in:
            that module imports this one).
          steps: T. inputs: validated ``CurvatureInputs`` (curvature objectives).
          blend_weight: λ (the blend).

        Raises:
          ValueError: the objective's W is not of the form ``α·AᵀA + β·Σ a_i u_i u_iᵀ``.
        """
        raise ValueError(
            f"objective {self.name!r} is not supported for Toeplitz strategies; the supported objectives "
            f"are {', '.join(repr(name) for name in TOEPLITZ_OBJECTIVES)}."
        )

    # ------------------------------------------------------- banded evaluation
    def surrogate_terms(self, *, steps, inputs, blend_weight, rule, prefix_map) -> SurrogateTerms:
        """How ``surrogate.Problem`` splits W (default: all of it factored)."""
        workload = self.exact_workload(steps, inputs, blend_weight, rule)
        return SurrogateTerms(workload=workload, lowrank=workload)

    def exact_loss(self, ab, *, workload=None, prefix_map=None) -> float:
        """``Tr(W X⁻¹)`` for C in (b, T) band storage (``surrogate.exact_loss``)."""
        return trace_w_xinv(ab, workload)

    def identity_loss(self, *, steps, workload=None, prefix_map=None) -> float:
        """Loss of C = I, i.e. Tr(W)."""
        return float(np.trace(workload))

    def reduces_to_bandmf(self, blend_weight) -> bool:
        """True when the minimiser is DP-BandMF's (the solver reuses that C)."""
        return False

    def loss_scale_for(self, *, plain_sgd: bool) -> str:
        """``loss_scale``, or ``rule_loss_scale`` for another rule when it has one."""
        return self.loss_scale if plain_sgd or self.rule_loss_scale is None else self.rule_loss_scale


class DPSGD(Objective):
    """W = I (independent noise); C = I, b = 1."""

    name = "dpsgd"
    loss_scale = "total per-step noise variance (sigma = 1)"
    any_update_rule = True  # C = I is optimal for no update rule in particular

    def check_bands(self, bands):
        if bands != 1:
            raise ValueError(
                f"objective='dpsgd' means C = I, which has bands=1; got bands={bands}. Use bands=1 "
                "(or objective='bandmf' for a banded C)."
            )

    def _workload(self, steps, inputs, blend_weight, rule):
        return np.eye(steps)

    def exact_workload(self, steps, inputs, blend_weight, rule):
        return None

    def surrogate_terms(self, *, steps, inputs, blend_weight, rule, prefix_map):
        return SurrogateTerms(identity_weight=1.0)

    def exact_loss(self, ab, *, workload=None, prefix_map=None):
        return inverse_frobenius_term(ab, gradient=False)[0]

    def identity_loss(self, *, steps, workload=None, prefix_map=None):
        return float(steps)


class BandMF(Objective):
    """W = A_ruleᵀA_rule (prefix sums; ``A`` for plain SGD): DP-BandMF."""

    name = "bandmf"
    toeplitz = True

    def toeplitz_workload(self, workload_cls, *, steps, inputs=None, blend_weight=None):
        empty = np.zeros(0)
        return workload_cls(steps, 1.0, 0.0, empty, empty, objective=self.name)
    loss_scale = "total variance of the running noise sum (sigma = 1)"
    rule_loss_scale = ("total variance of the iterate noise, sum_t E||w~_{t+1} - w_{t+1}||^2 per coordinate "
                       "with a zero Hessian (sigma = 1, eta = 1)")

    def _workload(self, steps, inputs, blend_weight, rule):
        wl, rw = _kernels()
        return wl.prefix_workload(steps) if rule is None else rw.PrefixMap(steps, rule).workload()

    def exact_workload(self, steps, inputs, blend_weight, rule):
        return None

    def surrogate_terms(self, *, steps, inputs, blend_weight, rule, prefix_map):
        return SurrogateTerms(prefix_weight=1.0)

    def exact_loss(self, ab, *, workload=None, prefix_map=None):
        factor = prefix_factor(ab) if prefix_map is None else prefix_map.factor(ab)
        return inverse_frobenius_term(factor, gradient=False)[0]

    def identity_loss(self, *, steps, workload=None, prefix_map=None):
        return steps * (steps + 1) / 2.0 if prefix_map is None else prefix_map.trace()

    def reduces_to_bandmf(self, blend_weight):
        return True


class NoiseCurve(Objective):
    """Paper eq. 1: the Hankel workload of the final loss gap (any update rule)."""

    name = "noisecurve"
    toeplitz = True

    def toeplitz_workload(self, workload_cls, *, steps, inputs=None, blend_weight=None):
        eta_mu = inputs.learning_rate * inputs.eigenvalues
        return workload_cls(steps, 0.0, 1.0, 1.0 - eta_mu, inputs.multiplicities * inputs.eigenvalues,
                            eta_mu=eta_mu, objective=self.name, learning_rate=inputs.learning_rate,
                            spectrum_digest=inputs.digest)
    loss_scale = _LOSS_GAP
    curvature = True

    def kernel(self, steps, inputs, rows=None):
        wl, _ = _kernels()
        mu, m, eta = inputs.eigenvalues, inputs.multiplicities, inputs.learning_rate
        h = wl.power_sums(weights=m * mu, eta_mu=eta * mu, max_power=2 * steps - 2)
        return wl._hankel_from_powers(h, steps, rows)

    def rule_kernel(self, steps, inputs, rule):
        _, rw = _kernels()
        return rw.final_loss_workload(steps=steps, eigenvalues=inputs.eigenvalues,
                                      multiplicities=inputs.multiplicities, learning_rate=inputs.learning_rate,
                                      rule=rule)


class _IterateMean(Objective):
    """A mean over all iterates (parity suffix sums of ``power_sums``); plain SGD only,
    where a constant multiplier c gives ``c²·W(η·c)``."""

    curvature = True
    plain_sgd_only = True  # listed in rule_workloads.PLAIN_ONLY_OBJECTIVES

    def _weights(self, mu, m):
        raise NotImplementedError

    def kernel(self, steps, inputs, rows=None):
        wl, _ = _kernels()
        mu, m, eta = inputs.eigenvalues, inputs.multiplicities, inputs.learning_rate
        h = wl.power_sums(weights=self._weights(mu, m), eta_mu=eta * mu, max_power=2 * steps)
        return wl._all_iterates_from_powers(h, steps, rows)

    def rule_kernel(self, steps, inputs, rule):
        wl, _ = _kernels()
        self.check_rule(rule)
        c = float(rule.multipliers(steps)[0])
        scaled = wl.CurvatureInputs(inputs.eigenvalues, inputs.multiplicities, inputs.learning_rate * c,
                                    inputs.digest)
        return c * c * self.kernel(steps, scaled)


class NoiseCurveConvergence(_IterateMean):
    """Paper eq. 2 (exact form): the mean squared gradient norm, weights m·μ²."""

    name = "noisecurve-convergence"
    loss_scale = "mean squared gradient norm = k* + eta^2 sigma^2 * loss for a quadratic model"

    def _weights(self, mu, m):
        return m * mu * mu


class NoiseCurveAllIterates(_IterateMean):
    """The mean loss gap over all iterates, weights m·μ."""

    name = "noisecurve-all-iterates"
    loss_scale = _LOSS_GAP

    def _weights(self, mu, m):
        return m * mu


class NoiseCurveBlend(Objective):
    """``(1−λ)·W_curv/Tr(W_curv) + λ·A_ruleᵀA_rule/Tr(A_ruleᵀA_rule)``, W_curv of eq. 1."""

    name = "noisecurve-blend"
    toeplitz = True

    def toeplitz_workload(self, workload_cls, *, steps, inputs=None, blend_weight=None):
        """``α = λ/Tr(AᵀA)``, ``β = (1 − λ)/Tr(W_curv)`` (the blend's normalisation)."""
        wl, _ = _kernels()
        lam = wl.check_blend_weight(blend_weight, allow_auto=False)
        curvature = REGISTRY["noisecurve"].toeplitz_workload(workload_cls, steps=steps, inputs=inputs)
        beta = 0.0
        if lam < 1.0:
            trace = curvature.curvature_trace()
            if not trace > 0:
                raise ValueError(
                    "the eq.-1 workload has zero trace (every eigenvalue is 0 or ημ = 1 with T > 1); "
                    "it cannot be normalised for the blend."
                )
            beta = (1.0 - lam) / trace
        return workload_cls(steps, lam / (steps * (steps + 1) / 2.0), beta, curvature.r, curvature.a,
                            eta_mu=curvature.eta_mu, objective=self.name, learning_rate=curvature.learning_rate,
                            blend_weight=lam, spectrum_digest=curvature.spectrum_digest)
    loss_scale = _LOSS_GAP
    curvature = True
    blend = True

    def _parts(self, steps, inputs, blend_weight, rule, prefix_map):
        curvature = REGISTRY["noisecurve"]._workload(steps, inputs, None, rule)
        wl, _ = _kernels()
        return curvature, wl.blend_workload(curvature=curvature, blend_weight=blend_weight, prefix=prefix_map)

    def _workload(self, steps, inputs, blend_weight, rule):
        _, rw = _kernels()
        prefix_map = None if rule is None else rw.PrefixMap(steps, rule)
        return self._parts(steps, inputs, blend_weight, rule, prefix_map)[1]

    def surrogate_terms(self, *, steps, inputs, blend_weight, rule, prefix_map):
        lam = float(blend_weight)
        curvature, workload = self._parts(steps, inputs, lam, rule, prefix_map)
        prefix_trace = steps * (steps + 1) / 2.0 if prefix_map is None else prefix_map.trace()
        terms = SurrogateTerms(workload=workload, prefix_weight=lam / prefix_trace)
        if lam < 1.0:  # the normalised curvature part, factored
            terms = terms._replace(lowrank=curvature, lowrank_scale=(1.0 - lam) / float(np.trace(curvature)))
        return terms

    def reduces_to_bandmf(self, blend_weight):
        return blend_weight == 1.0


#: Every objective by name, in the order of ``workloads.OBJECTIVES``: the two baselines,
#: then the curvature objectives (eq. 1, eq. 2, the all-iterates mean, the blend).
REGISTRY = types.MappingProxyType({objective.name: objective for objective in (
    DPSGD(), BandMF(), NoiseCurve(), NoiseCurveConvergence(), NoiseCurveAllIterates(), NoiseCurveBlend(),
)})


#: Objectives the Toeplitz-family strategies (toeplitz, blt, bisr) support.
TOEPLITZ_OBJECTIVES = tuple(name for name, objective in REGISTRY.items() if objective.toeplitz)


def get_objective(name) -> Objective:
    """The registered objective called ``name``.

    Raises:
      ValueError: ``name`` is not one of ``REGISTRY`` (the message lists them).
    """
    check_choice("objective", name, tuple(REGISTRY))
    return REGISTRY[name]
