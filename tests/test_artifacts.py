"""The two file artifacts: MixingMatrix (C) and Spectrum.

Checked against hand-built dense matrices and hand-derived values, not against
the classes' own output.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_noisecurve.mixing import InvalidMixingMatrixError, MixingMatrix
from keras_noisecurve.spectrum.artifact import Spectrum


def _random_banded(steps, bands, rng):
    """A random valid C built densely: lower triangular, banded, unit columns."""
    dense = np.tril(rng.normal(size=(steps, steps)))
    dense[np.subtract.outer(np.arange(steps), np.arange(steps)) >= bands] = 0.0
    dense[np.diag_indices(steps)] = np.abs(dense[np.diag_indices(steps)]) + 0.5
    return dense / np.linalg.norm(dense, axis=0)


# --------------------------------------------------------------- MixingMatrix
def test_band_values_layout_matches_dense_hand_example():
    s = 1 / np.sqrt(2)
    # C = [[s, 0, 0], [s, s, 0], [0, s, 1]]: columns have norm 1, b = 2.
    dense = np.array([[s, 0, 0], [s, s, 0], [0, s, 1.0]])
    c = MixingMatrix.from_dense(dense)
    assert (c.steps, c.bands) == (3, 2)
    np.testing.assert_array_equal(c.band_values, [[s, 0], [s, s], [1.0, s]])
    np.testing.assert_array_equal(c.to_dense(), dense)
    np.testing.assert_allclose(c.column_norms(), 1.0, atol=1e-15)


@settings(max_examples=30, deadline=None)
@given(steps=st.integers(1, 12), bands=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_dense_round_trip_and_inverse_recurrence(steps, bands, seed):
    bands = min(bands, steps)
    rng = np.random.default_rng(seed)
    dense = _random_banded(steps, bands, rng)
    c = MixingMatrix.from_dense(dense, bands=bands)
    np.testing.assert_allclose(c.to_dense(), dense, rtol=0, atol=0)
    z = rng.normal(size=(steps, 3))
    np.testing.assert_allclose(c.inverse_apply(z), np.linalg.solve(dense, z), rtol=1e-9, atol=1e-9)
    x = dense.T @ dense
    far = np.abs(np.subtract.outer(np.arange(steps), np.arange(steps))) >= bands
    assert np.all(x[far] == 0)
    np.testing.assert_allclose(np.diag(x), 1.0, atol=1e-12)


def test_identity_is_dpsgd():
    c = MixingMatrix.identity(5)
    np.testing.assert_array_equal(c.to_dense(), np.eye(5))
    assert c.bands == 1 and c.metadata["objective"] == "dpsgd"


@pytest.mark.parametrize(
    "values, match",
    [
        (np.array([[1.0, 0.0], [0.5, np.sqrt(0.75)]]), "column 1 has norm 0.5"),  # C[1,1] = 0.5 alone
        (np.array([[1.0, 0.3], [1.0, 0.0]]), "above the first row"),
        (np.array([[-1.0], [1.0]]), "positive diagonal"),
        (np.array([[np.nan], [1.0]]), "finite"),
        (np.ones((2, 3)), "cannot exceed steps"),
        (np.ones(3), "shape"),
    ],
)
def test_invalid_matrices_are_refused_with_a_reason(values, match):
    with pytest.raises(InvalidMixingMatrixError, match=match):
        MixingMatrix(values)


def test_from_dense_refuses_upper_and_out_of_band_entries():
    with pytest.raises(InvalidMixingMatrixError, match="lower triangular"):
        MixingMatrix.from_dense(np.array([[1.0, 0.1], [0.0, 1.0]]))
    dense = _random_banded(4, 3, np.random.default_rng(0))
    with pytest.raises(InvalidMixingMatrixError, match="outside a band of width 2"):
        MixingMatrix.from_dense(dense, bands=2)


def test_save_load_round_trip_without_pickle(tmp_path):
    dense = _random_banded(6, 3, np.random.default_rng(1))
    c = MixingMatrix.from_dense(dense, metadata={"objective": "bandmf", "loss": 1.5})
    path = tmp_path / "c.npz"
    c.save(path)
    loaded = MixingMatrix.load(path)
    assert loaded == c and loaded.metadata == {"objective": "bandmf", "loss": 1.5}
    with np.load(path, allow_pickle=False) as data:  # readable without pickle
        assert data["band_values"].dtype == np.float64


def _rewrite(path, **changes):
    with np.load(path, allow_pickle=False) as data:
        fields = {k: data[k] for k in data.files}
    fields.update(changes)
    with open(path, "wb") as f:
        np.savez(f, **fields)


def test_tampered_file_never_loads(tmp_path):
    c = MixingMatrix.from_dense(_random_banded(5, 2, np.random.default_rng(2)))
    path = tmp_path / "c.npz"
    c.save(path)
    # Scale one column: breaks the unit-norm constraint.
    bad = np.array(c.band_values)
    bad[2, 0] *= 1.5
    _rewrite(path, band_values=bad)
    with pytest.raises(InvalidMixingMatrixError, match="norm 1"):
        MixingMatrix.load(path)
    # A valid but different C with the old digest: detected as modified.
    c.save(path)
    _rewrite(path, band_values=MixingMatrix.identity(5).band_values)
    with pytest.raises(InvalidMixingMatrixError, match="identity|digest"):
        MixingMatrix.load(path)
    # Not an artifact at all.
    np.savez(tmp_path / "other.npz", a=np.zeros(3))
    with pytest.raises(InvalidMixingMatrixError, match="not a keras-noisecurve"):
        MixingMatrix.load(tmp_path / "other.npz")


def test_metadata_must_be_json():
    with pytest.raises(TypeError):
        MixingMatrix(np.ones((2, 1)), {"bad": object()})


# --------------------------------------------------------------------- Spectrum
def test_spectrum_merges_sorts_and_clamps():
    spec = Spectrum([0.5, 2.0, -1e-3, 0.5, 0.0], dimension=7)
    np.testing.assert_array_equal(spec.eigenvalues, [2.0, 0.5, 0.0])
    np.testing.assert_array_equal(spec.multiplicities, [1.0, 2.0, 2.0])
    assert spec.dimension == 7
    assert spec.metadata["clamped_negative"] == 1
    assert spec.trace() == pytest.approx(3.0)
    np.testing.assert_array_equal(spec.expanded(), [2.0, 0.5, 0.5, 0.0, 0.0])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eigenvalues": []}, "at least one"),
        ({"eigenvalues": [1.0, np.inf]}, "finite"),
        ({"eigenvalues": [1.0, 2.0], "multiplicities": [1.0]}, "same length"),
        ({"eigenvalues": [1.0], "multiplicities": [0.0]}, "> 0"),
        ({"eigenvalues": [1.0, 2.0], "dimension": 1}, "smaller than the total"),
    ],
)
def test_spectrum_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Spectrum(**kwargs)


def test_spectrum_save_load_and_digest(tmp_path):
    spec = Spectrum([3.0, 1.0], [2.0, 5.5], dimension=10, metadata={"method": "exact"})
    spec.save(tmp_path / "s.npz")
    loaded = Spectrum.load(tmp_path / "s.npz")
    np.testing.assert_array_equal(loaded.eigenvalues, spec.eigenvalues)
    np.testing.assert_array_equal(loaded.multiplicities, spec.multiplicities)
    assert loaded.dimension == 10 and loaded.metadata == {"method": "exact"}
    assert loaded.digest() == spec.digest()
    assert Spectrum([3.0, 1.0], [2.0, 5.5], dimension=11).digest() != spec.digest()
    with pytest.raises(ValueError, match="not a keras-noisecurve spectrum"):
        MixingMatrix.identity(3).save(tmp_path / "c.npz")
        Spectrum.load(tmp_path / "c.npz")
    with np.load(tmp_path / "s.npz") as data:
        fields = {k: data[k] for k in data.files if k != "multiplicities"}
    np.savez(tmp_path / "partial.npz", **fields)
    with pytest.raises(ValueError, match="missing field 'multiplicities'"):
        Spectrum.load(tmp_path / "partial.npz")


# ------------------------------------------------------------------ packaging
def test_numpy_parts_do_not_import_tensorflow():
    code = (
        "import sys, keras_noisecurve as k; k.MixingMatrix; import keras_noisecurve.mixing, "
        "keras_noisecurve.spectrum.artifact; print('tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_cli_version_and_unknown_command(capsys):
    from keras_noisecurve import __version__
    from keras_noisecurve.apps.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and __version__ in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["nonsense"])
    assert exc.value.code == 2


def test_unknown_attribute_message():
    import keras_noisecurve

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        keras_noisecurve.nope  # noqa: B018
    assert json.loads(json.dumps(keras_noisecurve.__all__))
