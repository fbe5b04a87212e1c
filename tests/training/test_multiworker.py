"""fit_distributed: two MultiWorkerMirroredStrategy worker processes on 127.0.0.1 equal
the single-process run, refuse different plans on both workers, agree on a secret key
without a seed; in process: fit_distributed equals fit, resumes from a checkpoint,
honours stop_training, PrivacyBudget and BackupAndRestore.

The worker program is tests/training/multiworker_worker.py. Every 2-process launch has
a deadline (``TIMEOUT`` s) and its children are killed in a ``finally``.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_noisecurve.training.distributed import (
    assert_same_on_all_workers,
    fit_distributed,
    is_chief,
    worker_checkpoint_dir,
)
from tests.training import multiworker_worker as mw
from tests.training.helpers import CrashAt

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 120  # seconds for one 2-process launch (about 15-30 s on 2 busy cores)
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


def _launch(out, *args, worker1_args=()):
    """Run the two workers (``args`` for both, ``worker1_args`` added for worker 1);
    return their exit codes and their output (stdout + stderr)."""
    ports = ",".join(str(p) for p in _free_ports(2))
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env.pop("TF_CONFIG", None)
    procs, logs = [], []
    try:
        for task in (0, 1):
            log = open(out / f"worker{task}.log", "w")
            logs.append(log)
            command = [sys.executable, "-m", "tests.training.multiworker_worker", "--task", str(task),
                       "--ports", ports, "--out", str(out), *args, *(worker1_args if task == 1 else ())]
            procs.append(subprocess.Popen(command, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=TIMEOUT))
            except subprocess.TimeoutExpired:
                codes.append(None)  # still running at the deadline
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()
    texts = [(out / f"worker{task}.log").read_text() for task in (0, 1)]
    return codes, texts


def _results(out, name="worker"):
    return [dict(np.load(out / f"{name}{task}.npz")) for task in (0, 1)]


def _weights(result):
    return [result[f"w{i}"] for i in range(sum(k.startswith("w") and k[1:].isdigit() for k in result))]


def _global_dataset():
    x, y, mask = mw.global_batches()
    return tf.data.Dataset.from_tensor_slices((x, y, mask))  # one element = one global batch of P rows


# ------------------------------------------------------------------- two workers
@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    """One launch of the two workers (importing TensorFlow is the slow part): the seeded
    run, the secret-key run with a checkpoint, a PrivateRun without any seed, then a
    PrivateRun that differs between them (noise multipliers 1 and 2), which must be refused."""
    out = tmp_path_factory.mktemp("two_workers")
    codes, texts = _launch(out, "--secret", "--run", "--refuse")
    assert None not in codes, f"a worker was still running at the {TIMEOUT} s deadline: {texts}"
    for task, text in enumerate(texts):
        assert f"worker {task}: trained the run" in text, text
    return out, codes, texts


def test_two_workers_equal_the_single_process_run(two_workers):
    out, _, texts = two_workers
    r0, r1 = _results(out)
    assert int(r0["iterations"]) == int(r1["iterations"]) == mw.STEPS
    for a, b in zip(_weights(r0), _weights(r1)):
        np.testing.assert_array_equal(a, b)  # the workers' replicas are identical
    np.testing.assert_array_equal(r0["probe"], r1["probe"])  # the chief's random initial value, broadcast

    reference = mw.build_model()  # one process, whole global batches, same seed
    history = reference.fit(_global_dataset(), epochs=1, shuffle=False, verbose=0)
    for a, ref in zip(_weights(r0), reference.get_weights()):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)
    # the logs are the synchronised metrics of the whole global batches, as fit's
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(r0[name], history.history[name], rtol=1e-5)
        np.testing.assert_allclose(r1[name], history.history[name], rtol=1e-5)
    assert f"{mw.STEPS}/{mw.STEPS}" in texts[0]  # the chief's progress bar
    assert "/step" not in texts[1] and f"{mw.STEPS}/{mw.STEPS}" not in texts[1]  # worker 1 prints none


def test_a_worker_with_another_plan_is_refused_on_both_workers(two_workers):
    _, codes, texts = two_workers  # both exited before the deadline (the fixture checks)
    assert codes[0] != 0 and codes[1] != 0, texts
    for text in texts:
        assert "ValueError: the workers do not run the same plan" in text, text
        assert "the optimizer (its public configuration)" in text and "the run plan (fingerprint)" in text
        assert "NOT refused" not in text


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


# -------------------------------------------------------------------- in process
def test_fit_distributed_equals_fit_with_steps_per_execution():
    """3 steps per execution over 4 steps: a call of 3, then one of 1 (the other tests run 1)."""
    reference = mw.build_model()
    history = reference.fit(_global_dataset(), epochs=1, shuffle=False, verbose=0)
    model = mw.build_model()
    model.steps_per_execution = 3
    seen = []
    batch_ends = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(batch))
    ours = fit_distributed(model, mw.shard_fn(*mw.global_batches()), steps=mw.STEPS, verbose=0,
                           callbacks=[batch_ends])
    assert int(model.optimizer.iterations.numpy()) == mw.STEPS
    for a, ref in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, ref, rtol=1e-5, atol=1e-6)
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(ours.history[name], history.history[name], rtol=1e-5)
    assert seen == [2, 3]


def test_two_local_replicas_and_a_checkpoint_resume():
    """MirroredStrategy on the 2 logical CPUs of tests/conftest.py (two per-replica
    batches per step from one dataset), interrupted after 2 steps: a tf.train.Checkpoint
    restored into a new model continues to the uninterrupted run's weights."""
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 2:
        pytest.skip("needs the 2 logical CPU devices created by tests/conftest.py")
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:2]])
    dataset_fn = mw.shard_fn(*mw.global_batches())
    reference = mw.build_model()
    reference.fit(_global_dataset(), epochs=1, shuffle=False, verbose=0)

    with strategy.scope():
        first = mw.build_model()
    fit_distributed(first, dataset_fn, steps=2, strategy=strategy, verbose=0)
    checkpoint = tf.train.Checkpoint(model=first, optimizer=first.optimizer)
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        path = checkpoint.save(os.path.join(worker_checkpoint_dir(directory, strategy), "ckpt"))
        with strategy.scope():
            second = mw.build_model(seed=1)  # another key: the checkpoint's replaces it
            second.optimizer.build(second.trainable_variables)
        tf.train.Checkpoint(model=second, optimizer=second.optimizer).restore(path).assert_existing_objects_matched()
    fit_distributed(second, dataset_fn, strategy=strategy, verbose=0)  # to the end of the plan
    assert int(second.optimizer.iterations.numpy()) == mw.STEPS
    for var, ref in zip(second.trainable_variables, reference.trainable_variables):
        copies = [c.numpy() for c in var.value.values]
        np.testing.assert_array_equal(copies[0], copies[1])
        np.testing.assert_allclose(copies[0], ref.numpy(), rtol=1e-5, atol=1e-6)


def test_stop_training_and_privacy_budget():
    from keras_noisecurve.callbacks import PrivacyBudget

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                self.model.stop_training = True

    model = mw.build_model()
    fit_distributed(model, mw.shard_fn(*mw.global_batches()), steps=3, callbacks=[StopAt()], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1

    plan = dict(noise_multiplier=1.0, delta=1e-5, num_examples=40, batch_size=mw.B, steps=mw.STEPS, bands=mw.BANDS,
                accountant="rdp")
    eps = PrivacyBudget(**plan).epsilon_at
    budget = PrivacyBudget(**plan, target_epsilon=(eps(2) + eps(3)) / 2, verbose=0)
    model = mw.build_model()
    history = fit_distributed(model, mw.shard_fn(*mw.global_batches()), callbacks=[budget], verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2 == budget.stopped_at_step
    assert history.history["epsilon"] == [pytest.approx(eps(2))]


def test_backup_and_restore_resumes_to_the_uninterrupted_run(tmp_path):
    dataset_fn = mw.shard_fn(*mw.global_batches())
    uninterrupted = mw.build_model()
    fit_distributed(uninterrupted, dataset_fn, verbose=0)

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
    for a, ref in zip(resumed.get_weights(), uninterrupted.get_weights()):
        np.testing.assert_allclose(a, ref, rtol=1e-6, atol=1e-7)


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
