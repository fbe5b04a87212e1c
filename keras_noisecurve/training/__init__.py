"""Private training in Keras 3 (TensorFlow backend).

- :class:`NoiseCurveOptimizer` (and its base :class:`DPOptimizer`, C = I without a
  step plan): the noisy SGD step from a clipped sum (``optimizer.py``), with the
  online banded noise of ``noise.py``.
- :class:`DPModel` / :func:`make_private`: per-example clipping in ``train_step``
  (``dp_model.py``) through a clipping engine: ``clipping.py`` (vectorized engine and
  the registry), ``ghost.py`` (ghost norms, rules in ``ghost_layers.py``), both
  returning the ``ClippedSum`` of ``clipped_sum.py``.
"""

from keras_noisecurve.training.clipping import ClippedSum, get_engine, vectorized_clipped_sum
from keras_noisecurve.training.dp_model import DPModel, PrivateModel, make_private
from keras_noisecurve.training.noise import BandedNoise
from keras_noisecurve.training.optimizer import DPOptimizer, NoiseCurveOptimizer

__all__ = [
    "BandedNoise",
    "ClippedSum",
    "DPModel",
    "DPOptimizer",
    "NoiseCurveOptimizer",
    "PrivateModel",
    "get_engine",
    "make_private",
    "vectorized_clipped_sum",
]
