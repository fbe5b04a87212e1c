"""Empirical privacy auditing: ε lower bounds from canaries planted in a real training run.

- :mod:`keras_noisecurve.audit.bounds` (numpy/scipy): the statistics, ε lower bounds
  from canary scores with confidence (Clopper–Pearson, one run, Gaussian DP).
- :mod:`keras_noisecurve.audit.scoring` (numpy): the white-box test statistic that
  whitens the observed noise by C (the Neyman–Pearson test of a correlated-noise run).
- :mod:`keras_noisecurve.audit.whitebox` and :mod:`keras_noisecurve.audit.blackbox`
  (TensorFlow): the auditors that train through ``make_private`` + ``NoiseCurveOptimizer``
  + ``PrivateRun``; :mod:`keras_noisecurve.audit.input_canaries` (TensorFlow): the white-box
  audit's input canaries, through Dense, Conv, attention and LayerNormalization layers.
- :mod:`keras_noisecurve.audit.mechanism` (TensorFlow; ``mechanism_clipping``,
  ``mechanism_noise``) and :mod:`keras_noisecurve.audit.participation` (numpy): the
  mechanism checks on the user's own model and run (clipping, sampling, noise).

docs/audit.md says what an audit proves and what it cannot (a lower bound, not a certificate).
Names are loaded lazily so that the statistics never import TensorFlow.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EpsilonBound": "keras_noisecurve.audit.bounds",
    "epsilon_lower_bound": "keras_noisecurve.audit.bounds",
    "one_run_lower_bound": "keras_noisecurve.audit.bounds",
    "gaussian_dp_bound": "keras_noisecurve.audit.bounds",
    "gaussian_epsilon": "keras_noisecurve.audit.bounds",
    "gaussian_mu_for_epsilon": "keras_noisecurve.audit.bounds",
    "clopper_pearson_upper": "keras_noisecurve.audit.bounds",
    "whitened_scores": "keras_noisecurve.audit.scoring",
    "poisson_log_likelihood_ratio": "keras_noisecurve.audit.scoring",
    "AuditResult": "keras_noisecurve.audit.report",
    "summarize": "keras_noisecurve.audit.report",
    "WhiteBoxAudit": "keras_noisecurve.audit.whitebox",
    "audit_whitebox": "keras_noisecurve.audit.whitebox",
    "audit_blackbox": "keras_noisecurve.audit.blackbox",
    "MechanismReport": "keras_noisecurve.audit.mechanism",
    "check_mechanism": "keras_noisecurve.audit.mechanism",
    "check_sampling": "keras_noisecurve.audit.mechanism",
    "ParticipationCheck": "keras_noisecurve.audit.participation",
    "check_participations": "keras_noisecurve.audit.participation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'keras_noisecurve.audit' has no attribute {name!r}")


def __dir__():
    return __all__
