"""fit_distributed: two MultiWorkerMirroredStrategy worker processes on 127.0.0.1 equal
the single-process run, refuse different plans and the examples in another order on both
workers, agree on a secret key without a seed; in process: fit_distributed equals fit, resumes from a checkpoint,
honours stop_training, PrivacyBudget and BackupAndRestore.

The worker program is tests/training/multiworker_worker.py. The one 2-process launch
starts with the module (the in-process tests run meanwhile), has a deadline
(``TIMEOUT`` s after its start) and its children are killed in a ``finally``.
"""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_noisecurve as knc
from keras_noisecurve.training.distributed import (
    assert_same_on_all_workers,
    fit_distributed,
    is_chief,
    worker_checkpoint_dir,
)
from tests.training import multiworker_worker as mw
from tests.training.helpers import CrashAt

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 240  # seconds from the start of the 2-process launch to its deadline (about 30-60 s on 2 busy cores)
_FIXED_KEY_WORD = 0x5EED_C0DE  # second word of the key of a fixed seed (noise.key_from_seed)


# --------------------------------------------------------------------- launching
def _free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _Workers:
    """The two worker processes of one launch (``args`` for both), started at once; their
    output goes to OUT/worker<i>.log. :meth:`wait` waits until ``TIMEOUT`` s after the
    start, :meth:`close` kills whatever still runs."""

    ARGS = ("--secret", "--run", "--shuffled", "--refuse")

    def __init__(self, out, args=ARGS):
        self.out = out
        self.deadline = time.monotonic() + TIMEOUT
        ports = ",".join(str(p) for p in _free_ports(2))
        env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        env.pop("TF_CONFIG", None)
        self.procs, self.logs = [], []
        try:
            for task in (0, 1):
                self.logs.append(open(out / f"worker{task}.log", "w"))
                command = [sys.executable, "-m", "tests.training.multiworker_worker", "--task", str(task),
                           "--ports", ports, "--out", str(out), *args]
                self.procs.append(
                    subprocess.Popen(command, env=env, cwd=REPO, stdout=self.logs[-1], stderr=subprocess.STDOUT)
                )
        except BaseException:
            self.close()
            raise

    def wait(self):
        """``(codes, texts)``: the exit codes (``None``: still running at the deadline, then
        killed) and the outputs of the two workers."""
        codes = []
        try:
            for proc in self.procs:
                try:
                    codes.append(proc.wait(timeout=max(0.0, self.deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    codes.append(None)
        finally:
            self.close()
        return codes, [(self.out / f"worker{task}.log").read_text() for task in (0, 1)]

    def close(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def _results(out, name="worker"):
    return [dict(np.load(out / f"{name}{task}.npz")) for task in (0, 1)]


def _weights(result):
    return [result[f"w{i}"] for i in range(sum(k.startswith("w") and k[1:].isdigit() for k in result))]


def _global_dataset():
    x, y, mask = mw.global_batches()
    return tf.data.Dataset.from_tensor_slices((x, y, mask))  # one element = one global batch of P rows


@pytest.fixture(scope="module")
def reference():
    """Keras's fit in this process on the whole global batches, same seed: (weights, history)."""
    model = mw.build_model()
    history = model.fit(_global_dataset(), epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == mw.STEPS
    return model.get_weights(), history.history


def _assert_close(weights, reference_weights):
    for a, ref in zip(weights, reference_weights):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------- in process
def test_fit_distributed_equals_fit_with_steps_per_execution(reference):
    """3 steps per execution over 4 steps: a call of 3, then one of 1 (the other tests run 1)."""
    weights, history = reference
    model = mw.build_model()
    model.steps_per_execution = 3
    seen = []
    batch_ends = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    ours = fit_distributed(model, mw.shard_fn(*mw.global_batches()), steps=mw.STEPS, verbose=0,
                           callbacks=[batch_ends])
    assert int(model.optimizer.iterations.numpy()) == mw.STEPS
    _assert_close(model.get_weights(), weights)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(ours.history[name], history[name], rtol=1e-5)
    assert seen == [2, 3]


def test_two_local_replicas_and_a_checkpoint_resume(tmp_path, reference):
    """MirroredStrategy on the 2 logical CPUs of tests/conftest.py (two per-replica
    batches per step from one dataset), interrupted after 2 steps: a tf.train.Checkpoint
    restored into a new model continues to the uninterrupted run's weights."""
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    dataset_fn = mw.shard_fn(*mw.global_batches())
    with strategy.scope():
        first = mw.build_model()
    fit_distributed(first, dataset_fn, steps=2, strategy=strategy, verbose=0)
    path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(
        os.path.join(worker_checkpoint_dir(tmp_path, strategy), "ckpt")
    )
    with strategy.scope():
        second = mw.build_model(seed=1)  # another key: the checkpoint's replaces it
        second.optimizer.build(second.trainable_variables)
    tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(path).assert_existing_objects_matched()
    fit_distributed(second, dataset_fn, strategy=strategy, verbose=0)  # to the end of the plan
    assert int(second.optimizer.iterations.numpy()) == mw.STEPS
    for var, ref in zip(second.trainable_variables, reference[0]):
        copies = [c.numpy() for c in var.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
        np.testing.assert_allclose(copies[0], ref, rtol=1e-5, atol=1e-6)


def test_stop_training_and_privacy_budget():
    from keras_noisecurve.callbacks import PrivacyBudget

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.model.stop_training = True

    model = mw.build_model()
    fit_distributed(model, mw.shard_fn(*mw.global_batches()), steps=3, callbacks=[StopAt()], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1

    run = knc.PrivateRun(num_examples=40, batch_size=mw.B, steps=mw.STEPS, mixing=mw.mixing(), noise_multiplier=1.0,
                         delta=1e-5, accountant="rdp", seed=0)
    eps = run.epsilon
    budget = PrivacyBudget(run=run, target_epsilon=(eps(2) + eps(3)) / 2, verbose=0)
    model = mw.build_model()
    history = fit_distributed(model, mw.shard_fn(*mw.global_batches()), callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 == budget.stopped_at_step
    assert history.history["epsilon"] == [pytest.approx(eps(2))]


def test_backup_and_restore_resumes_to_the_uninterrupted_run(tmp_path, reference):
    dataset_fn = mw.shard_fn(*mw.global_batches())
    backup = str(tmp_path / "backup")
    crashed = mw.build_model()
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit_distributed(crashed, dataset_fn, verbose=0,
                        callbacks=[keras.callbacks.BackupAndRestore(worker_checkpoint_dir(backup), save_freq=1),
                                   CrashAt(2)])
    resumed = mw.build_model(seed=5)  # the backup's key replaces it
    history = fit_distributed(resumed, dataset_fn, verbose=0,
                              callbacks=[keras.callbacks.BackupAndRestore(backup, save_freq=1)])
    assert int(resumed.optimizer.iterations.numpy()) == mw.STEPS
    assert len(history.history["loss"]) == 1
    _assert_close(resumed.get_weights(), reference[0])


def test_verbose_prints_a_progress_bar(capsys):
    model = mw.build_model()
    fit_distributed(model, mw.shard_fn(*mw.global_batches()), steps=2, verbose=1)
    assert "2/2" in capsys.readouterr().out
    assert is_chief() and worker_checkpoint_dir("d") == "d"


def test_arguments_are_checked():
    model = mw.build_model()
    dataset_fn = mw.shard_fn(*mw.global_batches())
    with pytest.raises(ValueError, match="steps must be >= 0, got -1"):
        fit_distributed(model, dataset_fn, steps=-1)
    with pytest.raises(ValueError, match="verbose must be 0, 1 or 2, got 3"):
        fit_distributed(model, dataset_fn, verbose=3)
    with pytest.raises(TypeError, match="must be a callable dataset_fn"):
        fit_distributed(model, [1, 2], steps=1)
    with pytest.raises(ValueError, match="y= is for fit_distributed"):
        fit_distributed(model, dataset_fn, np.zeros(3))
    run = mw.private_run(seed=0)
    with pytest.raises(ValueError, match="was not created for a PrivateRun"):
        fit_distributed(model, *mw.examples(), run=run)
    run_model = mw.build_model(run=run)
    with pytest.raises(ValueError, match="skip_done_steps=True does not apply with run="):
        fit_distributed(run_model, *mw.examples(), run=run, skip_done_steps=True)
    with pytest.raises(ValueError, match="goes past the run's plan of T = 4 steps: at most 4"):
        fit_distributed(run_model, *mw.examples(), run=run, steps=5, verbose=0)
    with pytest.raises(TypeError, match="model must be a private model"):
        fit_distributed(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), dataset_fn, steps=1)
    with pytest.raises(ValueError, match="ran out after fewer than 3 steps"):
        fit_distributed(model, lambda ctx: dataset_fn(ctx).take(2), steps=3, verbose=0)
    with pytest.raises(ValueError, match="fingerprint must be <="):
        assert_same_on_all_workers(tf.distribute.get_strategy(), 2**63, "the plan")
    assert_same_on_all_workers(tf.distribute.get_strategy(), 7, "the plan")  # one replica: nothing to compare


def test_the_comparison_names_what_differs_and_what_to_do_about_the_data():
    """The decision every worker takes on the gathered table (one row per replica), without
    a second process: nothing when every column agrees; else the entries that differ, each
    replica's fingerprint, and, for the examples, what to do."""
    from keras_noisecurve.backend.tensorflow.distributed import _DATA, _DATA_ADVICE, _disagreement

    names, advice = ["the start step (optimizer.iterations)", _DATA], {_DATA: _DATA_ADVICE}
    assert _disagreement(names, np.array([[0, 17], [0, 17]]), chief=True, advice=advice) is None
    message = _disagreement(names, np.array([[0, 17], [0, 99]]), chief=False, advice=advice)
    assert message.startswith(f"the workers do not run the same plan: {_DATA} differs between the 2 replicas")
    assert f"{_DATA}: [17, 99]" in message and "this worker (not the chief) stops before the first step" in message
    assert message.endswith(_DATA_ADVICE) and "shuffle with a fixed seed or not at all" in message
    message = _disagreement(names, np.array([[0, 17], [2, 17]]), chief=True, advice=advice)
    assert "the start step (optimizer.iterations): [0, 2]" in message and _DATA_ADVICE not in message


def test_fit_distributed_compares_the_examples_in_order_with_a_run(monkeypatch):
    """With run=, the plan the workers compare holds the fingerprint of the examples in
    their order (another order: another fingerprint); with a dataset_fn, none."""
    from keras_noisecurve.backend.tensorflow import distributed as backend

    class Compared(Exception):
        pass

    compared = []

    def record(strategy, plan, advice=None):
        compared.append(dict(plan))
        raise Compared  # before the first step

    monkeypatch.setattr(backend, "_assert_same", record)
    run = mw.private_run(seed=0)
    x, y = mw.examples()
    order = np.random.default_rng(11).permutation(mw.N)
    for xs, ys in ((x, y), (x[order], y[order])):
        with pytest.raises(Compared):
            fit_distributed(mw.build_model(run=run), xs, ys, run=run, verbose=0)
    with pytest.raises(Compared):
        fit_distributed(mw.build_model(), mw.shard_fn(*mw.global_batches()), steps=1, verbose=0)
    fingerprints = [plan.get(backend._DATA) for plan in compared]
    assert fingerprints[0] == run.dataset(x, y).source.fingerprint() != fingerprints[1]
    assert fingerprints[1] == run.dataset(x[order], y[order]).source.fingerprint()
    assert fingerprints[2] is None


def test_the_optimizer_fingerprint_ignores_seeds_and_names():
    """Workers compare the optimizer's public configuration: the seed (the chief's key is
    used) and Keras's per-process numbered names (sgd, sgd_1, …) are left out."""
    import keras_noisecurve as knc
    from keras_noisecurve.backend.tensorflow.distributed import _optimizer_fingerprint

    def optimizer(**kwargs):
        kwargs.setdefault("noise_multiplier", 1.0)
        return knc.NoiseCurveOptimizer(inner=keras.optimizers.SGD(0.1), mixing=mw.mixing(), l2_norm_clip=0.3,
                                       expected_batch_size=mw.B, **kwargs)

    first, second = optimizer(seed=1), optimizer(seed=None)
    assert first.inner.name != second.inner.name
    assert _optimizer_fingerprint(first) == _optimizer_fingerprint(second)
    assert _optimizer_fingerprint(optimizer(noise_multiplier=1.5)) != _optimizer_fingerprint(first)


# ------------------------------------------------------------------- two workers
@pytest.fixture(scope="module", autouse=True)
def _started_workers(request, tmp_path_factory):
    """Starts the two workers as this module starts, when a test here needs them, so
    that the in-process tests above run while the workers import TensorFlow (the slow
    part). Not under pytest-xdist, which may run those tests elsewhere."""
    wanted = any(
        "two_workers" in getattr(item, "fixturenames", ()) for item in request.session.items
        if item.module is request.module
    )
    workers = None
    if wanted and not os.environ.get("PYTEST_XDIST_WORKER"):
        workers = _Workers(tmp_path_factory.mktemp("two_workers"))
    try:
        yield workers
    finally:
        if workers is not None:
            workers.close()


@pytest.fixture(scope="module")
def two_workers(_started_workers, tmp_path_factory):
    """One launch of the two workers: the seeded run, the secret-key run with a
    checkpoint, a PrivateRun without any seed (first given worker 1's examples permuted,
    which must be refused, then trained), then a PrivateRun that differs between them
    (noise multipliers 1 and 2), which must be refused."""
    workers = _started_workers or _Workers(tmp_path_factory.mktemp("two_workers"))
    out = workers.out
    codes, texts = workers.wait()
    assert None not in codes, f"a worker was still running at the {TIMEOUT} s deadline: {texts}"
    for task, text in enumerate(texts):
        assert f"worker {task}: trained the run" in text, text
    return out, codes, texts


def test_two_workers_equal_the_single_process_run(two_workers, reference):
    out, _, texts = two_workers
    r0, r1 = _results(out)
    assert int(r0["iterations"]) == int(r1["iterations"]) == mw.STEPS
    for a, b in zip(_weights(r0), _weights(r1)):
        np.testing.assert_array_equal(a, b)  # the workers' replicas are identical
    np.testing.assert_array_equal(r0["probe"], r1["probe"])  # the chief's random initial value, broadcast

    weights, history = reference  # one process, whole global batches, same seed
    _assert_close(_weights(r0), weights)
    # the logs are the synchronised metrics of the whole global batches, as fit's
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(r0[name], history[name], rtol=1e-5)
        np.testing.assert_allclose(r1[name], history[name], rtol=1e-5)
    assert f"{mw.STEPS}/{mw.STEPS}" in texts[0]  # the chief's progress bar
    assert "/step" not in texts[1] and f"{mw.STEPS}/{mw.STEPS}" not in texts[1]  # worker 1 prints none


def test_a_worker_with_another_plan_is_refused_on_both_workers(two_workers):
    _, codes, texts = two_workers  # both exited before the deadline (the fixture checks)
    assert codes[0] != 0 and codes[1] != 0, texts
    for text in texts:
        assert "ValueError: the workers do not run the same plan" in text, text
        assert "the optimizer (its public configuration)" in text and "the run plan (fingerprint)" in text
        assert "NOT refused" not in text


def test_a_worker_with_the_examples_in_another_order_is_refused_on_both_workers(two_workers):
    """Worker 1 holds the examples permuted (as an unseeded shuffle would): both workers
    refuse before the first step, naming the examples and each worker's fingerprint; the
    same model then trains on the same order everywhere (the next test checks its weights)."""
    _, _, texts = two_workers
    run = mw.private_run(seed=0)
    x, y = mw.examples()
    order = np.random.default_rng(11).permutation(mw.N)
    ours, theirs = (run.dataset(*d).source.fingerprint() for d in ((x, y), (x[order], y[order])))
    for task, text in enumerate(texts):
        assert (f"worker {task}: refused the shuffled data at step 0: the workers do not run the same plan: "
                "the examples, in order (fingerprint) differs between the 2 replicas") in text, text
        assert f"the examples, in order (fingerprint): [{ours}, {theirs}]" in text
        assert "shuffle with a fixed seed or not at all (the run's sampling does the shuffling)" in text
        assert "shuffled data NOT refused" not in text


def test_without_a_seed_workers_agree_and_the_checkpoint_resumes(two_workers):
    """seed=None: each process draws its own secret key, the chief's is broadcast at the
    variable's creation; the checkpoint saved by the chief after 2 steps, restored in
    this process, continues to the workers' final weights."""
    out, _, _ = two_workers
    r0, r1 = _results(out, "secret")
    np.testing.assert_array_equal(r0["key"], r1["key"])
    assert r0["key"][1] != _FIXED_KEY_WORD  # a key from OS entropy, not from a seed
    for a, b in zip(_weights(r0), _weights(r1)):
        np.testing.assert_array_equal(a, b)
    ckpt_dir = out / "ckpt"
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith("workertemp_")]  # worker 1's copy removed

    model = mw.build_model(seed=None)  # another key: the checkpoint's replaces it
    model.optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).restore(
        tf.train.latest_checkpoint(str(ckpt_dir))
    ).assert_existing_objects_matched()
    assert int(model.optimizer.iterations.numpy()) == 2
    np.testing.assert_array_equal(model.optimizer._noise_key.numpy(), r0["key"])
    fit_distributed(model, mw.shard_fn(*mw.global_batches()), verbose=0)  # steps 2, 3 (skips 0, 1)
    assert int(model.optimizer.iterations.numpy()) == mw.STEPS
    for a, ref in zip(model.get_weights(), _weights(r0)):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)


def test_a_private_run_without_seeds_agrees_and_equals_fit(two_workers):
    """PrivateRun(seed=None) and an optimizer without seed: every worker draws its own
    sampling and noise keys, the chief's are broadcast, so the workers gather the same
    batches (each its rows) and add the same noise; with those keys, Keras's fit of
    run.dataset in this process reaches the same weights."""
    out, _, _ = two_workers
    r0, r1 = _results(out, "run")
    assert int(r0["iterations"]) == int(r1["iterations"]) == mw.STEPS
    for name in ("sampling_key", "key"):
        np.testing.assert_array_equal(r0[name], r1[name])
    np.testing.assert_array_equal(r0["sampling_key"], r0["run_key"])  # the chief's own key ...
    assert not np.array_equal(r1["sampling_key"], r1["run_key"])  # ... replaced worker 1's
    for a, b in zip(_weights(r0), _weights(r1)):
        np.testing.assert_array_equal(a, b)

    run = mw.private_run(seed=0)
    model = mw.build_model(seed=0, run=run)
    model.optimizer.build(model.trainable_variables)
    model.optimizer.sampling_key.assign(r0["sampling_key"])  # the dataset reads the key from here
    model.optimizer._noise_key.assign(r0["key"])
    history = model.fit(run.dataset(*mw.examples()), verbose=0)
    assert int(model.optimizer.iterations.numpy()) == mw.STEPS
    for a, ref in zip(_weights(r0), model.get_weights()):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r0["loss"], history.history["loss"][-1:], rtol=1e-5)


def test_fit_distributed_probes_the_model_and_refuses_callbacks_on_training_logs():
    # the same refusals as fit: a layer that centres the batch (found by the batch probe, after
    # the workers agreed on plan and data), and a callback steered by the training loss
    run = mw.private_run(seed=1)
    with pytest.raises(ValueError, match="acts on a training log"):
        fit_distributed(mw.build_model(run=run), *mw.examples(), run=run, verbose=0,
                        callbacks=[keras.callbacks.EarlyStopping(monitor="loss")])

    class Centre(keras.layers.Layer):
        def call(self, x, training=None):
            return x - keras.ops.mean(x, axis=0, keepdims=True) if training else x

    model = mw.build_model(run=run)
    mixing = knc.make_private(keras.Sequential([keras.Input((mw.FEATURES,)), Centre(), *model.inner.layers]),
                              clipping="vectorized")
    mixing.compile(optimizer=model.optimizer, loss=model.loss)
    with pytest.raises(ValueError, match="mixes the examples of a batch"):
        fit_distributed(mixing, *mw.examples(), run=run, verbose=0)
    assert int(mixing.optimizer.iterations.numpy()) == 0
