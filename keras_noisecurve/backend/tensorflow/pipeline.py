"""The ``tf.data`` side of the example sources and of a :class:`~keras_noisecurve.privacy.run.PrivateRun`.

- :func:`plan_batches`: the run's batches as a ``tf.data.Dataset``, below.
- :func:`gather`, :func:`tensor_spec`: an example source's rows as tensors in a ``tf.data``
  map function (``ExampleSource.tf_gather``, ``.element_spec``).
- :func:`materialize`: a ``tf.data.Dataset`` of examples read into numpy, the source of a
  run given one (on either backend: a program that made a ``tf.data.Dataset`` has TensorFlow;
  the JAX backend's pipeline hands its ``tf.data`` work here).
- :func:`plan_steps_dataset`: the batches of ``banded_poisson_dataset``'s low-level plan.

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


__all__ = ["gather", "materialize", "plan_batches", "plan_steps_dataset", "tensor_spec"]


def replicas_in_sync() -> int:
    """Replicas of the current ``tf.distribute`` strategy (1 outside any)."""
    return int(tf.distribute.get_strategy().num_replicas_in_sync)


def plan_batches(plan, input_context=None):
    """``RunData.batches(...)`` as a ``tf.data.Dataset``; see :meth:`RunData.batches` for the
    elements. ``plan``: the run's ``BatchPlan`` (``keras_noisecurve.privacy.step_batches``):
    its ``sampler()`` gives the step's ``(indices, mask)`` (int64 (≤ P,), float32 (≤ P,)), its
    ``position()`` the ``(step, key)`` where iteration starts, read when the dataset is iterated.
    A user-level run's batches are its ``run.padded_rows`` = P·k rows (k per user slot); it
    refuses ``input_context`` and more than one replica in sync."""
    run, source, position, batch_of = plan.run, plan.source, plan.position, plan.sampler()
    if run.privacy_unit == "user" and (input_context is not None or replicas_in_sync() > 1):
        raise ValueError(
            f"a user-level run (privacy_unit='user') trains on one replica: its batches are whole user slots of "
            f"{run.examples_per_user} rows, not split between replicas or input pipelines; got "
            + (f"an input_context ({int(input_context.num_replicas_in_sync)} replicas in sync)"
               if input_context is not None else f"a tf.distribute strategy with {replicas_in_sync()} replicas in sync")
            + ". Train outside the strategy (or on the JAX backend, which splits by whole users).")
    if input_context is None:
        replicas, pipelines, pipeline_id = replicas_in_sync(), 1, 0
    else:
        replicas = int(input_context.num_replicas_in_sync)
        pipelines, pipeline_id = int(input_context.num_input_pipelines), int(input_context.input_pipeline_id)
        if replicas % pipelines:
            raise ValueError(f"{replicas} replicas cannot be split evenly over {pipelines} input pipelines.")
    padded = -(-run.padded_rows // replicas) * replicas  # extra rows are masked padding
    per_replica = padded // replicas
    local = replicas // pipelines if input_context is not None else 1  # elements per step
    rows = per_replica * local if input_context is not None else padded
    first_row = pipeline_id * rows
    total = run.steps

    def start():
        step, key = position()
        return np.int64(step), np.asarray(key, np.int64)

    def indices_of(step, key):
        indices, mask = batch_of(step, key)
        if padded > indices.size:
            indices = np.concatenate([indices, np.zeros(padded - indices.size, np.int64)])
            mask = np.concatenate([mask, np.zeros(padded - mask.size, np.float32)])
        return indices[first_row:first_row + rows], mask[first_row:first_row + rows]

    def steps_from_position(_):
        step, key = tf.py_function(start, [], (tf.int64, tf.int64))
        step.set_shape([])
        key.set_shape([2])
        return tf.data.Dataset.range(step, total).map(lambda t: (t, key))

    def gather_step(t, key):
        idx, mask = tf.numpy_function(indices_of, [t, key], (tf.int64, tf.float32), stateful=False)
        idx.set_shape([rows])
        mask.set_shape([rows])
        xb, yb = gather(source, idx)
        return blank_rows(xb, mask), blank_rows(yb, mask), mask, tf.fill([rows], t)

    ds = tf.data.Dataset.from_tensors(np.int64(0)).flat_map(steps_from_position)
    ds = ds.map(gather_step, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
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


def blank_rows(tree, mask):
    """``tree`` (tensors with leading dimension P, or ``None``) with the rows of ``mask`` (P,)
    0 set to zero (``""`` for text): the padding rows of a batch are gathered as example 0
    under mask 0 and must carry no example's data, whatever a model does with them."""
    if tree is None:
        return None
    keep = tf.reshape(mask, [-1]) != 0

    def blank(leaf):
        cond = tf.reshape(keep, [-1] + [1] * (leaf.shape.rank - 1))  # the leaves' ranks are static
        out = tf.where(cond, leaf, tf.zeros_like(leaf))
        out.set_shape(leaf.shape)
        return out

    return tf.nest.map_structure(blank, tree)


# ------------------------------------------------------------ the example sources in tf.data
def tensor_spec(spec):
    """The ``tf.TensorSpec`` of one leaf's :class:`~keras_noisecurve.privacy.source_base.ArraySpec`
    (text is ``tf.string``)."""
    return tf.TensorSpec(spec.shape, tf.string if spec.is_text else tf.as_dtype(spec.dtype))


def _constants(x, y):
    with tf.init_scope():  # eager constants, captured by the map function (not graph constants)
        return tf.nest.map_structure(tf.convert_to_tensor, x), (
            None if y is None else tf.nest.map_structure(tf.convert_to_tensor, y))


def gather(source, indices) -> tuple:
    """``(x_batch, y_batch or None)`` tensors of ``source``'s rows ``indices`` (int tensor (P,)):
    :meth:`ExampleSource.tf_gather <keras_noisecurve.privacy.source_base.ExampleSource.tf_gather>`.

    In-memory arrays (``kind == "memory"``) are ``tf.gather``-ed from constant tensors made once
    per source; the other kinds run ONE ``tf.numpy_function`` of the source's numpy gather per
    call. Every leaf has the static shape ``(P, *spec.shape)`` (P static when ``indices``' is).
    """
    indices = tf.convert_to_tensor(indices)
    if indices.dtype != tf.int64:
        indices = tf.cast(indices, tf.int64)
    if source.kind == "memory":
        x_t, y_t = source.cached_arrays(_constants)
        take = lambda a: tf.gather(a, indices)  # noqa: E731
        return tf.nest.map_structure(take, x_t), (None if y_t is None else tf.nest.map_structure(take, y_t))
    x_spec, y_spec = source.element_spec
    specs = tf.nest.flatten(x_spec) + ([] if y_spec is None else tf.nest.flatten(y_spec))
    num_x = len(tf.nest.flatten(x_spec))
    flat = tf.numpy_function(
        source._flat_gather, [indices], [s.dtype for s in specs], stateful=False, name=f"gather_{source.kind}"
    )
    lead = indices.shape[:1]
    for tensor, spec in zip(flat, specs):
        tensor.set_shape(lead.concatenate(spec.shape))
    xb = tf.nest.pack_sequence_as(x_spec, flat[:num_x])
    yb = None if y_spec is None else tf.nest.pack_sequence_as(y_spec, flat[num_x:])
    return xb, yb


def materialize(dataset, *, max_bytes: int):
    """``(x, y, sample_weight)`` numpy structures of a ``tf.data.Dataset`` of examples ``x``,
    ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` (a batched dataset, every component with an
    unknown leading dimension, is unbatched); more than ``max_bytes`` is refused."""
    spec = dataset.element_spec
    leaves = tf.nest.flatten(spec)
    if leaves and all(getattr(s, "shape", None) is not None and s.shape.rank and s.shape[0] is None for s in leaves):
        dataset = dataset.unbatch()
        spec = dataset.element_spec
    rows, total = [], 0
    for element in dataset.as_numpy_iterator():
        total += sum(int(np.asarray(a).nbytes) for a in tf.nest.flatten(element))
        if total > max_bytes:
            raise ValueError(
                f"the tf.data input exceeds {max_bytes / 1024**3:g} GiB when materialised; "
                "a tf.data input is read into memory once to gather its batches. For larger data pass a "
                "np.memmap (np.load(path, mmap_mode='r')), a random-access sequence (e.g. "
                "tfds.data_source(...)) or a keras.utils.PyDataset: those are streamed."
            )
        rows.append(element)
    if not rows:
        raise ValueError("the tf.data input is empty.")
    stacked = tf.nest.map_structure(lambda *xs: np.stack(xs), *rows)
    if isinstance(spec, tuple):
        if len(spec) == 1:
            return stacked[0], None, None
        if len(spec) == 2:
            return stacked[0], stacked[1], None
        if len(spec) == 3:
            return stacked[0], stacked[1], stacked[2]
        raise ValueError(f"a tuple element must be (x,), (x, y) or (x, y, sample_weight); got {len(spec)} parts.")
    return stacked, None, None


# ------------------------------------------------------------ banded_poisson_dataset
def plan_steps_dataset(plan, optimizer=None, *, with_step=False):
    """The batches ``(x, y, mask)`` (``+ (step,)`` with ``with_step``) of a low-level plan of
    ``banded_poisson_dataset`` (``plan.source``, ``plan.indices`` (T, P), ``plan.mask`` (T, P)),
    from ``plan.start(optimizer)`` (read when the dataset is iterated: the step ``fit`` began at,
    else the optimizer's; step 0 without)."""
    indices, mask = tf.constant(plan.indices), tf.constant(plan.mask)
    rows = int(plan.indices.shape[1])
    if optimizer is None:
        steps = tf.data.Dataset.range(plan.steps)
    else:
        def first(_):
            start = tf.py_function(lambda: np.int64(plan.start(optimizer)), [], tf.int64)
            start.set_shape([])
            return tf.data.Dataset.range(start, plan.steps)

        steps = tf.data.Dataset.from_tensors(np.int64(0)).flat_map(first)

    def gather_step(t):
        m = tf.gather(mask, t)
        xb, yb = gather(plan.source, tf.gather(indices, t))
        xb, yb = blank_rows(xb, m), blank_rows(yb, m)
        return (xb, yb, m, tf.fill([rows], t)) if with_step else (xb, yb, m)

    ds = steps.map(gather_step, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return ds.prefetch(tf.data.AUTOTUNE)
