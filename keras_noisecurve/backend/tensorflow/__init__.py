"""The TensorFlow implementation of the backend seam (``keras_noisecurve.backend``)."""
