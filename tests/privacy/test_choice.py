"""``choose_mixing`` / ``PrivateRun(mixing="auto")``: the mechanism chosen for the budget.

Every score is checked against an independent computation: σ from
``calibrate_noise_multiplier`` for the candidate's bands (the public calibration, one call
per candidate), and Tr(W X⁻¹) = ‖A C⁻¹‖²_F with dense numpy, A written here from the
heavy-ball recursion (the weights' change at step t from noise at step s ≤ t is
(1 − β^{t−s+1})/(1 − β) learning rates). The hand-checked cases: at ε = 0.5 every b > 1
is worse (amplification dominates: σ(2) ≈ 1.4·σ(1) costs more than the correlation
gains), at ε = 8 the most bands the sampling allows (b = ⌊(n − 1)/B⌋ = 5 for n = 600,
B = 100: q = B·b/n < 1).
"""

import math
import warnings

import numpy as np
import pytest

import keras_noisecurve as knc
from keras_noisecurve.mixing import UpdateRule
from keras_noisecurve.privacy.choice import TOLERANCE, choose_mixing

N, B, T, DELTA = 600, 100, 30, 1e-5


def _momentum_prefix(steps, beta):
    t = np.arange(steps)
    lag = t[:, None] - t[None, :]
    return np.where(lag >= 0, (1.0 - beta ** (np.maximum(lag, 0) + 1)) / (1.0 - beta), 0.0)


def _choose(epsilon, momentum=0.0, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return choose_mixing(num_examples=N, batch_size=B, steps=T, epsilon=epsilon, delta=DELTA,
                             update_rule=UpdateRule(momentum=momentum), **kwargs)


@pytest.fixture(scope="module")
def small_eps():
    return _choose(0.5)


@pytest.fixture(scope="module")
def large_eps():
    return _choose(8.0)


@pytest.fixture(scope="module")
def momentum_eps2():
    return _choose(2.0, momentum=0.9)


def test_every_score_is_sigma_squared_times_a_dense_reference(momentum_eps2):
    choice = momentum_eps2
    prefix = _momentum_prefix(T, 0.9)
    sigmas = {}
    base = None
    for candidate, mixing in zip(choice.candidates, _mixings(choice)):
        b = candidate.size
        if b not in sigmas:
            sigmas[b] = knc.calibrate_noise_multiplier(epsilon=2.0, delta=DELTA, num_examples=N, batch_size=B,
                                                       steps=T, bands=b, sampling="cyclic_poisson")
        assert candidate.noise_multiplier == pytest.approx(sigmas[b], rel=1e-9)
        c = mixing.to_dense()
        assert np.allclose(np.linalg.norm(c, axis=0), 1.0, atol=1e-9)  # sensitivity 1: σ(b) is the run's
        error = np.linalg.norm(prefix @ np.linalg.inv(c), "fro") ** 2
        assert candidate.error == pytest.approx(error, rel=1e-8)
        total = sigmas[b] ** 2 * error
        base = total if base is None else base
        assert candidate.relative_error == pytest.approx(total / base, rel=1e-8)
    assert choice.candidates[0].label == "DP-SGD" and choice.candidates[0].relative_error == 1.0


def _mixings(choice):
    """The candidates' C, re-solved as the chooser solves them (the choice keeps only the chosen C)."""
    from keras_noisecurve.privacy.choice import _normalised

    rule = UpdateRule.from_metadata(choice.update_rule)
    out = []
    for candidate in choice.candidates:
        if candidate.buffers == 0:
            out.append(knc.MixingMatrix.identity(T))
        elif candidate.solved == "screen":
            toeplitz = knc.solve_mixing_matrix(steps=T, bands=candidate.size, strategy="toeplitz")
            out.append(_normalised(toeplitz.band_values, {}))
        else:
            out.append(knc.solve_mixing_matrix(steps=T, bands=candidate.size, update_rule=rule))
    return out


def test_a_small_epsilon_chooses_dpsgd(small_eps):
    choice = small_eps
    assert choice.chosen.label == "DP-SGD" and choice.chosen.buffers == 0
    assert choice.mixing.bands == 1 and choice.relative_error == 1.0
    assert all(c.relative_error > 1.0 for c in choice.candidates[1:])  # every b > 1 predicted worse
    assert "DP-SGD has the least noise" in choice.expectation()


def test_a_large_epsilon_chooses_the_most_bands_the_sampling_allows(large_eps):
    choice = large_eps
    assert (N - 1) // B == 5
    assert choice.chosen.size == 5 and choice.mixing.bands == 5
    assert max(c.size for c in choice.candidates) == 5  # b = 6 would sample with q = 1
    assert choice.relative_error < 0.85
    assert "lowers the noise of the updates by" in choice.expectation()


@pytest.mark.parametrize("name", ["small_eps", "large_eps", "momentum_eps2"])
def test_the_choice_is_never_predicted_worse_than_dpsgd(name, request):
    choice = request.getfixturevalue(name)
    best = min(c.relative_error for c in choice.candidates)
    assert choice.relative_error <= 1.0
    assert choice.relative_error <= best * (1.0 + TOLERANCE)
    # the fewest buffers among the candidates as good as that
    assert all(c.buffers >= choice.chosen.buffers for c in choice.candidates
               if c.relative_error <= min(1.0, best * (1.0 + TOLERANCE)))
    assert math.isclose(choice.noise_reduction, 1.0 - math.sqrt(choice.relative_error))


def test_tolerance_trades_a_small_gain_for_fewer_buffers():
    strict = _choose(8.0, tolerance=0.0)
    loose = _choose(8.0, tolerance=2.0)  # anything within 3x of the best and <= DP-SGD: DP-SGD itself
    assert strict.relative_error == min(c.relative_error for c in strict.candidates)
    assert loose.chosen.label == "DP-SGD"


def test_max_bands_and_the_sampling_bound_the_sizes():
    capped = _choose(8.0, max_bands=3)
    assert max(c.size for c in capped.candidates) == 3 and capped.chosen.size == 3
    with pytest.raises(ValueError, match="max_bands"):
        _choose(8.0, max_bands=0)


def test_the_run_takes_the_choice(large_eps):
    rule = UpdateRule(momentum=0.9)
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, epsilon=8.0, delta=DELTA, mixing="auto",
                         update_rule=rule, seed=0)
    choice = run.mixing_choice
    assert run.bands == choice.chosen.size == run.mixing.bands
    assert run.noise_multiplier == choice.noise_multiplier
    assert run.epsilon() <= 8.0 * (1 + 1e-6)
    assert run.mixing.metadata["update_rule"] == rule.to_metadata()
    assert run.mixing.metadata["choice"]["chosen"] == choice.chosen.label
    summary = run.summary()
    assert "mixing='auto'" in summary and choice.expectation() in summary and "->" in summary
    # the config holds the chosen C: the restored run is the same plan
    restored = knc.PrivateRun.from_config(run.get_config())
    assert restored.same_plan(run) and restored.mixing_choice is None
    # a choice made elsewhere is taken as it is, for the same plan and budget only
    again = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, epsilon=8.0, delta=DELTA, mixing=large_eps, seed=0)
    assert again.bands == large_eps.chosen.size and again.noise_multiplier == large_eps.noise_multiplier
    with pytest.raises(ValueError, match="made for another run: epsilon=8.0 there, 4.0 here"):
        knc.PrivateRun(num_examples=N, batch_size=B, steps=T, epsilon=4.0, delta=DELTA, mixing=large_eps)
    with pytest.raises(ValueError, match="batch_size=100 there, 50 here"):
        knc.PrivateRun(num_examples=N, batch_size=50, steps=T, epsilon=8.0, delta=DELTA, mixing=large_eps)


@pytest.mark.parametrize("kwargs, match", [
    ({"mixing": "auto", "noise_multiplier": 1.0}, "give epsilon="),
    ({"epsilon": 2.0, "update_rule": UpdateRule(momentum=0.9)}, "update_rule= is for mixing='auto'"),
    ({"epsilon": 2.0, "mixing": "auto", "update_rule": 0.9}, "update_rule must be"),
])
def test_bad_requests_are_refused_with_the_reason(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        knc.PrivateRun(num_examples=N, batch_size=B, steps=T, delta=DELTA, **kwargs)


def test_bad_objective_is_refused():
    with pytest.raises(ValueError, match="objective"):
        choose_mixing(num_examples=N, batch_size=B, steps=T, epsilon=2.0, delta=DELTA, objective="dpsgd")


def test_fixed_epochs_compares_blt_and_bisr_at_their_own_sigma():
    choice = choose_mixing(num_examples=400, batch_size=100, epochs=3, sampling="fixed_epochs", epsilon=4.0,
                           delta=DELTA)
    kinds = {c.kind for c in choice.candidates}
    assert {"banded", "blt", "bisr"} <= kinds
    assert max(c.size for c in choice.candidates if c.kind == "banded") <= 4  # b <= the epoch length
    # the memory each keeps: b - 1 (banded), d (BLT), p - 1 (BISR) noise vectors per variable
    assert all(c.buffers == {"banded": c.size - 1, "blt": c.size, "bisr": c.size - 1}[c.kind]
               for c in choice.candidates)
    assert max(c.buffers for c in choice.candidates) <= 4  # max_bands defaults to the epoch length
    blt = next(c for c in choice.candidates if c.kind == "blt" and c.size == 2)
    mixing = knc.solve_mixing_matrix(steps=12, strategy="blt", buffers=2, participations=3, separation=4)
    sigma = knc.calibrate_noise_multiplier(epsilon=4.0, delta=DELTA, num_examples=400, batch_size=100, steps=12,
                                           sampling="fixed_epochs", mixing=mixing)
    assert blt.noise_multiplier == pytest.approx(sigma, rel=1e-9)
    prefix = np.tril(np.ones((12, 12)))
    c = mixing.to_dense()
    assert blt.error == pytest.approx(np.linalg.norm(prefix @ np.linalg.inv(c), "fro") ** 2, rel=1e-8)
    run = knc.PrivateRun(num_examples=400, batch_size=100, epochs=3, sampling="fixed_epochs", epsilon=4.0,
                         delta=DELTA, mixing=choice, seed=0)
    assert run.epsilon() <= 4.0 * (1 + 1e-6)


def test_a_curvature_objective_adds_its_own_c_at_the_same_sigma():
    spectrum = knc.Spectrum(np.geomspace(1.0, 1e-3, 30))
    choice = _choose(8.0, objective="noisecurve", spectrum=spectrum, learning_rate=0.5)
    curvature = [c for c in choice.candidates if c.objective == "noisecurve"]
    assert curvature, choice.table(every=True)
    by_size = {c.size: c for c in choice.candidates if c.objective == "bandmf" and c.solved == "exact"}
    for c in curvature:
        assert c.noise_multiplier == pytest.approx(by_size[c.size].noise_multiplier, rel=1e-6)  # sigma(b): its column norms differ from 1 by 1e-16, its calibration to 1e-6
        assert c.error <= by_size[c.size].error * (1 + 1e-6)  # solved for the scored objective
    assert "the predicted loss increase" in choice.expectation()


def test_the_choice_is_deterministic(large_eps):
    again = _choose(8.0)
    assert again.chosen == dataclass_without_time(large_eps.chosen, again.chosen)
    assert [c.relative_error for c in again.candidates] == [c.relative_error for c in large_eps.candidates]
    assert np.array_equal(again.mixing.to_dense(), large_eps.mixing.to_dense())


def dataclass_without_time(a, b):
    import dataclasses

    return dataclasses.replace(a, seconds=b.seconds)


@pytest.mark.slow
def test_the_docs_figures_show_what_auto_chooses_for_the_demo_run():
    """docs/hooks/figures.py draws the choice for the demo's run at ε = 2 and 8 with fixed b
    (running the chooser at every docs build would cost 20 calibrations): they must be its."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "docs" / "hooks" / "figures.py"
    spec = importlib.util.spec_from_file_location("docs_figures", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    for epsilon, bands in hook.CHOSEN.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            choice = choose_mixing(num_examples=hook.N, batch_size=hook.B, steps=hook.T, epsilon=epsilon,
                                   delta=hook.DELTA, update_rule=UpdateRule(momentum=hook.MOMENTUM))
        assert choice.chosen.size == bands, (epsilon, choice.table())


def test_the_run_calibrates_its_own_c_never_a_sigma_it_was_handed(large_eps):
    """A MixingChoice whose C was swapped keeps the old σ in its record; the run calibrates the C
    it runs (σ(2) here, not the chosen b = 5's)."""
    import dataclasses

    other = knc.solve_mixing_matrix(steps=T, bands=2)
    swapped = dataclasses.replace(large_eps, mixing=other)
    run = knc.PrivateRun(num_examples=N, batch_size=B, steps=T, epsilon=8.0, delta=DELTA, mixing=swapped, seed=0)
    want = knc.calibrate_noise_multiplier(epsilon=8.0, delta=DELTA, num_examples=N, batch_size=B, steps=T, bands=2)
    assert run.bands == 2 and run.noise_multiplier == pytest.approx(want, rel=1e-9)
    assert run.noise_multiplier < large_eps.noise_multiplier
