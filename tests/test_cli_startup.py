"""The command line silences TensorFlow's C++ start-up logs unless the user set the level."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from keras_noisecurve.apps import cli

_WRITE_TO_FD2 = "import os; os.write(2, b'E0000 failed call to cuInit\\n')"


def _run(code, env_updates):
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env.update(env_updates)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_startup_output_is_silenced_and_the_level_set():
    code = (
        "import os; from keras_noisecurve.apps.cli import quiet_startup\n"
        f"def start():\n    {_WRITE_TO_FD2}\n"
        "assert quiet_startup(start) is True\n"
        "print(os.environ['TF_CPP_MIN_LOG_LEVEL'])\n"
        "os.write(2, b'later errors still show\\n')\n"
    )
    proc = _run(code, {})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "2"
    assert "cuInit" not in proc.stderr and "later errors still show" in proc.stderr


def test_startup_output_is_replayed_when_the_start_fails():
    code = (
        "from keras_noisecurve.apps.cli import quiet_startup\n"
        f"def start():\n    {_WRITE_TO_FD2}\n    raise RuntimeError('start failed')\n"
        "quiet_startup(start)\n"
    )
    proc = _run(code, {})
    assert proc.returncode != 0
    assert "cuInit" in proc.stderr and "start failed" in proc.stderr


def test_a_level_the_user_set_is_left_alone():
    code = (
        "import os; from keras_noisecurve.apps.cli import quiet_startup\n"
        f"def start():\n    {_WRITE_TO_FD2}\n"
        "assert quiet_startup(start) is False\n"
        "print(os.environ['TF_CPP_MIN_LOG_LEVEL'])\n"
    )
    proc = _run(code, {"TF_CPP_MIN_LOG_LEVEL": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0" and "cuInit" in proc.stderr


@pytest.mark.slow
def test_real_tensorflow_start_prints_nothing():
    # On a machine without a GPU, TensorFlow's start-up prints CUDA notices
    # ("failed call to cuInit", "Could not find cuda drivers") to file descriptor 2.
    proc = _run("from keras_noisecurve.apps import cli; cli.quiet_startup(cli._start_backend); print('ok')", {})
    assert proc.returncode == 0, proc.stderr
    noisy = [line for line in proc.stderr.splitlines() if line.strip()]
    assert noisy == [], noisy


def test_only_tensorflow_subcommands_start_it():
    assert cli.USES_BACKEND == {"spectrum", "demo"}
    assert cli.USES_BACKEND <= set(cli.SUBCOMMANDS)
