"""The ``tf.data`` pipeline of a :class:`~keras_noisecurve.privacy.run.PrivateRun`.

Per step t the pipeline asks the run's random-access sampler for the batch's example
indices and mask (a ``tf.numpy_function``, O(P) work), gathers only those examples from
the source (``keras_noisecurve.privacy.sources``) and yields ``(x, y, mask, step)``.

Where the sequence starts is decided when the dataset is ITERATED, not when it is
built: a ``tf.py_function`` calls ``position()`` (``optimizer.sampling_position`` of
the optimizer made from the run, :meth:`RunData.batches`). So a model restored by
``BackupAndRestore``, ``load_model`` or ``tf.train.Checkpoint`` continues with batch k
of the same plan when its optimizer stands at step k, with the saved key, and the
same dataset object serves a fresh run and a resumed one.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from keras_noisecurve.privacy.step_batches import Samplers as _Samplers

__all__ = ["plan_dataset", "replicas_in_sync"]


def replicas_in_sync() -> int:
    """Replicas of the current ``tf.distribute`` strategy (1 outside any)."""
    return int(tf.distribute.get_strategy().num_replicas_in_sync)


def plan_dataset(run, source, *, position, input_context=None):
    """``RunData.batches(...)``; see :meth:`RunData.batches` for the elements. ``source``:
    the run's ``ExampleSource``; ``position()``: ``(step, key)`` where iteration starts."""
    if input_context is None:
        replicas, pipelines, pipeline_id = replicas_in_sync(), 1, 0
    else:
        replicas = int(input_context.num_replicas_in_sync)
        pipelines, pipeline_id = int(input_context.num_input_pipelines), int(input_context.input_pipeline_id)
        if replicas % pipelines:
            raise ValueError(f"{replicas} replicas cannot be split evenly over {pipelines} input pipelines.")
    padded = -(-run.padded_batch_size // replicas) * replicas  # extra rows are masked padding
    per_replica = padded // replicas
    local = replicas // pipelines if input_context is not None else 1  # elements per step
    rows = per_replica * local if input_context is not None else padded
    first_row = pipeline_id * rows
    samplers = _Samplers(run, source.sample_weight)
    total = run.steps

    def start():
        step, key = position()
        return np.int64(step), np.asarray(key, np.int64)

    def indices_of(step, key):
        indices, mask = samplers.batch(step, key)
        if padded > indices.size:
            indices = np.concatenate([indices, np.zeros(padded - indices.size, np.int64)])
            mask = np.concatenate([mask, np.zeros(padded - mask.size, np.float32)])
        return indices[first_row:first_row + rows], mask[first_row:first_row + rows]

    def steps_from_position(_):
        step, key = tf.py_function(start, [], (tf.int64, tf.int64))
        step.set_shape([])
        key.set_shape([2])
        return tf.data.Dataset.range(step, total).map(lambda t: (t, key))

    def gather(t, key):
        idx, mask = tf.numpy_function(indices_of, [t, key], (tf.int64, tf.float32), stateful=False)
        idx.set_shape([rows])
        mask.set_shape([rows])
        xb, yb = source.tf_gather(idx)
        return xb, yb, mask, tf.fill([rows], t)

    ds = tf.data.Dataset.from_tensors(np.int64(0)).flat_map(steps_from_position)
    ds = ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if local > 1:  # one element per local replica: consecutive row blocks of the step
        def split(xb, yb, mask, step):
            def blocks(a):
                return tf.reshape(a, [local, per_replica, *a.shape[1:]])

            x_blocks, mask_blocks, step_blocks = tf.nest.map_structure(blocks, xb), blocks(mask), blocks(step)
            if yb is None:
                ds = tf.data.Dataset.from_tensor_slices((x_blocks, mask_blocks, step_blocks))
                return ds.map(lambda a, m, s: (a, None, m, s))
            return tf.data.Dataset.from_tensor_slices(
                (x_blocks, tf.nest.map_structure(blocks, yb), mask_blocks, step_blocks)
            )

        ds = ds.flat_map(split)
    return ds.prefetch(tf.data.AUTOTUNE)
