"""The correlated noise of a mixing strategy as a TensorFlow Privacy ``DPQuery``:
``BandedMatrixFactorizationQuery``, the same noise as ``NoiseCurveOptimizer`` at every step.

TensorFlow only, by nature (TensorFlow Privacy is a TensorFlow library): the query, its state
and its privacy accounting are documented where it lives,
``keras_noisecurve.backend.tensorflow.tf_privacy``; this module is its public name. Needs the
optional extra ``pip install "keras-noisecurve[tf-privacy]"`` (Python <= 3.11).
"""

from keras_noisecurve import backend as _backend

if _backend.name() != "tensorflow":
    raise ImportError(
        "keras_noisecurve.integrations.tf_privacy is TensorFlow Privacy's DPQuery, a TensorFlow library: set "
        f"KERAS_BACKEND=tensorflow (the backend is {_backend.name()!r}). On JAX the optimizer draws the same "
        "noise: NoiseCurveOptimizer."
    )

from keras_noisecurve.backend.tensorflow.tf_privacy import BandedMatrixFactorizationQuery  # noqa: E402

__all__ = ["BandedMatrixFactorizationQuery"]
