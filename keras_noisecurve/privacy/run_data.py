"""``RunData``: the private examples of a :class:`~keras_noisecurve.privacy.run.PrivateRun`,
what ``run.dataset(x, y)`` returns and a private model's ``fit`` takes.

The run flows one way: the optimizer made from the run (``NoiseCurveOptimizer(run=run)``)
holds the run, its step counter and the run's secret sampling key; the run holds no
optimizer, and a ``RunData`` holds only the run and the examples. The batches are a
``tf.data.Dataset`` built from a ``RunData`` FOR an optimizer, :meth:`RunData.batches`:

- ``model.fit(run.dataset(x, y))``: ``fit`` calls ``batches(model.optimizer)`` itself;
- a custom loop: ``for batch in run.dataset(x, y).batches(optimizer): ...``.

Where the sequence starts is decided when the dataset is ITERATED: it reads
``optimizer.sampling_position()`` (the optimizer's step and sampling key), so a
restored model (``BackupAndRestore``, ``load_model``, ``tf.train.Checkpoint``)
continues with batch k of the same plan when its optimizer stands at step k.

The examples are any :func:`~keras_noisecurve.privacy.sources.as_source` input on both
backends (arrays, memory maps, random-access sequences such as ``tfds.data_source``, a
``keras.utils.PyDataset``, a ``tf.data.Dataset`` where TensorFlow is installed). On the JAX
backend the batches are a ``keras.utils.PyDataset`` (``keras_noisecurve.backend.jax.pipeline``)
gathered in numpy (:meth:`ExampleSource.gather`), whose start is read when it is made, again
before ``fit``'s first step (after the callbacks' ``on_train_begin``: a restore) and when a
custom loop iterates it.

A user-level run (``PrivateRun(privacy_unit="user")``) takes the user of every example,
``run.dataset(x, y, users=ids)``: its sampler draws users, and each step's batch holds k rows
per user slot (:class:`~keras_noisecurve.privacy.users.UserTable`, applied right after the
sampler by :class:`~keras_noisecurve.privacy.step_batches.Samplers`). The data's fingerprint,
which the optimizer's state binds, then includes the users of the examples and k.

This module imports TensorFlow only inside :meth:`RunData.batches` on that backend.
"""

from __future__ import annotations

from keras_noisecurve import backend as _backend
from keras_noisecurve.privacy.sources import as_source
from keras_noisecurve.privacy.users import UserTable

__all__ = ["RunData"]


class RunData:
    """The examples of a run, ready to be sampled (``run.dataset(x, y, ...)``).

    Args:
      run: the ``PrivateRun``.
      x, y, sample_weight, example_fn: the private examples, anything
        :func:`keras_noisecurve.privacy.sources.as_source` accepts; exactly
        ``run.num_examples`` of them (``ValueError`` otherwise) for an example-level run.
      users: a user-level run's (required there, refused otherwise): one user id (int or
        string) per example, ``run.num_users`` distinct ids (``ValueError`` otherwise).

    A ``RunData`` is not iterable itself: give it to a private model's ``fit``, or take
    its batches for an optimizer with :meth:`batches`.
    """

    def __init__(self, run, x, y=None, *, users=None, sample_weight=None, example_fn=None):
        source = as_source(x, y, sample_weight=sample_weight, example_fn=example_fn)
        self._users = _user_table(run, users, source)
        if self._users is not None:
            source.salt_fingerprint(self._users.digest())
        elif source.num_examples != run.num_examples:
            raise ValueError(
                f"the data has {source.num_examples} examples but the run was planned for num_examples="
                f"{run.num_examples}: the sampling probability and the privacy guarantee assume n examples."
            )
        self._run = run
        self._source = source

    @property
    def run(self):
        """The ``PrivateRun`` whose plan samples these examples."""
        return self._run

    @property
    def source(self):
        """The ``ExampleSource`` the batches gather from."""
        return self._source

    @property
    def users(self):
        """The :class:`~keras_noisecurve.privacy.users.UserTable` of a user-level run's data, else ``None``."""
        return self._users

    def batches(self, optimizer=None, *, input_context=None):
        """The batches of the plan as a ``tf.data.Dataset``, from ``optimizer``'s step on.

        Args:
          optimizer: the optimizer made from this plan (``NoiseCurveOptimizer(run=...)``,
            or one restored from its checkpoint): iteration starts at its step,
            ``optimizer.iterations``, with the sampling key it saves. ``None``: from step
            0 with the run's own key (to inspect the plan; a training loop gives its
            optimizer, or a resumed run restarts at batch 0 and the step check refuses it).
          input_context: a ``tf.distribute.InputContext`` (from
            ``strategy.distribute_datasets_from_function``): the dataset then yields this
            input pipeline's per-replica shares of every global batch.

        Returns:
          A user-level run's batches hold ``run.padded_rows`` = P·k rows (k per user slot,
          user-major; padding by whole slots), and refuse ``input_context`` and more than one
          replica in sync on TensorFlow.
          On TensorFlow, a dataset of ``(x, y, mask, step)``: x, y with leading dimension P' (the padded
          size P, rounded up to a multiple of the replicas in sync, divided by them when
          sharded by ``input_context``), ``mask`` float32 (P',) (1 = real example, times
          ``sample_weight``), ``step`` int64 (P',) (every entry the step index t). It ends
          at step T. On JAX, a ``keras.utils.PyDataset`` of the same ``(x, y, mask,
          step)`` (numpy; ``step`` int32; P' = P rounded up to a multiple of the devices
          the batch is split over and of the JAX processes, divided by the processes:
          each process serves its block of the step's rows), starting at the optimizer's
          step when it is iterated, or in ``fit`` after the callbacks' ``on_train_begin``.

        Raises ``ValueError`` for an optimizer not made from a run, or made from another plan,
        and, when the batches start, for an optimizer whose state was saved under another plan
        or on other examples or another order of them (``optimizer.check_plan``).
        """
        run = self._run
        if optimizer is None:
            key = run.initial_key()

            def position(check=True):
                return 0, key
        else:
            check_optimizer(run, optimizer)
            data = self._source.fingerprint()

            def position(check=True):  # read when the batches start: after any restore
                if check:
                    optimizer.check_plan(data=data)
                return optimizer.sampling_position()
        from keras_noisecurve.privacy.step_batches import BatchPlan

        def built():  # the optimizer's own key, not yet the run's fresh one
            return optimizer is not None and optimizer.built and optimizer.sampling_key is not None

        plan = BatchPlan(run, self._source, position, built=built, users=self._users)
        return _backend.module("pipeline").plan_batches(plan, input_context=input_context)

    def __iter__(self):
        raise TypeError(
            "run.dataset(x, y) is not iterable itself: give it to a private model's fit(), or iterate its "
            "batches for your optimizer, run.dataset(x, y).batches(optimizer) (they start at the optimizer's step)."
        )

    def __repr__(self) -> str:
        return f"RunData({self._run!r}, {self._source!r})"


def _user_table(run, users, source):
    """The ``UserTable`` of a user-level run's ``users`` (``None`` for an example-level run),
    checked against the run and the examples (``ValueError`` naming the fix)."""
    if run.privacy_unit == "example":
        if users is not None:
            raise ValueError(
                "users= is for a user-level run, whose privacy unit is the user (PrivateRun(privacy_unit='user', "
                "num_users=..., examples_per_user=...)); this run's unit is the example: leave users= out, or plan "
                "a user-level run.")
        return None
    if users is None:
        raise ValueError(
            f"this run's privacy unit is the user (privacy_unit='user', num_users={run.num_users}): give the user "
            "of every example, run.dataset(x, y, users=ids), ids a 1-D array of ints or strings, one per example.")
    table = UserTable(users, examples_per_user=run.examples_per_user)
    if table.num_examples != source.num_examples:
        raise ValueError(f"users= holds {table.num_examples} ids but the data has {source.num_examples} examples: "
                         "give one user id per example.")
    if table.num_users != run.num_users:
        raise ValueError(
            f"users= holds {table.num_users} distinct user ids but the run was planned for num_users={run.num_users}: "
            "the sampling probability and the privacy guarantee assume n users.")
    return table


def check_optimizer(run, optimizer) -> None:
    """Refuse (``ValueError``) an optimizer that was not made from a run of ``run``'s plan:
    it would not save the sampling key and position, or it belongs to another run."""
    other = getattr(optimizer, "run", None)
    if other is None:
        raise ValueError(
            f"{type(optimizer).__name__} was not created for a PrivateRun: it does not save the run's "
            "sampling key and position, so a resumed run could not continue its batches. Create it with "
            "NoiseCurveOptimizer(run=run, ...)."
        )
    if not run.same_plan(other):
        raise ValueError(
            f"the optimizer was created for another plan ({other!r}) than this dataset's ({run!r}): "
            "the batches and the noise would not belong to one run."
        )
