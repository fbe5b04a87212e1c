"""Fingerprints cover what defines the mechanism (C's values, σ, B, the plan; for the
optimizer also the clip norm and the update rule), never the solver's timings or other
free-form metadata: two workers that each solve C themselves agree."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from keras_noisecurve.privacy.run import PrivateRun

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKER = """
import json, sys
import keras_noisecurve as knc
C = knc.solve_mixing_matrix(steps=24, bands=3, objective="bandmf")
run = knc.PrivateRun(num_examples=240, batch_size=10, steps=24, mixing=C, noise_multiplier=1.3, delta=1e-5)
print(json.dumps({"fingerprint": run.fingerprint(), "solver": C.metadata["solver"], "digest": C.digest()}))
"""


def _worker():
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_two_workers_that_each_solve_c_agree():
    a, b = _worker(), _worker()
    assert a["solver"] != b["solver"]  # the timings differ (they are in C's metadata) ...
    assert a["digest"] == b["digest"]  # ... C's values do not
    assert a["fingerprint"] == b["fingerprint"]


def _c(meta_extra=None, bump=0.0):
    """A banded C (T = 24, b = 3) with unit column norms; ``bump`` changes one entry."""
    from keras_noisecurve.mixing.matrix import MixingMatrix

    steps = 24
    dense = np.eye(steps) - 0.3 * np.eye(steps, k=-1) + 0.1 * np.eye(steps, k=-2)
    dense[7, 5] += bump
    dense /= np.linalg.norm(dense, axis=0)
    return MixingMatrix.from_dense(dense, bands=3, metadata={"objective": "bandmf", **(meta_extra or {})})


PLAN = dict(num_examples=240, batch_size=10, steps=24, noise_multiplier=1.3, delta=1e-5)


def test_metadata_does_not_change_the_run_fingerprint_but_the_mechanism_does():
    base = PrivateRun(mixing=_c({"solver": {"seconds": 1.0}}), **PLAN, seed=1).fingerprint()
    assert PrivateRun(mixing=_c({"solver": {"seconds": 9.9}, "note": "x"}), **PLAN, seed=2).fingerprint() == base
    assert PrivateRun(mixing=_c(bump=1e-9), **PLAN).fingerprint() != base
    for name, value in [("noise_multiplier", 1.31), ("batch_size", 12), ("steps", 23), ("delta", 2e-5)]:
        assert PrivateRun(mixing=_c(), **{**PLAN, name: value}).fingerprint() != base, name


def test_optimizer_fingerprint_ignores_metadata_and_sees_clip_sigma_and_rule():
    pytest.importorskip("tensorflow")
    import keras

    from keras_noisecurve.training import NoiseCurveOptimizer
    from keras_noisecurve.backend.tensorflow.distributed import _optimizer_fingerprint

    def fp(meta=None, clip=1.0, lr=0.1, inner=None, **plan):
        run = PrivateRun(mixing=_c(meta), **{**PLAN, **plan})
        if inner is not None:
            return _optimizer_fingerprint(NoiseCurveOptimizer(run=run, l2_norm_clip=clip, inner=inner))
        return _optimizer_fingerprint(NoiseCurveOptimizer(run=run, learning_rate=lr, l2_norm_clip=clip))

    base = fp({"solver": {"seconds": 1.0}})
    assert fp({"solver": {"seconds": 2.0}, "hostname": "b"}) == base
    assert fp(clip=0.5) != base
    assert fp(lr=0.2) != base
    assert fp(noise_multiplier=1.4) != base
    assert fp(inner=keras.optimizers.SGD(0.1, momentum=0.9)) != fp(inner=keras.optimizers.SGD(0.1))
