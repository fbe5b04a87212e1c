r"""Workload matrices W for the mixing-matrix objectives ``Tr(W X⁻¹)``, ``X = CᵀC``.

numpy only (no TensorFlow). Conventions (docs/design.md#notation): steps t = 0 … T−1, the
correlated noise is ``z̃ = C⁻¹z`` so ``Cov(z̃) = C⁻¹C⁻ᵀ = X⁻¹`` (per unit of σ²).

Objectives (``OBJECTIVES``; each is an object of ``keras_noisecurve.mixing.objectives``,
which says what it needs and builds its W from the kernels here):

``dpsgd``
    W = I: the sum of the per-step noise variances. Only C = I (b = 1) is "solved" for it.
``bandmf``
    W = AᵀA, A the T×T lower-triangular all-ones matrix (prefix sums): the DP-BandMF
    baseline, ``Tr(W X⁻¹) = ‖A C⁻¹‖_F²`` = total variance of the running noise sum.
``noisecurve`` (paper Theorem 3.1, eq. 1)
    ``W[j, l] = Σ_i m_i μ_i r_i^{2T−2−j−l}`` with ``r_i = 1 − ημ_i``: a Hankel matrix
    built in O(K·T) from the K distinct (eigenvalue, multiplicity) pairs. For a
    quadratic loss with Hessian eigenvalues μ, ``E[L(w̃_T)] − L(w_T) = (η²σ²/2)·Tr(W X⁻¹)``.
``noisecurve-convergence`` (paper eq. 2, the mean squared gradient norm)
    ``(1/T) Σ_{t=1}^{T} E‖∇L(w̃_t)‖² = k* + η²σ²·Tr(W X⁻¹)``. The paper prints
    ``W = 𝔐 ⊙ VᵀM²V`` with ``𝔐[j,l] = (T − max(j,l))/T``; its own proof (the line
    before the last) gives, for step t, the leading t×t block of a workload whose
    exponent is ``2t−2−j−l``, not ``2T−2−j−l``. Summing the proof's terms exactly gives

        W_conv[j, l] = (1/T) Σ_i m_i μ_i² r_i^{|j−l|} Σ_{k=0}^{T−1−max(j,l)} r_i^{2k},

    which equals the printed form only when every r_i = 1. The Monte Carlo test in
    ``tests/mixing/test_theorem31.py`` confirms this exact form and shows that the
    printed one does not match the simulated gradient norms. This module implements
    the exact form (same 𝔐 counting, correct exponents).
``noisecurve-all-iterates``
    Mean over t = 1 … T of ``E[L(w̃_t) − L(w_t)]``, see the derivation below;
    ``= (η²σ²/2)·Tr(W_all X⁻¹)``.
``noisecurve-blend``
    ``W = (1−λ)·W_curv/Tr(W_curv) + λ·AᵀA/Tr(AᵀA)`` with ``W_curv`` the eq.-1 workload
    and ``λ = blend_weight ∈ [0, 1]`` (``"auto"`` is resolved by the solver).

Derivation of the all-iterates workload. From the proof of Theorem 3.1,
``w̃_t − w_t = −η Σ_{s=0}^{t−1} (I − ηH)^{t−1−s} z̃_s`` and, because the cross term
has mean zero, ``E[L(w̃_t) − L(w_t)] = ½ E[(w̃_t − w_t)ᵀ H (w̃_t − w_t)]``. With
``E[z̃_s z̃_{s'}ᵀ] = σ² X⁻¹[s, s'] I`` and H = Q diag(μ) Qᵀ,

    E[L(w̃_t) − L(w_t)] = (η²σ²/2) Σ_{s,s'<t} X⁻¹[s,s'] Σ_i m_i μ_i r_i^{2t−2−s−s'}.

Averaging over t = 1 … T, entry (j, l) collects the t with max(j, l) < t ≤ T; with
k = t − 1 − max(j, l) the exponent is ``2t−2−j−l = |j−l| + 2k`` because
``2·max(j,l) − j − l = |j − l|``. Hence

    W_all[j, l] = (1/T) Σ_i m_i μ_i r_i^{|j−l|} Σ_{k=0}^{T−1−max(j,l)} r_i^{2k}.

The closed form of the geometric sum gives "Toeplitz minus Hankel" terms
``m_i μ_i (r_i^{|j−l|} − r_i^{2T−j−l}) / (T(1 − r_i²))`` that cancel catastrophically
when ημ_i is tiny (1/(1 − r²) ≈ 1/(2ημ) is huge). Instead we form
``h(n) = Σ_i a_i r_i^n`` for n = 0 … 2T (O(K·T), each power as ``sign·exp(n·log|r|)``
with ``log|r| = log1p(−ημ)``, 0⁰ = 1) and its suffix sums over each parity class,
``P(n) = Σ_{n' ≥ n, n' ≡ n (mod 2)} h(n')``; then
``Σ_{k=0}^{T−1−max(j,l)} h(|j−l| + 2k) = P(|j−l|) − P(2T − j − l)``. The suffix sums are
finite sums of at most T bounded terms, so the relative rounding error of an entry is
O(T·ε) even for ημ = 1e-10 (no 1/(1 − r²) factor ever appears).
The convergence workload uses the same construction with weights ``m_i μ_i²``.

Update rules: every workload above is for plain SGD, ``w ← w − η·ĝ_t``. With
``update_rule=`` (an ``UpdateRule``: heavy-ball momentum β, learning-rate multipliers s_t)
``bandmf`` is ``A_ruleᵀA_rule`` for the rule's map from gradients to iterates,
``noisecurve`` the eq.-1 workload of the rule, ``noisecurve-blend`` the same blend of
those two, and ``dpsgd`` stays I; ``noisecurve-all-iterates`` and
``noisecurve-convergence`` are refused for any rule but plain constant-rate SGD. The
derivations are in ``keras_noisecurve.mixing.rule_workloads``. None, and any rule with
β = 0 and every s_t = 1, give exactly the workloads above.

Scalar factors: the objective value is always ``Tr(W X⁻¹)``; for ``noisecurve`` and
``noisecurve-all-iterates`` the expected loss gap is ``(η²σ²/2)·Tr(W X⁻¹)``; for
``noisecurve-convergence`` the noise part of the mean squared gradient norm is
``η²σ²·Tr(W X⁻¹)`` (σ = noise multiplier × clip norm, in gradient units).
"""

from __future__ import annotations

import warnings

import numpy as np

from keras_noisecurve._validation import check_float, check_int
from keras_noisecurve.mixing.kernels import (
    CurvatureInputs,
    _all_iterates_from_powers,
    _hankel_from_powers,
    blend_workload,
    check_blend_weight,
    power_sums,
    prefix_workload,
)
from keras_noisecurve.mixing.objectives import REGISTRY, get_objective
from keras_noisecurve.mixing.rule_workloads import (
    check_rule_stability,
    is_identity_rule,
    resolve_update_rule,
)

__all__ = [
    "AUTO_BLEND_GRID", "CURVATURE_OBJECTIVES", "CurvatureInputs", "DEFAULT_OBJECTIVE", "LOSS_SCALES", "OBJECTIVES",
    "blend_workload", "check_blend_weight", "check_curvature_inputs", "check_unused_inputs", "curvature_workload",
    "dense_workload", "power_sums", "prefix_workload", "rule_curvature_workload", "workload_matrix",
    # defined in keras_noisecurve.mixing.kernels, documented and re-exported here
    "_all_iterates_from_powers", "_hankel_from_powers",
]

#: Names of the objectives: the two baselines, then the curvature objectives (eq. 1, eq. 2,
#: and the two variants that score the whole trajectory). Each is an object in
#: ``keras_noisecurve.mixing.objectives`` (``get_objective(name)``); these tables are read off it.
OBJECTIVES = tuple(REGISTRY)

#: Objectives whose workload depends on a Hessian spectrum and a learning rate.
CURVATURE_OBJECTIVES = tuple(name for name, objective in REGISTRY.items() if objective.curvature)

#: What the objective value ``Tr(W X⁻¹)`` measures, per objective (the solver stores it
#: as ``metadata["loss_scale"]``).
LOSS_SCALES = {name: objective.loss_scale for name, objective in REGISTRY.items()}

#: Default objective of ``solve_mixing_matrix``. Evidence decides it: in the
#: validation-tuned accuracy benchmark (docs/results.md; softmax regression and an MLP
#: on the bundled MNIST-5k, ε ∈ {2, 5, 8}, 20 paired seeds) no curvature objective
#: beat DP-BandMF on validation data, so DP-BandMF is the safe default. Curvature
#: objectives ("noisecurve" = paper eq. 1, and its variants) are an explicit choice.
DEFAULT_OBJECTIVE = "bandmf"

#: Grid of blend weights tried, in order, by ``blend_weight="auto"``.
AUTO_BLEND_GRID = (0.0, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)

def check_curvature_inputs(*, objective, spectrum, learning_rate, update_rule=None,
                           steps=None) -> CurvatureInputs:
    """Validate the spectrum and learning rate of a curvature objective.

    Args:
      objective: the objective name (used in messages).
      spectrum: a ``keras_noisecurve.Spectrum`` or a 1-D array of eigenvalues
        (multiplicity 1 each; must be finite and ≥ 0).
      learning_rate: η > 0.
      update_rule: the ``UpdateRule`` the workload is for (None: plain SGD); any other
        rule than plain constant-rate SGD needs ``steps`` (T, for its multipliers).

    Raises:
      ValueError: missing spectrum or learning rate, η ≤ 0, a non-finite or negative
        raw eigenvalue, ημ_max ≥ 2 (gradient descent diverges on the quadratic model);
        for another rule, η·max(s)·μ_max ≥ 2(1 + β) (heavy ball diverges).

    Warns:
      UserWarning: ημ_max > 1 (violates the assumption of the paper's Theorem 3.2), also
        for a momentum-free constant schedule at its effective rate.
    """
    from keras_noisecurve.spectrum.artifact import Spectrum

    if spectrum is None:
        raise ValueError(
            f"objective={objective!r} needs a spectrum (a keras_noisecurve.Spectrum or an array of "
            "Hessian eigenvalues); got spectrum=None."
        )
    if learning_rate is None:
        raise ValueError(f"objective={objective!r} needs learning_rate (η > 0); got learning_rate=None.")
    eta = check_float("learning_rate", learning_rate, positive=True)
    if isinstance(spectrum, Spectrum):
        spec = spectrum
    else:
        raw = np.asarray(spectrum, dtype=np.float64).reshape(-1)
        if raw.size == 0:
            raise ValueError("spectrum must contain at least one eigenvalue; got an empty array.")
        if not np.all(np.isfinite(raw)):
            bad = raw[~np.isfinite(raw)][:3]
            raise ValueError(f"spectrum eigenvalues must be finite; got {bad.tolist()} among them.")
        if np.any(raw < 0):
            bad = raw[raw < 0][:3]
            raise ValueError(
                f"spectrum eigenvalues must be >= 0 (a Hessian upper bound); got negative values "
                f"{bad.tolist()}. Build a keras_noisecurve.Spectrum to clamp them explicitly."
            )
        spec = Spectrum(raw)
    mu = np.asarray(spec.eigenvalues, dtype=np.float64)
    m = np.asarray(spec.multiplicities, dtype=np.float64)
    if update_rule is not None and not is_identity_rule(update_rule, steps):
        check_rule_stability(learning_rate=eta, max_eigenvalue=float(mu.max()), rule=update_rule, steps=steps,
                             stacklevel=4)
        return CurvatureInputs(mu, m, eta, spec.digest())
    eta_mu_max = eta * float(mu.max())
    if eta_mu_max >= 2.0:
        raise ValueError(
            f"learning_rate × max eigenvalue = {eta} × {mu.max():.6g} = {eta_mu_max:.6g} >= 2: gradient "
            "descent diverges on the quadratic model; use learning_rate < 2/μ_max "
            f"= {2.0 / mu.max():.6g}."
        )
    if eta_mu_max > 1.0:
        warnings.warn(
            f"learning_rate × max eigenvalue = {eta_mu_max:.6g} > 1 violates the assumption ημ_max <= 1 "
            "of the paper's Theorem 3.2; the workload is still exact for a quadratic loss.",
            UserWarning,
            stacklevel=3,
        )
    return CurvatureInputs(mu, m, eta, spec.digest())


def curvature_workload(*, objective: str, steps: int, inputs: CurvatureInputs, rows=None) -> np.ndarray:
    """Dense workload of one of ``noisecurve``, ``noisecurve-convergence``,
    ``noisecurve-all-iterates`` (validated inputs). Shape (T, T), symmetric PSD;
    with ``rows`` only those rows, shape (len(rows), T). (``Objective.kernel``.)"""
    return get_objective(objective).kernel(steps, inputs, rows)


def check_unused_inputs(objective, *, spectrum, learning_rate, blend_weight) -> None:
    """Refuse inputs that ``objective`` does not use (they would be silently ignored)."""
    get_objective(objective).check_unused(spectrum=spectrum, learning_rate=learning_rate,
                                          blend_weight=blend_weight)


def workload_matrix(*, objective, steps, spectrum=None, learning_rate=None, blend_weight=None,
                    update_rule=None) -> np.ndarray:
    """The (T, T) workload W of an objective: the solver minimises ``Tr(W X⁻¹)``, X = CᵀC.

    Args:
      objective: one of ``OBJECTIVES`` (see the module docstring for each W).
      steps: T ≥ 1.
      spectrum: ``Spectrum`` or 1-D array of Hessian eigenvalues μ ≥ 0 (curvature
        objectives only; the number of parameters is irrelevant, only the distinct
        values and their multiplicities enter).
      learning_rate: η > 0 (curvature objectives only), the learning rate of the
        training run the noise is for, in the same units as 1/μ.
      blend_weight: λ ∈ [0, 1], ``noisecurve-blend`` only (``"auto"`` is resolved by
        ``solve_mixing_matrix``, not here).
      update_rule: the ``UpdateRule`` (heavy-ball momentum β, schedule multipliers s_t)
        the workload is for; None is plain SGD. ``bandmf`` becomes ``A_ruleᵀA_rule`` and
        ``noisecurve`` (and the blend) the eq.-1 workload of the rule
        (``keras_noisecurve.mixing.rule_workloads``); ``dpsgd`` is I for every rule;
        ``noisecurve-all-iterates`` and ``noisecurve-convergence`` accept only plain
        constant-rate SGD.

    Returns:
      float64 array of shape (T, T), symmetric positive semi-definite. For
      ``noisecurve`` the expected final loss gap of a quadratic model is
      ``(η²σ²/2)·Tr(W X⁻¹)`` (paper eq. 1); for ``noisecurve-all-iterates`` the same factor
      gives the mean gap over all iterates; for ``noisecurve-convergence``
      ``η²σ²·Tr(W X⁻¹)`` is the noise part of the mean squared gradient norm (eq. 2).
      Memory: 8·T² bytes (800 MB at T = 10⁴).

    Raises:
      ValueError: unknown objective, steps < 1, a missing/invalid spectrum or learning
        rate for a curvature objective, ημ_max ≥ 2 (η·max(s)·μ_max ≥ 2(1 + β) for a
        rule), an invalid blend weight, any of these arguments given to an objective
        that does not use it, or a rule the objective is not derived for.
      TypeError: ``update_rule`` is not an ``UpdateRule`` or None.
    """
    spec = get_objective(objective)
    steps = check_int("steps", steps, minimum=1)
    spec.check_unused(spectrum=spectrum, learning_rate=learning_rate, blend_weight=blend_weight)
    rule = resolve_update_rule(update_rule, steps)
    spec.check_rule(rule)
    inputs = lam = None
    if spec.curvature:
        inputs = check_curvature_inputs(objective=objective, spectrum=spectrum, learning_rate=learning_rate,
                                        update_rule=rule, steps=steps)
    if spec.blend:
        lam = check_blend_weight(blend_weight, allow_auto=False)
    return spec.workload(steps=steps, inputs=inputs, blend_weight=lam, update_rule=rule)


def dense_workload(*, objective: str, steps: int, inputs: CurvatureInputs | None = None,
                   blend_weight: float | None = None, update_rule=None) -> np.ndarray:
    """The dense (T, T) workload of ``objective`` from already validated inputs.

    ``inputs`` (from ``check_curvature_inputs``) for the curvature objectives, λ =
    ``blend_weight`` (a number in [0, 1]) for ``noisecurve-blend``, ``update_rule`` an
    ``UpdateRule`` or None (plain SGD; the same workloads as a rule with β = 0 and every
    s_t = 1); see ``workload_matrix`` for the validated public entry point.
    """
    return get_objective(objective).workload(steps=steps, inputs=inputs, blend_weight=blend_weight,
                                             update_rule=update_rule)


def rule_curvature_workload(*, objective: str, steps: int, inputs: CurvatureInputs, rule) -> np.ndarray:
    """Dense curvature workload for an update rule other than literal plain SGD.

    ``noisecurve``: ``final_loss_workload`` of the rule. ``noisecurve-all-iterates`` and
    ``noisecurve-convergence``: only for β = 0 with a constant multiplier c
    (``rule.is_plain``), where SGD at rate η·c gives ``c²·W(η·c)``; any other rule
    raises ``ValueError`` (``check_rule_objective``).
    """
    return get_objective(objective).rule_kernel(steps, inputs, rule)
