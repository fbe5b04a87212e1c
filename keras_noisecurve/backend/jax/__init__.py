"""The JAX implementation of the backend seam (``keras_noisecurve.backend``): imports
JAX and never TensorFlow."""

#: the modules of ``keras_noisecurve.backend.MODULES`` this package has; ``devices`` (nothing to do at
#: start-up), ``ghost_conv`` (``keras.ops`` convolutions serve), ``distributed`` and ``tf_privacy``
#: (refused: tf.distribute and TensorFlow Privacy are TensorFlow's) are
#: ``keras_noisecurve.backend.common.defaults``'; ``pipeline`` is the default's with the agreement of
#: several JAX processes added
MODULES = ("audit", "clipping", "dp_model", "ghost", "hvp", "noise", "optimizer", "pipeline")

#: the public names of the library this backend has not (``keras_noisecurve.backend.refuses``)
REFUSED = frozenset({
    "BandedMatrixFactorizationQuery",  # TensorFlow Privacy's DPQuery (the default tf_privacy refuses it)
    "ClippedSum", "get_engine", "vectorized_clipped_sum",  # the TensorFlow engines' objects
    "fit_distributed",  # the loop of tf.distribute strategies (the default distributed refuses it)
})
