"""Two JAX processes on one host (``jax.distributed.initialize`` on 127.0.0.1, CPU
collectives over gloo) under ``keras.distribution.DataParallel``: each process feeds its
part of the batch (its half through ``train_on_batch``, its block of each step of a
``PrivateRun`` through ``fit(run.dataset(...))``), the clipped sums are added across the
processes and one noise draw, the same in both, is added; the weights equal the 1-process
run's. A secret run (``seed=None``) takes process 0's keys in both; a process at another
step, feeding another step's rows, or holding the examples in another order, is refused in
every process (the comparison itself is tested without a second process too). Under
``ModelParallel`` on a 1 × 2 mesh (the kernels split across the processes, each feeding the whole batch) each process holds
half of a split kernel and half of its noise state, and the run ends with the same weights. Every process is bounded in time and
killed if it has not finished (no test hangs)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join("tests", "jax", "_processes_run.py")
TIMEOUT = 300  # seconds for each process (a few on a quiet machine)
ORBAX = importlib.util.find_spec("orbax") is not None  # orbax-checkpoint (the dev install, Python >= 3.12)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(nproc, rank, port, directory=""):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1")
    return subprocess.Popen([sys.executable, SCRIPT, str(nproc), str(rank), str(port), str(directory)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _results(processes):
    """Each process's JSON line; every process still running at the deadline is killed."""
    outputs = []
    try:
        for process in processes:
            out, err = process.communicate(timeout=TIMEOUT)
            assert process.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return outputs


def _close(a, b):
    for u, v in zip(a, b):
        u, v = np.array(u), np.array(v)
        np.testing.assert_allclose(v, u, rtol=0, atol=1e-5 * np.max(np.abs(u)))


@pytest.mark.slow
def test_two_processes_equal_one_process_and_refuse_a_process_out_of_step(tmp_path):
    """DataParallel and ModelParallel over two processes end with the one-process weights."""
    (one,) = _results([_start(1, 0, 0)])
    port = _free_port()
    two = _results([_start(2, rank, port, tmp_path / "orbax") for rank in range(2)])
    first = one["train_on_batch"]
    moved = max(float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(first["initial"], first["final"]))
    assert moved > 1e-3  # the steps changed the weights
    for result in two:
        # each process feeding half of a batch (train_on_batch), or its block of each step of a
        # PrivateRun (fit(run.dataset)): the one-process weights
        _close(first["final"], result["train_on_batch"]["final"])
        _close(one["run"]["final"], result["run"]["final"])
        # a secret run (seed=None): one noise key and one sampling key, process 0's
        _close(two[0]["secret"]["final"], result["secret"]["final"])
        # a process at another step is refused before any step, in every process
        assert "stand at different steps of its plan ([0, 1]" in result["host_refused"]["error"]
        # a process feeding the rows of another step: every step refused, fit raises
        assert "its batch holds rows of step" in result["step_refused"]["error"]
        assert "under several processes, as JAX runs them: a process fed the rows of another step" in result["step_refused"]["error"]
        # a process holding the examples in another order (an unseeded shuffle): refused in every
        # process before the first step, naming each process's fingerprint of its examples
        refused = result["data_refused"]
        assert refused["step"] == 0, refused
        assert "hold other examples, or the same ones in another order" in refused["error"]
        assert f"one per process: [{two[0]['data_refused']['fingerprint']}, {two[1]['data_refused']['fingerprint']}]" \
            in refused["error"]
        assert "shuffle with a fixed seed or not at all (the run's sampling does the shuffling)" in refused["error"]
        # ModelParallel with the kernels split across the processes: each process holds half of
        # the hidden kernel and half of its noise state, and the run ends with the same weights
        _close(one["run"]["final"], result["model_parallel"]["final"])
        assert result["model_parallel"]["shards"] == [[[4, 2]], [[1, 4, 2]]]
        assert result["run"]["shards"] == [[[4, 4]], [[1, 4, 4]]]  # DataParallel: replicated
        if ORBAX:  # a checkpoint of the shards (Keras's OrbaxCheckpoint) resumes the split run exactly
            assert result["orbax"]["restored_step"] == 2
            _close(one["run"]["final"], result["orbax"]["final"])
            assert "split across JAX processes" in result["orbax"]["save_refused"]
        else:
            assert "orbax" not in result
    assert max(abs(a - b) for a, b in zip(np.ravel(one["secret"]["final"][0]), np.ravel(two[0]["secret"]["final"][0]))) > 0
    assert two[0]["data_refused"]["fingerprint"] != two[1]["data_refused"]["fingerprint"]


def _position(step=0, built=0, data=17, key=(5, 6, 7, 8)):
    """One process's row of the table ``agreed_position`` gathers."""
    return [step, built, data, *key]


def test_the_processes_agreement_refuses_another_step_other_data_or_another_key():
    """The decision every process takes on the same gathered table (one row per process),
    without a second process: equal rows pass; a step, the examples' fingerprint (their
    order) or, once built, the sampling key that differs is refused with its message."""
    from keras_noisecurve.backend.jax.pipeline import _check_agreement

    _check_agreement([_position(), _position()], 0)
    _check_agreement([_position(key=(1, 2, 3, 4)), _position()], 1)  # fresh keys: process 0's is taken
    with pytest.raises(ValueError, match=r"stand at different steps of its plan \(\[0, 1\], one per process; "
                                         r"this is process 1\)"):
        _check_agreement([_position(data=3), _position(step=1)], 1)  # the step is named first
    with pytest.raises(ValueError, match=r"hold other examples, or the same ones in another order \(.* one per "
                                         r"process: \[17, 99\]; this is process 0; all must be equal\).*load them "
                                         r"deterministically, and shuffle with a fixed seed or not at all"):
        _check_agreement([_position(), _position(data=99)], 0)
    with pytest.raises(ValueError, match="hold different sampling keys"):
        _check_agreement([_position(built=1), _position(built=1, key=(5, 6, 7, 9))], 0)
