"""``fit(class_weight=...)`` of a private model: the table, validated (numpy only; the
backends turn it into per-example weights: ``backend.tensorflow.features.class_weights`` on
TensorFlow, ``backend.common.step_features.class_weights`` on JAX)."""

from __future__ import annotations

import numpy as np

__all__ = ["check_class_weight"]


def check_class_weight(class_weight):
    """``{int class: float weight ≥ 0}`` validated, as a dense (max class + 1,) float32 table
    (classes not named weigh 1, as in Keras), or ``None``.

    Raises:
      TypeError / ValueError: not a dict of integer classes to finite weights ≥ 0.
    """
    if class_weight is None:
        return None
    if not isinstance(class_weight, dict) or not class_weight:
        raise TypeError(f"class_weight must be a non-empty dict {{class index: weight}}, got {class_weight!r}.")
    table = {}
    for key, value in class_weight.items():
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
            raise ValueError(f"class_weight keys must be class indices (integers >= 0), got {key!r}.")
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"class_weight[{key}] must be a number, got {value!r}.") from None
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"class_weight[{key}] must be a finite weight >= 0, got {value}.")
        table[int(key)] = value
    dense = np.ones(max(table) + 1, np.float32)
    for key, value in table.items():
        dense[key] = value
    return dense
