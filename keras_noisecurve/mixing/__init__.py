"""Mixing matrices C: workloads, the banded solver and the ``MixingMatrix`` artifact.

numpy/scipy only: nothing here imports TensorFlow.
"""

from keras_noisecurve.mixing.matrix import (
    COLUMN_NORM_TOLERANCE,
    InvalidMixingMatrixError,
    MixingMatrix,
)

__all__ = ["COLUMN_NORM_TOLERANCE", "InvalidMixingMatrixError", "MixingMatrix"]
