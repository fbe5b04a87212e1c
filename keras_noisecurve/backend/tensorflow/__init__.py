"""The TensorFlow implementation of the backend seam (``keras_noisecurve.backend``)."""

#: the modules the neutral code asks ``keras_noisecurve.backend.module`` for: the same in every
#: backend package (``keras_noisecurve.backend.MODULES``)
MODULES = ("audit", "clipping", "devices", "distributed", "dp_model", "ghost", "hvp", "noise", "optimizer",
           "pipeline", "tf_privacy")

#: the public names of the library this backend has not (``keras_noisecurve.backend.refuses``)
REFUSED = frozenset()
