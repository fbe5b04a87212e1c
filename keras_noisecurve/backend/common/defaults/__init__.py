"""What a backend package may leave out: the seam modules of ``keras_noisecurve.backend.
OPTIONAL``, each here under the seam module's own name, with the seam module's public names.

A backend package lists in its ``MODULES`` the seam modules it has; ``keras_noisecurve.backend.
module(name)`` serves one it has not from here. ``devices`` does nothing a framework must do at
start-up (it lists Keras's devices); ``ghost_conv`` makes the convolution kernels' windows and
per-example filter gradients with ``keras.ops`` convolutions; ``pipeline`` serves a run's batches
as a ``keras.utils.PyDataset`` in one process (JAX's adds its processes' agreement); ``distributed`` and ``tf_privacy`` refuse, saying why and what
to call instead, as the package's ``REFUSED`` says of their public names. So a backend writes only
the modules its framework needs.
"""
