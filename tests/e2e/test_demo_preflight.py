"""`noisecurve demo` runs one step of each training configuration before the spectrum."""

from __future__ import annotations

import time

import pytest

from keras_noisecurve.apps import cli, demo


class _Broken(RuntimeError):
    pass


def test_a_step_that_cannot_run_fails_before_the_spectrum(tmp_path, monkeypatch):
    # Break the private training step (as a missing kernel would) and make the
    # spectrum estimation impossible to reach unnoticed: the demo must stop in the
    # check, before any spectrum work.
    import keras_noisecurve as knc
    from keras_noisecurve.backend.tensorflow import ghost_conv

    def broken(*args, **kwargs):
        raise _Broken("this kernel does not run here")

    def spectrum_reached(*args, **kwargs):
        raise AssertionError("the spectrum estimation started before the training steps were checked")

    monkeypatch.setattr(ghost_conv, "conv_example_grads", broken)  # what the conv rule calls
    monkeypatch.setattr(knc, "estimate_spectrum", spectrum_reached)
    started = time.perf_counter()
    with pytest.raises(_Broken, match="does not run here"):
        cli.main(["demo", "--quick", "--deterministic", "--no-plots", "--out", str(tmp_path / "o")])
    assert time.perf_counter() - started < 120


def test_the_check_runs_each_band_configuration_once(tmp_path, monkeypatch):
    calls = []
    real = demo._private_cnn

    def counting(**kwargs):
        calls.append(kwargs["run"].mixing.bands)
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
    # ... and when they differ only in numbers the traced step takes (as the shipped
    # configurations do: learning rates 0.4 and 0.2), still once
    calls.clear()
    configs["NoiseCurve"] = dict(configs["NoiseCurve"], learning_rate=0.25, clip=2.0)
    demo._check_training_steps(x, y, batch=8, configs=configs, seed=0)
    assert sorted(calls) == [1, 3]
    # a different band width or momentum is a different step: checked on its own
    calls.clear()
    configs["NoiseCurve"] = dict(configs["NoiseCurve"], momentum=0.5 if configs["NoiseCurve"]["momentum"] != 0.5 else 0.0)
    demo._check_training_steps(x, y, batch=8, configs=configs, seed=0)
    assert sorted(calls) == [1, 3, 3]
    # b chosen later (the shipped 'auto'): the step is checked at b = 2 before the choice,
    # once for DP-BandMF and NoiseCurve, and the configurations are left as they were
    calls.clear()
    shipped = {name: dict(cfg, learning_rate=0.5) for name, cfg in demo.CONFIGS.items()}
    demo._check_training_steps(x, y, batch=8, configs=shipped, seed=0)
    assert sorted(calls) == [1, demo._CHECK_BANDS] and demo._CHECK_BANDS == 2
    assert all(demo.is_auto(shipped[name]["bands"]) for name in ("DP-BandMF", "NoiseCurve"))


def _spy_private_cnn(monkeypatch):
    built = []
    real = demo._private_cnn

    def spy(**kwargs):
        model, private = real(**kwargs)
        built.append((kwargs, private))
        return model, private

    monkeypatch.setattr(demo, "_private_cnn", spy)
    return built


def _tiny_data():
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.uniform(size=(64, 28, 28, 1)).astype("float32"), rng.integers(0, 10, 64)


def _assert_c_follows_its_rule(built, momentum, schedule, recwarn):
    import keras_noisecurve as knc

    assert sorted(kwargs["run"].mixing.bands for kwargs, _ in built) == [1, 3]
    for kwargs, _ in built:
        if kwargs["run"].mixing.bands > 1:
            rule = knc.UpdateRule.from_metadata(kwargs["run"].mixing.metadata.get("update_rule"))
            assert rule == knc.UpdateRule(momentum=momentum, schedule=schedule)
    # the optimizer runs the update rule C was solved for: no mismatch warning
    assert not [w for w in recwarn if "optimised for" in str(w.message)]


def test_a_schedule_trains_with_c_solved_for_it(monkeypatch, recwarn):
    built = _spy_private_cnn(monkeypatch)
    x, y = _tiny_data()
    configs = {name: dict(cfg, learning_rate=0.5, momentum=0.0, schedule="cosine",
                         bands=1 if name == "DP-SGD" else 3)
               for name, cfg in demo.CONFIGS.items()}
    demo._check_training_steps(x, y, batch=8, configs=configs, seed=0)
    _assert_c_follows_its_rule(built, 0.0, "cosine", recwarn)
    for kwargs, private in built:  # the learning rate followed the cosine multipliers for one step
        import keras_noisecurve as knc

        steps = kwargs["run"].mixing.steps
        expected = 0.5 * knc.UpdateRule(schedule="cosine").multipliers(steps)[1]
        assert float(private.optimizer.learning_rate) == pytest.approx(expected, rel=1e-6)


def test_momentum_trains_through_the_inner_optimizer_with_c_solved_for_it(monkeypatch, recwarn):
    built = _spy_private_cnn(monkeypatch)
    x, y = _tiny_data()
    configs = {name: dict(cfg, learning_rate=0.5, momentum=0.9, bands=1 if name == "DP-SGD" else 3)
               for name, cfg in demo.CONFIGS.items()}
    demo._check_training_steps(x, y, batch=8, configs=configs, seed=0)
    _assert_c_follows_its_rule(built, 0.9, "constant", recwarn)
