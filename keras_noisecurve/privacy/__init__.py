"""Privacy accounting and the cyclic Poisson sampler (docs/design.md#privacy-model, docs/privacy.md).

- :mod:`keras_noisecurve.privacy.accounting` (numpy/scipy + dp_accounting): the
  dominating ``dp_accounting`` event of a run and ε (``events``), noise calibration
  (``calibration``), padding and overflow bounds (``overflow``). Re-exported here.
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
    AccountingSetup,
    Calibration,
    accounting_setup,
    calibrate,
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_event,
    overflow_delta,
    overflow_probability,
    padded_batch_size,
    sampling_probability,
    steps_for_epochs,
)
from keras_noisecurve.privacy.ledger import EpsilonLedger

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_OVERFLOW_PROBABILITY",
    "PLD_VALUE_DISCRETIZATION",
    "RDP_ORDERS",
    "SAMPLINGS",
    "AccountingSetup",
    "Calibration",
    "EpsilonLedger",
    "accounting_setup",
    "calibrate",
    "calibrate_noise_multiplier",
    "compute_epsilon",
    "dp_event",
    "overflow_delta",
    "overflow_probability",
    "padded_batch_size",
    "sampling_probability",
    "steps_for_epochs",
]
