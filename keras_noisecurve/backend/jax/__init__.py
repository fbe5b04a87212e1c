"""The JAX implementation of the backend seam (``keras_noisecurve.backend``): imports
JAX and never TensorFlow."""

#: the modules the neutral code asks ``keras_noisecurve.backend.module`` for: the same in every
#: backend package (``keras_noisecurve.backend.MODULES``)
MODULES = ("audit", "clipping", "devices", "distributed", "dp_model", "ghost", "hvp", "noise", "optimizer",
           "pipeline", "tf_privacy")

#: the public names of the library this backend has not (``keras_noisecurve.backend.refuses``)
REFUSED = frozenset({
    "BandedMatrixFactorizationQuery",  # TensorFlow Privacy's DPQuery (tf_privacy refuses it)
    "ClippedSum", "get_engine", "vectorized_clipped_sum",  # the TensorFlow engines' objects
    "fit_distributed",  # the loop of tf.distribute strategies (distributed refuses it)
})
