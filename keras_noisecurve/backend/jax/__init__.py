"""The JAX implementation of the backend seam (``keras_noisecurve.backend``): imports
JAX and never TensorFlow."""
