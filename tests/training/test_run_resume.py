"""A PrivateRun resumes exactly: kill a fit mid-run, restore, and the weights, batches
and noise equal an uninterrupted run bit for bit; a dataset out of step is refused."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.privacy.run import PrivateRun
from keras_noisecurve.training import NoiseCurveOptimizer, make_private
from tests.training.helpers import CrashAt, random_banded_c

N, B, STEPS, BANDS = 48, 6, 10, 3
C = random_banded_c(STEPS, BANDS, rng=np.random.default_rng(4), diag_scale=0.5)
PLAN = dict(num_examples=N, batch_size=B, steps=STEPS, mixing=C, noise_multiplier=1.5, delta=1e-5)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, 3)).astype("float32"), rng.integers(0, 2, N)


def _run(seed=7):
    return PrivateRun(**PLAN, seed=seed)


def _model(run, noise_seed=11, **compile_kwargs):
    keras.utils.set_random_seed(2)
    base = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
    model = make_private(base, clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(run=run, learning_rate=0.3, l2_norm_clip=0.5, seed=noise_seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return model


class _RecordSteps(keras.callbacks.Callback):
    """The optimizer step after every batch (to check no step is repeated or skipped)."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append(int(self.model.optimizer.iterations.numpy()))


def _state(model):
    opt = model.optimizer
    rings = [r.numpy() for r in opt._rings if r is not None]
    return model.get_weights(), rings, opt.sampling_key.numpy(), int(opt.iterations.numpy())


def _assert_identical(a, b):
    (wa, ra, ka, ia), (wb, rb, kb, ib) = a, b
    assert ia == ib
    np.testing.assert_array_equal(ka, kb)
    for u, v in zip(wa + ra, wb + rb):
        np.testing.assert_array_equal(u, v)  # bit for bit


def _batches(run, data, optimizer):
    """Every batch of the plan, as the optimizer's run draws them from step 0."""
    fresh = PrivateRun(**PLAN)
    fresh._key = optimizer.sampling_key.numpy()  # the same secret key, position 0
    return [tuple(np.asarray(a) for a in (e[0], e[2], e[3])) for e in fresh.dataset(*data).batches().as_numpy_iterator()]


@pytest.fixture(scope="module")
def uninterrupted(data):
    run = _run()
    model = _model(run)
    record = _RecordSteps()
    model.fit(run.dataset(*data), verbose=0, callbacks=[record])
    assert record.steps == list(range(1, STEPS + 1))
    return _state(model), _batches(run, data, model.optimizer)


def test_the_dataset_carries_step_indices_and_the_plan(data):
    run = _run()
    elements = list(run.dataset(*data).batches().as_numpy_iterator())
    assert len(elements) == STEPS
    sampler = run.sampler()
    for t, (xb, yb, mask, step) in enumerate(elements):
        assert np.all(step == t)
        indices, expected_mask, _ = sampler.batch(t)
        np.testing.assert_array_equal(mask, expected_mask)
        real = expected_mask > 0  # padding rows are blanked
        np.testing.assert_array_equal(xb, np.where(real[:, None], data[0][indices], 0.0))


def test_steps_per_execution_runs_the_same_batches(data, uninterrupted):
    run = _run()
    model = _model(run)
    model.compile(optimizer=model.optimizer, loss=model.loss, steps_per_execution=3)
    model.fit(run.dataset(*data), verbose=0)
    _assert_identical(_state(model), uninterrupted[0])


def test_backup_and_restore_after_a_crash_is_bit_for_bit(tmp_path, data, uninterrupted):
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    model = _model(_run())
    with pytest.raises(RuntimeError, match="simulated crash"):
        model.fit(_run().dataset(*data), verbose=0, callbacks=[backup, CrashAt(at_step=7)])  # mid epoch 1
    # "a new process": a new run object with a NEW secret key, a new noise seed: both
    # must come from the backup
    run = _run(seed=None)
    resumed = _model(run, noise_seed=999)
    record = _RecordSteps()
    resumed.fit(run.dataset(*data), verbose=0, callbacks=[backup, record])
    assert record.steps == list(range(8, STEPS + 1))  # steps 7 ... 9 were run, once each
    _assert_identical(_state(resumed), uninterrupted[0])
    assert [b[2][0] for b in _batches(run, data, resumed.optimizer)] == list(range(STEPS))
    for ours, theirs in zip(_batches(run, data, resumed.optimizer), uninterrupted[1]):
        for a, b in zip(ours, theirs):
            np.testing.assert_array_equal(a, b)


def test_keras_file_load_and_fit_continues_the_plan(tmp_path, data, uninterrupted):
    run = _run()
    model = _model(run)
    model.fit(run.dataset(*data), verbose=0, callbacks=[CrashAt(at_step=99)], epochs=1, steps_per_epoch=4)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.run.same_plan(run)
    np.testing.assert_array_equal(loaded.optimizer.sampling_key.numpy(), model.optimizer.sampling_key.numpy())
    loaded.fit(_run(seed=None).dataset(*data), verbose=0)  # any run object of the same plan
    _assert_identical(_state(loaded), uninterrupted[0])


def test_tf_train_checkpoint_custom_loop(tmp_path, data, uninterrupted):
    run = _run()
    model = _model(run)
    ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    train = tf.function(model.train_step)
    for batch in run.dataset(*data).batches(model.optimizer).take(3):
        train(batch)
    path = ckpt.save(str(tmp_path / "ckpt"))

    other = _run(seed=None)
    restored = _model(other, noise_seed=123)
    restored.optimizer.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path).assert_consumed()
    train = tf.function(restored.train_step)
    for batch in other.dataset(*data).batches(restored.optimizer):  # starts at step 3, with the restored key
        train(batch)
    _assert_identical(_state(restored), uninterrupted[0])


def test_a_dataset_out_of_step_is_refused(data):
    run = _run()
    model = _model(run)
    model.fit(run.dataset(*data), verbose=0, epochs=1, steps_per_epoch=3)
    # batches taken without the optimizer start at batch 0: the optimizer is at step 3
    stale = _run().dataset(*data).batches()
    train = tf.function(model.train_step)
    with pytest.raises(tf.errors.InvalidArgumentError, match="another step than the optimizer"):
        train(next(iter(stale)))
    # a dataset reordered after run.dataset() (skip(1) would give batch 4 at step 3) is refused
    # by fit before any step (tests/training/test_run_data.py); by hand it fails the step check
    with pytest.raises(tf.errors.InvalidArgumentError, match="restarted at batch 0"):
        train(next(iter(run.dataset(*data).batches(model.optimizer).skip(1))))


def _ancestors(op):
    """Every op ``op`` depends on, through its inputs and its control inputs."""
    seen, stack = set(), [op]
    while stack:
        current = stack.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


@pytest.mark.parametrize("loss_scale, plan_check", [(1.0, True), (2.0, True), (2.0, False)])
def test_a_batch_out_of_step_is_checked_before_any_update(data, loss_scale, plan_check, monkeypatch):
    """In a ``tf.function`` an assertion runs but is ordered before no variable update it
    shares no data with: the step check must be a dependency of every write of the step
    (weights, noise rings, optimizer step), so a batch out of step changes nothing.

    It used to be ordered only by accident: TensorFlow runs the stateful ops without a
    resource input (assertions) in program order, and a LATER assertion was a dependency of
    the updates (the non-finite check, absent under a loss scale; the optimizer's plan check
    t < T). Without the plan check (``plan_check=False``, patched out: the state a refactor
    could leave) and with a loss scale, nothing ordered the step check before the updates,
    nor its read of the optimizer's step: this test failed then (in 2 of 3 tries already in
    ``fit``, the check reading step 0 for the batch of step 1)."""
    if not plan_check:
        from keras_noisecurve.training.noise import StreamNoise

        monkeypatch.setattr(StreamNoise, "assert_in_plan", lambda self, step: None)
    run = _run()
    model = _model(run, loss_scale=loss_scale)
    model.fit(run.dataset(*data), verbose=0, epochs=1, steps_per_epoch=3)
    before = _state(model)
    stale = next(iter(_run().dataset(*data).batches()))  # batch 0; the optimizer is at step 3
    train = tf.function(model.train_step)
    graph = train.get_concrete_function(stale).graph
    checks = [op for op in graph.get_operations()
              if op.type in ("If", "StatelessIf", "Assert") and op.name.startswith("assert_equal")]
    assert len(checks) == 1, [op.name for op in checks]
    owned = {v.handle.ref(): v.path for v in list(model.trainable_variables) + list(model.optimizer.variables)}
    placeholders = {inner.op: owned[outer.ref()] for outer, inner in graph.captures if outer.ref() in owned}
    writes = [op for op in graph.get_operations()
              if op.type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp", "StatefulPartitionedCall")
              and any(t.op in placeholders for t in op.inputs)]
    written = {placeholders[t.op] for op in writes for t in op.inputs if t.op in placeholders}
    assert "noisecurve_optimizer/iteration" in written and {v.path for v in model.trainable_variables} <= written
    unordered = [op.name for op in writes if checks[0] not in _ancestors(op)]
    assert not unordered, unordered
    with pytest.raises(tf.errors.InvalidArgumentError, match="another step than the optimizer"):
        train(stale)
    _assert_identical(_state(model), before)


def test_fit_refuses_another_plan_and_a_complete_plan(data):
    run = _run()
    model = _model(run)
    other = PrivateRun(**{**PLAN, "noise_multiplier": 2.0})
    with pytest.raises(ValueError, match="another plan"):
        model.fit(other.dataset(*data), verbose=0)
    model.fit(run.dataset(*data), verbose=0)
    with pytest.raises(RuntimeError, match="plan of 10 steps is complete"):
        model.fit(run.dataset(*data), verbose=0)


def test_an_optimizer_without_the_run_is_refused(data):
    run = _run()
    model = make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]), clipping="vectorized")
    model.compile(
        optimizer=NoiseCurveOptimizer(learning_rate=0.1, mixing=C, noise_multiplier=1.5, expected_batch_size=B),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    with pytest.raises(ValueError, match="not created for a PrivateRun"):
        model.fit(run.dataset(*data), verbose=0)


def test_mirrored_strategy_fit_equals_one_device(data, uninterrupted):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    run = _run()
    with strategy.scope():
        model = _model(run)
        spec = run.dataset(*data).batches(model.optimizer).element_spec
    assert spec[0].shape[0] % 2 == 0  # P rounded up to the replicas
    model.fit(run.dataset(*data), verbose=0)  # fit takes the batches under the model's strategy
    weights, _, key, steps = _state(model)
    assert steps == STEPS
    for a, b in zip(weights, uninterrupted[0][0]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # sums in another order
