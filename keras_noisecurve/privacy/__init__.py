"""Privacy accounting and the cyclic Poisson sampler (docs/design.md#privacy-model, docs/privacy.md).

- :mod:`keras_noisecurve.privacy.accounting` (numpy/scipy + dp_accounting): the run
  spec ``RunSpec`` (the run described and validated once, ``spec``), its dominating
  ``dp_accounting`` event and ε for planning (``events``), noise calibration
  (``calibration``), padding and overflow bounds (``overflow``). Re-exported here.
- :mod:`keras_noisecurve.privacy.run`: ``PrivateRun``, whose ``run.epsilon(step)`` is
  the ε of a run.
- :mod:`keras_noisecurve.privacy.sampler` (TensorFlow, imported lazily):
  ``banded_poisson_dataset`` and ``sampling_plan``.
- :mod:`keras_noisecurve.privacy.budget` (Keras): the ``PrivacyBudget`` callback.

Importing this package does not import TensorFlow.
"""

from keras_noisecurve.privacy.accounting import (
    ACCOUNTANTS,
    DEFAULT_OVERFLOW_PROBABILITY,
    PLD_VALUE_DISCRETIZATION,
    RDP_ORDERS,
    SAMPLINGS,
    Calibration,
    RunSpec,
    calibrate,
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_event,
    overflow_delta,
    overflow_probability,
    padded_batch_size,
    padding,
    steps_for_epochs,
)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "PLD_VALUE_DISCRETIZATION",
    "RDP_ORDERS",
    "SAMPLINGS",
    "Calibration",
    "RunSpec",
    "calibrate",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "dp_event",
    "overflow_delta",
    "overflow_probability",
    "padded_batch_size",
    "padding",
    "steps_for_epochs",
]
