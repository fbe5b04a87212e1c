"""Mixing strategies C: workloads, the solvers and the files (banded ``MixingMatrix``,
``ToeplitzMixing``, ``BLTMixing``, ``BISRMixing``, ``IdentityMixing``).

numpy/scipy only: nothing here imports TensorFlow.
"""

from keras_noisecurve.mixing.matrix import COLUMN_NORM_TOLERANCE, InvalidMixingMatrixError, MixingMatrix
from keras_noisecurve.mixing.api import TOEPLITZ_OBJECTIVES, objective_value, solve_mixing_matrix
from keras_noisecurve.mixing.solver import AUTO_BLEND_FACTOR, RIDGE_RELATIVE, TRUNCATION_RELATIVE, prefix_noise_std
from keras_noisecurve.mixing.stream import NoiseStream, stream_apply
from keras_noisecurve.mixing.strategies import (
    STRATEGIES,
    STRATEGY_CLASSES,
    BISRMixing,
    BLTMixing,
    IdentityMixing,
    Strategy,
    ToeplitzMixing,
    load_mixing,
)
from keras_noisecurve.mixing.update_rule import SCHEDULES, UpdateRule
from keras_noisecurve.mixing.workloads import (
    AUTO_BLEND_GRID,
    CURVATURE_OBJECTIVES,
    DEFAULT_OBJECTIVE,
    OBJECTIVES,
    workload_matrix,
)

__all__ = [
    "AUTO_BLEND_FACTOR",
    "BISRMixing",
    "BLTMixing",
    "IdentityMixing",
    "NoiseStream",
    "STRATEGIES",
    "STRATEGY_CLASSES",
    "Strategy",
    "TOEPLITZ_OBJECTIVES",
    "ToeplitzMixing",
    "stream_apply",
    "AUTO_BLEND_GRID",
    "COLUMN_NORM_TOLERANCE",
    "CURVATURE_OBJECTIVES",
    "DEFAULT_OBJECTIVE",
    "InvalidMixingMatrixError",
    "MixingMatrix",
    "OBJECTIVES",
    "RIDGE_RELATIVE",
    "SCHEDULES",
    "TRUNCATION_RELATIVE",
    "UpdateRule",
    "load_mixing",
    "objective_value",
    "prefix_noise_std",
    "solve_mixing_matrix",
    "workload_matrix",
]
