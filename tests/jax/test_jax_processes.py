"""Two JAX processes on one host (``jax.distributed.initialize`` on 127.0.0.1, CPU
collectives over gloo) under ``keras.distribution.DataParallel``: each process feeds its
half of the batch, the clipped sums are added across the processes and one noise draw,
the same in both, is added; the weights after three DP-BandMF steps equal the 1-process run's.
Every process is bounded in time and killed if it has not finished (no test hangs)."""

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


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(nproc, rank, port):
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="3",
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.Popen([sys.executable, SCRIPT, str(nproc), str(rank), str(port)], env=env, cwd=ROOT,
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


@pytest.mark.slow
def test_two_processes_feeding_half_a_batch_each_equal_one_process():
    (one,) = _results([_start(1, 0, 0)])
    port = _free_port()
    two = _results([_start(2, rank, port) for rank in range(2)])
    moved = max(float(np.max(np.abs(np.array(a) - np.array(b)))) for a, b in zip(one["initial"], one["final"]))
    assert moved > 1e-3  # the steps changed the weights
    for result in two:
        for a, b in zip(one["final"], result["final"]):
            a, b = np.array(a), np.array(b)
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * np.max(np.abs(a)))
