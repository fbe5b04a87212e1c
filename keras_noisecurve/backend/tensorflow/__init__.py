"""The TensorFlow implementation of the backend seam (``keras_noisecurve.backend``)."""

#: the modules of ``keras_noisecurve.backend.MODULES`` this package has: all of them
MODULES = ("audit", "clipping", "devices", "distributed", "dp_model", "ghost", "ghost_conv", "hvp", "noise",
           "optimizer", "pipeline", "tf_privacy")

#: the public names of the library this backend has not (``keras_noisecurve.backend.refuses``)
REFUSED = frozenset()
