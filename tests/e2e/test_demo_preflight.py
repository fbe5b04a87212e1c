"""`noisecurve demo` runs one step of each training configuration before the spectrum."""

from __future__ import annotations

import time

import pytest

from keras_noisecurve import cli, demo


class _Broken(RuntimeError):
    pass


def test_a_step_that_cannot_run_fails_before_the_spectrum(tmp_path, monkeypatch):
    # Break the private training step (as a missing kernel would) and make the
    # spectrum estimation impossible to reach unnoticed: the demo must stop in the
    # check, before any spectrum work.
    import keras_noisecurve as knc
    from keras_noisecurve.training import ghost_conv

    def broken(*args, **kwargs):
        raise _Broken("this kernel does not run here")

    def spectrum_reached(*args, **kwargs):
        raise AssertionError("the spectrum estimation started before the training steps were checked")

    monkeypatch.setattr(ghost_conv, "conv_sq_norms", broken)
    monkeypatch.setattr(knc, "estimate_spectrum", spectrum_reached)
    started = time.perf_counter()
    with pytest.raises(_Broken, match="does not run here"):
        cli.main(["demo", "--quick", "--deterministic", "--no-plots", "--out", str(tmp_path / "o")])
    assert time.perf_counter() - started < 120


def test_the_check_runs_each_band_configuration_once(tmp_path, monkeypatch):
    calls = []
    real = demo._private_cnn

    def counting(**kwargs):
        calls.append(kwargs["mixing"].bands)
        return real(**kwargs)

    monkeypatch.setattr(demo, "_private_cnn", counting)
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.uniform(size=(64, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, 64)
    configs = {name: dict(cfg, learning_rate=0.5, bands=1 if name == "DP-SGD" else 3)
               for name, cfg in demo.CONFIGS.items()}
    demo._check_training_steps(x, y, batch=8, configs=configs, seed=0)
    # DP-BandMF and NoiseCurve train with the same configuration: checked once
    assert sorted(calls) == [1, 3]
