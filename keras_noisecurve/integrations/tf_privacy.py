"""The correlated noise of a mixing strategy as a TensorFlow Privacy ``DPQuery``.

TensorFlow only, by nature (TensorFlow Privacy is a TensorFlow library): the query lives in
the TensorFlow backend (``keras_noisecurve.backend.tensorflow.tf_privacy``); this module
is its public name.

``BandedMatrixFactorizationQuery`` is a ``SumAggregationDPQuery``: each record (a
nested structure of tensors, e.g. one example's gradients) is clipped to global L2
norm ζ, records are summed, and ``get_noised_result`` adds ζσ·z̃_t, where
z̃ = C⁻¹Z is produced online by the SAME code as ``NoiseCurveOptimizer``
(``keras_noisecurve.training.noise``). With the same seed and C, step t of the
query adds exactly the noise the optimizer adds at step t (the flattened position
of a tensor in the record structure plays the role of the optimizer's variable index).

Every strategy kind works (``MixingMatrix``, ``ToeplitzMixing``, ``BLTMixing``,
``BISRMixing``: ``keras_noisecurve.training.noise.StreamNoise``, the optimizer's
generator). The global state holds the step counter, the int64 noise key and one
noise-state array per tensor (``mixing.buffers`` × the tensor's shape: the ring of
b − 1 past z̃ of a banded or Toeplitz C, the p − 1 past draws of BISR, the d
accumulators of BLT; an empty tensor without state); it is a plain nest of tensors,
so it can be checkpointed and carried through ``tf.function``.

Privacy accounting: each call returns ``GaussianDpEvent(σ)``. Composing it once per
step is a valid (conservative) account when every example participates at most
once in any b consecutive steps, b the band width of C, and no amplification is
claimed: row t of C has entries of magnitude ≤ 1 (unit columns) and then touches at
most one participation, so it moves row t of CG by at most ζ. BLT and BISR C's are
full lower-triangular (b = T): for them the condition is one participation in the
whole run. The tight account (cyclic Poisson with b partitions, or several epochs
with the sensitivity of all participations) is ``keras_noisecurve.privacy``
(``PrivateRun``).

Needs TensorFlow Privacy, an optional extra (Python <= 3.11 only):
``pip install "keras-noisecurve[tf-privacy]"``. Without it, importing this module
raises an ``ImportError`` that says so.
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
