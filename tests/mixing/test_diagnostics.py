"""Noise diagnostics of a mixing matrix, checked against dense numpy references.

References: ``np.linalg.inv`` (rows of C⁻¹ and of A C⁻¹), ``np.linalg.cond``
(2-norm condition number), closed forms for C = I, and a hand-computed 2×2 C.
"""

import json
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_noisecurve.mixing import MixingMatrix
from keras_noisecurve.mixing import diagnostics
from keras_noisecurve.mixing.diagnostics import (
    NoiseExcursionWarning,
    noise_diagnostics,
    noise_profile,
    warn_if_excursive,
)


def _normalised_dense(raw: np.ndarray) -> np.ndarray:
    """Divide each column of a lower-triangular matrix by its L2 norm (numpy only)."""
    return raw / np.linalg.norm(raw, axis=0, keepdims=True)


def _random_dense_c(rng: np.random.Generator, steps: int, bands: int, spread: float) -> np.ndarray:
    """A random valid C: positive diagonal, random band below it, unit columns."""
    raw = np.zeros((steps, steps))
    for t in range(steps):
        raw[t, t] = rng.uniform(0.2, 1.0)
        for j in range(1, min(bands, t + 1)):
            raw[t, t - j] = spread * rng.standard_normal()
    return _normalised_dense(raw)


def _dense_reference(dense: np.ndarray):
    steps = dense.shape[0]
    inverse = np.linalg.inv(dense)
    prefix = np.tril(np.ones((steps, steps))) @ inverse
    return np.linalg.norm(inverse, axis=1), np.linalg.norm(prefix, axis=1), np.linalg.cond(dense)


@settings(max_examples=40, deadline=None)
@given(
    steps=st.integers(min_value=1, max_value=40),
    bands=st.integers(min_value=1, max_value=6),
    spread=st.floats(min_value=0.0, max_value=0.5),
    seed=st.integers(min_value=0, max_value=2**32 - 1),
)
def test_matches_dense_inverse_and_cond(steps, bands, spread, seed):
    bands = min(bands, steps)
    dense = _random_dense_c(np.random.default_rng(seed), steps, bands, spread)
    mixing = MixingMatrix.from_dense(dense, bands=bands)
    step_ref, prefix_ref, cond_ref = _dense_reference(dense)

    diag = noise_diagnostics(mixing)

    # rounding in C⁻¹ grows like eps·cond(C); these Cs reach cond ≈ 1e6
    rtol = max(1e-10, 1e-13 * cond_ref)
    np.testing.assert_allclose(diag["step_std"], step_ref, rtol=rtol)
    np.testing.assert_allclose(diag["prefix_std"], prefix_ref, rtol=rtol)
    assert diag["step_std_max"] == pytest.approx(step_ref.max(), rel=1e-9)
    assert diag["prefix_std_max"] == pytest.approx(prefix_ref.max(), rel=1e-9)
    assert prefix_ref[diag["prefix_std_argmax"]] == pytest.approx(prefix_ref.max(), rel=1e-9)
    assert diag["prefix_std_final"] == pytest.approx(prefix_ref[-1], rel=1e-9)
    assert diag["min_diagonal"] == pytest.approx(np.diag(dense).min(), rel=1e-12)
    assert diag["condition_number"] == pytest.approx(cond_ref, rel=1e-8)
    assert diag["condition_number_method"] == "svd"
    assert (diag["steps"], diag["bands"]) == (steps, bands)


def test_identity_closed_form():
    steps = 37
    diag = noise_diagnostics(MixingMatrix.identity(steps))
    np.testing.assert_allclose(diag["step_std"], np.ones(steps), rtol=0, atol=1e-15)
    np.testing.assert_allclose(diag["prefix_std"], np.sqrt(np.arange(1, steps + 1)), rtol=1e-14)
    assert diag["prefix_std_max"] == pytest.approx(math.sqrt(steps), rel=1e-14)
    assert diag["prefix_std_argmax"] == steps - 1
    assert diag["prefix_std_final"] == pytest.approx(math.sqrt(steps), rel=1e-14)
    assert diag["step_std_max"] == pytest.approx(1.0, abs=1e-15)
    assert diag["min_diagonal"] == 1.0
    assert diag["condition_number"] == pytest.approx(1.0, abs=1e-12)


def test_hand_example_2x2():
    # C = [[0.6, 0], [0.8, 1]]: unit columns. C⁻¹ = [[5/3, 0], [-4/3, 1]];
    # A C⁻¹ = [[5/3, 0], [1/3, 1]]; CᵀC = [[1, .8], [.8, 1]] has eigenvalues 1.8, 0.2,
    # so cond(C) = sqrt(1.8 / 0.2) = 3.
    mixing = MixingMatrix(np.array([[0.6, 0.0], [1.0, 0.8]]))
    np.testing.assert_allclose(mixing.to_dense(), [[0.6, 0.0], [0.8, 1.0]])
    diag = noise_diagnostics(mixing)
    np.testing.assert_allclose(diag["step_std"], [5 / 3, 5 / 3], rtol=1e-14)
    np.testing.assert_allclose(diag["prefix_std"], [5 / 3, math.sqrt(10) / 3], rtol=1e-14)
    assert diag["prefix_std_argmax"] == 0
    assert diag["prefix_std_max"] == pytest.approx(5 / 3, rel=1e-14)
    assert diag["prefix_std_final"] == pytest.approx(math.sqrt(10) / 3, rel=1e-14)
    assert diag["min_diagonal"] == pytest.approx(0.6, rel=1e-15)
    assert diag["condition_number"] == pytest.approx(3.0, rel=1e-12)


def test_json_serialisable_plain_types():
    rng = np.random.default_rng(1)
    diag = noise_diagnostics(MixingMatrix.from_dense(_random_dense_c(rng, 12, 3, 0.5), bands=3))
    assert json.loads(json.dumps(diag)) == diag
    assert all(type(v) is float for v in diag["step_std"] + diag["prefix_std"])
    assert type(diag["prefix_std_argmax"]) is int


def test_block_sweep_matches_dense(monkeypatch):
    # Force many small column blocks (block = 3 columns for T = 50) to exercise the
    # block boundaries of the banded sweep.
    rng = np.random.default_rng(2)
    dense = _random_dense_c(rng, 50, 5, 0.6)
    monkeypatch.setattr(diagnostics, "_BLOCK_ENTRIES", 150)
    step_std, prefix_std = noise_profile(MixingMatrix.from_dense(dense, bands=5))
    step_ref, prefix_ref, _ = _dense_reference(dense)
    np.testing.assert_allclose(step_std, step_ref, rtol=1e-10)
    np.testing.assert_allclose(prefix_std, prefix_ref, rtol=1e-10)


@pytest.mark.parametrize("spread", [0.2, 0.4])
def test_lanczos_condition_estimate_for_large_steps(monkeypatch, spread):
    rng = np.random.default_rng(3)
    dense = _random_dense_c(rng, 120, 6, spread)  # cond ≈ 50 and ≈ 6e8
    monkeypatch.setattr(diagnostics, "EXACT_CONDITION_MAX_STEPS", 100)
    diag = noise_diagnostics(MixingMatrix.from_dense(dense, bands=6))
    assert diag["condition_number_method"] == "lanczos"
    assert diag["condition_number"] == pytest.approx(np.linalg.cond(dense), rel=1e-6)


def test_lanczos_identity(monkeypatch):
    monkeypatch.setattr(diagnostics, "EXACT_CONDITION_MAX_STEPS", 10)
    diag = noise_diagnostics(MixingMatrix.identity(30))
    assert diag["condition_number_method"] == "lanczos"
    assert diag["condition_number"] == pytest.approx(1.0, abs=1e-12)


def _difference_c(steps: int) -> np.ndarray:
    """C ∝ (I − shift) with unit columns: C⁻¹ accumulates, the running sum explodes."""
    raw = np.eye(steps) - np.eye(steps, k=-1)
    return _normalised_dense(raw)


def test_warn_if_excursive_fires_with_the_dense_ratio():
    steps = 20
    dense = _difference_c(steps)
    mixing = MixingMatrix.from_dense(dense, bands=2)
    reference = MixingMatrix.identity(steps)
    _, prefix_ref, _ = _dense_reference(dense)
    expected = prefix_ref.max() / math.sqrt(steps)
    assert expected > 3.0  # the example is meant to be excursive
    with pytest.warns(NoiseExcursionWarning, match=r"swings .*further than the reference"):
        ratio = warn_if_excursive(mixing, reference=reference)
    assert isinstance(ratio, float)
    assert ratio == pytest.approx(expected, rel=1e-10)
    assert issubclass(NoiseExcursionWarning, UserWarning)


def test_warn_if_excursive_silent_below_factor():
    steps = 20
    mixing = MixingMatrix.from_dense(_difference_c(steps), bands=2)
    reference = MixingMatrix.identity(steps)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_excursive(reference, reference=reference) == pytest.approx(1.0, rel=1e-14)
        # identity against the excursive C: ratio < 1, no warning
        assert warn_if_excursive(reference, reference=mixing) < 1.0
        # a generous factor silences the excursive one too
        ratio = warn_if_excursive(mixing, reference=reference, factor=1e6)
    assert ratio > 3.0


def test_validation_messages():
    ident = MixingMatrix.identity(5)
    with pytest.raises(TypeError, match="MixingMatrix"):
        noise_diagnostics(np.eye(5))
    with pytest.raises(TypeError, match="reference must be"):
        warn_if_excursive(ident, reference=np.eye(5))
    with pytest.raises(ValueError, match="factor must be > 0"):
        warn_if_excursive(ident, reference=ident, factor=0.0)
    with pytest.raises(ValueError, match=r"same number of steps as mixing \(5\), got 6"):
        warn_if_excursive(ident, reference=MixingMatrix.identity(6))


def test_top_level_exports():
    import keras_noisecurve as knc

    assert knc.noise_diagnostics is noise_diagnostics
    assert knc.warn_if_excursive is warn_if_excursive
    assert knc.NoiseExcursionWarning is NoiseExcursionWarning
