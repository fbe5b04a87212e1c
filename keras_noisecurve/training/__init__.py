"""Private training in Keras 3 (TensorFlow backend).

- :class:`NoiseCurveOptimizer`: the noisy SGD step from a clipped sum for every
  mixing strategy, C = I (DP-SGD) by default (``optimizer.py``; its argument checks in
  ``optimizer_args.py``, its update-rule warning in ``update_rule_check.py``), with the
  online noise of ``noise.py``.
- :func:`make_private` (a :class:`PrivateModel`): per-example clipping in ``train_step``
  (``dp_model.py``) through a clipping engine: ``clipping.py`` (vectorized engine and
  the registry), ``ghost.py`` (ghost norms, rules in ``ghost_layers.py``), both
  returning the ``ClippedSum`` of ``clipped_sum.py``; examples with a non-finite loss or
  gradient are dropped, counted and reported (``nonfinite.py``).
- :func:`fit_distributed` (``distributed.py``): the training loop for
  ``MultiWorkerMirroredStrategy``, where Keras 3's ``fit`` does not run.
- :func:`learning_rate_schedule`, :class:`LinearCooldown`, :class:`MultiplierSchedule`
  (``schedules.py``): the Keras learning rate of an ``UpdateRule``'s schedule, for an
  ``inner=keras.optimizers.SGD(...)`` that runs the update a mixing matrix was solved for.
"""

from keras_noisecurve.training.batchnorm import replace_batch_normalization
from keras_noisecurve.training.clipping import ClippedSum, get_engine, vectorized_clipped_sum
from keras_noisecurve.training.distributed import fit_distributed
from keras_noisecurve.training.dp_model import PrivateModel, make_private
from keras_noisecurve.training.noise import StreamNoise
from keras_noisecurve.training.optimizer import NoiseCurveOptimizer
from keras_noisecurve.training.schedules import LinearCooldown, MultiplierSchedule, learning_rate_schedule

__all__ = [
    "ClippedSum",
    "LinearCooldown",
    "MultiplierSchedule",
    "NoiseCurveOptimizer",
    "PrivateModel",
    "StreamNoise",
    "fit_distributed",
    "get_engine",
    "learning_rate_schedule",
    "make_private",
    "replace_batch_normalization",
    "vectorized_clipped_sum",
]
