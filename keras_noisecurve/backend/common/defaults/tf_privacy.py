"""TensorFlow Privacy's ``DPQuery`` on a backend other than TensorFlow: refused (TensorFlow
Privacy is a TensorFlow library). There the optimizer draws the same noise:
``NoiseCurveOptimizer``."""

from __future__ import annotations

__all__ = ["query_class"]


def query_class() -> type:
    """Refused: an ``ImportError`` (``keras_noisecurve.integrations.tf_privacy`` is not
    importable on this backend)."""
    import keras

    raise ImportError(
        "keras_noisecurve.integrations.tf_privacy is TensorFlow Privacy's DPQuery, a TensorFlow library: set "
        f"KERAS_BACKEND=tensorflow (the backend is {keras.backend.backend()!r}). On this backend the optimizer "
        "draws the same noise: NoiseCurveOptimizer."
    )
