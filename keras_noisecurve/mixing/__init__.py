"""Mixing matrices C: workloads, the banded solver and the ``MixingMatrix`` artifact.

numpy/scipy only: nothing here imports TensorFlow.
"""

from keras_noisecurve.mixing.matrix import (
    COLUMN_NORM_TOLERANCE,
    InvalidMixingMatrixError,
    MixingMatrix,
    load_mixing,
)
from keras_noisecurve.mixing.solver import (
    AUTO_BLEND_FACTOR,
    RIDGE_RELATIVE,
    TRUNCATION_RELATIVE,
    objective_value,
    prefix_noise_std,
    solve_mixing_matrix,
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
