"""Privacy accounting for banded matrix factorization with cyclic Poisson sampling.

numpy/scipy + ``dp_accounting`` only: this module never imports TensorFlow.

Privacy model (docs/privacy.md): example-level DP with add-or-remove-one adjacency; the
mechanism is the whole training run. This module gathers the accounting API of four
modules, each with one job:

- :mod:`keras_noisecurve.privacy.spec`: the run spec (:class:`RunSpec`: n, B, T, b,
  sampling, q, compositions, sensitivity, validated once);
- :mod:`keras_noisecurve.privacy.events`: the run's dominating ``dp_accounting`` event
  (:func:`dp_event`) and ε for planning (:func:`compute_epsilon`);
- :mod:`keras_noisecurve.privacy.calibration`: σ from (ε, δ)
  (:func:`calibrate_noise_multiplier`, :func:`calibrate`);
- :mod:`keras_noisecurve.privacy.overflow`: the sampler's padded batch size
  (:func:`padding`), the δ its truncation adds (:func:`overflow_delta`) and the overflow
  rule ``(1 + e^ε)·p ≤ δ/10`` (:func:`smallest_allowed_padded_size`).
"""

from keras_noisecurve.privacy.calibration import (
    CALIBRATION_EPSILON_RTOL,
    CALIBRATION_RTOL,
    Calibration,
    calibrate,
    calibrate_noise_multiplier,
)
from keras_noisecurve.privacy.events import (
    ACCOUNTANTS,
    PLD_VALUE_DISCRETIZATION,
    RDP_ORDERS,
    compute_epsilon,
    dp_event,
)
from keras_noisecurve.privacy.spec import RUN_ARGUMENTS, SAMPLINGS, RunSpec, steps_for_epochs
from keras_noisecurve.privacy.overflow import (
    DEFAULT_OVERFLOW_PROBABILITY,
    OVERFLOW_DELTA_SHARE,
    allowed_overflow_probability,
    overflow_delta,
    overflow_probability,
    padded_batch_size,
    padding,
    smallest_allowed_padded_size,
)

__all__ = [
    "ACCOUNTANTS",
    "CALIBRATION_EPSILON_RTOL",
    "CALIBRATION_RTOL",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "OVERFLOW_DELTA_SHARE",
    "PLD_VALUE_DISCRETIZATION",
    "RDP_ORDERS",
    "RUN_ARGUMENTS",
    "SAMPLINGS",
    "Calibration",
    "RunSpec",
    "allowed_overflow_probability",
    "calibrate",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "dp_event",
    "overflow_delta",
    "overflow_probability",
    "padded_batch_size",
    "padding",
    "smallest_allowed_padded_size",
    "steps_for_epochs",
]
