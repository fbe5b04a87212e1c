"""TensorFlow Privacy's ``DPQuery`` on JAX: refused (TensorFlow Privacy is a TensorFlow library).
On JAX the optimizer draws the same noise: ``NoiseCurveOptimizer``."""

from __future__ import annotations

__all__ = ["query_class"]


def query_class() -> type:
    """Refused: an ``ImportError`` (``keras_noisecurve.integrations.tf_privacy`` is not
    importable on JAX)."""
    raise ImportError(
        "keras_noisecurve.integrations.tf_privacy is TensorFlow Privacy's DPQuery, a TensorFlow library: set "
        "KERAS_BACKEND=tensorflow (the backend is 'jax'). On JAX the optimizer draws the same "
        "noise: NoiseCurveOptimizer."
    )
